//! Fault and race tests of the partition: gated fsyncs, injected write errors, damaged index
//! entries. Found by an adversarial review; each one failed before its fix.
use super::tests::{open_with, opts, KEY};
use super::*;
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FaultFs, FileHandle, ForwardingFile, StdFs, WrapFs};
use crate::engine::record::ReqId;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{mpsc, Condvar};

#[derive(Default)]
struct GateState {
    block_next: u32,
    blocked: u32,
    release: bool,
    fail_released: bool,
    fail_seg_writes: bool,
}

#[derive(Default)]
struct Gate {
    st: Mutex<GateState>,
    cv: Condvar,
}

impl Gate {
    fn arm(&self, n: u32) {
        let mut s = self.st.lock().unwrap();
        s.block_next = n;
        s.blocked = 0;
        s.release = false;
        s.fail_released = false;
    }
    fn wait_blocked(&self, n: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut s = self.st.lock().unwrap();
        while s.blocked < n {
            assert!(Instant::now() < deadline, "nobody reached the gated sync");
            s = self.cv.wait_timeout(s, Duration::from_millis(50)).unwrap().0;
        }
    }
    fn release(&self, fail: bool) {
        let mut s = self.st.lock().unwrap();
        s.release = true;
        s.fail_released = fail;
        self.cv.notify_all();
    }
    fn fail_writes(&self, on: bool) {
        self.st.lock().unwrap().fail_seg_writes = on;
    }
}

struct GateFile {
    inner: Arc<dyn FileHandle>,
    is_seg: bool,
    gate: Arc<Gate>,
}

