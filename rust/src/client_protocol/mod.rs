//! The client protocol (client <-> server, magic "WC"): its messages decoded from and encoded to
//! payloads, byte for byte as docs/protocol.md and `waltz.client_protocol` (the Python reference
//! implementation) define them, and `ClientReader`, which turns a byte stream into messages.
//!
//! Decoding is as strict as the Python decoder and fails with the same texts (the bindings raise
//! them as the same exception classes; tests/client/unit/test_client_protocol_parity.py compares
//! the two on valid and damaged frames): short fields, trailing bytes, counts that cannot fit in
//! the frame, data whose CRC fails. Counts are checked against the bytes present before anything
//! is allocated, and an Append declaring more locks than the reader allows is refused on the
//! declared count, before its locks are read. Messages borrow the frame's bytes.
pub mod reader;

pub use reader::{ClientReader, ReadError};

use crate::engine::record::{crc32, ReqId};
use crate::node::protocol::{encode_frame, put_bytes, put_req_id, MAGIC_CLIENT};

/// Message type codes (docs/protocol.md, "Client protocol").
pub mod msg {
    pub const HELLO: u8 = 0x01;
    pub const HELLO_OK: u8 = 0x82;
    pub const MOUNT: u8 = 0x30;
    pub const MOUNT_RESPONSE: u8 = 0xB0;
    pub const APPEND: u8 = 0x31;
    pub const LOCK_FAILURE: u8 = 0xB1;
    pub const FEED_REQUEST: u8 = 0x32;
    pub const FEED_DATA: u8 = 0xB2;
    pub const FLUSH: u8 = 0x33;
    pub const FLUSH_RESPONSE: u8 = 0xB3;
    pub const TRANSACTION_DATA_REQUEST: u8 = 0x34;
    pub const TRANSACTION_DATA_RESPONSE: u8 = 0xB4;
    pub const TRANSACTION_DATA_RANGE_REQUEST: u8 = 0x36;
    pub const TRANSACTION_DATA_RANGE_RESPONSE: u8 = 0xB6;
    pub const HIGH_WATER_MARK_REQUEST: u8 = 0x35;
    pub const HIGH_WATER_MARK_RESPONSE: u8 = 0xB5;
    pub const CLIENT_ID_REQUEST: u8 = 0x37;
    pub const CLIENT_ID_RESPONSE: u8 = 0xB7;
    pub const FAILURE: u8 = 0x81;
}

/// Every message type this decoder knows, with the name its errors start with (the Python
/// class's name, so both decoders say the same).
pub const MESSAGE_TYPES: [(u8, &str); 19] = [
    (msg::HELLO, "Hello"),
    (msg::HELLO_OK, "HelloOk"),
    (msg::MOUNT, "Mount"),
    (msg::MOUNT_RESPONSE, "MountResponse"),
    (msg::APPEND, "Append"),
    (msg::LOCK_FAILURE, "LockFailure"),
    (msg::FEED_REQUEST, "FeedRequest"),
    (msg::FEED_DATA, "FeedData"),
    (msg::FLUSH, "Flush"),
    (msg::FLUSH_RESPONSE, "FlushResponse"),
    (msg::TRANSACTION_DATA_REQUEST, "TransactionDataRequest"),
    (msg::TRANSACTION_DATA_RESPONSE, "TransactionDataResponse"),
    (msg::TRANSACTION_DATA_RANGE_REQUEST, "TransactionDataRangeRequest"),
    (msg::TRANSACTION_DATA_RANGE_RESPONSE, "TransactionDataRangeResponse"),
    (msg::HIGH_WATER_MARK_REQUEST, "HighWaterMarkRequest"),
    (msg::HIGH_WATER_MARK_RESPONSE, "HighWaterMarkResponse"),
    (msg::CLIENT_ID_REQUEST, "ClientIdRequest"),
    (msg::CLIENT_ID_RESPONSE, "ClientIdResponse"),
    (msg::FAILURE, "Failure"),
];

/// The Mount Response statuses (READY, NOT_READY, CLIENT_AHEAD, BEHIND_RETENTION).
pub const MOUNT_STATUSES: u8 = 4;
pub const TOKEN_BYTES: usize = 16;
/// A Feed Data entry: transaction id, ReqId, header.
pub const FEED_ENTRY_SIZE: usize = 8 + 16 + 4;

