//! Torn writes with survivors (torture seed 61): a power loss may persist any subset of the
//! pages written since the last completed fdatasync, so a hole in the last segment may have
//! valid records after it. Recovery cuts such a tail when every byte after the hole that is not
//! zero lies within the writer's unsynced bound, the hole is above the low-water mark and the
//! segment is the last; anything else stays corruption. The writer keeps that bound.
use super::tests::{open_with, opts, KEY};
use super::*;
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FileHandle, ForwardingFile, StdFs, WrapFs};
use crate::engine::record::ReqId;
use crate::engine::segment::UNSYNCED_SPAN;
use crate::engine::storage::Storage;
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::FileExt;

fn data(t: i64) -> Vec<u8> {
    format!("torn-{t}-").repeat((t % 5 + 3) as usize).into_bytes()
}

fn append(p: &Partition, from: i64, n: i64) {
    let datas: Vec<Vec<u8>> = (from..from + n).map(data).collect();
    let recs: Vec<NewRecord<'_>> =
        datas.iter().map(|d| NewRecord { req_id: ReqId::default(), header: 0, data: d, data_crc: None }).collect();
    p.append(from, &recs).unwrap();
}

fn check(p: &Partition, last: i64) {
    assert_eq!(p.max_txid(), last);
    for t in 0..=last {
        assert_eq!(p.read_record(t).unwrap().unwrap().data, data(t), "transaction {t}");
    }
}

fn reopen(dir: &Path, o: PartitionOptions) -> Result<Partition> {
    Partition::open(Arc::new(StdFs), dir, 0, KEY, o)
}

/// A partition of `n` records in one segment, as a power loss may leave it: its index without
/// entries (a proven checkpoint after the damage would hide it from the open, by design: reads
/// find it). Returns each record's offset and the end.
fn log_of(dir: &Path, n: i64) -> (Vec<u64>, u64) {
    let p = open_with(Arc::new(StdFs), dir, opts(1 << 30, 4)).unwrap();
    append(&p, 0, n);
    let seg = p.snapshot(0).unwrap().0.pop().unwrap();
    let offs = (0..n as u64).map(|i| seg.files.index.offset_of(i).unwrap()).collect();
    drop((seg, p));
    lose_index(dir, 0);
    (offs, seg_end(dir))
}

fn lose_index(dir: &Path, first: i64) {
    let f = std::fs::OpenOptions::new().write(true).open(dir.join(index_name(first))).unwrap();
    f.set_len(HEADER_LEN).unwrap();
}

fn seg_end(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(data_name(0))).unwrap().len()
}

fn write_at(path: &Path, bytes: &[u8], at: u64) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().write_all_at(bytes, at).unwrap();
}

fn corruption_at(r: Result<Partition>) -> (u64, String) {
    match r {
        Err(Error::Corruption { offset, reason, .. }) => (offset, reason),
        Err(e) => panic!("expected corruption, got {e}"),
        Ok(p) => panic!("expected corruption, the partition opened at {}", p.max_txid()),
    }
}

/// Zeros over `[from, to)`: blocks a power loss kept from the disk (they held zeros before).
fn zero(path: &Path, from: u64, to: u64) {
    write_at(path, &vec![0; (to - from) as usize], from);
}

#[test]
fn a_hole_with_valid_records_after_it_within_the_bound_is_a_torn_tail() {
    // Seed 61's file: zeros where a record began, valid records after. Unwritten space of each
    // shape a disk leaves: a whole record; from a record to a sector boundary; from a record's
    // id to a sector boundary inside it; from a sector boundary inside a record to the next one.
    let up = |o: u64| o.next_multiple_of(512);
    for shape in ["record", "to a sector", "id to a sector", "sector to the next record"] {
        let d = tempfile::tempdir().unwrap();
        let (offs, end) = log_of(d.path(), 200);
        let seg = d.path().join(data_name(0));
        let k = |ok: &dyn Fn(usize) -> bool| (100..190).find(|k| ok(*k)).expect("the log has a record so placed");
        let (bad, from, to) = match shape {
            "record" => (100, offs[100], offs[101]),
            "to a sector" => (100, offs[100], up(offs[100] + 40)),
            "id to a sector" => {
                let k = k(&|k| (8..40).contains(&(up(offs[k]) - offs[k])) && up(offs[k]) < offs[k + 1]);
                (k, offs[k], up(offs[k]))
            }
            _ => {
                let k = k(&|k| up(offs[k] + 1) + 4 <= offs[k + 1]);
                (k, up(offs[k] + 1), offs[k + 1])
            }
        };
        zero(&seg, from, to);
        let survivor = *offs.iter().find(|o| **o >= to && **o > offs[bad]).unwrap();
        let p = reopen(d.path(), opts(1 << 30, 4)).unwrap();
        check(&p, bad as i64 - 1);
        assert_eq!(p.recovery.torn_survivors, Some((seg.clone(), offs[bad], survivor)), "{shape}");
        assert_eq!(p.recovery.torn_bytes, end - offs[bad]);
        assert_eq!(std::fs::metadata(&seg).unwrap().len(), offs[bad], "the survivors are cut with the hole");
        append(&p, bad as i64, 3);
        drop(p);
        let p = reopen(d.path(), opts(1 << 30, 4)).unwrap();
        check(&p, bad as i64 + 2);
        assert_eq!((p.recovery.torn_bytes, p.recovery.torn_survivors.clone()), (0, None));
    }
}