impl ForwardingFile for GateFile {
    fn inner(&self) -> &dyn FileHandle {
        self.inner.as_ref()
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.is_seg && self.gate.st.lock().unwrap().fail_seg_writes {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.inner.write_all_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        if self.is_seg {
            let mut s = self.gate.st.lock().unwrap();
            if s.block_next > 0 {
                s.block_next -= 1;
                s.blocked += 1;
                self.gate.cv.notify_all();
                while !s.release {
                    s = self.gate.cv.wait(s).unwrap();
                }
                if s.fail_released {
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
            }
        }
        self.inner.sync_data()
    }
}

fn gated(dir: &Path) -> (Arc<Partition>, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let g = gate.clone();
    let fs = WrapFs(move |path: &Path, f: Arc<dyn FileHandle>| -> io::Result<Arc<dyn FileHandle>> {
        let is_seg = path.extension().is_some_and(|e| e == "seg");
        Ok(Arc::new(GateFile { inner: f, is_seg, gate: g.clone() }))
    });
    let p = open_with(Arc::new(fs), dir, opts(1 << 30, 1000)).unwrap();
    (Arc::new(p), gate)
}

fn one(data: &[u8]) -> [NewRecord<'_>; 1] {
    [NewRecord { req_id: ReqId::default(), header: 0, data, data_crc: None }]
}

fn append_bg(p: &Arc<Partition>, first: Option<i64>, data: Vec<u8>) -> std::thread::JoinHandle<Result<(i64, i64)>> {
    let p = p.clone();
    std::thread::spawn(move || p.append_at_opt(first, &one(&data)))
}

fn wait_next_txid(p: &Partition, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while lock(&p.state).next_txid != n {
        assert!(Instant::now() < deadline, "append never enqueued");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Give the appender time to reach wait_durable (it only needs the sync lock).
    std::thread::sleep(Duration::from_millis(50));
}

fn fill(p: &Partition, n: i64) {
    for t in 0..n {
        let d = format!("base-{t}").into_bytes();
        p.append(t, &one(&d)).unwrap();
    }
}

/// F1: a sync leader that was in flight when `truncate` ran raises `durable` back above the
/// truncated log end; the next (not yet synced) append is then readable and counted durable.
#[test]
fn r1_durable_watermark_after_truncate_during_a_sync() {
    let d = tempfile::tempdir().unwrap();
    let (p, gate) = gated(d.path());
    fill(&p, 5); // txids 0..=4
    gate.arm(1);
    let x = append_bg(&p, None, b"X".to_vec()); // txid 5, leader, blocked in fdatasync
    gate.wait_blocked(1);
    // The truncation waits for the in-flight sync (one syncer at a time), then cuts.
    let pt = p.clone();
    let t = std::thread::spawn(move || pt.truncate(4));
    std::thread::sleep(Duration::from_millis(50));
    gate.release(false);
    let _ = x.join().unwrap();
    assert_eq!(t.join().unwrap().unwrap(), 4);
    assert_eq!(p.max_txid(), 4);
    let mut problems = Vec::new();
    if p.max_txid() != 4 {
        problems.push(format!(
            "max_txid() = {} after truncate(4) (log ends at {})",
            p.max_txid(),
            lock(&p.state).next_txid - 1
        ));
    }
    // A new append whose fdatasync will fail: while it is in flight it must not be readable.
    gate.arm(1);
    let b = append_bg(&p, None, b"B-not-durable".to_vec());
    gate.wait_blocked(1);
    let seen = p.read_record(5).unwrap();
    gate.release(true);
    let br = b.join().unwrap();
    if let Some(r) = seen {
        problems.push(format!(
            "read_record(5) returned {:?} while its fdatasync was in flight; that append then returned {:?}",
            String::from_utf8_lossy(&r.data),
            br.map_err(|e| e.to_string())
        ));
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// F2: records still waiting for their sync are cut by `truncate`, then acknowledged.
#[test]
fn r2_truncate_cuts_queued_records_that_are_then_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let (p, gate) = gated(d.path());
    fill(&p, 5);
    gate.arm(1);
    let x = append_bg(&p, None, b"X".to_vec()); // txid 5: leader, blocked in fdatasync
    gate.wait_blocked(1);
    let a = append_bg(&p, None, b"A-record".to_vec()); // txid 6: queued, waits for the leader
    wait_next_txid(&p, 7);
    let pt = p.clone();
    let t = std::thread::spawn(move || pt.truncate(4)); // waits for the in-flight sync
    std::thread::sleep(Duration::from_millis(50));
    gate.release(false);
    let (xr, ar, tr) = (x.join().unwrap(), a.join().unwrap(), t.join().unwrap());
    assert_eq!(tr.unwrap(), 4);
    assert!(xr.is_ok());
    // A was either synced before the cut (acknowledged, then truncated on request) or cut
    // before any sync covered it, and then it must fail: never acknowledged unsynced.
    assert!(matches!(ar, Ok(_) | Err(Error::AppendTruncated { .. })), "{ar:?}");
    assert_eq!(p.append_at_opt(Some(5), &one(b"B-record")).unwrap(), (5, 5));
    assert_eq!(p.read_record(5).unwrap().unwrap().data, b"B-record");
    assert!(p.read_record(6).unwrap().is_none());
}

/// A queued append that a truncation cuts before any sync fails instead of being acknowledged.
#[test]
fn r2b_a_queued_append_cut_by_truncate_fails() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    fill(&p, 5);
    let kept = p.enqueue(None, &one(b"kept")).unwrap(); // txid 5
    let cut = p.enqueue(None, &one(b"cut")).unwrap(); // txid 6
    assert_eq!(p.truncate(5).unwrap(), 5);
    assert!(p.wait_durable(kept.seq).is_ok());
    assert!(matches!(p.wait_durable(cut.seq), Err(Error::AppendTruncated { .. })));
    assert_eq!(p.read_record(5).unwrap().unwrap().data, b"kept");
    assert!(p.read_record(6).unwrap().is_none());
}

/// F3: a write failure in `flush_index` (Storage.flush / close) drops the queue without
/// poisoning; the queued appender is then acknowledged for bytes that were never written.
/// (flush_index now syncs before writing the index, so the write fails in its sync.)
#[test]
fn r3_flush_index_write_error_loses_a_queued_record_that_is_then_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let (p, gate) = gated(d.path());
    fill(&p, 5);
    gate.arm(1);
    let x = append_bg(&p, None, b"X".to_vec()); // txid 5, leader blocked in fdatasync
    gate.wait_blocked(1);
    let a = append_bg(&p, None, b"A-record".to_vec()); // txid 6, queued
    wait_next_txid(&p, 7);
    gate.fail_writes(true);
    // flush_index syncs first, so it waits for the leader held at the gate.
    let flusher = {
        let p = p.clone();
        std::thread::spawn(move || p.flush_index())
    };
    std::thread::sleep(Duration::from_millis(100));
    gate.release(false);
    let fl = flusher.join().unwrap();
    gate.fail_writes(false);
    let poisoned = p.is_failed();
    let (_xr, ar) = (x.join().unwrap(), a.join().unwrap());
    let max = p.max_txid();
    drop(p);
    let p2 = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    let after = p2.read_record(6).unwrap();
    assert!(
        !(ar.is_ok() && after.is_none()),
        "flush_index -> {:?}, poisoned: {:?}; A acknowledged as {:?} (max_txid {}), but after reopen \
         txid 6 is {:?} and max_txid is {}",
        fl.map_err(|e| e.to_string()),
        poisoned,
        ar.ok(),
        max,
        after,
        p2.max_txid()
    );
}

/// Close variant of F3: the failure is only logged.
#[test]
fn r3b_close_write_error_loses_a_queued_record_that_is_then_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let (p, gate) = gated(d.path());
    fill(&p, 5);
    gate.arm(1);
    let x = append_bg(&p, None, b"X".to_vec());
    gate.wait_blocked(1);
    let a = append_bg(&p, None, b"A-record".to_vec());
    wait_next_txid(&p, 7);
    gate.fail_writes(true);
    // close() syncs as the sync leader, so it waits for X's gated sync.
    let closer = {
        let p = p.clone();
        std::thread::spawn(move || p.close())
    };
    gate.release(false);
    let (_xr, ar) = (x.join().unwrap(), a.join().unwrap());
    closer.join().unwrap();
    gate.fail_writes(false);
    drop(p);
    let p2 = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    let after = p2.read_record(6).unwrap();
    assert!(!(ar.is_ok() && after.is_none()), "A acknowledged as {:?}, after reopen txid 6 = {:?}", ar.ok(), after);
}

/// An append queued (txid 5), then `close` syncs while the gate holds that sync, and a thread
/// waits for the append meanwhile; the gate then lets the sync fail or succeed. Returns the
/// waiter's answer.
fn close_while_an_append_waits(dir: &Path, sync_fails: bool) -> Result<()> {
    let (p, gate) = gated(dir);
    fill(&p, 5);
    let ticket = p.enqueue(None, &one(b"A-record")).unwrap();
    gate.arm(1);
    let closer = {
        let p = p.clone();
        std::thread::spawn(move || p.close())
    };
    gate.wait_blocked(1);
    let waiter = {
        let p = p.clone();
        std::thread::spawn(move || p.wait_durable(ticket.seq))
    };
    gate.release(sync_fails);
    closer.join().unwrap();
    waiter.join().unwrap()
}

/// The sync `close` makes fails (Linux then reports the lost writeback to no later fdatasync of
/// the file): an append waiting for a sync must fail, not be acknowledged by a sync of its own
/// that ran beside close's and succeeded. Before, close's failure was only logged.
#[test]
fn r3c_close_sync_error_fails_an_append_waiting_for_a_sync() {
    let d = tempfile::tempdir().unwrap();
    let r = close_while_an_append_waits(d.path(), true);
    assert!(r.is_err(), "the append was acknowledged after the sync covering it failed: {r:?}");
}

/// A clean close answers the appends waiting for a sync: its own sync covered them.
#[test]
fn r3d_close_acknowledges_what_its_sync_covered() {
    let d = tempfile::tempdir().unwrap();
    close_while_an_append_waits(d.path(), false).unwrap();
    let p2 = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    assert_eq!(p2.read_record(5).unwrap().map(|r| r.data), Some(b"A-record".to_vec()));
}

fn payload(t: i64) -> Vec<u8> {
    format!("payload-{t}-").repeat((t % 7 + 1) as usize).into_bytes()
}

fn write_250(dir: &Path, cp: u64) {
    let p = open_with(Arc::new(StdFs), dir, opts(1 << 30, cp)).unwrap();
    for t in 0..250 {
        p.append(t, &one(&payload(t))).unwrap();
    }
    drop(p); // clean close: complete index
}

/// F4: only the highest checkpoint window is verified; entries of earlier windows are trusted,
/// so one damaged entry makes an intact, acknowledged record unreadable on every later open.
#[test]
fn r4_damaged_entry_in_an_earlier_window_is_trusted_forever() {
    let d = tempfile::tempdir().unwrap();
    write_250(d.path(), 100);
    let idx =
        std::fs::OpenOptions::new().write(true).open(d.path().join(crate::engine::segment::index_name(0))).unwrap();
    idx.write_all_at(&[0u8; 8], HEADER_LEN + 8 * 50).unwrap(); // window [0,100), below cp 200
    for _ in 0..2 {
        let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 100)).unwrap();
        let r = p.read_record(50);
        assert!(
            matches!(&r, Ok(Some(rec)) if rec.data == payload(50)),
            "intact record 50 unreadable after reopen (scanned {} records): {:?}",
            p.recovery.scanned_records,
            r.map(|o| o.map(|r| r.txid)).map_err(|e| e.to_string())
        );
    }
}