/// Big-endian i64 lock hashes as they lie in the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Locks<'a>(&'a [u8]);

impl<'a> Locks<'a> {
    pub fn len(&self) -> usize {
        self.0.len() / 8
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> impl ExactSizeIterator<Item = i64> + 'a {
        self.0.chunks_exact(8).map(|c| i64::from_be_bytes(c.try_into().unwrap()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedEntry {
    pub txid: i64,
    pub req_id: ReqId,
    pub header: i32,
}

/// Feed Data entries as they lie in the payload (decoded one by one when iterated).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedEntries<'a>(&'a [u8]);

impl<'a> FeedEntries<'a> {
    pub fn len(&self) -> usize {
        self.0.len() / FEED_ENTRY_SIZE
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> impl ExactSizeIterator<Item = FeedEntry> + 'a {
        self.0.chunks_exact(FEED_ENTRY_SIZE).map(|c| FeedEntry {
            txid: i64::from_be_bytes(c[0..8].try_into().unwrap()),
            req_id: ReqId::decode(&c[8..24]),
            header: i32::from_be_bytes(c[24..28].try_into().unwrap()),
        })
    }
}

/// One client-protocol message; variable-length fields borrow the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// `credential`: role (never empty) and secret, sent only by a peer with a role secret.
    Hello {
        min_version: u8,
        max_version: u8,
        credential: Option<(&'a str, &'a [u8])>,
    },
    HelloOk {
        version: u8,
    },
    Mount {
        seq: i64,
        partition: i32,
        client_id: i32,
        client_high_water_mark: i64,
        connection_seq: i64,
        client_token: [u8; TOKEN_BYTES],
    },
    /// `status` is below MOUNT_STATUSES.
    MountResponse {
        seq: i64,
        partition: i32,
        status: u8,
        high_water_mark: i64,
        generation: i32,
    },
    Append {
        req_id: ReqId,
        client_high_water_mark: i64,
        write_locks: Locks<'a>,
        read_locks: Locks<'a>,
        append_locks: Locks<'a>,
        header: i32,
        data: &'a [u8],
    },
    LockFailure {
        req_id: ReqId,
        txid: i64,
    },
    FeedRequest {
        seq: i64,
        partition: i32,
        after: i64,
        max_count: i32,
    },
    FeedData {
        seq: i64,
        partition: i32,
        entries: FeedEntries<'a>,
    },
    Flush {
        seq: i64,
        partition: i32,
    },
    FlushResponse {
        seq: i64,
        partition: i32,
        high_water_mark: i64,
    },
    TransactionDataRequest {
        seq: i64,
        partition: i32,
        txid: i64,
    },
    TransactionDataResponse {
        seq: i64,
        partition: i32,
        txid: i64,
        data: &'a [u8],
    },
    TransactionDataRangeRequest {
        seq: i64,
        partition: i32,
        first: i64,
        max_count: i32,
        max_bytes: i32,
    },
    TransactionDataRangeResponse {
        seq: i64,
        partition: i32,
        first: i64,
        data: Vec<&'a [u8]>,
    },
    HighWaterMarkRequest {
        seq: i64,
        partition: i32,
    },
    HighWaterMarkResponse {
        seq: i64,
        partition: i32,
        high_water_mark: i64,
    },
    ClientIdRequest {
        seq: i64,
    },
    ClientIdResponse {
        seq: i64,
        client_id: i32,
    },
    /// `kind` as sent: a kind this side does not know is the receiver's to read as internal.
    Failure {
        seq: i64,
        partition: i32,
        kind: u16,
        message: &'a str,
    },
}

/// Why a payload does not decode. Either way the frame is consumed; after `TooManyLocks` the
/// connection may answer the Append (APPEND_REJECTED) and go on, after the others it closes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The text says what is wrong, as the Python decoder says it.
    Malformed(String),
    UnknownType(u8),
    /// An Append declaring more locks than allowed, refused on the declared count.
    TooManyLocks {
        message: String,
        req_id: ReqId,
    },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Malformed(m) | DecodeError::TooManyLocks { message: m, .. } => f.write_str(m),
            DecodeError::UnknownType(t) => write!(f, "unknown client-protocol message type 0x{t:02x}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// `(1, 2, 3, 4)`: a ReqId as the Python decoder prints its tuple.
pub fn req_id_text(r: &ReqId) -> String {
    format!("({}, {}, {}, {})", r.client_id, r.generation, r.partition_id, r.sequence)
}

/// A bounds-checked cursor over a payload, the counterpart of the Python decoder's `_Reader`.
struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
    what: &'static str,
    /// Locks the rest of the message may declare (write, read and append together), or None.
    locks_left: Option<u64>,
}

type Decoded<T> = Result<T, DecodeError>;

impl<'a> Cursor<'a> {
    fn malformed(&self, m: std::fmt::Arguments<'_>) -> DecodeError {
        DecodeError::Malformed(format!("{}: {}", self.what, m))
    }
    fn left(&self) -> usize {
        self.b.len() - self.i
    }
    fn take<const N: usize>(&mut self, field: &str) -> Decoded<[u8; N]> {
        if self.left() < N {
            return Err(self.malformed(format_args!("payload ends inside {field}")));
        }
        let v = self.b[self.i..self.i + N].try_into().unwrap();
        self.i += N;
        Ok(v)
    }
    fn u8(&mut self, field: &str) -> Decoded<u8> {
        Ok(self.take::<1>(field)?[0])
    }
    fn u16(&mut self, field: &str) -> Decoded<u16> {
        Ok(u16::from_be_bytes(self.take(field)?))
    }
    fn i32(&mut self, field: &str) -> Decoded<i32> {
        Ok(i32::from_be_bytes(self.take(field)?))
    }
    fn u32(&mut self, field: &str) -> Decoded<u32> {
        Ok(u32::from_be_bytes(self.take(field)?))
    }
    fn i64(&mut self, field: &str) -> Decoded<i64> {
        Ok(i64::from_be_bytes(self.take(field)?))
    }
    fn req_id(&mut self) -> Decoded<ReqId> {
        Ok(ReqId::decode(&self.take::<16>("the ReqId")?))
    }
    /// A message of fixed size: all of it present, or the fixed-layout error.
    fn fixed(&mut self, size: usize) -> Decoded<()> {
        if self.left() < size {
            return Err(self.malformed(format_args!("payload shorter than its {size} bytes")));
        }
        Ok(())
    }
    fn count(&mut self, field: &str, element_size: usize) -> Decoded<usize> {
        let n = self.i32(field)?;
        if n < 0 || (n as usize).saturating_mul(element_size) > self.left() {
            return Err(self.malformed(format_args!("{field} {n} does not fit in the frame")));
        }
        Ok(n as usize)
    }
    fn slice(&mut self, n: usize) -> &'a [u8] {
        let v = &self.b[self.i..self.i + n];
        self.i += n;
        v
    }
    fn raw(&mut self, field: &str) -> Decoded<&'a [u8]> {
        let n = self.count(&format!("{field} length"), 1)?;
        Ok(self.slice(n))
    }
    fn text(&mut self, field: &str) -> Decoded<&'a str> {
        let b = self.raw(field)?;
        std::str::from_utf8(b).map_err(|_| self.malformed(format_args!("{field} is not UTF-8")))
    }
    fn locks(&mut self, field: &str) -> Decoded<Locks<'a>> {
        let n = self.count(field, 8)?;
        if let Some(left) = self.locks_left {
            // Checked on the declared count, before the locks are read (issue 34).
            if n as u64 > left {
                return Err(DecodeError::TooManyLocks {
                    message: format!("{}: {field} {n} takes it beyond max_transaction_locks", self.what),
                    req_id: ReqId::decode(&self.b[..16]), // an Append's payload starts with it
                });
            }
            self.locks_left = Some(left - n as u64);
        }
        Ok(Locks(self.slice(8 * n)))
    }
    fn checked_data(&mut self) -> Decoded<(&'a [u8], bool)> {
        let data = self.raw("data")?;
        let crc = self.u32("data checksum")?;
        Ok((data, crc32(data) == crc))
    }
    fn done(&self) -> Decoded<()> {
        if self.i != self.b.len() {
            return Err(self.malformed(format_args!("{} trailing bytes", self.left())));
        }
        Ok(())
    }
}

