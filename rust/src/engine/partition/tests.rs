//! Unit tests of the partition: append, group commit, reads, truncation, retention, recovery.
use super::*;
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FaultFs, FileHandle, ForwardingFile, StdFs, WrapFs};
use crate::engine::record::ReqId;
use std::os::unix::fs::FileExt;

pub(super) const KEY: [u8; 16] = [3; 16];

pub(super) fn opts(segment_size: u64, cp: u64) -> PartitionOptions {
    let mut o = default_options();
    o.segment_size = segment_size;
    o.recover.checkpoint_interval = cp;
    o
}

pub(super) fn open_with(fs: Arc<dyn FileSystem>, dir: &Path, o: PartitionOptions) -> Result<Partition> {
    Partition::create(fs.as_ref(), dir, 0, KEY)?;
    Partition::open(fs, dir, 0, KEY, o)
}

/// A file that writes everything through the page cache: a `ForwardingFile` offers no direct
/// handle (`direct.rs`).
struct Plain(Arc<dyn FileHandle>);

impl ForwardingFile for Plain {
    fn inner(&self) -> &dyn FileHandle {
        self.0.as_ref()
    }
}

/// `StdFs` without O_DIRECT: every flush through the page cache.
pub(super) fn plain_fs() -> Arc<dyn FileSystem> {
    Arc::new(WrapFs(|_: &Path, f: Arc<dyn FileHandle>| Ok(Arc::new(Plain(f)) as Arc<dyn FileHandle>)))
}

fn open(dir: &Path, o: PartitionOptions) -> Partition {
    open_with(Arc::new(StdFs), dir, o).unwrap()
}

/// Copies the partition folder as it is now, open files and all: what kill -9 leaves
/// (everything written, possibly only in the page cache).
pub(super) fn crash_copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            continue;
        }
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

pub(super) fn payload(txid: i64) -> Vec<u8> {
    format!("payload-{txid}-").repeat((txid % 7 + 1) as usize).into_bytes()
}

pub(super) fn append_n(p: &Partition, from: i64, n: i64) {
    let datas: Vec<Vec<u8>> = (from..from + n).map(payload).collect();
    let recs: Vec<NewRecord<'_>> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| NewRecord {
            req_id: ReqId { client_id: 1, generation: 1, partition_id: 0, sequence: (from + i as i64) as i32 },
            header: i as i32,
            data: d,
            data_crc: None,
        })
        .collect();
    p.append(from, &recs).unwrap();
}

pub(super) fn check_all(p: &Partition, upto: i64) {
    assert_eq!(p.max_txid(), upto);
    let first = p.first_txid();
    let mut t = first;
    p.visit(
        first,
        i64::MAX,
        |h, d| {
            assert_eq!(h.txid, t);
            assert_eq!(d, payload(t).as_slice());
            t += 1;
            true
        },
        1 << 20,
    )
    .unwrap();
    assert_eq!(t, upto + 1);
}

fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().map(|e| e == "seg").unwrap_or(false))
        .collect();
    v.sort();
    v
}

#[test]
fn rolls_segments_and_survives_reopen() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    for i in 0..50 {
        append_n(&p, i * 7, 7);
    }
    assert!(p.segment_count() > 5);
    check_all(&p, 349);
    drop(p);
    let p = open(d.path(), opts(4096, 10));
    check_all(&p, 349);
    assert_eq!(p.recovery.torn_bytes, 0);
}

#[test]
fn index_is_rebuilt_only_past_the_last_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(1 << 30, 100));
    for i in 0..25 {
        append_n(&p, i * 10, 10);
    }
    drop(p);
    let p = open(d.path(), opts(1 << 30, 100));
    assert_eq!(p.recovery.scanned_records, 50);
    check_all(&p, 249);
    drop(p);
    // A damaged entry inside the last checkpoint window moves recovery one window back.
    let idx = std::fs::OpenOptions::new().write(true).open(d.path().join(index_name(0))).unwrap();
    idx.write_all_at(&[0u8; 8], HEADER_LEN + 8 * 150).unwrap();
    let p = open(d.path(), opts(1 << 30, 100));
    assert_eq!(p.recovery.scanned_records, 150);
    check_all(&p, 249);
}