/// F5: an index entry of -1 (bytes FF..FF) overflows `pos + needed` in `visit`: a panic in debug
/// builds, an endless loop in release builds (the extension is built release).
#[test]
fn r5_index_entry_minus_one_hangs_or_panics_the_reader() {
    let d = tempfile::tempdir().unwrap();
    write_250(d.path(), 100);
    let idx =
        std::fs::OpenOptions::new().write(true).open(d.path().join(crate::engine::segment::index_name(0))).unwrap();
    idx.write_all_at(&[0xFFu8; 8], HEADER_LEN + 8 * 50).unwrap();
    let p = Arc::new(open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 100)).unwrap());
    let (tx, rx) = mpsc::channel();
    let p2 = p.clone();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p2.read_record(50).map(|_| ()).map_err(|e| e.to_string())
        }));
        let _ = tx.send(r.map_err(|e| {
            e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        }));
    });
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(Ok(r)) => println!("read_record(50) -> {r:?}"),
        Ok(Err(panic)) => panic!("read_record(50) panicked: {panic:?}"),
        Err(_) => panic!("read_record(50) still running after 5 s (endless loop)"),
    }
}

/// F6: after a failed fdatasync and a reopen, recovery reads the never-synced record back from
/// the page cache and reports it durable, without any successful fdatasync covering it.
#[test]
fn r6_record_whose_fsync_failed_is_durable_after_reopen() {
    let d = tempfile::tempdir().unwrap();
    let fs = Arc::new(FaultFs::new());
    let p = open_with(fs.clone(), d.path(), opts(1 << 30, 1000)).unwrap();
    fill(&p, 5);
    fs.syncs_before_eio.store(0, Ordering::SeqCst);
    assert!(p.append(5, &one(b"never-synced")).is_err());
    fs.syncs_before_eio.store(-1, Ordering::SeqCst);
    drop(p);
    let p = open_with(fs, d.path(), opts(1 << 30, 1000)).unwrap();
    assert_eq!(
        p.max_txid(),
        4,
        "record 5 (its fdatasync failed) is reported durable after reopen: {:?}",
        p.read_record(5).unwrap().map(|r| r.data)
    );
}

