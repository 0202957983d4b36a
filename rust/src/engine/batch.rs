//! A batch of records laid out when it is built exactly as they will lie in a segment data file
//! (`record.rs`), so that an append writes the batch's buffer as it is: no copy into the write
//! queue and no per-record encoding on the append's path (at 1,000 records of 100 B or 1 KiB
//! those were most of an append's CPU; docs/performance.md, issue 38).
//!
//! Only the transaction ids are unknown when the batch is built. They are laid out from some
//! first id and patched when the batch is appended at another: each record's id field changes
//! by an XOR `d`, and since a CRC is linear its record CRC changes by `d`'s CRC difference
//! carried over the bytes after the id (`crc::delta`, `crc::multiply` by the power of x kept per
//! record). Patching touches 12 bytes a record and hashes nothing; a batch appended again at the
//! ids it already carries is not touched at all.
use crate::engine::crc;
use crate::engine::partition::SharedData;
use crate::engine::record::{be_u32, crc32, encode_record, parse_prefix, NewRecord, RECORD_OVERHEAD, RECORD_PREFIX};
use std::sync::Arc;

/// Bytes of a record after its 8-byte id field up to its CRC: the prefix's rest and the data.
const AFTER_ID: usize = RECORD_PREFIX - 8;

#[derive(Clone, Copy)]
struct Laid {
    /// Where the record starts in `bytes`.
    start: usize,
    data_len: usize,
    /// x^(8·(AFTER_ID + data_len)) mod P: carries a change of the id over the rest of the record.
    power: u32,
}

#[derive(Default)]
pub struct LaidBatch {
    /// The records, encoded with ids `first`, `first + 1`, ...
    bytes: SharedData,
    first: i64,
    records: Vec<Laid>,
    data_bytes: usize,
    max_data: usize,
    /// The last data length and its power: a batch's records are often all one size.
    last_power: Option<(usize, u32)>,
    /// Set while `set_first` patches: a patch cut short (a panic) leaves records whose ids are
    /// not `first`'s, which the next `set_first` rewrites whole instead of patching.
    patching: bool,
}

impl LaidBatch {
    /// Adds a record at the end (id: the batch's first plus its position).
    pub fn push(&mut self, rec: &NewRecord<'_>) {
        self.extend(std::slice::from_ref(rec));
    }