#[test]
fn garbage_or_a_flipped_bit_with_valid_records_after_it_is_corruption() {
    // No unwritten space in the hole: a disk that did not write a block leaves what it held,
    // zeros past the synced end, never other bytes. So this is damage, even near the end.
    let d = tempfile::tempdir().unwrap();
    let (offs, _) = log_of(d.path(), 20);
    let seg = d.path().join(data_name(0));
    let pristine = std::fs::read(&seg).unwrap();
    for (bytes, at) in [(vec![0xAB; 50], offs[15]), (vec![pristine[offs[15] as usize + 45] ^ 4], offs[15] + 45)] {
        std::fs::write(&seg, &pristine).unwrap();
        write_at(&seg, &bytes, at);
        let (offset, reason) = corruption_at(reopen(d.path(), opts(1 << 30, 4)));
        assert_eq!(offset, offs[15]);
        assert!(reason.contains("no unwritten space"), "{reason}");
    }
    // Zeros that do not reach a sector boundary nor the next record are no block's either.
    std::fs::write(&seg, &pristine).unwrap();
    write_at(&seg, &[0; 50], offs[15]);
    assert!((offs[15] + 50) % 512 != 0 && offs[15] + 50 < offs[16]);
    corruption_at(reopen(d.path(), opts(1 << 30, 4)));
}

#[test]
fn data_past_the_bound_after_a_hole_is_corruption() {
    // A valid record (a copy of the next one) or any non-zero byte further from the hole than the
    // writer ever leaves unsynced: the hole is in synced data.
    let d = tempfile::tempdir().unwrap();
    let (offs, _) = log_of(d.path(), 10);
    let seg = d.path().join(data_name(0));
    let mut next = vec![0u8; (offs[6] - offs[5]) as usize];
    std::fs::File::open(&seg).unwrap().read_exact_at(&mut next, offs[5]).unwrap();
    let bound = unsynced_bound(opts(1 << 30, 4).recover.max_record_size);
    assert!(bound >= UNSYNCED_SPAN);
    let past = offs[4] + bound;
    let pristine = std::fs::read(&seg).unwrap();
    for (beyond, at) in [(next.clone(), past), (vec![1u8], past), (next.clone(), past - 1)] {
        std::fs::write(&seg, &pristine).unwrap();
        zero(&seg, offs[4], offs[5]);
        write_at(&seg, &beyond, at);
        let (offset, reason) = corruption_at(reopen(d.path(), opts(1 << 30, 4)));
        assert_eq!(offset, offs[4]);
        assert!(reason.contains("further than the writer leaves unsynced"), "{reason}");
    }
    // Zeros up to the end of the file past the bound are what preallocation leaves: torn.
    std::fs::write(&seg, &pristine).unwrap();
    zero(&seg, offs[4], offs[5]);
    std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(past + 4096).unwrap();
    let p = reopen(d.path(), opts(1 << 30, 4)).unwrap();
    check(&p, 3);
    assert_eq!(p.recovery.torn_bytes, past + 4096 - offs[4]);
    drop(p);
    // Repair still cuts a corrupt one at the hole.
    std::fs::write(&seg, &pristine).unwrap();
    zero(&seg, offs[4], offs[5]);
    write_at(&seg, &next, past);
    let mut repair = opts(1 << 30, 4);
    repair.recover.mode = RecoveryMode::TruncateAtCorruption;
    let p = reopen(d.path(), repair).unwrap();
    check(&p, 3);
    assert_eq!(p.recovery.corruption_cut, Some((seg, offs[4])));
}

#[test]
fn a_hole_at_or_below_the_low_water_mark_is_corruption() {
    let d = tempfile::tempdir().unwrap();
    let (offs, _) = log_of(d.path(), 20);
    let seg = d.path().join(data_name(0));
    zero(&seg, offs[15], offs[16]);
    for committed in [15, 19] {
        let mut o = opts(1 << 30, 4);
        o.recover.low_water_mark = committed;
        let (offset, reason) = corruption_at(reopen(d.path(), o));
        assert_eq!(offset, offs[15]);
        assert!(reason.contains(&format!("low-water mark {committed}")), "{reason}");
    }
    let mut o = opts(1 << 30, 4);
    o.recover.low_water_mark = 14;
    check(&reopen(d.path(), o).unwrap(), 14);
}

