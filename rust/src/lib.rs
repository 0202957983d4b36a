//! Waltz's native core: the storage engine, the storage node, the client protocol, and (feature `python`) the
//! bindings that make them `waltz._native`.
pub mod client_protocol;
pub mod engine;
pub mod node;

#[cfg(feature = "python")]
mod python;

/// The benchmarks' raw ceiling, which a Python benchmark runs in-process; it lives in
/// benches/native.
#[doc(hidden)]
#[path = "../../benches/native/raw_append.rs"]
pub mod bench_raw_append;
