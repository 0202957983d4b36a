//! Transaction records as they lie in a segment data file (all integers big-endian):
//!
//! | offset | field                                   |
//! |--------|-----------------------------------------|
//! | 0      | transaction id, i64                     |
//! | 8      | ReqId: client id, generation, partition id, sequence (4 x i32) |
//! | 24     | transaction header, i32                 |
//! | 28     | data length, i32                        |
//! | 32     | data CRC-32 (IEEE), i32                 |
//! | 36     | data                                    |
//! | 36+len | record CRC-32 over bytes [0, 36+len)    |

pub const RECORD_PREFIX: usize = 36;
pub const RECORD_OVERHEAD: usize = RECORD_PREFIX + 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ReqId {
    pub client_id: i32,
    pub generation: i32,
    pub partition_id: i32,
    pub sequence: i32,
}

impl ReqId {
    pub fn encode_into(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.client_id.to_be_bytes());
        out[4..8].copy_from_slice(&self.generation.to_be_bytes());
        out[8..12].copy_from_slice(&self.partition_id.to_be_bytes());
        out[12..16].copy_from_slice(&self.sequence.to_be_bytes());
    }
    pub fn decode(b: &[u8]) -> ReqId {
        ReqId {
            client_id: be_i32(&b[0..4]),
            generation: be_i32(&b[4..8]),
            partition_id: be_i32(&b[8..12]),
            sequence: be_i32(&b[12..16]),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub txid: i64,
    pub req_id: ReqId,
    pub header: i32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub txid: i64,
    pub req_id: ReqId,
    pub header: i32,
    pub data: Vec<u8>,
}

impl Record {
    pub fn record_header(&self) -> RecordHeader {
        RecordHeader { txid: self.txid, req_id: self.req_id, header: self.header }
    }
}

/// A record to append, borrowing its data. The transaction id is given by its position in the
/// batch, so a batch can be appended at any id without being rebuilt.
#[derive(Clone, Copy, Debug)]
pub struct NewRecord<'a> {
    pub req_id: ReqId,
    pub header: i32,
    pub data: &'a [u8],
    /// CRC-32 of `data` when the caller already has it (it travels in the storage protocol).
    pub data_crc: Option<u32>,
}

#[inline]
pub fn be_i32(b: &[u8]) -> i32 {
    i32::from_be_bytes(b[..4].try_into().unwrap())
}
#[inline]
pub fn be_i64(b: &[u8]) -> i64 {
    i64::from_be_bytes(b[..8].try_into().unwrap())
}
#[inline]
pub fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// What surrounds a record's data on disk: its prefix and its trailing CRC (of everything before
/// it). With the data's CRC known (it travels in the storage protocol and in a RecordBatch) the
/// data is not read at all, so a writer can send it from where it lies.
pub fn record_frame(txid: i64, rec: &NewRecord<'_>) -> ([u8; RECORD_PREFIX], [u8; 4]) {
    let data_crc = rec.data_crc.unwrap_or_else(|| crc32(rec.data));
    let mut prefix = [0u8; RECORD_PREFIX];
    prefix[0..8].copy_from_slice(&txid.to_be_bytes());
    rec.req_id.encode_into(&mut prefix[8..24]);
    prefix[24..28].copy_from_slice(&rec.header.to_be_bytes());
    prefix[28..32].copy_from_slice(&(rec.data.len() as i32).to_be_bytes());
    prefix[32..36].copy_from_slice(&data_crc.to_be_bytes());
    let crc = crate::engine::crc::extend(crc32(&prefix), data_crc, rec.data.len() as u64);
    (prefix, crc.to_be_bytes())
}

/// Appends the on-disk encoding of `rec` with id `txid` to `out`.
pub fn encode_record(out: &mut Vec<u8>, txid: i64, rec: &NewRecord<'_>) {
    let (prefix, crc) = record_frame(txid, rec);
    out.extend_from_slice(&prefix);
    out.extend_from_slice(rec.data);
    out.extend_from_slice(&crc);
}

/// Why the bytes at some offset are not a valid record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalid {
    /// Fewer bytes remain than the record needs (a cut or an unfinished write).
    Short {
        needed: u64,
        available: u64,
    },
    BadTxid {
        expected: i64,
        found: i64,
    },
    BadLength(i32),
    DataCrc,
    RecordCrc,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Short { needed, available } => {
                write!(f, "record needs {needed} bytes but only {available} remain")
            }
            Invalid::BadTxid { expected, found } => {
                write!(f, "expected transaction id {expected}, found {found}")
            }
            Invalid::BadLength(n) => write!(f, "impossible data length {n}"),
            Invalid::DataCrc => write!(f, "data checksum mismatch"),
            Invalid::RecordCrc => write!(f, "record checksum mismatch"),
        }
    }
}

/// A record located inside a buffer: what a scan needs without copying the data.
#[derive(Clone, Copy, Debug)]
pub struct RecordView {
    pub header: RecordHeader,
    pub data_start: usize,
    pub data_len: usize,
}