/// The name a type's errors start with, or None for a type this decoder does not know.
pub fn type_name(msg_type: u8) -> Option<&'static str> {
    MESSAGE_TYPES.iter().find(|(t, _)| *t == msg_type).map(|(_, n)| *n)
}

/// Decodes one payload of type `msg_type`. `max_locks`: an Append declaring more locks in all
/// is refused (`TooManyLocks`) before they are read.
pub fn decode(msg_type: u8, payload: &[u8], max_locks: Option<u64>) -> Result<Message<'_>, DecodeError> {
    let what = type_name(msg_type).ok_or(DecodeError::UnknownType(msg_type))?;
    let mut r = Cursor { b: payload, i: 0, what, locks_left: max_locks };
    let m = decode_fields(msg_type, &mut r)?;
    r.done()?;
    Ok(m)
}

fn decode_fields<'a>(msg_type: u8, r: &mut Cursor<'a>) -> Decoded<Message<'a>> {
    Ok(match msg_type {
        msg::HELLO => {
            let (min_version, max_version) = (r.u8("min version")?, r.u8("max version")?);
            if r.left() == 0 {
                return Ok(Message::Hello { min_version, max_version, credential: None });
            }
            let role = r.text("role")?;
            if role.is_empty() {
                return Err(r.malformed(format_args!("empty role")));
            }
            Message::Hello { min_version, max_version, credential: Some((role, r.raw("secret")?)) }
        }
        msg::HELLO_OK => Message::HelloOk { version: r.u8("version")? },
        msg::MOUNT => {
            r.fixed(8 + 4 + 4 + 8 + 8 + TOKEN_BYTES)?;
            Message::Mount {
                seq: r.i64("seq")?,
                partition: r.i32("partition")?,
                client_id: r.i32("client id")?,
                client_high_water_mark: r.i64("client high-water mark")?,
                connection_seq: r.i64("connection seq")?,
                client_token: r.take("client token")?,
            }
        }
        msg::MOUNT_RESPONSE => {
            let (seq, partition, status) = (r.i64("seq")?, r.i32("partition")?, r.u8("status")?);
            if status >= MOUNT_STATUSES {
                return Err(DecodeError::Malformed(format!("mount response: unknown status {status}")));
            }
            Message::MountResponse {
                seq,
                partition,
                status,
                high_water_mark: r.i64("high-water mark")?,
                generation: r.i32("generation")?,
            }
        }
        msg::APPEND => {
            let (req_id, client_high_water_mark) = (r.req_id()?, r.i64("client high-water mark")?);
            let write_locks = r.locks("write lock count")?;
            let read_locks = r.locks("read lock count")?;
            let append_locks = r.locks("append lock count")?;
            let header = r.i32("header")?;
            let (data, crc_ok) = r.checked_data()?;
            if !crc_ok {
                return Err(DecodeError::Malformed(format!("append {}: data checksum mismatch", req_id_text(&req_id))));
            }
            Message::Append { req_id, client_high_water_mark, write_locks, read_locks, append_locks, header, data }
        }
        msg::LOCK_FAILURE => Message::LockFailure { req_id: r.req_id()?, txid: r.i64("transaction id")? },
        msg::FEED_REQUEST => {
            r.fixed(8 + 4 + 8 + 4)?;
            Message::FeedRequest {
                seq: r.i64("seq")?,
                partition: r.i32("partition")?,
                after: r.i64("after")?,
                max_count: r.i32("max count")?,
            }
        }
        msg::FEED_DATA => {
            let (seq, partition) = (r.i64("seq")?, r.i32("partition")?);
            let n = r.count("entry count", FEED_ENTRY_SIZE)?;
            Message::FeedData { seq, partition, entries: FeedEntries(r.slice(n * FEED_ENTRY_SIZE)) }
        }
        msg::FLUSH => {
            r.fixed(8 + 4)?;
            Message::Flush { seq: r.i64("seq")?, partition: r.i32("partition")? }
        }
        msg::FLUSH_RESPONSE => {
            r.fixed(8 + 4 + 8)?;
            Message::FlushResponse {
                seq: r.i64("seq")?,
                partition: r.i32("partition")?,
                high_water_mark: r.i64("high-water mark")?,
            }
        }
        msg::TRANSACTION_DATA_REQUEST => {
            r.fixed(8 + 4 + 8)?;
            Message::TransactionDataRequest {
                seq: r.i64("seq")?,
                partition: r.i32("partition")?,
                txid: r.i64("transaction id")?,
            }
        }
        msg::TRANSACTION_DATA_RESPONSE => {
            let (seq, partition, txid) = (r.i64("seq")?, r.i32("partition")?, r.i64("transaction id")?);
            let (data, crc_ok) = r.checked_data()?;
            if !crc_ok {
                return Err(DecodeError::Malformed(format!("transaction {txid} data: checksum mismatch")));
            }
            Message::TransactionDataResponse { seq, partition, txid, data }
        }
        msg::TRANSACTION_DATA_RANGE_REQUEST => {
            r.fixed(8 + 4 + 8 + 4 + 4)?;
            Message::TransactionDataRangeRequest {
                seq: r.i64("seq")?,
                partition: r.i32("partition")?,
                first: r.i64("first")?,
                max_count: r.i32("max count")?,
                max_bytes: r.i32("max bytes")?,
            }
        }
        msg::TRANSACTION_DATA_RANGE_RESPONSE => {
            let (seq, partition, first) = (r.i64("seq")?, r.i32("partition")?, r.i64("first transaction id")?);
            let n = r.count("transaction count", 8)?; // each at least a length and a checksum
            let mut data = Vec::with_capacity(n);
            for i in 0..n {
                let (d, crc_ok) = r.checked_data()?;
                if !crc_ok {
                    // Python's ints do not overflow: neither does this id.
                    return Err(DecodeError::Malformed(format!(
                        "transaction {} data: checksum mismatch",
                        first as i128 + i as i128
                    )));
                }
                data.push(d);
            }
            Message::TransactionDataRangeResponse { seq, partition, first, data }
        }
        msg::HIGH_WATER_MARK_REQUEST => {
            r.fixed(8 + 4)?;
            Message::HighWaterMarkRequest { seq: r.i64("seq")?, partition: r.i32("partition")? }
        }
        msg::HIGH_WATER_MARK_RESPONSE => {
            r.fixed(8 + 4 + 8)?;
            Message::HighWaterMarkResponse {
                seq: r.i64("seq")?,
                partition: r.i32("partition")?,
                high_water_mark: r.i64("high-water mark")?,
            }
        }
        msg::CLIENT_ID_REQUEST => {
            r.fixed(8)?;
            Message::ClientIdRequest { seq: r.i64("seq")? }
        }
        msg::CLIENT_ID_RESPONSE => {
            r.fixed(8 + 4)?;
            Message::ClientIdResponse { seq: r.i64("seq")?, client_id: r.i32("client_id")? }
        }
        msg::FAILURE => {
            let (seq, partition, kind) = (r.i64("seq")?, r.i32("partition")?, r.u16("kind")?);
            Message::Failure { seq, partition, kind, message: r.text("message")? }
        }
        other => return Err(DecodeError::UnknownType(other)),
    })
}

