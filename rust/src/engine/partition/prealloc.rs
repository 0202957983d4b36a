//! Preallocated segment tails: zeros written ahead of the records, cut off at a seal and a close,
//! read as free space by recovery; a "crash" is a copy of the files taken while the partition is
//! open (what kill -9 leaves: everything written, in the page cache).
use super::tests::{crash_copy, open_with, opts, plain_fs, KEY};
use super::*;
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FaultFs, StdFs};
use crate::engine::record::ReqId;
use crate::engine::segment::data_name;
use std::os::unix::fs::FileExt;

const STEP: u64 = 64 << 10;

fn prealloc_opts(segment_size: u64) -> PartitionOptions {
    let mut o = opts(segment_size, 10);
    o.preallocate = STEP;
    o
}

fn data(t: i64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (t as usize * 31 + i) as u8).collect()
}

fn append_sized(p: &Partition, from: i64, sizes: &[usize]) {
    let datas: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(k, n)| data(from + k as i64, *n)).collect();
    let recs: Vec<NewRecord<'_>> = datas
        .iter()
        .map(|d| NewRecord {
            req_id: ReqId { client_id: 7, generation: 1, partition_id: 0, sequence: 0 },
            header: 0,
            data: d,
            data_crc: None,
        })
        .collect();
    p.append(from, &recs).unwrap();
}

fn check(p: &Partition, expect: &[(i64, usize)]) {
    assert_eq!(p.max_txid(), expect.last().map_or(-1, |e| e.0));
    for (t, n) in expect {
        assert_eq!(p.read_record(*t).unwrap().unwrap().data, data(*t, *n), "txid {t}");
    }
}

fn reopen(dir: &Path, o: PartitionOptions) -> Result<Partition> {
    Partition::open(Arc::new(StdFs), dir, 0, KEY, o)
}

fn seg_len(dir: &Path, first: i64) -> u64 {
    std::fs::metadata(dir.join(data_name(first))).unwrap().len()
}

#[test]
fn zeros_run_ahead_of_the_records_and_are_cut_at_close() {
    let d = tempfile::tempdir().unwrap();
    // Through the page cache only: a large flush past it leaves zeros to its 4 KiB boundary
    // (`direct_tests`), which would move the small flush after it into them.
    let p = open_with(plain_fs(), d.path(), prealloc_opts(1 << 30)).unwrap();
    append_sized(&p, 0, &[100, 200]);
    let end = HEADER_LEN + 2 * RECORD_OVERHEAD as u64 + 300;
    assert_eq!(seg_len(d.path(), 0), STEP, "the first append preallocates up to the next step");
    // Small batches run into the zeros; the one that crosses their end extends them by a step.
    for t in 2..5 {
        append_sized(&p, t, &[20_000]);
        assert_eq!(seg_len(d.path(), 0), STEP, "written into the zeros");
    }
    append_sized(&p, 5, &[20_000]);
    assert_eq!(seg_len(d.path(), 0), 2 * STEP);
    // A batch too large to gain from zeros grows the file to its records, with none after them.
    append_sized(&p, 6, &[70_000]);
    let end = end + 4 * (RECORD_OVERHEAD as u64 + 20_000) + RECORD_OVERHEAD as u64 + 70_000;
    assert_eq!(seg_len(d.path(), 0), end, "no zeros after a large flush");
    append_sized(&p, 7, &[100]);
    assert_eq!(seg_len(d.path(), 0), 3 * STEP, "a small flush past the end zero-fills again");
    drop(p);
    assert_eq!(seg_len(d.path(), 0), end + RECORD_OVERHEAD as u64 + 100, "close leaves the file at its last record");
    let p = reopen(d.path(), prealloc_opts(1 << 30)).unwrap();
    assert_eq!(p.recovery.torn_bytes, 0);
    check(&p, &[(0, 100), (1, 200), (2, 20_000), (3, 20_000), (4, 20_000), (5, 20_000), (6, 70_000), (7, 100)]);
}

#[test]
fn a_crash_leaves_zeros_that_recovery_reads_as_free_space() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), prealloc_opts(1 << 30)).unwrap();
    let mut expect = Vec::new();
    for t in 0..50 {
        let n = 1 + (t as usize * 97) % 3000;
        append_sized(&p, t, &[n]);
        expect.push((t, n));
    }
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    assert!(seg_len(&crashed, 0) % STEP == 0);
    let q = reopen(&crashed, prealloc_opts(1 << 30)).unwrap();
    assert_eq!(q.recovery.torn_bytes, 0, "zeros after the last record are not a torn tail");
    check(&q, &expect);
    // Appends go on where the records end, and the files survive another crash.
    append_sized(&q, 50, &[5000, 6]);
    expect.extend([(50, 5000), (51, 6)]);
    let again = d.path().join("again");
    crash_copy(&crashed, &again);
    let r = reopen(&again, prealloc_opts(1 << 30)).unwrap();
    check(&r, &expect);
}