/// F7: truncate/drop_segments_before check `closed` before taking the state lock; a call that
/// waited for the lock runs on a partition that close() already handed back.
#[test]
fn r7_truncate_runs_after_close() {
    let d = tempfile::tempdir().unwrap();
    let p = Arc::new(open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap());
    fill(&p, 10);
    let guard = lock(&p.state);
    let pt = p.clone();
    let t = std::thread::spawn(move || pt.truncate(2));
    std::thread::sleep(Duration::from_millis(100)); // truncate passed check_writable, waits for the lock
    p.closed.store(true, Ordering::Release); // what close() does first
    drop(guard);
    let r = t.join().unwrap();
    drop(p);
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    assert!(r.is_err(), "truncate on a closed partition returned {:?}; the files now end at {}", r.ok(), p.max_txid());
}

/// F8: a read-only open with a pending truncation intent serves the records being truncated.
#[test]
fn r8_read_only_open_with_intent_serves_truncated_records() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    fill(&p, 10);
    drop(p);
    write_file_atomically(&StdFs, &d.path().join(TRUNCATE_INTENT), &encode_intent(3)).unwrap();
    let mut o = opts(1 << 30, 1000);
    o.recover.read_only = true;
    let p = Partition::open(Arc::new(StdFs), d.path(), 0, KEY, o).unwrap();
    assert_eq!(
        p.max_txid(),
        3,
        "read-only view shows {} (finished_truncation = {:?})",
        p.max_txid(),
        p.recovery.finished_truncation
    );
}