#[test]
fn torn_tail_is_truncated_and_appends_continue() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(1 << 30, 1000));
    append_n(&p, 0, 20);
    drop(p);
    let seg = d.path().join(data_name(0));
    let len = std::fs::metadata(&seg).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
    f.set_len(len - 5).unwrap();
    let p = open(d.path(), opts(1 << 30, 1000));
    check_all(&p, 18);
    assert!(p.recovery.torn_bytes > 0);
    append_n(&p, 19, 5);
    check_all(&p, 23);
}

#[test]
fn corruption_before_valid_records_is_an_error_and_repair_cuts() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(1 << 30, 1000));
    append_n(&p, 0, 20);
    let off = p.snapshot(10).unwrap().0[0].files.index.offset_of(10).unwrap();
    drop(p);
    let seg = d.path().join(data_name(0));
    let f = std::fs::OpenOptions::new().write(true).read(true).open(&seg).unwrap();
    f.write_all_at(b"X", off + 40).unwrap();
    // Committed records (up to the low-water mark): not a torn write, whatever the bound says.
    let mut strict = opts(1 << 30, 1000);
    strict.recover.low_water_mark = 19;
    match open_with(Arc::new(StdFs), d.path(), strict) {
        Err(Error::Corruption { path, offset, .. }) => {
            assert_eq!(path, seg);
            assert_eq!(offset, off);
        }
        other => panic!("expected corruption, got {:?}", other.map(|_| ())),
    }
    let mut o = opts(1 << 30, 1000);
    o.recover.mode = RecoveryMode::TruncateAtCorruption;
    let p = open(d.path(), o);
    check_all(&p, 9);
}

#[test]
fn truncate_across_segments_and_an_interrupted_one_finishes_on_open() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    for i in 0..30 {
        append_n(&p, i * 5, 5);
    }
    let before = data_files(d.path()).len();
    assert_eq!(p.truncate(40).unwrap(), 40);
    check_all(&p, 40);
    assert!(data_files(d.path()).len() < before);
    append_n(&p, 41, 3);
    check_all(&p, 43);
    drop(p);
    // Simulate a crash right after the intent was written: nothing deleted yet.
    write_file_atomically(&StdFs, &d.path().join(TRUNCATE_INTENT), &encode_intent(12)).unwrap();
    let p = open(d.path(), opts(4096, 10));
    assert_eq!(p.recovery.finished_truncation, Some(12));
    check_all(&p, 12);
    assert!(!d.path().join(TRUNCATE_INTENT).exists());
    assert!(matches!(p.truncate(-5), Err(Error::BelowLogStart { .. })));
}

/// Found while fuzzing recovery (fuzz/regressions/segment_recovery/intent-*): an intent file
/// naming i64::MAX overflowed `t + 1` on open (in a release build it wrapped and deleted every
/// segment but the first); one naming less than -1 overflowed the cut or emptied the log.
#[test]
fn intent_files_at_the_ends_of_the_id_range_do_not_overflow() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    append_n(&p, 0, 10);
    drop(p);
    let intent = d.path().join(TRUNCATE_INTENT);
    // Keeping everything up to i64::MAX cuts nothing; the intent is simply finished.
    write_file_atomically(&StdFs, &intent, &encode_intent(i64::MAX)).unwrap();
    let p = open(d.path(), opts(4096, 10));
    assert_eq!(p.recovery.finished_truncation, Some(i64::MAX));
    check_all(&p, 9);
    assert!(!intent.exists());
    drop(p);
    // No truncation targets an id below -1: such an intent is damage, reported as such.
    for bad in [i64::MIN, -2] {
        write_file_atomically(&StdFs, &intent, &encode_intent(bad)).unwrap();
        match Partition::open(Arc::new(StdFs), d.path(), 0, KEY, opts(4096, 10)) {
            Err(Error::Corruption { reason, .. }) => assert!(reason.contains("intent"), "{reason}"),
            other => panic!("intent {bad}: expected corruption, got {:?}", other.map(|p| p.max_txid())),
        }
    }
}

