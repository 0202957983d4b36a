//! The storage protocol (server <-> storage node): a byte stream split into frames as the node's
//! connection loop does (`split_frame`), each frame decoded as a request (what the node does)
//! and as a response (what the server does through the bindings' ResponseReader).
//! Input and oracles: `waltz_fuzz::protocol_stream!`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use waltz_native::node::protocol::{Request, Response, MAGIC_STORAGE};

fuzz_target!(|data: &[u8]| waltz_fuzz::protocol_stream!(data, MAGIC_STORAGE, Request, Response));