/// F4b: `truncate` trusts the same unverified entry as the cut point (`cut_after` -> offset_of ->
/// set_len), so one damaged index entry deletes acknowledged records below the target.
#[test]
fn r9_truncate_through_a_damaged_entry_deletes_acknowledged_records() {
    let d = tempfile::tempdir().unwrap();
    write_250(d.path(), 100);
    let idx =
        std::fs::OpenOptions::new().write(true).open(d.path().join(crate::engine::segment::index_name(0))).unwrap();
    idx.write_all_at(&(HEADER_LEN as i64).to_be_bytes(), HEADER_LEN + 8 * 50).unwrap(); // entry 50 := 128
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 100)).unwrap();
    assert_eq!(p.truncate(49).unwrap(), 49);
    drop(p);
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 100)).unwrap();
    let r = p.read_record(10);
    assert!(
        matches!(&r, Ok(Some(rec)) if rec.data == payload(10)),
        "after truncate(49) record 10 is {:?}; max_txid {}; data file {} bytes",
        r.map(|o| o.map(|r| r.txid)).map_err(|e| e.to_string()),
        p.max_txid(),
        std::fs::metadata(d.path().join(crate::engine::segment::data_name(0))).unwrap().len()
    );
}

/// F10: an index entry damaged to the exact end of the records passed as proven (it was taken
/// for "the position after the last record"), so a truncation through it cut nothing: the
/// records it dropped stayed in the file ahead of the next appends.
#[test]
fn r10_truncate_through_an_entry_equal_to_the_end_cuts_the_records() {
    let d = tempfile::tempdir().unwrap();
    write_250(d.path(), 100);
    let data_len = std::fs::metadata(d.path().join(crate::engine::segment::data_name(0))).unwrap().len();
    let idx =
        std::fs::OpenOptions::new().write(true).open(d.path().join(crate::engine::segment::index_name(0))).unwrap();
    // Entry 50 := the end, in a window below the last checkpoint (recovery proves only that one).
    idx.write_all_at(&(data_len as i64).to_be_bytes(), HEADER_LEN + 8 * 50).unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 100)).unwrap();
    assert_eq!(p.truncate(49).unwrap(), 49);
    assert!(
        std::fs::metadata(d.path().join(crate::engine::segment::data_name(0))).unwrap().len() < data_len,
        "nothing was cut"
    );
    for t in 50..55 {
        p.append(t, &one(format!("new-{t}").as_bytes())).unwrap();
    }
    drop(p);
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 100)).unwrap();
    assert_eq!(p.max_txid(), 54);
    assert_eq!(p.read_record(49).unwrap().unwrap().data, payload(49));
    assert_eq!(p.read_record(50).unwrap().unwrap().data, b"new-50");
}

/// The data file as a read-only open sees it while a running node appends: right after the
/// scan's read that first reaches the frontier (preallocated zeros), the "node" writes two more
/// records there.
struct AppendedBehindTheReader {
    inner: Arc<dyn FileHandle>,
    path: PathBuf,
    at: u64,
    bytes: Vec<u8>,
    written: std::sync::atomic::AtomicBool,
}

impl ForwardingFile for AppendedBehindTheReader {
    fn inner(&self) -> &dyn FileHandle {
        self.inner.as_ref()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let n = self.inner.read_at(buf, offset)?;
        if offset <= self.at && self.at < offset + n as u64 && !self.written.swap(true, Ordering::SeqCst) {
            std::fs::OpenOptions::new().write(true).open(&self.path)?.write_all_at(&self.bytes, self.at)?;
        }
        Ok(n)
    }
}