#[test]
fn truncating_into_a_sealed_segment_then_appending_other_sizes_reads_back_exactly() {
    let d = tempfile::tempdir().unwrap();
    for reopen_first in [false, true] {
        let dir = d.path().join(format!("{reopen_first}"));
        std::fs::create_dir(&dir).unwrap();
        let mut p = open(&dir, opts(4096, 10));
        for i in 0..30 {
            append_n(&p, i * 5, 5);
        }
        if reopen_first {
            drop(p);
            p = open(&dir, opts(4096, 10));
        }
        assert!(p.segment_count() > 1 && p.first_txid() == 0);
        p.truncate(12).unwrap();
        // Records of other sizes than before, so stale index entries would point wrongly.
        let datas: Vec<Vec<u8>> = (13..40).map(|t| vec![t as u8; 3 + (t as usize * 53) % 400]).collect();
        for (k, d) in datas.iter().enumerate() {
            let r = [NewRecord { req_id: ReqId::default(), header: 0, data: d, data_crc: None }];
            p.append(13 + k as i64, &r).unwrap();
        }
        for _ in 0..2 {
            for t in 13..40i64 {
                assert_eq!(p.read_record(t).unwrap().unwrap().data, datas[(t - 13) as usize], "txid {t}");
            }
            assert_eq!(p.read_record(5).unwrap().unwrap().data, payload(5));
            drop(p);
            p = open(&dir, opts(4096, 10));
        }
    }
}

#[test]
fn a_restart_replaces_the_log_with_an_empty_one_and_an_interrupted_one_finishes_on_open() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    for i in 0..30 {
        append_n(&p, i * 5, 5);
    }
    p.close();
    drop(p);
    Partition::restart_files(&StdFs, d.path(), 0, KEY, 500).unwrap();
    let p = open(d.path(), opts(4096, 10));
    assert_eq!((p.first_txid(), p.max_txid(), p.segment_count()), (500, 499, 1));
    assert!(matches!(p.read_record(100), Err(Error::BelowLogStart { .. })));
    append_n(&p, 500, 5);
    p.close();
    drop(p);
    // Crashed after the intent and part of the deletion: the open finishes it.
    let intent = d.path().join(RESTART_INTENT);
    std::fs::write(&intent, super::encode_intent(900)).unwrap();
    let p = open(d.path(), opts(4096, 10));
    assert_eq!((p.first_txid(), p.max_txid()), (900, 899));
    assert!(!intent.exists());
    append_n(&p, 900, 3);
    check_all(&p, 902);
}

#[test]
fn retention_drops_whole_segments_and_keeps_the_start_across_reopen() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    for i in 0..30 {
        append_n(&p, i * 5, 5);
    }
    let first = p.drop_segments_before(100).unwrap();
    assert!(first > 0 && first <= 100);
    assert!(matches!(p.read_record(first - 1), Err(Error::BelowLogStart { .. })));
    check_all(&p, 149);
    drop(p);
    let p = open(d.path(), opts(4096, 10));
    assert_eq!(p.first_txid(), first);
    check_all(&p, 149);
}

#[test]
fn a_paced_deletion_stops_early_and_puts_back_what_it_did_not_free() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    for i in 0..100 {
        append_n(&p, i * 5, 5);
    }
    let spans = p.segment_spans().unwrap();
    assert!(spans.len() >= 5, "{}", spans.len());
    let last = spans.last().unwrap().first_txid;
    // Each small segment counts as one 4 MiB step: at 4 MiB/s the second is due after a second,
    // and the stop comes first. The one being freed then goes; the rest are put back.
    let began = std::time::Instant::now();
    let stop = || began.elapsed() > std::time::Duration::from_millis(300);
    let first = p.drop_segments_paced(last, Some(4 << 20), &stop).unwrap();
    assert!(began.elapsed() < std::time::Duration::from_secs(2), "{:?}", began.elapsed());
    assert_eq!(first, spans[2].first_txid);
    assert_eq!(p.segment_spans().unwrap()[0].first_txid, first);
    check_all(&p, 499);
    drop(p);
    let p = open(d.path(), opts(4096, 10));
    assert_eq!(p.first_txid(), first);
    check_all(&p, 499);
    // Unpaced, the rest goes at once.
    assert_eq!(p.drop_segments_before(last).unwrap(), last);
}

#[test]
fn non_dense_append_writes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(1 << 30, 1000));
    append_n(&p, 0, 3);
    let data = b"x".to_vec();
    let r = [NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: None }];
    assert!(matches!(p.append(5, &r), Err(Error::NonDenseAppend { expected: 3, got: 5, .. })));
    assert!(matches!(p.append(2, &r), Err(Error::NonDenseAppend { .. })));
    check_all(&p, 2);
    let big = vec![0u8; (16 << 20) + 1];
    let r = [NewRecord { req_id: ReqId::default(), header: 0, data: &big, data_crc: None }];
    assert!(matches!(p.append(3, &r), Err(Error::RecordTooLarge { .. })));
    check_all(&p, 2);
}