    /// Adds records at the end (`push` for each).
    pub fn extend(&mut self, recs: &[NewRecord<'_>]) {
        let buf = Arc::make_mut(&mut self.bytes);
        let mut last = self.last_power;
        for rec in recs {
            let len = rec.data.len();
            let power = match last {
                Some((l, p)) if l == len => p,
                _ => {
                    let p = crc::zeros_power((AFTER_ID + len) as u64);
                    last = Some((len, p));
                    p
                }
            };
            let start = buf.len();
            encode_record(buf, self.first + self.records.len() as i64, rec);
            self.records.push(Laid { start, data_len: len, power });
            self.data_bytes += len;
            self.max_data = self.max_data.max(len);
        }
        self.last_power = last;
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Bytes of data (without the records' framing).
    pub fn data_bytes(&self) -> usize {
        self.data_bytes
    }

    /// The longest record's data.
    pub fn max_data(&self) -> usize {
        self.max_data
    }

    /// The id the first record carries now.
    pub fn first(&self) -> i64 {
        self.first
    }

    /// The encoded records, ids from `first()`.
    pub fn bytes(&self) -> &SharedData {
        &self.bytes
    }

    /// Where each record starts in `bytes()`.
    pub fn starts(&self) -> impl Iterator<Item = u64> + '_ {
        self.records.iter().map(|r| r.start as u64)
    }

    /// Where each record ends in `bytes()`.
    pub fn ends(&self) -> impl Iterator<Item = u64> + '_ {
        self.records.iter().map(|r| (r.start + RECORD_OVERHEAD + r.data_len) as u64)
    }

    /// Gives the records ids `first`, `first + 1`, ...: each id and record CRC patched in place
    /// (the buffer is copied first only if a write queue still holds it).
    pub fn set_first(&mut self, first: i64) {
        if self.patching {
            return self.rewrite(first);
        }
        if first == self.first || self.records.is_empty() {
            self.first = first;
            return;
        }
        let old = self.first;
        self.patching = true;
        let buf = Arc::make_mut(&mut self.bytes);
        for (k, r) in self.records.iter().enumerate() {
            let (from, to) = (old.wrapping_add(k as i64), first.wrapping_add(k as i64));
            buf[r.start..r.start + 8].copy_from_slice(&to.to_be_bytes());
            let at = r.start + RECORD_PREFIX + r.data_len;
            let crc = be_u32(&buf[at..at + 4]) ^ crc::multiply(r.power, crc::delta(&(from ^ to).to_be_bytes()));
            buf[at..at + 4].copy_from_slice(&crc.to_be_bytes());
        }
        self.first = first;
        self.patching = false;
    }

    /// Writes every record's id and CRC from its other fields (the data by its CRC).
    fn rewrite(&mut self, first: i64) {
        let buf = Arc::make_mut(&mut self.bytes);
        for (k, r) in self.records.iter().enumerate() {
            buf[r.start..r.start + 8].copy_from_slice(&first.wrapping_add(k as i64).to_be_bytes());
            let prefix = &buf[r.start..r.start + RECORD_PREFIX];
            let crc = crc::extend(crc32(prefix), be_u32(&prefix[32..36]), r.data_len as u64);
            let at = r.start + RECORD_PREFIX + r.data_len;
            buf[at..at + 4].copy_from_slice(&crc.to_be_bytes());
        }
        self.first = first;
        self.patching = false;
    }

    /// The records as `NewRecord`s (data CRCs included), borrowing the data in place.
    pub fn records(&self) -> Vec<NewRecord<'_>> {
        self.records
            .iter()
            .map(|r| {
                let b = &self.bytes[r.start..];
                let (h, len, data_crc) = parse_prefix(b, r.data_len).expect("a laid-out record parses");
                NewRecord {
                    req_id: h.req_id,
                    header: h.header,
                    data: &b[RECORD_PREFIX..RECORD_PREFIX + len],
                    data_crc: Some(data_crc),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::record::{check_record, ReqId};

    fn rec(k: usize, data: &[u8]) -> NewRecord<'_> {
        let req_id = ReqId { client_id: k as i32, generation: 2, partition_id: 3, sequence: -(k as i32) };
        NewRecord { req_id, header: k as i32 * 7, data, data_crc: None }
    }

    /// What `encode_record` gives for the same records at ids from `first`.
    fn expected(datas: &[Vec<u8>], first: i64) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, d) in datas.iter().enumerate() {
            encode_record(&mut out, first + k as i64, &rec(k, d));
        }
        out
    }

    #[test]
    fn patched_ids_give_the_bytes_encoding_at_those_ids_gives() {
        let sizes = [0usize, 1, 100, 100, 1024, 5000, 100, 70_000, 3];
        let datas: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(k, n)| vec![k as u8 * 31 + 1; *n]).collect();
        let mut b = LaidBatch::default();
        for (k, d) in datas.iter().enumerate() {
            b.push(&rec(k, d));
        }
        assert_eq!(**b.bytes(), expected(&datas, 0));
        // Ids whose XOR with the old ones flips every byte, the sign, and carries across bytes.
        for first in [0i64, 1, 255, 256, 1 << 40, i64::MAX - 20, -1, 12345, 12345, 0] {
            b.set_first(first);
            assert_eq!(b.first(), first);
            assert_eq!(**b.bytes(), expected(&datas, first), "first id {first}");
        }
        let ends: Vec<u64> = b.ends().collect();
        for (k, start) in b.starts().enumerate() {
            let v = check_record(&b.bytes()[start as usize..ends[k] as usize], Some(k as i64), 1 << 20).unwrap();
            assert_eq!(v.data_len, sizes[k]);
        }
        assert_eq!(b.data_bytes(), sizes.iter().sum::<usize>());
        assert_eq!(b.max_data(), 70_000);
        let views = b.records();
        for (k, v) in views.iter().enumerate() {
            assert_eq!((v.req_id, v.header, v.data), (rec(k, &datas[k]).req_id, k as i32 * 7, &datas[k][..]));
            assert_eq!(v.data_crc, Some(crate::engine::record::crc32(&datas[k])));
        }
    }

    #[test]
    fn a_patch_cut_short_is_rewritten_whole_by_the_next() {
        let datas: Vec<Vec<u8>> = (0..5).map(|k| vec![k as u8; 10 * k]).collect();
        let mut b = LaidBatch::default();
        for (k, d) in datas.iter().enumerate() {
            b.push(&rec(k, d));
        }
        b.set_first(100);
        // As a panic halfway through a patch to 200 would leave it: two records at their new ids.
        b.patching = true;
        let bytes = Arc::make_mut(&mut b.bytes);
        let half = expected(&datas, 200);
        let cut = b.records[2].start;
        bytes[..cut].copy_from_slice(&half[..cut]);
        b.set_first(300);
        assert_eq!(**b.bytes(), expected(&datas, 300));
        b.set_first(7);
        assert_eq!(**b.bytes(), expected(&datas, 7));
    }

    #[test]
    fn a_buffer_a_queue_still_holds_is_copied_before_it_is_patched() {
        let mut b = LaidBatch::default();
        b.push(&rec(0, b"abc"));
        let held = b.bytes().clone();
        b.set_first(9);
        assert_eq!(*held, expected(&[b"abc".to_vec()], 0), "the held bytes are unchanged");
        assert_eq!(**b.bytes(), expected(&[b"abc".to_vec()], 9));
    }

    #[test]
    fn records_pushed_after_a_patch_continue_its_ids() {
        let mut b = LaidBatch::default();
        b.push(&rec(0, b"one"));
        b.set_first(40);
        b.push(&rec(1, b"two"));
        assert_eq!(**b.bytes(), expected(&[b"one".to_vec(), b"two".to_vec()], 40));
    }
}
