//! The native client-protocol reader (`ClientReader`, what `waltz.client_protocol.MessageReader`
//! runs on both ends of a client connection): a byte stream fed in chunks, every message taken.
//!
//! Input: a flags byte (bit 0: leave frame CRCs as they are instead of fixing them up; bit 1: a
//! 64-byte frame maximum; bit 2: a lock limit, the chunk byte's low three bits), a chunk byte (the
//! stream is fed chunk + 1 bytes at a time), then the stream. Oracles: no panic; a message
//! re-encodes to its exact payload and decodes again to an equal message; TooManyLocks only under
//! a lock limit, for an Append; after a framing error the reader is not used again (the
//! connection closes), after a decode error it goes on with the next frame.
#![no_main]
use libfuzzer_sys::fuzz_target;
use waltz_native::client_protocol::{decode, msg, ClientReader, DecodeError};
use waltz_native::node::protocol::DEFAULT_MAX_FRAME;

fuzz_target!(|data: &[u8]| {
    let [flags, chunk, rest @ ..] = data else { return };
    let mut stream = rest.to_vec();
    if flags & 1 == 0 {
        waltz_fuzz::fix_frame_crcs(&mut stream);
    }
    let max_frame = if flags & 2 != 0 { 64 } else { DEFAULT_MAX_FRAME };
    let max_locks = (flags & 4 != 0).then_some(u64::from(chunk & 7));
    let mut reader = ClientReader::new(max_frame, max_locks);
    for piece in stream.chunks(*chunk as usize + 1) {
        reader.feed(piece);
        loop {
            let step = reader.next_with(|t, payload, decoded| match decoded {
                Ok(m) => {
                    assert_eq!(m.msg_type(), t);
                    let mut again = Vec::new();
                    m.encode_payload(&mut again);
                    assert_eq!(again, payload, "{m:?} re-encodes differently");
                    assert_eq!(decode(t, &again, max_locks).as_ref(), Ok(&m));
                }
                Err(DecodeError::TooManyLocks { .. }) => assert!(max_locks.is_some() && t == msg::APPEND),
                Err(DecodeError::UnknownType(u)) => assert_eq!(u, t),
                Err(DecodeError::Malformed(_)) => {}
            });
            match step {
                Ok(Some(())) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
