//! The admin protocol (operator tools <-> storage node): a byte stream split into frames as the node's
//! admin connection loop does (`split_frame`), each frame decoded as a request (what the node does)
//! and as a response (what StorageAdminClient does through the bindings).
//! Input and oracles: `waltz_fuzz::protocol_stream!`.
#![no_main]
use libfuzzer_sys::fuzz_target;
use waltz_native::node::protocol::{AdminRequest, AdminResponse, MAGIC_ADMIN};

fuzz_target!(|data: &[u8]| waltz_fuzz::protocol_stream!(data, MAGIC_ADMIN, AdminRequest, AdminResponse));