fn put_locks(out: &mut Vec<u8>, l: &Locks<'_>) {
    out.extend_from_slice(&(l.len() as i32).to_be_bytes());
    out.extend_from_slice(l.0);
}

fn put_data(out: &mut Vec<u8>, d: &[u8]) {
    put_bytes(out, d);
    out.extend_from_slice(&crc32(d).to_be_bytes());
}

impl Message<'_> {
    pub fn msg_type(&self) -> u8 {
        match self {
            Message::Hello { .. } => msg::HELLO,
            Message::HelloOk { .. } => msg::HELLO_OK,
            Message::Mount { .. } => msg::MOUNT,
            Message::MountResponse { .. } => msg::MOUNT_RESPONSE,
            Message::Append { .. } => msg::APPEND,
            Message::LockFailure { .. } => msg::LOCK_FAILURE,
            Message::FeedRequest { .. } => msg::FEED_REQUEST,
            Message::FeedData { .. } => msg::FEED_DATA,
            Message::Flush { .. } => msg::FLUSH,
            Message::FlushResponse { .. } => msg::FLUSH_RESPONSE,
            Message::TransactionDataRequest { .. } => msg::TRANSACTION_DATA_REQUEST,
            Message::TransactionDataResponse { .. } => msg::TRANSACTION_DATA_RESPONSE,
            Message::TransactionDataRangeRequest { .. } => msg::TRANSACTION_DATA_RANGE_REQUEST,
            Message::TransactionDataRangeResponse { .. } => msg::TRANSACTION_DATA_RANGE_RESPONSE,
            Message::HighWaterMarkRequest { .. } => msg::HIGH_WATER_MARK_REQUEST,
            Message::HighWaterMarkResponse { .. } => msg::HIGH_WATER_MARK_RESPONSE,
            Message::ClientIdRequest { .. } => msg::CLIENT_ID_REQUEST,
            Message::ClientIdResponse { .. } => msg::CLIENT_ID_RESPONSE,
            Message::Failure { .. } => msg::FAILURE,
        }
    }

    /// Appends the message's payload (data checksums computed here, as the Python encoder does).
    pub fn encode_payload(&self, out: &mut Vec<u8>) {
        let i64s = |out: &mut Vec<u8>, v: &[i64]| v.iter().for_each(|x| out.extend_from_slice(&x.to_be_bytes()));
        let i32s = |out: &mut Vec<u8>, v: &[i32]| v.iter().for_each(|x| out.extend_from_slice(&x.to_be_bytes()));
        match self {
            Message::Hello { min_version, max_version, credential } => {
                out.extend_from_slice(&[*min_version, *max_version]);
                if let Some((role, secret)) = credential {
                    put_bytes(out, role.as_bytes());
                    put_bytes(out, secret);
                }
            }
            Message::HelloOk { version } => out.push(*version),
            Message::Mount { seq, partition, client_id, client_high_water_mark, connection_seq, client_token } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition, *client_id]);
                i64s(out, &[*client_high_water_mark, *connection_seq]);
                out.extend_from_slice(client_token);
            }
            Message::MountResponse { seq, partition, status, high_water_mark, generation } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                out.push(*status);
                i64s(out, &[*high_water_mark]);
                i32s(out, &[*generation]);
            }
            Message::Append { req_id, client_high_water_mark, write_locks, read_locks, append_locks, header, data } => {
                put_req_id(out, req_id);
                i64s(out, &[*client_high_water_mark]);
                for l in [write_locks, read_locks, append_locks] {
                    put_locks(out, l);
                }
                i32s(out, &[*header]);
                put_data(out, data);
            }
            Message::LockFailure { req_id, txid } => {
                put_req_id(out, req_id);
                i64s(out, &[*txid]);
            }
            Message::FeedRequest { seq, partition, after, max_count } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                i64s(out, &[*after]);
                i32s(out, &[*max_count]);
            }
            Message::FeedData { seq, partition, entries } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition, entries.len() as i32]);
                out.extend_from_slice(entries.0);
            }
            Message::Flush { seq, partition } | Message::HighWaterMarkRequest { seq, partition } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
            }
            Message::ClientIdRequest { seq } => i64s(out, &[*seq]),
            Message::ClientIdResponse { seq, client_id } => {
                i64s(out, &[*seq]);
                i32s(out, &[*client_id]);
            }
            Message::FlushResponse { seq, partition, high_water_mark: v }
            | Message::HighWaterMarkResponse { seq, partition, high_water_mark: v }
            | Message::TransactionDataRequest { seq, partition, txid: v } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                i64s(out, &[*v]);
            }
            Message::TransactionDataResponse { seq, partition, txid, data } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                i64s(out, &[*txid]);
                put_data(out, data);
            }
            Message::TransactionDataRangeRequest { seq, partition, first, max_count, max_bytes } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                i64s(out, &[*first]);
                i32s(out, &[*max_count, *max_bytes]);
            }
            Message::TransactionDataRangeResponse { seq, partition, first, data } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                i64s(out, &[*first]);
                i32s(out, &[data.len() as i32]);
                for d in data {
                    put_data(out, d);
                }
            }
            Message::Failure { seq, partition, kind, message } => {
                i64s(out, &[*seq]);
                i32s(out, &[*partition]);
                out.extend_from_slice(&kind.to_be_bytes());
                put_bytes(out, message.as_bytes());
            }
        }
    }

    /// Appends the message as one whole frame.
    pub fn encode(&self, out: &mut Vec<u8>) {
        encode_frame(out, MAGIC_CLIENT, self.msg_type(), |o| self.encode_payload(o));
    }
}

#[cfg(test)]
mod tests;