#[test]
fn a_torn_record_in_preallocated_space_is_a_torn_tail() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), prealloc_opts(1 << 30)).unwrap();
    append_sized(&p, 0, &[300, 400]);
    let end = HEADER_LEN + 2 * RECORD_OVERHEAD as u64 + 700;
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    // Half a record for id 2: its header and part of its data, zeros after.
    let mut half = Vec::new();
    crate::engine::record::encode_record(
        &mut half,
        2,
        &NewRecord { req_id: ReqId::default(), header: 0, data: &[0xEE; 900], data_crc: None },
    );
    half.truncate(500);
    std::fs::OpenOptions::new().write(true).open(crashed.join(data_name(0))).unwrap().write_all_at(&half, end).unwrap();
    let q = reopen(&crashed, prealloc_opts(1 << 30)).unwrap();
    assert_eq!(q.recovery.torn_bytes, STEP - end);
    assert_eq!(seg_len(&crashed, 0), end);
    check(&q, &[(0, 300), (1, 400)]);
}

#[test]
fn a_torn_first_record_before_a_long_run_of_zeros_is_found_quickly() {
    // With expected id 0 every zero byte could start a record of id 0: the search for a valid
    // record after the tear skips zero runs instead of reading each position.
    let d = tempfile::tempdir().unwrap();
    let o = prealloc_opts(1 << 30);
    let p = open_with(Arc::new(StdFs), d.path(), o.clone()).unwrap();
    append_sized(&p, 0, &[10]);
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    let f = std::fs::OpenOptions::new().write(true).open(crashed.join(data_name(0))).unwrap();
    f.write_all_at(&[0xAB; 7], HEADER_LEN + 4).unwrap();
    // 8 MiB of zeros, as a `preallocate` of that size leaves after a crash.
    f.set_len(8 << 20).unwrap();
    let q = reopen(&crashed, o).unwrap();
    assert_eq!(q.max_txid(), -1);
    assert_eq!(q.recovery.torn_bytes, (8 << 20) - HEADER_LEN);
}

#[test]
fn zeros_then_a_valid_record_is_never_free_space() {
    // Lost writes inside the log must not pass for free space: a record after zeros is found.
    // Above the low-water mark it is a torn write whose survivor is cut with it; at or below, an
    // error (committed records are damaged).
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), prealloc_opts(1 << 30)).unwrap();
    append_sized(&p, 0, &[300, 400, 500]);
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    let second = HEADER_LEN + RECORD_OVERHEAD as u64 + 300;
    let seg = crashed.join(data_name(0));
    std::fs::OpenOptions::new().write(true).open(&seg).unwrap().write_all_at(&[0; 440], second).unwrap();
    let pristine = std::fs::read(&seg).unwrap();
    let q = reopen(&crashed, prealloc_opts(1 << 30)).unwrap();
    check(&q, &[(0, 300)]);
    assert_eq!(q.recovery.torn_survivors, Some((seg.clone(), second, second + RECORD_OVERHEAD as u64 + 400)));
    drop(q);
    std::fs::write(&seg, &pristine).unwrap();
    let mut committed = prealloc_opts(1 << 30);
    committed.recover.low_water_mark = 2;
    match reopen(&crashed, committed.clone()) {
        Err(Error::Corruption { offset, .. }) => assert_eq!(offset, second),
        other => panic!("expected corruption, got {:?}", other.map(|p| p.max_txid())),
    }
    let mut repair = committed;
    repair.recover.mode = RecoveryMode::TruncateAtCorruption;
    let q = reopen(&crashed, repair).unwrap();
    check(&q, &[(0, 300)]);
}

#[test]
fn sealed_segments_end_at_their_last_record() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), prealloc_opts(STEP)).unwrap();
    let mut expect = Vec::new();
    for t in 0..120 {
        append_sized(&p, t, &[1500]);
        expect.push((t, 1500));
    }
    assert!(p.segment_count() > 2);
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    let q = reopen(&crashed, prealloc_opts(STEP)).unwrap();
    check(&q, &expect);
    let segs: Vec<i64> = {
        let st = lock(&q.state);
        st.segments.iter().map(|s| s.first_txid()).collect()
    };
    let st = lock(&p.state);
    for s in &st.segments[..st.segments.len() - 1] {
        assert_eq!(seg_len(d.path(), s.first_txid()), s.end, "sealed segment {} keeps no zeros", s.first_txid());
    }
    assert_eq!(segs.len(), st.segments.len());
}

