//! The storage protocol (server <-> storage node): a byte stream split into frames as the node's
//! connection loop does (`split_frame`), each frame decoded as a request (what the node does)
//! and as a response (what the server does through the bindings' ResponseReader).
//! Oracles: no panic, no frame bigger than the stream or the maximum, and whatever decodes
//! re-encodes to the same bytes (requests, and responses but for unknown failure kinds, which
//! decode as Internal) and decodes again to the same message.
//!
//! Input: one flags byte (bit 0: leave frame CRCs as they are instead of fixing them up; bit 1:
//! a 64-byte frame maximum instead of the default), then the stream.
#![no_main]
use libfuzzer_sys::fuzz_target;
use waltz_fuzz::fix_frame_crcs;
use waltz_native::protocol::{msg, split_frame, Request, Response, DEFAULT_MAX_FRAME, FRAME_OVERHEAD, MAGIC_STORAGE};

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let mut stream = rest.to_vec();
    if flags & 1 == 0 {
        fix_frame_crcs(&mut stream);
    }
    let max = if flags & 2 != 0 { 64 } else { DEFAULT_MAX_FRAME };
    let mut pos = 0usize;
    while let Ok(Some(f)) = split_frame(&stream[pos..], MAGIC_STORAGE, max) {
        assert!(f.size >= FRAME_OVERHEAD && f.size - 4 <= max && f.size <= stream.len() - pos);
        assert_eq!(f.payload.len() + FRAME_OVERHEAD, f.size);
        let bytes = &stream[pos..pos + f.size];
        if let Ok(req) = Request::decode(&f) {
            let mut again = Vec::new();
            req.encode(&mut again);
            assert_eq!(again, bytes, "{req:?} re-encodes differently");
            let _ = req.header();
        }
        if let Ok(resp) = Response::decode(&f) {
            let mut again = Vec::new();
            resp.encode(&mut again);
            if f.msg_type != msg::FAILURE {
                assert_eq!(again, bytes, "{resp:?} re-encodes differently");
            }
            let f2 = split_frame(&again, MAGIC_STORAGE, usize::MAX).unwrap().unwrap();
            assert_eq!(Response::decode(&f2).unwrap(), resp);
        }
        pos += f.size;
    }
});