#[test]
fn fsync_failure_poisons_and_reports_nothing_durable() {
    let d = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultFs::new());
    let p = open_with(fs.clone(), d.path(), opts(1 << 30, 1000)).unwrap();
    append_n(&p, 0, 5);
    fs.syncs_before_eio.store(0, Ordering::SeqCst);
    let data = payload(5);
    let r = [NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: None }];
    assert!(matches!(p.append(5, &r), Err(Error::Io { .. })));
    assert_eq!(p.max_txid(), 4, "an unsynced record must not count as durable");
    fs.syncs_before_eio.store(-1, Ordering::SeqCst);
    // Even with the disk healthy again, the partition refuses until reopened.
    assert!(matches!(p.append(6, &r), Err(Error::PartitionFailed { .. })));
    assert!(matches!(p.append(5, &r), Err(Error::PartitionFailed { .. })));
    drop(p);
    // Closing the failed partition discarded the record whose sync failed.
    let p = open_with(fs, d.path(), opts(1 << 30, 1000)).unwrap();
    check_all(&p, 4);
}

#[test]
fn disk_full_fails_the_append_and_reopen_drops_the_partial_write() {
    let d = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultFs::new());
    let p = open_with(fs.clone(), d.path(), opts(1 << 30, 1000)).unwrap();
    append_n(&p, 0, 5);
    fs.write_budget.store(30, Ordering::SeqCst);
    let data = vec![7u8; 1000];
    let r = [NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: None }];
    match p.append(5, &r) {
        Err(Error::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::ENOSPC)),
        other => panic!("expected ENOSPC, got {:?}", other),
    }
    assert!(matches!(p.append(5, &r), Err(Error::PartitionFailed { .. })));
    fs.write_budget.store(u64::MAX, Ordering::SeqCst);
    drop(p);
    let p = open_with(fs, d.path(), opts(1 << 30, 1000)).unwrap();
    // Closing the failed partition already cut the partial write back to the last sync.
    assert_eq!(p.recovery.torn_bytes, 0);
    check_all(&p, 4);
}

#[test]
fn a_failed_sync_under_concurrency_acknowledges_nothing_it_did_not_sync() {
    let d = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultFs::new());
    let p = Arc::new(open_with(fs.clone(), d.path(), opts(1 << 30, 1000)).unwrap());
    fs.syncs_before_eio.store(30, Ordering::SeqCst);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut acked = Vec::new();
                let mut failures = 0;
                for i in 0..100 {
                    let data = vec![t as u8; 50 + i];
                    let r = [NewRecord { req_id: ReqId::default(), header: t, data: &data, data_crc: None }];
                    match p.append_next(&r) {
                        Ok((first, _)) => acked.push((first, data)),
                        Err(Error::Io { .. }) | Err(Error::PartitionFailed { .. }) => failures += 1,
                        Err(e) => panic!("unexpected {e}"),
                    }
                }
                (acked, failures)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(results.iter().all(|(_, f)| *f > 0), "every thread must see the failure");
    let durable = p.max_txid();
    for (acked, _) in &results {
        for (txid, _) in acked {
            assert!(*txid <= durable, "acknowledged {txid} beyond the durable {durable}");
        }
    }
    drop(p);
    fs.syncs_before_eio.store(-1, Ordering::SeqCst);
    let p = open_with(fs, d.path(), opts(1 << 30, 1000)).unwrap();
    for (acked, _) in &results {
        for (txid, data) in acked {
            assert_eq!(&p.read_record(*txid).unwrap().unwrap().data, data);
        }
    }
}

