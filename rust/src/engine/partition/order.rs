//! Write order on the disk: an index entry must never reach the index file before the record it
//! points to is synced. Recovery checks a checkpoint window's record prefixes and its last
//! record, not every byte between, so a window that outlived its records' data in a power loss
//! would be trusted over a hole. The file system here keeps, per data file, the byte ranges
//! written since its last sync, and checks every index write against them at that moment.
use super::tests::{crash_copy, open_with, opts, KEY};
use super::*;
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FileHandle, ForwardingFile, StdFs, WrapFs};
use crate::engine::record::{parse_prefix, ReqId, RECORD_OVERHEAD};
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::FileExt;

#[derive(Default)]
struct Disk {
    /// Per data file: byte ranges written since its last sync (what a power loss may lose).
    dirty: HashMap<PathBuf, Vec<(u64, u64)>>,
    /// Index entries written while their record was not yet synced, as "file: entry -> range".
    early: Vec<String>,
    entries_written: u64,
    /// Index writes still to fail with ENOSPC (after writing half of their bytes), and how many did.
    failing_index_writes: u32,
    failed_index_writes: u32,
}

impl Disk {
    fn check_entries(&mut self, index_path: &Path, buf: &[u8], offset: u64) {
        if offset < HEADER_LEN {
            return;
        }
        let data_path = index_path.with_extension("seg");
        let data = std::fs::File::open(&data_path).unwrap();
        let dirty = self.dirty.get(&data_path).cloned().unwrap_or_default();
        for (k, e) in buf.chunks_exact(8).enumerate() {
            self.entries_written += 1;
            let at = i64::from_be_bytes(e.try_into().unwrap()) as u64;
            let mut prefix = [0u8; 36];
            data.read_exact_at(&mut prefix, at).unwrap();
            let (_, len, _) = parse_prefix(&prefix, 1 << 30).unwrap();
            let end = at + (RECORD_OVERHEAD + len) as u64;
            if dirty.iter().any(|&(a, b)| a < end && at < b) {
                let pos = (offset - HEADER_LEN) / 8 + k as u64;
                self.early.push(format!("{}: entry {pos} -> [{at}, {end}) not synced", index_path.display()));
            }
        }
    }
}

struct OrderFile {
    inner: Arc<dyn FileHandle>,
    path: PathBuf,
    disk: Arc<Mutex<Disk>>,
}

impl OrderFile {
    fn is(&self, ext: &str) -> bool {
        self.path.extension().is_some_and(|e| e == ext)
    }
}

