//! `ClientReader`: bytes in, client-protocol messages out, with the limits a connection sets.
use super::{decode, DecodeError, Message};
use crate::node::protocol::{split_frame, FrameBuf, FrameError, DEFAULT_MAX_FRAME, MAGIC_CLIENT};

/// Why the stream gave no message. A framing error is final for the connection (the bytes
/// that follow cannot be trusted to start a frame); a decode error consumed its frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// `FrameError::TooLarge` is found on the length alone, before the frame is buffered.
    Frame(FrameError),
    Decode(DecodeError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Frame(e) => e.fmt(f),
            ReadError::Decode(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ReadError {}

/// Splits a client-protocol byte stream into frames (length bounds, magic, version, CRC) and
/// decodes each one.
#[derive(Debug)]
pub struct ClientReader {
    buf: FrameBuf,
    /// The largest frame accepted, checked when a frame's length arrives; a server lowers it
    /// until the peer has mounted.
    pub max_frame: usize,
    /// The most locks an Append may declare in all, or None.
    pub max_locks: Option<u64>,
}

impl Default for ClientReader {
    fn default() -> Self {
        ClientReader::new(DEFAULT_MAX_FRAME, None)
    }
}

impl ClientReader {
    pub fn new(max_frame: usize, max_locks: Option<u64>) -> Self {
        ClientReader { buf: FrameBuf::default(), max_frame, max_locks }
    }

    pub fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Bytes received but not yet taken as frames.
    pub fn buffered(&self) -> usize {
        self.buf.pending().len()
    }

    /// Calls `f` with the next whole frame's type, payload and decoding (borrowing the buffer),
    /// then consumes the frame; Ok(None) until a whole frame has arrived.
    pub fn next_with<R>(
        &mut self,
        f: impl FnOnce(u8, &[u8], Result<Message<'_>, DecodeError>) -> R,
    ) -> Result<Option<R>, FrameError> {
        let (size, out) = match split_frame(self.buf.pending(), MAGIC_CLIENT, self.max_frame)? {
            None => return Ok(None),
            Some(frame) => {
                (frame.size, f(frame.msg_type, frame.payload, decode(frame.msg_type, frame.payload, self.max_locks)))
            }
        };
        self.buf.consume(size);
        Ok(Some(out))
    }

    /// The next message, handed to `f`: Ok(None) until a whole frame has arrived.
    pub fn next_message<R>(&mut self, f: impl FnOnce(Message<'_>) -> R) -> Result<Option<R>, ReadError> {
        match self.next_with(|_, _, m| m.map(f)) {
            Ok(None) => Ok(None),
            Ok(Some(Ok(r))) => Ok(Some(r)),
            Ok(Some(Err(e))) => Err(ReadError::Decode(e)),
            Err(e) => Err(ReadError::Frame(e)),
        }
    }
}