#[test]
fn concurrent_appenders_share_fsyncs() {
    let d = tempfile::tempdir().unwrap();
    let p = Arc::new(open(d.path(), opts(1 << 30, 1000)));
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let p = p.clone();
            std::thread::spawn(move || {
                let data = vec![1u8; 100];
                for _ in 0..50 {
                    let r = [NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: None }];
                    p.append_next(&r).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = p.stats();
    assert_eq!(s.appends, 800);
    assert_eq!(p.max_txid(), 799);
    assert!(s.syncs < s.appends / 2, "group commit should share syncs: {s:?}");
}

/// Records whose data lies in one shared buffer, as a RecordBatch hands them over: sizes on both
/// sides of the by-reference threshold, data CRCs known.
fn shared_batch<'a>(owner: &'a SharedData, sizes: &[usize]) -> Vec<NewRecord<'a>> {
    let mut at = 0;
    sizes
        .iter()
        .map(|&n| {
            let data = &owner[at..at + n];
            at += n;
            NewRecord {
                req_id: ReqId { client_id: 2, generation: 1, partition_id: 0, sequence: at as i32 },
                header: n as i32,
                data,
                data_crc: Some(crc32(data)),
            }
        })
        .collect()
}

#[test]
fn shared_batches_are_written_from_their_buffer_and_read_back_after_reopening() {
    let d = tempfile::tempdir().unwrap();
    // 1,500 large records make over 3,000 iovecs: the write takes several pwritev calls.
    let sizes: Vec<usize> = (0..1500).map(|k| if k % 3 == 0 { 100 + k } else { 4096 + k }).collect();
    let owner: SharedData = Arc::new((0..sizes.iter().sum::<usize>()).map(|i| (i % 251) as u8).collect());
    let p = open(d.path(), opts(1 << 30, 64));
    append_n(&p, 0, 3);
    let recs = shared_batch(&owner, &sizes);
    assert_eq!(p.append_shared(Some(3), &recs, &owner).unwrap(), (3, 1502));
    append_n(&p, 1503, 2);
    assert_eq!(Arc::strong_count(&owner), 1, "the queue let go of the buffer once it was written");
    drop(p);
    let p = open(d.path(), opts(1 << 30, 64));
    assert_eq!(p.max_txid(), 1504);
    let read = p.read_records(3, 2000, usize::MAX).unwrap();
    for (r, want) in read.iter().zip(&recs) {
        assert_eq!((r.data.as_slice(), r.header), (want.data, want.header));
    }
    assert_eq!(read.len(), 1502);
}

#[test]
fn a_failed_sync_releases_shared_appenders_and_keeps_nothing_of_their_batch() {
    let d = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let syncs = fs.syncs_before_eio.clone();
    let p = open_with(Arc::new(fs), d.path(), opts(1 << 30, 64)).unwrap();
    let owner: SharedData = Arc::new(vec![7u8; 8 << 10]);
    let recs = shared_batch(&owner, &[4096, 4096]);
    p.append_shared(Some(0), &recs, &owner).unwrap();
    syncs.store(0, std::sync::atomic::Ordering::SeqCst);
    assert!(p.append_shared(Some(2), &recs, &owner).is_err());
    assert!(p.is_failed().is_some());
    assert_eq!(Arc::strong_count(&owner), 1, "no queue holds the buffer of an append that failed");
    drop(p);
    let p = open(d.path(), opts(1 << 30, 64));
    assert_eq!(p.max_txid(), 1, "only the acknowledged batch is there");
}

fn spare_files(dir: &Path) -> Vec<bool> {
    [spare::SPARE_DATA, spare::SPARE_INDEX].iter().map(|n| dir.join(n).exists()).collect()
}