/// F11: a read-only open of a running node's directory (the Spark source reads them) failed
/// about half the time with "corruption ... with a valid record after it": the scan stopped at
/// the zeros ahead of the writer, and by the time the checks after it read on, the writer had
/// filled them with valid records. Now the open follows the records written meanwhile.
#[test]
fn r11_a_read_only_open_follows_records_appended_while_it_scans() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), opts(1 << 30, 1000)).unwrap();
    for t in 0..7 {
        p.append(t, &one(&payload(t))).unwrap();
    }
    drop(p);
    let (seg, idx) =
        (d.path().join(crate::engine::segment::data_name(0)), d.path().join(crate::engine::segment::index_name(0)));
    let entry = |i: u64| {
        let mut b = [0u8; 8];
        std::fs::File::open(&idx).unwrap().read_exact_at(&mut b, HEADER_LEN + 8 * i).unwrap();
        i64::from_be_bytes(b) as u64
    };
    let (at, last) = (entry(5), entry(6));
    let end = last + (crate::engine::record::RECORD_OVERHEAD + payload(6).len()) as u64;
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&seg).unwrap();
    let mut bytes = vec![0u8; (end - at) as usize];
    file.read_exact_at(&mut bytes, at).unwrap();
    file.write_all_at(&vec![0u8; bytes.len()], at).unwrap(); // as when the reader began: 5 records, then zeros
    std::fs::OpenOptions::new().write(true).open(&idx).unwrap().set_len(HEADER_LEN + 8 * 5).unwrap();

    let live = seg.clone();
    let fs = WrapFs(move |path: &Path, f: Arc<dyn FileHandle>| -> io::Result<Arc<dyn FileHandle>> {
        if path != live {
            return Ok(f);
        }
        Ok(Arc::new(AppendedBehindTheReader {
            inner: f,
            path: path.to_path_buf(),
            at,
            bytes: bytes.clone(),
            written: Default::default(),
        }))
    });
    let mut o = opts(1 << 30, 1000);
    o.recover.read_only = true;
    let p = Partition::open(Arc::new(fs), d.path(), 0, KEY, o).unwrap();
    assert_eq!(p.max_txid(), 6);
    assert_eq!(p.read_record(6).unwrap().unwrap().data, payload(6));
}

/// A folder listing that misses one segment the first time, as a listing made while a running
/// node rolls its segments can.
struct ListingMissesOnce {
    hidden: Mutex<Option<PathBuf>>,
}

impl crate::engine::fs::FileSystem for ListingMissesOnce {
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn FileHandle>> {
        StdFs.open(path, writable)
    }
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn FileHandle>> {
        StdFs.create_new(path)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<PathBuf>> {
        let mut found = StdFs.list_dir(path)?;
        if let Some(hidden) = self.hidden.lock().unwrap().take() {
            found.retain(|p| *p != hidden);
        }
        Ok(found)
    }
}

/// F12: a read-only open whose folder listing missed a segment created during it (and named
/// the next one) failed: the segment before the gap "holds transactions up to X but the next
/// segment starts at Y". The Spark source hit it reading a node that rolls often.
#[test]
fn r12_a_read_only_open_lists_again_when_a_segment_was_missed() {
    let d = tempfile::tempdir().unwrap();
    let p = open_with(Arc::new(StdFs), d.path(), opts(4096, 10)).unwrap();
    for t in 0..200 {
        p.append(t, &one(&payload(t))).unwrap();
    }
    assert!(p.segment_count() > 3);
    drop(p);
    let mut segs: Vec<PathBuf> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    let fs = ListingMissesOnce { hidden: Mutex::new(Some(segs[2].clone())) };
    let mut o = opts(4096, 10);
    o.recover.read_only = true;
    let p = Partition::open(Arc::new(fs), d.path(), 0, KEY, o).unwrap();
    assert_eq!((p.max_txid(), p.segment_count()), (199, segs.len()));
    for t in [0, 100, 199] {
        assert_eq!(p.read_record(t).unwrap().unwrap().data, payload(t));
    }
}
