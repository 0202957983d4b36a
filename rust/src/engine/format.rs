//! What every Waltz file shares: the format version and the 128-byte header length of the
//! control file, segment data files and index files, the creation time they record, and the
//! text form of a cluster key. The control file and segments both build on it, so neither needs
//! the other.

/// The version the headers of every file carry (and recovery checks).
pub const FORMAT_VERSION: i32 = 1;
/// Every file starts with a header this long (docs/format.md).
pub const HEADER_LEN: u64 = 128;

/// Milliseconds since the Unix epoch: a header's creation time (the clock faults step it).
pub use crate::engine::clock::now_ms;

/// A cluster key as a UUID string, the form errors and the bindings show.
pub fn format_uuid(k: &[u8; 16]) -> String {
    let h: String = k.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}
