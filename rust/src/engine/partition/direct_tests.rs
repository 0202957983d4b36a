//! Large flushes past the page cache (`direct.rs`): the same bytes as a plain write, the zeros
//! after them cut at a roll and a close, faults on the direct handle, and file systems that
//! refuse O_DIRECT.
use super::tests::{append_n, check_all, crash_copy, open_with, opts, plain_fs};
use super::*;
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FaultFs, FileHandle, ForwardingFile, StdFs, WrapFs};

fn direct_writes(p: &Partition) -> u64 {
    lock(&p.state).direct.writes
}

/// Whether `dir`'s file system takes O_DIRECT (tmpfs does not): asked of the kernel directly.
fn takes_o_direct(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.join("probe"))
        .is_ok()
}

fn segment_bytes(dir: &Path) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()[HEADER_LEN as usize..].to_vec()).collect()
}

/// Small, large (1,000 records: 40-70 KB), small again, a large one right after another, a
/// truncation into the middle of the last large one, then large again: every switch between the
/// two paths, and a last block read back from the file after a plain write and a cut.
fn mixed_workload(p: &Partition) -> i64 {
    mixed_workload_from(p, 0)
}

fn mixed_workload_from(p: &Partition, at: i64) -> i64 {
    append_n(p, at, 3);
    append_n(p, at + 3, 1000);
    append_n(p, at + 1003, 1);
    append_n(p, at + 1004, 1000);
    append_n(p, at + 2004, 1200);
    p.truncate(at + 2500).unwrap();
    append_n(p, at + 2501, 1000);
    append_n(p, at + 3501, 2);
    at + 3502
}

#[test]
fn large_flushes_past_the_page_cache_leave_the_bytes_a_plain_write_leaves() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let direct = open_with(Arc::new(StdFs), a.path(), opts(1 << 30, 1000)).unwrap();
    let plain = open_with(plain_fs(), b.path(), opts(1 << 30, 1000)).unwrap();
    let last = mixed_workload(&direct);
    mixed_workload(&plain);
    if takes_o_direct(a.path()) {
        assert_eq!(direct_writes(&direct), 4, "each large flush went past the page cache");
    }
    assert_eq!(direct_writes(&plain), 0);
    check_all(&direct, last);
    // What kill -9 leaves: the records, then zeros to the last direct write's 4 KiB boundary.
    let crashed = tempfile::tempdir().unwrap();
    crash_copy(a.path(), crashed.path());
    direct.close();
    plain.close();
    let (ours, theirs) = (segment_bytes(a.path()), segment_bytes(b.path()));
    assert_eq!(ours.len(), 1);
    assert!(ours == theirs, "the closed logs differ (lengths {} and {})", ours[0].len(), theirs[0].len());
    let p = open_with(Arc::new(StdFs), crashed.path(), opts(1 << 30, 1000)).unwrap();
    assert_eq!(p.recovery.torn_bytes, 0, "zeros after the records are not a torn write");
    check_all(&p, last);
    append_n(&p, last + 1, 1000);
    check_all(&p, last + 1000);
}

#[test]
fn the_zeros_after_a_direct_write_are_cut_when_the_segment_is_sealed() {
    let d = tempfile::tempdir().unwrap();
    // About 50 KB a large append, 200 KB segments: a roll every four or five appends, small ones between.
    let p = open_with(Arc::new(StdFs), d.path(), opts(200 << 10, 1000)).unwrap();
    let mut next = 0;
    for k in 0..20 {
        append_n(&p, next, if k % 3 == 2 { 1 } else { 1000 });
        next += if k % 3 == 2 { 1 } else { 1000 };
        let st = lock(&p.state);
        if let Some(held) = st.direct.held() {
            // A sealed segment's descriptors are closed: retention may delete it.
            assert!(Arc::ptr_eq(held, &st.segments.last().unwrap().files), "an older segment is held open");
        }
    }
    if takes_o_direct(d.path()) {
        assert_eq!(direct_writes(&p), 14, "every large flush");
    }
    let sealed = lock(&p.state).segments.len() - 1;
    assert!(sealed >= 3, "only {sealed} segments sealed");
    for seg in &lock(&p.state).segments[..sealed] {
        let len = seg.files.data.len().unwrap();
        assert_eq!(len, seg.end, "{} ends after its last record", seg.files.data_path.display());
    }
    drop(p);
    let p = open_with(Arc::new(StdFs), d.path(), opts(200 << 10, 1000)).unwrap();
    check_all(&p, next - 1);
}

/// 1,000 records of 60 bytes: a 100 KB flush.
fn large_batch() -> Vec<Vec<u8>> {
    (0..1000).map(|i| vec![i as u8; 60]).collect()
}

fn records(datas: &[Vec<u8>]) -> Vec<NewRecord<'_>> {
    datas.iter().map(|d| NewRecord { req_id: Default::default(), header: 0, data: d, data_crc: None }).collect()
}