#[test]
fn storage_opens_a_partition_with_the_control_files_low_water_mark() {
    // Above the hole: committed records are damaged. Below it: the tail was never committed here.
    for (mark, opens) in [(17, false), (14, true)] {
        let d = tempfile::tempdir().unwrap();
        let s = Storage::create(d.path(), KEY, 1, opts(1 << 30, 4)).unwrap();
        s.add_partition(0).unwrap();
        append(&s.partition(0).unwrap(), 0, 20);
        let seg = s.partition(0).unwrap().snapshot(0).unwrap().0.pop().unwrap();
        let (hole, next) = (seg.files.index.offset_of(15).unwrap(), seg.files.index.offset_of(16).unwrap());
        let path = seg.files.data_path.clone();
        drop(seg);
        s.set_low_water_mark(0, 3, mark).unwrap();
        s.close();
        drop(s);
        lose_index(path.parent().unwrap(), 0);
        zero(&path, hole, next);
        let s = Storage::open(d.path(), Some(KEY), Some(1), opts(1 << 30, 4)).unwrap();
        match s.partition(0) {
            Ok(p) => {
                assert!(opens, "opened below a low-water mark of {mark}");
                check(&p, 14);
            }
            Err(Error::Corruption { offset, .. }) => assert!(!opens && offset == hole),
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn a_hole_in_a_sealed_segment_is_corruption_whatever_follows() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), opts(1024, 4)).unwrap();
    for t in 0..40 {
        append(&p, t, 1);
    }
    let segs = p.snapshot(0).unwrap().0;
    assert!(segs.len() > 2);
    let first = &segs[0];
    assert!(first.count > 3);
    let (hole, path) = (first.files.index.offset_of(1).unwrap(), first.files.data_path.clone());
    drop((segs, p));
    lose_index(d.path(), 0);
    write_at(&path, &[0; 50], hole);
    let (offset, reason) = corruption_at(reopen(d.path(), opts(1024, 4)));
    assert_eq!(offset, hole);
    assert!(reason.contains("sealed segment") || reason.contains("valid record after it"), "{reason}");
}

/// Per data file, the span of the writes of records since its last sync (zeros excluded: they
/// are preallocation, and recovery reads them as free space), and the widest seen.
#[derive(Default)]
struct Spans {
    open: HashMap<PathBuf, (u64, u64)>,
    widest: u64,
    syncs: u64,
}

struct SpanFile {
    inner: Arc<dyn FileHandle>,
    path: PathBuf,
    spans: Arc<Mutex<Spans>>,
}

impl ForwardingFile for SpanFile {
    fn inner(&self) -> &dyn FileHandle {
        self.inner.as_ref()
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_all_at(buf, offset)?;
        if self.path.extension().is_some_and(|e| e == "seg") && buf.iter().any(|b| *b != 0) {
            let mut s = self.spans.lock().unwrap();
            let end = offset + buf.len() as u64;
            let span = s.open.entry(self.path.clone()).or_insert((offset, end));
            *span = (span.0.min(offset), span.1.max(end));
            let width = span.1 - span.0;
            s.widest = s.widest.max(width);
        }
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()?;
        let mut s = self.spans.lock().unwrap();
        s.open.remove(&self.path);
        s.syncs += 1;
        Ok(())
    }
}

#[test]
fn the_writer_splits_a_round_larger_than_the_bound() {
    let spans = Arc::new(Mutex::new(Spans::default()));
    let s2 = spans.clone();
    let fs = WrapFs(move |p: &Path, f: Arc<dyn FileHandle>| -> io::Result<Arc<dyn FileHandle>> {
        Ok(Arc::new(SpanFile { inner: f, path: p.to_path_buf(), spans: s2.clone() }))
    });
    let d = tempfile::tempdir().unwrap();
    let mut o = opts(1 << 30, 1000);
    o.recover.max_record_size = 1 << 20;
    let bound = unsynced_bound(o.recover.max_record_size);
    assert_eq!(bound, UNSYNCED_SPAN);
    let p = open_with(Arc::new(fs), d.path(), o.clone()).unwrap();
    // One sync leader finds 24 MiB queued: more than the bound, in whole records.
    let big: Vec<Vec<u8>> = (0..24).map(|k| vec![k as u8 + 1; (1 << 20) - 100]).collect();
    let mut last = None;
    for (k, b) in big.iter().enumerate() {
        let rec = NewRecord { req_id: ReqId::default(), header: 0, data: b, data_crc: None };
        last = Some(p.enqueue(Some(k as i64), &[rec]).unwrap());
    }
    let syncs_before = spans.lock().unwrap().syncs;
    p.wait_durable(last.unwrap().seq).unwrap();
    let (widest, syncs) = {
        let s = spans.lock().unwrap();
        (s.widest, s.syncs - syncs_before)
    };
    assert!(widest <= bound, "{widest} bytes of records unsynced at once, bound {bound}");
    assert!(widest > bound / 2, "the pieces fill the bound: {widest}");
    assert!(syncs >= 2, "the round was split: {syncs} syncs");
    assert_eq!(p.max_txid(), 23);
    drop(p);
    let p = reopen(d.path(), o).unwrap();
    for (k, b) in big.iter().enumerate() {
        assert_eq!(&p.read_record(k as i64).unwrap().unwrap().data, b);
    }
}
