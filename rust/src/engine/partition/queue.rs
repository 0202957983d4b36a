//! The tail's write queue: batches encoded but not yet written to the data file, in id order.
//! Small records are copied in; the data of large ones from a shared buffer (a `RecordBatch`'s)
//! is held by reference, and the sync leader writes it from where it lies, the whole queue in one
//! `pwritev`. The queue owns what it refers to (an `Arc` per piece): a poisoned partition
//! releases its waiters at once, and whatever an appender then does with its batch, the bytes the
//! leader may still be writing stay alive until the queue is cleared.
use crate::engine::fs::FileHandle;
use crate::engine::record::{record_frame, NewRecord, RECORD_OVERHEAD};
use std::io::{self, IoSlice};
use std::sync::Arc;

/// A buffer appenders share with the queue: records whose data lies in it can be queued by
/// reference (`Partition::append_shared`).
pub type SharedData = Arc<Vec<u8>>;

/// Data at least this long goes by reference. Below it a copy costs less than an iovec: at 1 KiB
/// the pwritev of 2,000 slices per 1 MiB batch took 130 µs longer than the pwrite of a copy, which
/// saved 75 µs of encoding; at 4 KiB and up the write took as long and the encoding fell from
/// 60–140 µs to 7 µs per batch (docs/performance.md, "Where an append's time goes").
const BY_REFERENCE_MIN: usize = 4096;
/// A copy buffer grown past this by a huge batch is not kept for the next one.
const SCRATCH_KEEP: usize = 16 << 20;

enum Piece {
    /// `bytes[start..start + len]`.
    Copied {
        start: usize,
        len: usize,
    },
    Shared {
        data: SharedData,
        start: usize,
        len: usize,
    },
}

#[derive(Default)]
pub struct WriteQueue {
    bytes: Vec<u8>,
    pieces: Vec<Piece>,
    len: u64,
    /// The buffers of batches absorbed by reference (`absorb`), to reuse once written.
    owned: Vec<SharedData>,
    /// Where each queued record ends (bytes from the queue's start): the points a write that
    /// must stop short of the whole queue may stop at (`Partition`'s unsynced bound).
    ends: Vec<u64>,
}

/// Where `data` starts inside `owner`, if it lies wholly in it.
fn offset_in(owner: &[u8], data: &[u8]) -> Option<usize> {
    let (base, p) = (owner.as_ptr() as usize, data.as_ptr() as usize);
    (p >= base && p - base + data.len() <= owner.len()).then(|| p - base)
}

impl WriteQueue {
    /// Bytes queued.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The furthest record end after `from` and at most `room` bytes past it, if any.
    pub fn record_end_within(&self, from: u64, room: u64) -> Option<u64> {
        let limit = from.saturating_add(room);
        let i = self.ends.partition_point(|e| *e <= limit);
        i.checked_sub(1).map(|i| self.ends[i]).filter(|e| *e > from)
    }

    fn copy(&mut self, b: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(b);
        match self.pieces.last_mut() {
            Some(Piece::Copied { start: s, len }) if *s + *len == start => *len += b.len(),
            _ => self.pieces.push(Piece::Copied { start, len: b.len() }),
        }
    }

    /// Queues record `rec` as transaction `txid`: by reference when its data lies in `owner` and
    /// is large enough, copied otherwise. Returns its encoded length.
    pub fn push_record(&mut self, txid: i64, rec: &NewRecord<'_>, owner: Option<&SharedData>) -> u64 {
        let (prefix, crc) = record_frame(txid, rec);
        self.copy(&prefix);
        let shared =
            owner.filter(|_| rec.data.len() >= BY_REFERENCE_MIN).and_then(|o| Some((o, offset_in(o, rec.data)?)));
        match shared {
            Some((o, start)) => self.pieces.push(Piece::Shared { data: o.clone(), start, len: rec.data.len() }),
            None => self.copy(rec.data),
        }
        self.copy(&crc);
        let n = (RECORD_OVERHEAD + rec.data.len()) as u64;
        self.len += n;
        self.ends.push(self.len);
        n
    }