#[test]
fn a_full_disk_during_a_direct_write_fails_the_append_and_keeps_what_was_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultFs::new());
    let p = open_with(fs.clone(), d.path(), opts(1 << 30, 1000)).unwrap();
    append_n(&p, 0, 1000);
    append_n(&p, 1000, 7);
    // Aligned, so that the direct write itself stops at the full disk (after 8 KiB of it).
    fs.write_budget.store(8192, Ordering::SeqCst);
    let datas = large_batch();
    let recs = records(&datas);
    match p.append(1007, &recs) {
        Err(Error::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::ENOSPC)),
        other => panic!("expected ENOSPC, got {other:?}"),
    }
    if takes_o_direct(d.path()) {
        assert_eq!(direct_writes(&p), 1, "the first large write went direct, the faulted one failed");
    }
    assert!(matches!(p.append(1007, &recs), Err(Error::PartitionFailed { .. })));
    fs.write_budget.store(u64::MAX, Ordering::SeqCst);
    drop(p);
    let p = open_with(fs, d.path(), opts(1 << 30, 1000)).unwrap();
    check_all(&p, 1006);
}

#[test]
fn a_failed_sync_after_a_direct_write_acknowledges_nothing() {
    let d = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultFs::new());
    let p = open_with(fs.clone(), d.path(), opts(1 << 30, 1000)).unwrap();
    append_n(&p, 0, 1000);
    fs.syncs_before_eio.store(0, Ordering::SeqCst);
    let datas = large_batch();
    assert!(p.append(1000, &records(&datas)).is_err());
    assert_eq!(p.max_txid(), 999);
    fs.syncs_before_eio.store(-1, Ordering::SeqCst);
    drop(p);
    let p = open_with(fs, d.path(), opts(1 << 30, 1000)).unwrap();
    check_all(&p, 999);
}

#[test]
fn a_file_system_without_o_direct_takes_large_flushes_through_the_page_cache() {
    let shm = Path::new("/dev/shm");
    let Ok(d) = tempfile::tempdir_in(shm) else {
        return; // no tmpfs here to try it on; `plain_fs` covers the same path in the test above
    };
    if takes_o_direct(d.path()) {
        return;
    }
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    let last = mixed_workload(&p);
    assert_eq!(direct_writes(&p), 0);
    check_all(&p, last);
    drop(p);
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    check_all(&p, last);
}

/// A data file whose direct handle writes everything and then says EINVAL, as a device wanting a
/// larger alignment than 4 KiB would (after writing or not).
struct RefusingDirect(Arc<dyn FileHandle>);

impl ForwardingFile for RefusingDirect {
    fn inner(&self) -> &dyn FileHandle {
        self.0.as_ref()
    }
    fn open_direct(&self) -> Option<Arc<dyn FileHandle>> {
        Some(Arc::new(Refuses(self.0.open_direct()?)))
    }
}

struct Refuses(Arc<dyn FileHandle>);

impl ForwardingFile for Refuses {
    fn inner(&self) -> &dyn FileHandle {
        self.0.as_ref()
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.0.write_all_at(buf, offset)?;
        Err(std::io::Error::from_raw_os_error(libc::EINVAL))
    }
}

#[test]
fn a_direct_write_refused_after_it_wrote_is_redone_through_the_page_cache_and_its_zeros_cut() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    if !takes_o_direct(a.path()) {
        return; // the refusal is of a real direct write
    }
    let fs: Arc<dyn FileSystem> =
        Arc::new(WrapFs(|_: &Path, f: Arc<dyn FileHandle>| Ok(Arc::new(RefusingDirect(f)) as Arc<dyn FileHandle>)));
    let p = open_with(fs.clone(), a.path(), opts(1 << 30, 1000)).unwrap();
    let plain = open_with(plain_fs(), b.path(), opts(1 << 30, 1000)).unwrap();
    // The refused write is the first large one; the file it leaves ends in zeros, which the
    // records that follow overwrite or the close cuts.
    append_n(&p, 0, 1000);
    append_n(&plain, 0, 1000);
    assert_eq!(direct_writes(&p), 0);
    let (len, end) = {
        let st = lock(&p.state);
        let tail = st.segments.last().unwrap();
        (tail.files.data.len().unwrap(), tail.end)
    };
    assert!(len > end, "the refused write left its zeros after the records ({len} <= {end})");
    // Closed right after it: the close cuts the zeros as it cuts preallocated ones.
    p.close();
    plain.close();
    assert!(segment_bytes(a.path()) == segment_bytes(b.path()), "zeros left after the records");
    let (p, plain) = (
        open_with(fs.clone(), a.path(), opts(1 << 30, 1000)).unwrap(),
        open_with(plain_fs(), b.path(), opts(1 << 30, 1000)).unwrap(),
    );
    let last = mixed_workload_from(&p, 1000);
    mixed_workload_from(&plain, 1000);
    assert_eq!(direct_writes(&p), 0, "refused once, never tried again for this file");
    check_all(&p, last);
    p.close();
    plain.close();
    assert!(segment_bytes(a.path()) == segment_bytes(b.path()));
    let p = open_with(fs, a.path(), opts(1 << 30, 1000)).unwrap();
    check_all(&p, last);
}