impl ForwardingFile for OrderFile {
    fn inner(&self) -> &dyn FileHandle {
        self.inner.as_ref()
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.is("idx") && offset >= HEADER_LEN {
            let mut d = self.disk.lock().unwrap();
            if d.failing_index_writes > 0 {
                d.failing_index_writes -= 1;
                d.failed_index_writes += 1;
                self.inner.write_all_at(&buf[..buf.len() / 2], offset)?;
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        self.inner.write_all_at(buf, offset)?;
        let mut d = self.disk.lock().unwrap();
        if self.is("seg") {
            d.dirty.entry(self.path.clone()).or_default().push((offset, offset + buf.len() as u64));
        } else if self.is("idx") {
            d.check_entries(&self.path, buf, offset);
        }
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()?;
        self.disk.lock().unwrap().dirty.remove(&self.path);
        Ok(())
    }
}

fn order_fs() -> (Arc<dyn FileSystem>, Arc<Mutex<Disk>>) {
    let disk = Arc::new(Mutex::new(Disk::default()));
    let d = disk.clone();
    let fs = WrapFs(move |p: &Path, f: Arc<dyn FileHandle>| -> io::Result<Arc<dyn FileHandle>> {
        // What an earlier process wrote may be in the page cache only: nothing counts as
        // synced until this process syncs it.
        if p.extension().is_some_and(|e| e == "seg") {
            let len = f.len()?;
            d.lock().unwrap().dirty.insert(p.to_path_buf(), vec![(0, len)]);
        }
        Ok(Arc::new(OrderFile { inner: f, path: p.to_path_buf(), disk: d.clone() }))
    });
    (Arc::new(fs), disk)
}

fn data(t: i64) -> Vec<u8> {
    format!("record-{t}-").repeat((t % 5 + 1) as usize).into_bytes()
}

fn append_batch(p: &Partition, n: usize) -> (i64, i64) {
    // Each record's bytes depend only on its id, and ids are known only once queued: the
    // batch is retried at the id the partition hands out.
    loop {
        let next = lock(&p.state).next_txid;
        let datas: Vec<Vec<u8>> = (next..next + n as i64).map(data).collect();
        let recs: Vec<NewRecord<'_>> =
            datas.iter().map(|d| NewRecord { req_id: ReqId::default(), header: 0, data: d, data_crc: None }).collect();
        match p.append_at_opt(Some(next), &recs) {
            Ok(r) => return r,
            Err(Error::NonDenseAppend { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

fn assert_in_order(disk: &Mutex<Disk>) {
    let d = disk.lock().unwrap();
    assert!(d.entries_written > 0, "the run wrote no index entry: nothing was checked");
    assert!(
        d.early.is_empty(),
        "{} index entries reached the file before their records were synced, first: {}",
        d.early.len(),
        d.early[0]
    );
}

fn check_reads(dir: &Path, last: i64) {
    let p = Partition::open(Arc::new(StdFs), dir, 0, KEY, opts(4096, 4)).unwrap();
    assert_eq!(p.max_txid(), last);
    for t in 0..=last {
        assert_eq!(p.read_record(t).unwrap().unwrap().data, data(t), "txid {t}");
    }
}

/// Group-committed appends from four threads, rolls every few kilobytes, a truncation, a flush
/// and a close: no index entry is written before its record is synced.
#[test]
fn index_entries_reach_the_file_only_after_their_records_are_synced() {
    let d = tempfile::tempdir().unwrap();
    let (fs, disk) = order_fs();
    let p = Arc::new(open_with(fs, d.path(), opts(4096, 4)).unwrap());
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let p = p.clone();
            std::thread::spawn(move || {
                for i in 0..40 {
                    append_batch(&p, 1 + (w + i) % 3);
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let cut = p.max_txid() - 7;
    p.truncate(cut).unwrap();
    for i in 0..10 {
        append_batch(&p, 1 + i % 4);
    }
    p.flush_index().unwrap();
    for _ in 0..3 {
        append_batch(&p, 2);
    }
    let last = p.max_txid();
    p.close();
    assert!(p.segment_count() > 3, "the run must roll segments");
    assert_in_order(&disk);
    check_reads(d.path(), last);
}

/// After a crash (the files as the process left them, maybe page cache only), recovery rebuilds
/// the index tail from the records it scanned: it syncs them before writing any entry.
#[test]
fn recovery_syncs_the_records_it_scanned_before_indexing_them() {
    let d = tempfile::tempdir().unwrap();
    // Without preallocated zeros the scan cuts nothing, the one case where recovery had no
    // reason of its own to sync the data file.
    let mut o = opts(1 << 20, 4);
    o.preallocate = 0;
    let p = open_with(Arc::new(StdFs), d.path(), o.clone()).unwrap();
    for i in 0..30 {
        append_batch(&p, 1 + i % 3);
    }
    let last = p.max_txid();
    let crashed = d.path().join("crashed");
    crash_copy(d.path(), &crashed);
    p.close();
    // The crash left part of the index tail unwritten: recovery has windows to write back.
    let idx = crashed.join(crate::engine::segment::index_name(0));
    let f = std::fs::OpenOptions::new().write(true).open(&idx).unwrap();
    f.set_len(HEADER_LEN + 8 * 4).unwrap();
    drop(f);
    let (fs, disk) = order_fs();
    let r = Partition::open(fs, &crashed, 0, KEY, o).unwrap();
    assert_eq!(r.max_txid(), last);
    r.close();
    assert_in_order(&disk);
    check_reads(&crashed, last);
}

/// A checkpoint window the disk refuses (full) stops nothing: its half-written bytes are cut
/// off, the entries stay in memory, and the write is tried again a checkpoint interval later
/// (not at every sync), or by the close.
#[test]
fn a_failed_checkpoint_write_is_retried_and_loses_no_entry() {
    let d = tempfile::tempdir().unwrap();
    let (fs, disk) = order_fs();
    let p = open_with(fs, d.path(), opts(1 << 20, 4)).unwrap();
    append_batch(&p, 5); // window [0, 4) written
    disk.lock().unwrap().failing_index_writes = 100;
    for _ in 0..12 {
        append_batch(&p, 1); // one sync each; windows complete at 8, 12 and 16
    }
    assert_eq!(disk.lock().unwrap().failed_index_writes, 3, "one attempt per checkpoint interval");
    assert!(p.is_failed().is_none(), "a failed index write must not stop the partition");
    disk.lock().unwrap().failing_index_writes = 0;
    for _ in 0..6 {
        append_batch(&p, 1);
    }
    let last = p.max_txid();
    p.close();
    assert_in_order(&disk);
    let idx = d.path().join(crate::engine::segment::index_name(0));
    assert_eq!(
        std::fs::metadata(&idx).unwrap().len(),
        HEADER_LEN + 8 * (last as u64 + 1),
        "a closed partition has its whole index"
    );
    check_reads(d.path(), last);
}