/// Waits (at most 10 s) for the spare's thread to have created both files.
fn wait_for_spare(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while spare_files(dir) != [true, true] {
        assert!(Instant::now() < deadline, "no spare prepared");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn the_next_segment_is_prepared_ahead_and_a_spare_is_never_log_data() {
    let d = tempfile::tempdir().unwrap();
    let p = open(d.path(), opts(4096, 10));
    // Past half of the first segment: the spare is prepared; the roll then takes it.
    append_n(&p, 0, 30);
    assert_eq!(p.segment_count(), 1);
    wait_for_spare(d.path());
    let before = now_ms();
    let mut next = 30;
    while p.segment_count() < 2 {
        append_n(&p, next, 1);
        next += 1;
    }
    let after = now_ms();
    assert_eq!(spare_files(d.path()), [false, false], "the roll renamed the spare into place");
    let segs = data_files(d.path());
    assert_eq!(segs.len(), 2);
    for path in [&segs[1], &segs[1].with_extension("idx")] {
        let mut b = [0u8; HEADER_LEN as usize];
        std::fs::File::open(path).unwrap().read_exact_at(&mut b, 0).unwrap();
        let h = SegmentHeader::decode(&b);
        assert_eq!((h.first_txid, h.partition_id, h.cluster_key), (next - 1, 0, KEY), "{}", path.display());
        assert!(before <= h.creation_ms && h.creation_ms <= after, "created at the roll, not when prepared");
    }
    // A crash while a spare lies in the folder: the open removes it and the log is intact.
    append_n(&p, next, 30);
    next += 30;
    wait_for_spare(d.path());
    let copy = tempfile::tempdir().unwrap();
    crash_copy(d.path(), copy.path());
    let q = open(copy.path(), opts(4096, 10));
    check_all(&q, next - 1);
    assert_eq!(q.recovery.removed_files.len(), 2, "{:?}", q.recovery.removed_files);
    assert_eq!(spare_files(copy.path()), [false, false]);
    append_n(&q, next, 40);
    check_all(&q, next + 39);
    // A closed log's folder holds its segments only.
    drop(p);
    assert_eq!(spare_files(d.path()), [false, false]);
    let p = open(d.path(), opts(4096, 10));
    check_all(&p, next - 1);
    assert!(p.recovery.removed_files.is_empty() && p.recovery.torn_bytes == 0);
}

/// A laid-out batch of `sizes` records from writer `w`: record k's data is `w + k` repeated.
fn laid_batch(w: i32, sizes: &[usize]) -> LaidBatch {
    let mut b = LaidBatch::default();
    for (k, n) in sizes.iter().enumerate() {
        let data = vec![(w as usize + k) as u8; *n];
        let req_id = ReqId { client_id: w, generation: 1, partition_id: 0, sequence: k as i32 };
        b.push(&NewRecord { req_id, header: w, data: &data, data_crc: None });
    }
    b
}

#[test]
fn laid_batches_land_at_the_ids_they_get_even_when_guessed_wrong_and_survive_a_crash() {
    let d = tempfile::tempdir().unwrap();
    let p = Arc::new(open(d.path(), opts(256 << 10, 64)));
    // Small (copied into the queue), 1,000 x 100 B, and large records; a fourth writer appends
    // plain records, so the ids a laid batch is patched to before the lock go stale often.
    let sizes: [Vec<usize>; 4] =
        [vec![100; 10], vec![100; 1000], (0..20).map(|k| 4000 + 37 * k).collect(), vec![50; 3]];
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (p, sizes) = (p.clone(), sizes[w].clone());
            std::thread::spawn(move || {
                let mut b = laid_batch(w as i32, &sizes);
                let mut got = Vec::new();
                for _ in 0..40 {
                    if w == 3 {
                        got.push(p.append_next(&b.records()).unwrap().0);
                    } else {
                        let t = p.enqueue_laid(None, &mut b).unwrap();
                        p.wait_durable(t.seq).unwrap();
                        got.push(t.first);
                    }
                }
                got
            })
        })
        .collect();
    let mut owner = std::collections::BTreeMap::new();
    for (w, h) in writers.into_iter().enumerate() {
        for first in h.join().unwrap() {
            owner.insert(first, w);
        }
    }
    // And at a given id, the batch patched back to ids it carried before.
    let mut b = laid_batch(0, &sizes[0]);
    let next = p.max_txid() + 1;
    b.set_first(next + 5);
    assert_eq!(p.append_laid(Some(next), &mut b).unwrap(), (next, next + 9));
    owner.insert(next, 0);
    assert!(p.segment_count() > 3, "the batches rolled segments");
    let copy = tempfile::tempdir().unwrap();
    crash_copy(d.path(), copy.path());
    let q = open(copy.path(), opts(256 << 10, 64));
    assert_eq!(q.max_txid(), p.max_txid());
    let mut txid = 0;
    for (&first, &w) in &owner {
        assert_eq!(first, txid, "batches are dense");
        for (k, n) in sizes[w].iter().enumerate() {
            let r = q.read_record(txid).unwrap().unwrap();
            assert_eq!((r.header, r.req_id.client_id, r.req_id.sequence), (w as i32, w as i32, k as i32));
            assert_eq!(r.data, vec![(w + k) as u8; *n], "record {txid}");
            txid += 1;
        }
    }
    assert_eq!(txid, q.max_txid() + 1);
}