#[test]
fn a_truncation_leaves_no_old_record_behind_shorter_new_ones() {
    // Old records of the same ids and other sizes after the cut could be read back behind new
    // ones if the cut only moved the end: the file must be zeros or nothing after the records.
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), prealloc_opts(1 << 30)).unwrap();
    for t in 0..20 {
        append_sized(&p, t, &[200]);
    }
    p.truncate(9).unwrap();
    let mut expect: Vec<(i64, usize)> = (0..10).map(|t| (t, 200)).collect();
    // One shorter record for id 10: an old record 11 would sit right where a scan looks next.
    append_sized(&p, 10, &[200 - RECORD_OVERHEAD - 1]);
    expect.push((10, 200 - RECORD_OVERHEAD - 1));
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    let q = reopen(&crashed, prealloc_opts(1 << 30)).unwrap();
    assert_eq!(q.recovery.torn_bytes, 0);
    check(&q, &expect);
}

#[test]
fn a_disk_too_full_for_the_zeros_still_takes_the_records() {
    let d = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let budget = fs.write_budget.clone();
    let p = open_with(Arc::new(fs), d.path(), prealloc_opts(1 << 30)).unwrap();
    append_sized(&p, 0, &[100]);
    let end = HEADER_LEN + RECORD_OVERHEAD as u64 + 100;
    // Room for records, not for the next stretch of zeros (small batches, which zero-fill).
    let sizes = [20_000usize; 4];
    let records: u64 = sizes.iter().map(|n| (RECORD_OVERHEAD + n) as u64).sum();
    budget.store(records + 10_000, std::sync::atomic::Ordering::SeqCst);
    for (k, n) in sizes.iter().enumerate() {
        append_sized(&p, 1 + k as i64, &[*n]);
    }
    assert!(p.is_failed().is_none());
    let written = end + records;
    assert!(written > STEP, "the last batch crossed the zeros");
    assert_eq!(seg_len(d.path(), 0), written, "the partial zeros were cut away");
    drop(p);
    let q = reopen(d.path(), prealloc_opts(1 << 30)).unwrap();
    check(&q, &[(0, 100), (1, 20_000), (2, 20_000), (3, 20_000), (4, 20_000)]);
}

#[test]
fn the_zeros_ahead_follow_the_flushes() {
    // Small flushes: one fill in ZERO_STEP_FLUSHES of them, at least ZERO_STEP_MIN.
    assert_eq!(zero_step(1 << 20, 100), 64 << 10);
    assert_eq!(zero_step(1 << 20, 600), 256 << 10);
    assert_eq!(zero_step(1 << 20, 1100), 512 << 10);
    // Flushes whose rare fill would be large: small fills, more often.
    assert_eq!(zero_step(1 << 20, 2100), 64 << 10);
    assert_eq!(zero_step(1 << 20, 30_000), 64 << 10);
    // `preallocate` caps the step.
    assert_eq!(zero_step(32 << 10, 1100), 32 << 10);
    assert_eq!(zero_step(1 << 20, 0), 64 << 10);
}

/// The default cap on the zeros ahead (1 MiB), so `zero_step` picks each stretch.
fn capped_opts() -> PartitionOptions {
    let mut o = prealloc_opts(1 << 30);
    o.preallocate = DEFAULT_PREALLOCATE;
    o
}

fn open_capped(dir: &Path) -> Partition {
    open_with(Arc::new(StdFs), dir, capped_opts()).unwrap()
}

#[test]
fn one_kib_appends_fill_a_rare_large_step_and_ten_kib_ones_a_small_step() {
    let d = tempfile::tempdir().unwrap();
    let p = open_capped(d.path());
    for t in 0..40 {
        append_sized(&p, t, &[1000]);
    }
    assert_eq!(seg_len(d.path(), 0), 512 << 10, "1 KiB flushes: 512 KiB of zeros at a time");
    let e = tempfile::tempdir().unwrap();
    let q = open_capped(e.path());
    for t in 0..40 {
        append_sized(&q, t, &[10_000]);
    }
    let len = seg_len(e.path(), 0);
    assert!(len % (64 << 10) == 0 && len < 500 << 10, "10 KiB flushes: 64 KiB steps, got {len}");
    check(&q, &(0..40).map(|t| (t, 10_000)).collect::<Vec<_>>());
}

#[test]
fn stretches_of_changing_size_survive_crashes() {
    // Flush sizes that move the step between 64 KiB and 512 KiB and back; a crash copy after
    // each phase reopens with every record and no torn tail.
    let d = tempfile::tempdir().unwrap();
    let p = open_capped(d.path());
    let mut expect = Vec::new();
    let mut t = 0;
    for (k, (size, count)) in
        [(1000, 300), (12_000, 40), (200, 600), (20_000, 30), (2_000, 200)].into_iter().enumerate()
    {
        for _ in 0..count {
            append_sized(&p, t, &[size]);
            expect.push((t, size));
            t += 1;
        }
        let crashed = d.path().join(format!("crashed-{k}"));
        crash_copy(d.path(), &crashed);
        let q = reopen(&crashed, capped_opts()).unwrap();
        assert_eq!(q.recovery.torn_bytes, 0, "phase {k}: zeros after the last record are free space");
        check(&q, &expect);
    }
}