impl RecordView {
    pub fn total_len(&self) -> usize {
        RECORD_OVERHEAD + self.data_len
    }
}

/// Parses the prefix only (no checksum work). `max_data` bounds the length before any allocation.
pub fn parse_prefix(buf: &[u8], max_data: usize) -> Result<(RecordHeader, usize, u32), Invalid> {
    if buf.len() < RECORD_PREFIX {
        return Err(Invalid::Short { needed: RECORD_PREFIX as u64, available: buf.len() as u64 });
    }
    let len = be_i32(&buf[28..32]);
    if len < 0 || len as usize > max_data {
        return Err(Invalid::BadLength(len));
    }
    Ok((
        RecordHeader { txid: be_i64(&buf[0..8]), req_id: ReqId::decode(&buf[8..24]), header: be_i32(&buf[24..28]) },
        len as usize,
        be_u32(&buf[32..36]),
    ))
}

/// Validates one whole record at the start of `buf`, expecting id `expected` (None: any id).
pub fn check_record(buf: &[u8], expected: Option<i64>, max_data: usize) -> Result<RecordView, Invalid> {
    let (header, len, data_crc) = parse_prefix(buf, max_data)?;
    if let Some(e) = expected {
        if header.txid != e {
            return Err(Invalid::BadTxid { expected: e, found: header.txid });
        }
    }
    let total = RECORD_OVERHEAD + len;
    if buf.len() < total {
        return Err(Invalid::Short { needed: total as u64, available: buf.len() as u64 });
    }
    let data = &buf[RECORD_PREFIX..RECORD_PREFIX + len];
    if crc32(data) != data_crc {
        return Err(Invalid::DataCrc);
    }
    // The data matches its CRC, so the record's CRC follows from the prefix's: the data is
    // hashed once, not twice (a third of a scan's time went to CRCs).
    let stored = be_u32(&buf[RECORD_PREFIX + len..total]);
    if crate::engine::crc::extend(crc32(&buf[..RECORD_PREFIX]), data_crc, len as u64) != stored {
        return Err(Invalid::RecordCrc);
    }
    Ok(RecordView { header, data_start: RECORD_PREFIX, data_len: len })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(data: &[u8]) -> NewRecord<'_> {
        NewRecord {
            req_id: ReqId { client_id: 1, generation: 2, partition_id: 3, sequence: 4 },
            header: 7,
            data,
            data_crc: None,
        }
    }

    #[test]
    fn round_trip() {
        let mut out = Vec::new();
        encode_record(&mut out, 42, &rec(b"hello"));
        assert_eq!(out.len(), RECORD_OVERHEAD + 5);
        let v = check_record(&out, Some(42), 1 << 20).unwrap();
        assert_eq!(v.header.txid, 42);
        assert_eq!(v.header.header, 7);
        assert_eq!(v.header.req_id.sequence, 4);
        assert_eq!(&out[v.data_start..v.data_start + v.data_len], b"hello");
    }

    #[test]
    fn layout_is_big_endian_as_specified() {
        let mut out = Vec::new();
        encode_record(&mut out, 1, &rec(b"ab"));
        assert_eq!(&out[0..8], &1i64.to_be_bytes());
        assert_eq!(&out[8..12], &1i32.to_be_bytes());
        assert_eq!(&out[20..24], &4i32.to_be_bytes());
        assert_eq!(&out[28..32], &2i32.to_be_bytes());
        assert_eq!(&out[32..36], &crc32(b"ab").to_be_bytes());
        assert_eq!(&out[38..42], &crc32(&out[..38]).to_be_bytes());
    }

    #[test]
    fn combined_record_crc_equals_hashing_everything() {
        for len in [0usize, 1, 1023, 1024, 1025, 4096, 65536, 100_003] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut known = rec(&data);
            known.data_crc = Some(crc32(&data));
            let (mut a, mut b) = (Vec::new(), Vec::new());
            encode_record(&mut a, 5, &known);
            encode_record(&mut b, 5, &rec(&data));
            assert_eq!(a, b, "len {len}");
            assert!(check_record(&a, Some(5), 1 << 20).is_ok());
        }
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let mut out = Vec::new();
        encode_record(&mut out, 9, &rec(b"some payload bytes"));
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x40;
            assert!(check_record(&bad, Some(9), 1 << 20).is_err(), "flip at {i} undetected");
        }
    }

    #[test]
    fn short_and_oversized_are_rejected_before_reading_data() {
        let mut out = Vec::new();
        encode_record(&mut out, 0, &rec(&[1u8; 100]));
        assert!(matches!(check_record(&out[..50], Some(0), 1 << 20), Err(Invalid::Short { .. })));
        assert!(matches!(check_record(&out, Some(0), 10), Err(Invalid::BadLength(100))));
        assert!(matches!(check_record(&out, Some(1), 1 << 20), Err(Invalid::BadTxid { .. })));
    }
}