    /// Encodes `records` as transactions `first_txid`, ... onto the queue (as `push_record`) and
    /// appends each record's offset, counted from where the batch starts, to `offsets`. Returns the
    /// batch's encoded length.
    pub fn push_batch(
        &mut self,
        first_txid: i64,
        records: &[NewRecord<'_>],
        owner: Option<&SharedData>,
        offsets: &mut Vec<u64>,
    ) -> u64 {
        let mut written = 0u64;
        for (k, r) in records.iter().enumerate() {
            offsets.push(written);
            written += self.push_record(first_txid + k as i64, r, owner);
        }
        written
    }

    /// Queues records already encoded in `bytes` (`LaidBatch`), ending at `ends` (offsets in
    /// `bytes`): a large buffer by reference (written from where it lies), a small one copied.
    pub fn push_encoded(&mut self, bytes: &SharedData, ends: impl Iterator<Item = u64>) {
        let base = self.len;
        if bytes.len() >= BY_REFERENCE_MIN {
            self.pieces.push(Piece::Shared { data: bytes.clone(), start: 0, len: bytes.len() });
        } else {
            self.copy(bytes);
        }
        self.ends.extend(ends.map(|e| base + e));
        self.len += bytes.len() as u64;
    }

    /// Moves everything `batch` holds to the end of this queue by reference, its buffer becoming a
    /// shared piece: no copy under the partition's lock. The buffer comes back from `clear_into`.
    pub fn absorb(&mut self, mut batch: WriteQueue) {
        let base = self.len;
        self.ends.extend(batch.ends.iter().map(|e| base + e));
        self.len += batch.len;
        let bytes: SharedData = Arc::new(std::mem::take(&mut batch.bytes));
        self.owned.push(bytes.clone());
        for p in batch.pieces {
            self.pieces.push(match p {
                Piece::Copied { start, len } => Piece::Shared { data: bytes.clone(), start, len },
                shared => shared,
            });
        }
    }

    /// The queued bytes as slices, end to end.
    pub fn slices(&self) -> Vec<IoSlice<'_>> {
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Copied { start, len } => IoSlice::new(&self.bytes[*start..*start + *len]),
                Piece::Shared { data, start, len } => IoSlice::new(&data[*start..*start + *len]),
            })
            .collect()
    }

    /// Writes the queue at `at`: one pwrite when it is one piece, else one pwritev.
    pub fn write_to(&self, file: &dyn FileHandle, at: u64) -> io::Result<()> {
        match self.pieces.as_slice() {
            [Piece::Copied { start, len }] => return file.write_all_at(&self.bytes[*start..*start + *len], at),
            [Piece::Shared { data, start, len }] => return file.write_all_at(&data[*start..*start + *len], at),
            _ => {}
        }
        file.write_all_vectored_at(&self.slices(), at)
    }

    /// Empties the queue, dropping its references to shared buffers; the buffers of absorbed
    /// batches that nobody else holds go to `reuse`.
    pub fn clear_into(&mut self, reuse: &mut Vec<Vec<u8>>) {
        self.pieces.clear();
        for b in self.owned.drain(..) {
            if let Ok(mut v) = Arc::try_unwrap(b) {
                if v.capacity() <= SCRATCH_KEEP {
                    v.clear();
                    reuse.push(v);
                }
            }
        }
        self.clear();
    }

    /// Writes the queue's bytes `from..to` (offsets in the queue) at `at + from`.
    pub fn write_range(&self, file: &dyn FileHandle, at: u64, from: u64, to: u64) -> io::Result<()> {
        let (mut pos, mut slices) = (0u64, Vec::new());
        for p in &self.pieces {
            let bytes = match p {
                Piece::Copied { start, len } => &self.bytes[*start..*start + *len],
                Piece::Shared { data, start, len } => &data[*start..*start + *len],
            };
            let (lo, hi) = (pos.max(from), (pos + bytes.len() as u64).min(to));
            if lo < hi {
                slices.push(IoSlice::new(&bytes[(lo - pos) as usize..(hi - pos) as usize]));
            }
            pos += bytes.len() as u64;
        }
        file.write_all_vectored_at(&slices, at + from)
    }

    /// Empties the queue, dropping its references to shared buffers.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.pieces.clear();
        self.owned.clear();
        self.ends.clear();
        self.len = 0;
        if self.bytes.capacity() > SCRATCH_KEEP {
            self.bytes = Vec::new();
        }
    }

    /// An empty queue that encodes into `bytes` (a buffer kept from an earlier batch).
    pub fn with_buffer(bytes: Vec<u8>) -> WriteQueue {
        WriteQueue { bytes, ..WriteQueue::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::record::{encode_record, ReqId};
    use std::sync::Mutex;

    /// A file that records its writes' bytes at their offsets.
    #[derive(Default)]
    struct Mem(Mutex<Vec<u8>>);

    impl FileHandle for Mem {
        fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<usize> {
            Ok(0)
        }
        fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            let mut v = self.0.lock().unwrap();
            let end = offset as usize + buf.len();
            if v.len() < end {
                v.resize(end, 0);
            }
            v[offset as usize..end].copy_from_slice(buf);
            Ok(())
        }
        fn sync_data(&self) -> io::Result<()> {
            Ok(())
        }
        fn set_len(&self, _: u64) -> io::Result<()> {
            Ok(())
        }
        fn len(&self) -> io::Result<u64> {
            Ok(self.0.lock().unwrap().len() as u64)
        }
        fn try_lock_exclusive(&self) -> io::Result<bool> {
            Ok(true)
        }
    }

    fn rec(data: &[u8], crc: bool) -> NewRecord<'_> {
        let req_id = ReqId { client_id: 1, generation: 2, partition_id: 3, sequence: 4 };
        NewRecord { req_id, header: 5, data, data_crc: crc.then(|| crate::engine::record::crc32(data)) }
    }

    #[test]
    fn shared_and_copied_records_write_the_bytes_encode_record_gives() {
        let owner: SharedData = Arc::new((0..10_000u32).map(|i| (i * 7) as u8).collect());
        let other = vec![9u8; 3000];
        // Large and small, inside the owner and outside it, with and without a known data CRC.
        let recs = [
            rec(&owner[0..4100], true),
            rec(&owner[4100..4200], true),
            rec(&other, false),
            rec(&owner[5000..10_000], false),
            rec(&[], true),
        ];
        let (mut q, mut expect) = (WriteQueue::default(), Vec::new());
        for (k, r) in recs.iter().enumerate() {
            assert_eq!(q.push_record(100 + k as i64, r, Some(&owner)), (RECORD_OVERHEAD + r.data.len()) as u64);
            encode_record(&mut expect, 100 + k as i64, r);
        }
        assert_eq!(q.len(), expect.len() as u64);
        assert_eq!(q.pieces.iter().filter(|p| matches!(p, Piece::Shared { .. })).count(), 2);
        let f = Mem::default();
        q.write_to(&f, 128).unwrap();
        assert_eq!(&f.0.lock().unwrap()[128..], &expect[..]);
    }

    #[test]
    fn a_queue_written_in_ranges_ending_at_records_writes_the_same_bytes() {
        let owner: SharedData = Arc::new((0..20_000u32).map(|i| (i * 13) as u8).collect());
        let (mut q, mut expect) = (WriteQueue::default(), Vec::new());
        for (k, r) in
            [rec(&owner[..100], true), rec(&owner[100..9000], true), rec(&owner[9000..9010], false)].iter().enumerate()
        {
            q.push_record(k as i64, r, Some(&owner));
            encode_record(&mut expect, k as i64, r);
        }
        let ends = [140, 140 + 8940, expect.len() as u64];
        assert_eq!(q.record_end_within(0, 139), None, "no record ends that soon");
        assert_eq!(q.record_end_within(0, 9000), Some(ends[0]));
        assert_eq!(q.record_end_within(ends[0], 8950), Some(ends[1]));
        assert_eq!(q.record_end_within(ends[0], u64::MAX), Some(ends[2]));
        let f = Mem::default();
        let mut from = 0;
        for to in ends {
            q.write_range(&f, 128, from, to).unwrap();
            from = to;
        }
        assert_eq!(&f.0.lock().unwrap()[128..], &expect[..]);
    }

    #[test]
    fn laid_out_batches_queue_their_record_ends_and_write_in_ranges_as_they_lie() {
        use crate::engine::batch::LaidBatch;
        let (small, large) = ([1u8; 50], [2u8; 6000]);
        let mut q = WriteQueue::default();
        q.push_record(0, &rec(&small, true), None);
        let mut expect = Vec::new();
        encode_record(&mut expect, 0, &rec(&small, true));
        // One batch under 4 KiB (copied), one over it (by reference).
        for (first, data) in [(1i64, &small[..]), (3, &large[..])] {
            let mut b = LaidBatch::default();
            b.extend(&[rec(data, false), rec(&small, false)]);
            b.set_first(first);
            let base = q.len();
            q.push_encoded(b.bytes(), b.ends());
            let ends: Vec<u64> = b.ends().map(|e| base + e).collect();
            assert_eq!(q.record_end_within(base, ends[0] - base), Some(ends[0]));
            assert_eq!(q.record_end_within(base, u64::MAX), Some(ends[1]));
            assert_eq!(q.record_end_within(ends[0], ends[1] - ends[0] - 1), None);
            encode_record(&mut expect, first, &rec(data, false));
            encode_record(&mut expect, first + 1, &rec(&small, false));
        }
        assert_eq!(q.pieces.iter().filter(|p| matches!(p, Piece::Shared { .. })).count(), 1);
        let f = Mem::default();
        let mut from = 0;
        while from < q.len() {
            let to = q.record_end_within(from, 100).unwrap_or_else(|| q.record_end_within(from, u64::MAX).unwrap());
            q.write_range(&f, 64, from, to).unwrap();
            from = to;
        }
        assert_eq!(&f.0.lock().unwrap()[64..], &expect[..]);
    }

    #[test]
    fn absorbed_batches_write_what_they_encoded_and_their_buffers_come_back() {
        let owner: SharedData = Arc::new(vec![7u8; 8000]);
        let (mut q, mut expect, mut reuse) = (WriteQueue::default(), Vec::new(), Vec::new());
        let mut txid = 0i64;
        // Copied records, and records by reference in `owner`.
        for (n, size) in [(3usize, 100usize), (100, 1024), (2, 6000)] {
            let data: Vec<u8> = (0..size).map(|i| (i * 13) as u8).collect();
            let recs: Vec<NewRecord<'_>> =
                (0..n).map(|_| rec(if size == 6000 { &owner[..size] } else { &data }, true)).collect();
            let mut batch = WriteQueue::with_buffer(Vec::with_capacity(16));
            let mut offsets = Vec::new();
            let len = batch.push_batch(txid, &recs, Some(&owner), &mut offsets);
            let mut at = 0u64;
            for (k, r) in recs.iter().enumerate() {
                assert_eq!(offsets[k], at);
                at += (RECORD_OVERHEAD + r.data.len()) as u64;
                encode_record(&mut expect, txid + k as i64, r);
            }
            assert_eq!(len, at);
            let before = q.len();
            q.absorb(batch);
            assert_eq!(q.record_end_within(before, u64::MAX), Some(before + len), "an absorbed batch's ends count");
            let first_end = before + (RECORD_OVERHEAD + size) as u64;
            assert_eq!(q.record_end_within(before, first_end - before), Some(first_end), "and its first record's");
            txid += n as i64;
        }
        assert_eq!(q.len(), expect.len() as u64);
        let f = Mem::default();
        q.write_to(&f, 0).unwrap();
        assert_eq!(*f.0.lock().unwrap(), expect);
        q.clear_into(&mut reuse);
        assert!(q.is_empty() && Arc::strong_count(&owner) == 1, "a cleared queue holds no buffer");
        assert_eq!(reuse.len(), 3, "the buffers of absorbed batches come back for reuse");
    }
}
