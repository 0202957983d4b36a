//! One partition's log: a run of segments, the append path with group commit, sequential reads,
//! tail truncation (crash-safe through an intent file) and head retention.
//!
//! Durability: an append returns only after an fdatasync that started after its bytes were
//! written has succeeded. Concurrent appenders elect one leader per sync; the others wait for a
//! sync that covers them. Any write or sync error poisons the partition: it acknowledges nothing
//! more until reopened, because after a failed fsync the page cache no longer tells the truth.
use crate::engine::batch::LaidBatch;
use crate::engine::error::{Error, IoContext, Result};
use crate::engine::format::{now_ms, FORMAT_VERSION, HEADER_LEN};
use crate::engine::fs::{tmp_path, write_file_atomically, FileSystem};
use crate::engine::index::{self, Checkpointer, Durable};
use crate::engine::record::{
    be_i64, be_u32, check_record, crc32, Invalid, NewRecord, Record, RecordHeader, RECORD_OVERHEAD,
};
use crate::engine::segment::{
    create_segment, data_name, index_name, locate, parse_segment_name, recover_segment, unsynced_bound, RecoverOptions,
    RecoveryMode, Segment, SegmentContext, SegmentFiles, SegmentHeader, Tail,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod direct;
mod phases;
mod queue;
mod spare;
use phases::{Phase, Phases};
pub use queue::SharedData;
use queue::WriteQueue;
use spare::SpareSlot;

/// Written before a tail truncation deletes anything, removed after; replayed on open.
pub const TRUNCATE_INTENT: &str = "truncate.intent";
/// Written before a restart (`Partition::restart_files`) deletes the log, removed once the new
/// empty log is in place; finished on open.
pub const RESTART_INTENT: &str = "restart.intent";
const READ_CHUNK_MIN: usize = 64 << 10;
const READ_CHUNK_MAX: usize = 8 << 20;

thread_local! {
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The read buffer of `visit`, kept per thread between calls: a fresh one per call was zeroed
/// and faulted in again for every chunk a scan returned (an eighth of a bulk scan's time). A
/// thread keeps at most twice READ_CHUNK_MAX.
struct ReadBuf(Vec<u8>);

impl ReadBuf {
    fn take() -> Self {
        ReadBuf(READ_BUF.try_with(|b| std::mem::take(&mut *b.borrow_mut())).unwrap_or_default())
    }
}

impl Drop for ReadBuf {
    fn drop(&mut self) {
        if self.0.capacity() <= 2 * READ_CHUNK_MAX {
            let v = std::mem::take(&mut self.0);
            let _ = READ_BUF.try_with(|b| *b.borrow_mut() = v);
        }
    }
}
pub const DEFAULT_PREALLOCATE: u64 = 1 << 20;
/// Zero pages of the binary's bss: one write per preallocation step of the default size.
pub(crate) static ZEROS: [u8; 1 << 20] = [0; 1 << 20];
const MAX_COMMIT_DELAY: Duration = Duration::from_micros(200);
/// Bytes of encoding buffers a partition keeps for reuse: a fresh 1 MiB buffer per batch is faulted
/// in again each time, and a few appends in flight at once each need one.
const ENCODE_BUFFERS_KEEP: usize = 8 << 20;
/// Batches with at least this many bytes of data are encoded before the state lock is taken.
const ENCODE_UNLOCKED_MIN: usize = 64 << 10;
/// Flushes at least this large grow the file instead of zero-filling ahead. Zeros save a flush
/// the inode write (about 35 µs here) but cost their own bytes once: worth it for small flushes,
/// a loss from about this size up, where a fill ran on nearly every flush (at 1 MiB a flush, the
/// disk wrote twice the records' bytes) and put a 1 MiB write on one sync in ten at 100 KiB
/// (docs/performance.md, "Where an append's time goes").
const ZERO_FILL_MAX_FLUSH: u64 = 32 << 10;
/// The smallest stretch of zeros written at once: its sync costs about a plain one and a half.
const ZERO_STEP_MIN: u64 = 64 << 10;
/// Stretches of zeros up to this size are rare enough to leave the p99 alone when they come once
/// per `ZERO_STEP_FLUSHES` flushes (their sync takes about 0.5 ms); a larger one would put a long
/// sync on about one flush in a hundred.
const ZERO_STEP_RARE_MAX: u64 = 512 << 10;
const ZERO_STEP_FLUSHES: u64 = 256;

/// Bytes of zeros to write ahead, given the recent flushes' mean size: one sync in
/// `ZERO_STEP_FLUSHES` carries them when that takes at most `ZERO_STEP_RARE_MAX` bytes (a sync
/// that rare stays out of the p99 even though it writes a lot); otherwise `ZERO_STEP_MIN`, paid
/// more often but each time for little. `max` (the `preallocate` option) caps both. A fixed 1 MiB
/// step put a 1 ms sync on one flush in a hundred at 10 KiB flushes, and a fixed 64 KiB one on one
/// in sixty at 1 KiB (docs/performance.md, "Issue 38, fifth round").
fn zero_step(max: u64, mean_flush: u64) -> u64 {
    let rare = mean_flush.saturating_mul(ZERO_STEP_FLUSHES).next_power_of_two();
    let step = if rare <= ZERO_STEP_RARE_MAX { rare.max(ZERO_STEP_MIN) } else { ZERO_STEP_MIN };
    step.min(max)
}

#[derive(Clone, Debug)]
pub struct PartitionOptions {
    pub segment_size: u64,
    /// The most bytes of zeros written ahead of the tail's records at once (0: none; `zero_step`
    /// sizes each stretch to the recent flushes). The fdatasync of a write
    /// that grows the file also writes the inode (its size, its new blocks); that of a write
    /// into zeros already synced writes the data only. The zeros go out with the sync after the
    /// write that reaches them, so one commit per stretch pays for the next.
    pub preallocate: u64,
    pub recover: RecoverOptions,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub segments: usize,
    /// Records validated by scanning past the last proven index checkpoint.
    pub scanned_records: u64,
    pub torn_bytes: u64,
    /// A torn write whose surviving records after the hole were dropped with it (file, the
    /// hole's offset, the first survivor's offset), if there was one.
    pub torn_survivors: Option<(PathBuf, u64, u64)>,
    /// Where repair cut a corrupt partition (file, offset), if it did.
    pub corruption_cut: Option<(PathBuf, u64)>,
    /// A truncation interrupted by a crash, finished during open.
    pub finished_truncation: Option<i64>,
    pub removed_files: Vec<PathBuf>,
    pub foreign_files: Vec<PathBuf>,
}

/// What an append brings: records to encode (their data in `owner` when it lies in a shared
/// buffer), or records laid out already (`LaidBatch`, ids patched to where they land).
enum Input<'a> {
    Records { records: &'a [NewRecord<'a>], owner: Option<&'a SharedData> },
    Laid(&'a mut LaidBatch),
}

/// A batch for `write_batch`: encoded before the lock (offsets counted from its start), to be
/// encoded there, or laid out at the ids it lands at.
enum Encoded<'a> {
    Before(WriteQueue, Vec<u64>),
    Here { first_txid: i64, records: &'a [NewRecord<'a>], owner: Option<&'a SharedData> },
    Laid(&'a LaidBatch),
}

/// A queued append: its ids, and the sequence to pass to `Partition::wait_durable`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendTicket {
    pub seq: u64,
    pub first: i64,
    pub last: i64,
}

/// Upper bounds (inclusive) of the histogram buckets; the last bucket takes the rest.
pub const SYNC_MICROS_BOUNDS: [u64; 10] = [50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 50_000, 250_000];
pub const BATCH_RECORDS_BOUNDS: [u64; 8] = [1, 2, 5, 10, 50, 100, 500, 1_000];

/// A fixed-bucket histogram cheap enough for the append path (one relaxed add per sample).
pub struct Histogram<const N: usize> {
    counts: [AtomicU64; N],
    overflow: AtomicU64,
    sum: AtomicU64,
}

impl<const N: usize> Default for Histogram<N> {
    fn default() -> Self {
        Histogram {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            overflow: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }
}

impl<const N: usize> Histogram<N> {
    fn observe(&self, bounds: &[u64; N], v: u64) {
        match bounds.iter().position(|b| v <= *b) {
            Some(i) => self.counts[i].fetch_add(1, Ordering::Relaxed),
            None => self.overflow.fetch_add(1, Ordering::Relaxed),
        };
        self.sum.fetch_add(v, Ordering::Relaxed);
    }
    /// Per-bucket counts (not cumulative), the overflow bucket last, and the sum of samples.
    pub fn snapshot(&self) -> (Vec<u64>, u64) {
        let mut v: Vec<u64> = self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        v.push(self.overflow.load(Ordering::Relaxed));
        (v, self.sum.load(Ordering::Relaxed))
    }
}

#[derive(Clone, Debug, Default)]
pub struct PartitionStats {
    pub appends: u64,
    pub records: u64,
    pub bytes: u64,
    pub syncs: u64,
    /// fdatasync latency in microseconds: bucket counts (bounds SYNC_MICROS_BOUNDS, then +Inf), sum.
    pub sync_micros: (Vec<u64>, u64),
    /// Records per append: bucket counts (bounds BATCH_RECORDS_BOUNDS, then +Inf), sum.
    pub batch_records: (Vec<u64>, u64),
    /// Per phase of the append path (name, count, total ns, max ns), when `WALTZ_ENGINE_PHASES=1`.
    pub phases: Option<Vec<(&'static str, u64, u64, u64)>>,
}

struct State {
    segments: Vec<Segment>,
    next_txid: i64,
    write_seq: u64,
    /// Encoded batches not yet written to the tail's data file (they end at the tail's `end`).
    queue: WriteQueue,
    /// The tail's data file length: its records, then zeros (preallocated) up to here.
    tail_allocated: u64,
    /// The tail's bytes before this offset (a record boundary) are covered by a completed
    /// fdatasync; records written since end within `unsynced_bound` of it (`write_queue`).
    synced_end: u64,
    /// After a failed preallocation, the tail offset before which none is tried again: a full
    /// disk costs one attempt (and one warning) per step of zeros (`zero_step`), not one per append.
    prealloc_retry_at: u64,
    /// Whether the last flush zero-filled ahead (its sync then writes the zeros too).
    zero_filled: bool,
    /// The recent flushes' mean size in bytes (a moving average): what `zero_step` sizes by.
    mean_flush: u64,
    /// After a failed checkpoint window write, the tail position before which none is tried
    /// again: one attempt per checkpoint interval, not one per sync.
    index_retry_at: u64,
    /// Batches appended but not yet known durable: (ticket sequence, last id), oldest first.
    inflight: std::collections::VecDeque<(u64, i64)>,
    /// Appends in the queue, and how many a waiting sync leader wants (0: none waits). It is
    /// woken once, by the append that completes its round: woken by each, it took the state lock
    /// between every two appends of the round.
    queued_appends: u64,
    leader_wants: u64,
    /// Whether the next segment's spare was asked for since the last roll.
    spare_requested: bool,
    /// Large flushes past the page cache: the tail's O_DIRECT handle and last block.
    direct: direct::DirectTail,
}

struct SyncState {
    synced_seq: u64,
    /// One thread at a time syncs or truncates the data files: the append sync leader or a
    /// truncation. Two concurrent fdatasyncs of one file could each miss the other's error.
    leader: bool,
    /// Tickets whose records a truncation cut before they were acknowledged: they fail.
    cut: std::collections::HashSet<u64>,
}

pub struct Partition {
    pub id: i32,
    dir: PathBuf,
    fs: Arc<dyn FileSystem>,
    cluster_key: [u8; 16],
    opts: PartitionOptions,
    state: Mutex<State>,
    sync: Mutex<SyncState>,
    synced: Condvar,
    enqueued: Condvar,
    /// Appends the previous sync covered, and how long it took: the commit delay's inputs.
    last_round: AtomicU64,
    last_sync_ns: AtomicU64,
    durable: AtomicI64,
    health: Arc<Health>,
    checkpointer: Checkpointer<SegmentFiles>,
    closed: AtomicBool,
    appends: AtomicU64,
    records: AtomicU64,
    bytes: AtomicU64,
    syncs: AtomicU64,
    sync_micros: Histogram<10>,
    batch_records: Histogram<8>,
    /// Bytes of segment files retention deleted since the partition was opened.
    reclaimed: AtomicU64,
    /// One retention deletion at a time: the doomed prefix is taken out of the state under its
    /// lock and unlinked outside it, and put back if an unlink fails.
    retention: Mutex<()>,
    phases: Phases,
    /// The next segment, prepared once the tail is half full (`spare.rs`).
    spare: SpareSlot,
    /// `next_txid` as last set under the state lock: the id `append_next` encodes at before it
    /// takes the lock.
    next_hint: AtomicI64,
    /// Buffers batches were encoded into, kept for the next ones.
    encode_buffers: Mutex<Vec<Vec<u8>>>,
    pub recovery: RecoveryReport,
}

/// Retention's freeing rate: the file of a deleted segment shrinks `STEP` bytes at a time, and
/// each step waits until the bytes freed so far fit the rate since the deletion began. A paced
/// deletion can take minutes: `stop` (the partition closing, the node stopping) ends it early.
struct Pace<'a> {
    rate: Option<u64>,
    began: Instant,
    freed: u64,
    stop: &'a dyn Fn() -> bool,
}

impl Pace<'_> {
    const STEP: u64 = 4 << 20;

    /// Accounts one step and sleeps until it is due; false once `stop` says so.
    fn wait(&mut self) -> bool {
        let Some(rate) = self.rate else { return !(self.stop)() };
        let due = Duration::from_secs_f64(self.freed as f64 / rate as f64);
        self.freed += Self::STEP;
        while let Some(ahead) = due.checked_sub(self.began.elapsed()) {
            if (self.stop)() {
                return false;
            }
            std::thread::sleep(ahead.min(Duration::from_millis(50)));
        }
        !(self.stop)()
    }
}

/// A segment as retention sees it: its ids, its size on disk, and when it was created (every
/// record of a sealed segment was written before the next segment's creation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentSpan {
    pub first_txid: i64,
    pub next_txid: i64,
    pub bytes: u64,
    pub creation_ms: i64,
}

/// Columns of a scanned range, ready to become Arrow buffers: one entry per record, data packed
/// end to end with `offsets` (n + 1 of them) marking each record's slice.
#[derive(Default, Debug, Clone)]
pub struct Columns {
    pub txids: Vec<i64>,
    pub headers: Vec<i32>,
    pub client_ids: Vec<i32>,
    pub generations: Vec<i32>,
    pub req_partitions: Vec<i32>,
    pub sequences: Vec<i32>,
    pub offsets: Vec<i32>,
    pub payload: Vec<u8>,
}

/// Whether the partition may still acknowledge appends; shared with its checkpointer thread.
#[derive(Default)]
struct Health {
    poisoned: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Health {
    fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }
    fn reason(&self) -> Option<String> {
        lock(&self.reason).clone()
    }
    fn poison(&self, partition: i32, err: &Error) {
        let mut r = lock(&self.reason);
        if r.is_none() {
            *r = Some(err.to_string());
        }
        self.poisoned.store(true, Ordering::Release);
        log::error!("partition {partition}: {err}; refusing appends until reopened");
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock is a bug; the state it guards stays usable for reads.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn encode_intent(txid: i64) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..8].copy_from_slice(&txid.to_be_bytes());
    let c = crc32(&b[0..8]);
    b[8..12].copy_from_slice(&c.to_be_bytes());
    b
}

impl Partition {
    /// Creates the folder and the first segment (starting at transaction 0). Idempotent.
    pub fn create(fs: &dyn FileSystem, dir: &Path, id: i32, cluster_key: [u8; 16]) -> Result<()> {
        if !fs.exists(dir) {
            fs.create_dir(dir).at(dir)?;
            fs.sync_dir(crate::engine::fs::parent_dir(dir)).at(dir)?;
        }
        let has_segment = fs
            .list_dir(dir)
            .at(dir)?
            .iter()
            .any(|p| p.file_name().and_then(|n| n.to_str()).and_then(|n| parse_segment_name(n, "seg")).is_some());
        if !has_segment {
            create_segment(fs, dir, &Self::header(cluster_key, id, 0))?;
        }
        Ok(())
    }

    fn header(cluster_key: [u8; 16], id: i32, first_txid: i64) -> SegmentHeader {
        SegmentHeader { version: FORMAT_VERSION, creation_ms: now_ms(), cluster_key, partition_id: id, first_txid }
    }

    /// A read-only open lists the folder while a running node may be rolling segments, and a
    /// listing promises nothing of files created during it: it can name a new segment and miss
    /// the one created just before it, and the segment before that gap then seems to end short.
    /// True when a new listing shows segments after `segs[i]` that the first one missed (they are
    /// added, and segment `i` is recovered again).
    /// Segments a truncation intent dooms (first ids above `kept`) stay out, as from the first listing.
    fn missed_by_listing(fs: &dyn FileSystem, dir: &Path, segs: &mut Vec<i64>, i: usize, kept: i64) -> Result<bool> {
        let (after, before) = (segs[i], segs.get(i + 1).copied().unwrap_or(i64::MAX));
        let mut missed: Vec<i64> = fs
            .list_dir(dir)
            .at(dir)?
            .iter()
            .filter_map(|p| p.file_name().and_then(|n| n.to_str()).and_then(|n| parse_segment_name(n, "seg")))
            .filter(|&t| after < t && t < before && t <= kept)
            .collect();
        if missed.is_empty() {
            return Ok(false);
        }
        log::debug!("{}: segments {missed:?} were created while the folder was listed", dir.display());
        segs.append(&mut missed);
        segs.sort_unstable();
        Ok(true)
    }

    /// Replaces a closed partition's whole log with an empty one starting at `first`: for a
    /// replica whose peers deleted (retention) everything up to past its end, so that it can be
    /// filled again from `first` on. Crash-safe: the intent file is written first, and whatever
    /// an interrupted restart left is finished by the next open.
    pub fn restart_files(fs: &dyn FileSystem, dir: &Path, id: i32, cluster_key: [u8; 16], first: i64) -> Result<()> {
        let intent = dir.join(RESTART_INTENT);
        write_file_atomically(fs, &intent, &encode_intent(first)).at(&intent)?;
        Self::finish_restart(fs, dir, id, cluster_key, first)
    }

    fn finish_restart(fs: &dyn FileSystem, dir: &Path, id: i32, cluster_key: [u8; 16], first: i64) -> Result<()> {
        let mut segs: Vec<i64> = fs
            .list_dir(dir)
            .at(dir)?
            .iter()
            .filter_map(|p| p.file_name().and_then(|n| n.to_str()).and_then(|n| parse_segment_name(n, "seg")))
            .collect();
        segs.sort_unstable();
        // Lowest first, as retention does; the new segment only once none is left, so the folder
        // never holds a gap that an open without the intent would take for a lost segment.
        for t in segs.iter().filter(|&&t| t != first) {
            Self::delete_segment_files(fs, dir, *t)?;
        }
        if !segs.contains(&first) {
            create_segment(fs, dir, &Self::header(cluster_key, id, first))?;
        }
        let intent = dir.join(RESTART_INTENT);
        fs.remove_file(&intent).at(&intent)?;
        fs.sync_dir(dir).at(dir)
    }

    fn read_restart_intent(fs: &dyn FileSystem, dir: &Path) -> Result<Option<i64>> {
        let path = dir.join(RESTART_INTENT);
        if !fs.exists(&path) {
            return Ok(None);
        }
        let mut b = [0u8; 12];
        let f = fs.open(&path, false).at(&path)?;
        let n = f.read_full_at(&mut b, 0).at(&path)?;
        if n == 12 && crc32(&b[0..8]) == be_u32(&b[8..12]) && be_i64(&b[0..8]) >= 0 {
            Ok(Some(be_i64(&b[0..8])))
        } else {
            Err(Error::corruption(&path, 0, "restart intent file is damaged"))
        }
    }

    pub fn open(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        id: i32,
        cluster_key: [u8; 16],
        opts: PartitionOptions,
    ) -> Result<Partition> {
        let ro = opts.recover.read_only;
        if let Some(first) = Self::read_restart_intent(fs.as_ref(), dir)? {
            if ro {
                return Err(Error::corruption(dir, 0, format!("a restart at {first} was interrupted: open writable")));
            }
            Self::finish_restart(fs.as_ref(), dir, id, cluster_key, first)?;
        }
        let mut report = RecoveryReport::default();
        let (mut segs, idxs, intent) = Self::list_files(fs.as_ref(), dir, ro, &mut report)?;
        segs.sort();
        Self::drop_leftovers(fs.as_ref(), dir, ro, &mut segs, idxs, intent, &mut report)?;
        if segs.is_empty() {
            return Err(Error::corruption(dir, 0, "partition folder holds no segment files"));
        }
        let ctx = |first: i64, next: Option<i64>| SegmentContext {
            fs: fs.as_ref(),
            dir,
            cluster_key,
            partition_id: id,
            first_txid: first,
            next_first: next,
            opts: &opts.recover,
        };
        let segments = Self::recover_segments(fs.as_ref(), dir, ro, &mut segs, intent, ctx, &mut report)?;
        report.segments = segments.len();
        let mut p = Self::recovered(fs, dir, id, cluster_key, opts, segments, report);
        if let Some(t) = intent {
            p.finish_intent(t)?;
        }
        if !ro {
            // What recovery read may be page cache the disk never got (a crash after a failed
            // fsync): only a sync of our own makes it durable before anything counts it so.
            let st = lock(&p.state);
            let f = &st.segments.last().unwrap().files;
            f.data.sync_data().at(&f.data_path)?;
        }
        Ok(p)
    }

    /// The partition folder's segment data files, index files and truncation intent; removes
    /// temporary files a crash left (when writable) and reports files Waltz did not write.
    fn list_files(
        fs: &dyn FileSystem,
        dir: &Path,
        ro: bool,
        report: &mut RecoveryReport,
    ) -> Result<(Vec<i64>, Vec<i64>, Option<i64>)> {
        let mut segs: Vec<i64> = Vec::new();
        let mut idxs: Vec<i64> = Vec::new();
        let mut intent: Option<i64> = None;
        for path in fs.list_dir(dir).at(dir)? {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
            if let Some(t) = parse_segment_name(&name, "seg") {
                segs.push(t);
            } else if let Some(t) = parse_segment_name(&name, "idx") {
                idxs.push(t);
            } else if name == RESTART_INTENT {
                // Finished before listing (`open`); a read-only open refused it.
            } else if name == TRUNCATE_INTENT {
                let mut b = [0u8; 12];
                let f = fs.open(&path, false).at(&path)?;
                let n = f.read_full_at(&mut b, 0).at(&path)?;
                // A truncation keeps ids up to its target, -1 (nothing) at the lowest.
                if n == 12 && crc32(&b[0..8]) == be_u32(&b[8..12]) && be_i64(&b[0..8]) >= -1 {
                    intent = Some(be_i64(&b[0..8]));
                } else {
                    return Err(Error::corruption(&path, 0, "truncation intent file is damaged"));
                }
            } else if name.ends_with(".tmp") {
                // A file that never got renamed into place: its creation never completed.
                if !ro {
                    fs.remove_file(&path).at(&path)?;
                    report.removed_files.push(path);
                }
            } else {
                log::warn!("{}: ignoring a file Waltz did not write", path.display());
                report.foreign_files.push(path);
            }
        }
        Ok((segs, idxs, intent))
    }

    /// Removes index files without a data file, and the segments an unfinished truncation
    /// (`intent`) had started deleting; `segs` keeps the rest.
    #[allow(clippy::too_many_arguments)]
    fn drop_leftovers(
        fs: &dyn FileSystem,
        dir: &Path,
        ro: bool,
        segs: &mut Vec<i64>,
        idxs: Vec<i64>,
        intent: Option<i64>,
        report: &mut RecoveryReport,
    ) -> Result<()> {
        for t in idxs {
            if segs.binary_search(&t).is_err() && !ro {
                // Segments are deleted data file first, so an index alone is a leftover.
                let p = dir.join(index_name(t));
                fs.remove_file(&p).at(&p)?;
                report.removed_files.push(p);
            }
        }
        if let Some(t) = intent {
            let doomed: Vec<i64> = segs.iter().copied().filter(|&f| f > t.saturating_add(1) && f != segs[0]).collect();
            for f in doomed.iter().rev() {
                if !ro {
                    Self::delete_segment_files(fs, dir, *f)?;
                }
            }
            segs.retain(|f| !doomed.contains(f));
        }
        Ok(())
    }

    /// Recovers each segment in order; a corruption cut (repair) ends the log there and deletes
    /// the segments after it (when writable).
    fn recover_segments<'a>(
        fs: &dyn FileSystem,
        dir: &Path,
        ro: bool,
        segs: &mut Vec<i64>,
        intent: Option<i64>,
        ctx: impl Fn(i64, Option<i64>) -> SegmentContext<'a>,
        report: &mut RecoveryReport,
    ) -> Result<Vec<Segment>> {
        let mut segments: Vec<Segment> = Vec::with_capacity(segs.len());
        let mut cut: Option<usize> = None;
        // The highest first id a truncation intent keeps (see `doomed` above).
        let kept = intent.map_or(i64::MAX, |t| t.saturating_add(1));
        let mut i = 0;
        while i < segs.len() {
            let rec = match recover_segment(&ctx(segs[i], segs.get(i + 1).copied())) {
                Ok(rec) => rec,
                Err(_) if ro && Self::missed_by_listing(fs, dir, segs, i, kept)? => continue,
                Err(e) => return Err(e),
            };
            report.scanned_records += rec.scanned_records;
            match &rec.tail {
                Tail::Clean => {}
                Tail::Torn { offset, bytes, survivor, .. } => {
                    report.torn_bytes += bytes;
                    if let Some(s) = survivor {
                        report.torn_survivors = Some((rec.segment.files.data_path.clone(), *offset, *s));
                    }
                }
                Tail::CorruptionCut { offset, .. } => {
                    report.corruption_cut = Some((rec.segment.files.data_path.clone(), *offset));
                }
            }
            let stop = matches!(rec.tail, Tail::CorruptionCut { .. });
            segments.push(rec.segment);
            if stop {
                cut = Some(i);
                break;
            }
            i += 1;
        }
        if let Some(i) = cut {
            for f in segs[i + 1..].iter().rev() {
                if !ro {
                    Self::delete_segment_files(fs, dir, *f)?;
                }
            }
        }
        Ok(segments)
    }

    /// A partition over recovered segments, its tail ready for appends.
    fn recovered(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        id: i32,
        cluster_key: [u8; 16],
        opts: PartitionOptions,
        segments: Vec<Segment>,
        report: RecoveryReport,
    ) -> Partition {
        let next_txid = segments.last().unwrap().next_txid();
        // A writable recovery cut the tail's file to its records (and any preallocated zeros).
        let tail_allocated = segments.last().unwrap().end;
        Partition {
            id,
            dir: dir.to_path_buf(),
            fs,
            cluster_key,
            opts,
            state: Mutex::new(State {
                segments,
                next_txid,
                write_seq: 0,
                queue: WriteQueue::default(),
                tail_allocated,
                synced_end: tail_allocated,
                prealloc_retry_at: 0,
                zero_filled: false,
                mean_flush: 0,
                index_retry_at: 0,
                inflight: std::collections::VecDeque::new(),
                queued_appends: 0,
                leader_wants: 0,
                spare_requested: false,
                direct: direct::DirectTail::default(),
            }),
            sync: Mutex::new(SyncState { synced_seq: 0, leader: false, cut: Default::default() }),
            synced: Condvar::new(),
            enqueued: Condvar::new(),
            last_round: AtomicU64::new(1),
            last_sync_ns: AtomicU64::new(0),
            durable: AtomicI64::new(next_txid - 1),
            health: Arc::new(Health::default()),
            checkpointer: Checkpointer::default(),
            closed: AtomicBool::new(false),
            appends: AtomicU64::new(0),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            sync_micros: Histogram::default(),
            batch_records: Histogram::default(),
            reclaimed: AtomicU64::new(0),
            retention: Mutex::new(()),
            phases: Phases::default(),
            spare: SpareSlot::default(),
            next_hint: AtomicI64::new(next_txid),
            encode_buffers: Mutex::new(Vec::new()),
            recovery: report,
        }
    }

    /// Finishes the truncation to `t` a crash interrupted (in memory only, when read-only).
    fn finish_intent(&mut self, t: i64) -> Result<()> {
        let ro = self.opts.recover.read_only;
        let mut st = lock(&self.state);
        if t < st.next_txid - 1 {
            if ro {
                self.cut_in_memory(&mut st, t)?;
            } else {
                self.cut_files_after(&mut st, t)?;
            }
        }
        if !ro {
            self.finish_truncation(&mut st)?;
        }
        drop(st);
        self.recovery.finished_truncation = Some(t);
        Ok(())
    }

    fn delete_segment_files(fs: &dyn FileSystem, dir: &Path, first: i64) -> Result<()> {
        let d = dir.join(data_name(first));
        let i = dir.join(index_name(first));
        if fs.exists(&d) {
            fs.remove_file(&d).at(&d)?;
        }
        if fs.exists(&i) {
            fs.remove_file(&i).at(&i)?;
        }
        fs.sync_dir(dir).at(dir)
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed { partition: self.id });
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        self.check_open()?;
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        if self.health.is_poisoned() {
            return Err(self.poison_error());
        }
        Ok(())
    }

    fn poison_error(&self) -> Error {
        Error::PartitionFailed { partition: self.id, reason: self.health.reason().unwrap_or_default() }
    }

    fn poison(&self, err: Error) -> Error {
        self.health.poison(self.id, &err);
        // Wake waiters so they see the failure instead of waiting for a sync that won't come.
        let _g = lock(&self.sync);
        self.synced.notify_all();
        err
    }

    /// Makes every append so far durable, then writes the in-memory index tail to the index
    /// file and syncs it: the files are then as complete as after a clean close.
    pub fn flush_index(&self) -> Result<()> {
        if self.opts.recover.read_only || self.health.is_poisoned() {
            return Ok(());
        }
        self.settled_max_txid()?;
        self.write_index_tail()
    }

    /// Writes and syncs the tail's index entries for every durable record.
    fn write_index_tail(&self) -> Result<()> {
        let st = lock(&self.state);
        let files = &st.segments.last().unwrap().files;
        index::write_all_durable(&files.index, self.durable(files))
    }

    /// The segment's records that are durable: up to the acknowledged max transaction id.
    fn durable(&self, files: &SegmentFiles) -> Durable {
        Durable::first(self.durable_positions(files))
    }

    /// How many of the segment's first records are durable.
    fn durable_positions(&self, files: &SegmentFiles) -> u64 {
        (self.max_txid() + 1 - files.first_txid).max(0) as u64
    }

    /// After a sync: the tail's complete checkpoint windows of durable records go to the index
    /// file (synced in the background). Called under the state lock, so no append adds entries
    /// and no truncation cuts them meanwhile. A failed write (a full disk) only leaves the
    /// entries in memory for the next checkpoint: recovery proves every window it uses, and the
    /// appends themselves report the disk's state.
    fn write_checkpoint_windows(&self, st: &mut State) {
        let files = st.segments.last().unwrap().files.clone();
        let interval = self.opts.recover.checkpoint_interval.max(1);
        let synced = self.durable_positions(&files);
        if synced < st.index_retry_at {
            return;
        }
        match files.index.write_pending(interval, false, Durable::first(synced)) {
            Ok(true) => self.request_index_sync(files),
            Ok(false) => {}
            Err(e) => {
                log::warn!("partition {}: index checkpoint not written ({e}); kept in memory, tried again in {interval} records", self.id);
                st.index_retry_at = synced + interval;
            }
        }
    }

    /// Makes everything written durable, flushes the index tail and refuses further use of this
    /// handle. Appends waiting for a sync are answered by this one. It syncs as the sync leader:
    /// two concurrent fdatasyncs of one file could each miss the other's error, and a waiter
    /// whose own sync then succeeded would be acknowledged over a write the kernel lost. A
    /// failure poisons the partition, so nothing waiting on it is acknowledged.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.opts.recover.read_only {
            return;
        }
        self.acquire_leadership();
        if !self.health.is_poisoned() {
            if let Err(e) = self.sync_for_close() {
                log::warn!("partition {}: the sync on close failed ({e}); its unsynced records are discarded", self.id);
            }
        }
        if self.health.is_poisoned() {
            self.discard_unsynced();
        } else if let Err(e) = self.write_index_tail() {
            log::warn!("partition {}: index not flushed on close ({e}); the next open rebuilds it", self.id);
        }
        self.spare.discard(self.fs.as_ref(), &self.dir);
        self.release_leadership();
    }

    /// `close`'s data sync, as the sync leader.
    fn sync_for_close(&self) -> Result<()> {
        let mut st = lock(&self.state);
        self.flush_queue(&mut st)?;
        st.direct.release();
        let files = st.segments.last().unwrap().files.clone();
        // A closed log's files end at its last record; recovery would also accept the zeros.
        let end = st.segments.last().unwrap().end;
        if st.tail_allocated > end {
            files.data.set_len(end).at(&files.data_path).map_err(|e| self.poison(e))?;
            st.tail_allocated = end;
        }
        files.data.sync_data().at(&files.data_path).map_err(|e| self.poison(e))?;
        st.synced_end = end;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        let mut s = lock(&self.sync);
        let (seq, txid) = (st.write_seq, st.next_txid - 1);
        self.count_synced(&mut st, &mut s, seq, txid);
        self.synced.notify_all();
        Ok(())
    }

    /// A sync covering tickets up to `seq` (ids up to `txid`) succeeded: they are durable.
    fn count_synced(&self, st: &mut State, s: &mut SyncState, seq: u64, txid: i64) {
        s.synced_seq = s.synced_seq.max(seq);
        self.durable.fetch_max(txid, Ordering::AcqRel);
        while st.inflight.front().is_some_and(|(q, _)| *q <= seq) {
            st.inflight.pop_front();
        }
    }

    /// Zero-fills the tail's data file from `from` (where its written bytes end) to the next
    /// preallocation step, when `from` passed the preallocated space. Never fails an append: on
    /// an error (a disk too full for the zeros) the partial zeros are cut away and the records
    /// go on with writes that grow the file.
    fn preallocate(&self, st: &mut State, files: &SegmentFiles, from: u64, flushed: u64) -> Result<()> {
        if self.opts.preallocate == 0 {
            return Ok(());
        }
        st.mean_flush = if st.mean_flush == 0 { flushed } else { (st.mean_flush * 7 + flushed) / 8 };
        if from <= st.tail_allocated || from < st.prealloc_retry_at {
            return Ok(());
        }
        let step = zero_step(self.opts.preallocate, st.mean_flush);
        if flushed >= ZERO_FILL_MAX_FLUSH {
            // This flush grew the file: it now ends at the records.
            st.tail_allocated = from;
            return Ok(());
        }
        // Never far past the segment size: the file is cut back at the roll anyway.
        // At least half a step of zeros, so a flush that ends just short of a multiple of the
        // step does not leave the next one a few bytes to fill.
        let to = (from + step / 2).next_multiple_of(step).min(self.opts.segment_size.max(from));
        let t = self.phases.start();
        let zero_fill = || -> std::io::Result<()> {
            let mut at = from;
            while at < to {
                let n = ((to - at) as usize).min(ZEROS.len());
                files.data.write_all_at(&ZEROS[..n], at)?;
                at += n as u64;
            }
            Ok(())
        };
        let filled = zero_fill();
        st.zero_filled = true;
        self.phases.end(Phase::Prealloc, t);
        match filled {
            Ok(()) => st.tail_allocated = to,
            Err(e) => {
                log::warn!(
                    "partition {}: {}: could not preallocate {} bytes ({e}); writing without",
                    self.id,
                    files.data_path.display(),
                    to - from
                );
                files.data.set_len(from).at(&files.data_path)?;
                st.tail_allocated = from;
                st.prealloc_retry_at = from + step;
            }
        }
        Ok(())
    }

    pub fn is_failed(&self) -> Option<String> {
        if self.health.is_poisoned() {
            self.health.reason()
        } else {
            None
        }
    }

    /// The highest transaction id that is durable (-1 when empty).
    pub fn max_txid(&self) -> i64 {
        self.durable.load(Ordering::Acquire)
    }

    /// The highest transaction id once every append accepted so far is durable: what this
    /// replica holds for good. A recovery asks this after fencing older sessions out; an append
    /// of theirs accepted just before the fence but not yet synced is then counted (and cut if
    /// the vote says so), instead of landing after the vote above a log it did not see.
    pub fn settled_max_txid(&self) -> Result<i64> {
        let seq = lock(&self.state).write_seq;
        self.wait_synced(seq, false, false)?;
        Ok(self.max_txid())
    }

    /// The lowest transaction id still held (retention moves it up).
    pub fn first_txid(&self) -> i64 {
        lock(&self.state).segments[0].first_txid()
    }

    pub fn segment_count(&self) -> usize {
        lock(&self.state).segments.len()
    }

    pub fn stats(&self) -> PartitionStats {
        PartitionStats {
            appends: self.appends.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            sync_micros: self.sync_micros.snapshot(),
            batch_records: self.batch_records.snapshot(),
            phases: self.phases.snapshot(),
        }
    }

    /// Appends `records` as transactions `first_txid`, `first_txid + 1`, ... and returns the last
    /// id once it is durable. The ids must continue the partition exactly.
    pub fn append(&self, first_txid: i64, records: &[NewRecord<'_>]) -> Result<i64> {
        self.append_at_opt(Some(first_txid), records).map(|(_, last)| last)
    }

    /// Appends `records` at the partition's next ids, whatever they are, and returns the
    /// (first, last) ids once durable. Concurrent callers share fsyncs (group commit).
    pub fn append_next(&self, records: &[NewRecord<'_>]) -> Result<(i64, i64)> {
        self.append_at_opt(None, records)
    }

    pub fn append_at_opt(&self, first: Option<i64>, records: &[NewRecord<'_>]) -> Result<(i64, i64)> {
        let t = self.enqueue(first, records)?;
        self.wait_durable(t.seq)?;
        Ok((t.first, t.last))
    }

    /// `append_at_opt` for records whose data lies in `owner`: large records are written from
    /// there (the queue holds `owner` until they are written) instead of copied into the queue.
    pub fn append_shared(
        &self,
        first: Option<i64>,
        records: &[NewRecord<'_>],
        owner: &SharedData,
    ) -> Result<(i64, i64)> {
        let t = self.enqueue_with(first, records, Some(owner))?;
        self.wait_durable(t.seq)?;
        Ok((t.first, t.last))
    }

    /// The first half of an append, for pipelining: checks and queues the batch in order and
    /// returns at once. It is durable only once `wait_durable(ticket.seq)` returned Ok.
    pub fn enqueue(&self, first: Option<i64>, records: &[NewRecord<'_>]) -> Result<AppendTicket> {
        self.enqueue_with(first, records, None)
    }

    /// `append_at_opt` for a batch laid out as records already (`enqueue_laid`).
    pub fn append_laid(&self, first: Option<i64>, batch: &mut LaidBatch) -> Result<(i64, i64)> {
        let t = self.enqueue_laid(first, batch)?;
        self.wait_durable(t.seq)?;
        Ok((t.first, t.last))
    }

    /// `enqueue` for a batch laid out as records already: its ids are patched to where it lands
    /// and its buffer is written as it is (no copy for 4 KiB and up, no per-record encoding).
    pub fn enqueue_laid(&self, first: Option<i64>, batch: &mut LaidBatch) -> Result<AppendTicket> {
        self.enqueue_input(first, Input::Laid(batch))
    }

    fn enqueue_with(
        &self,
        first: Option<i64>,
        records: &[NewRecord<'_>],
        owner: Option<&SharedData>,
    ) -> Result<AppendTicket> {
        self.enqueue_input(first, Input::Records { records, owner })
    }

    fn enqueue_input(&self, first: Option<i64>, mut input: Input<'_>) -> Result<AppendTicket> {
        self.check_writable()?;
        let max = self.opts.recover.max_record_size;
        let (n, longest) = match &input {
            Input::Records { records, .. } => (records.len(), records.iter().map(|r| r.data.len()).max().unwrap_or(0)),
            Input::Laid(b) => (b.len(), b.max_data()),
        };
        if longest > max {
            return Err(Error::RecordTooLarge { size: longest, max });
        }
        let guess = || first.unwrap_or_else(|| self.next_hint.load(Ordering::Acquire));
        // A large batch is encoded before taking the lock (prefix CRCs, the copy: 90-130 µs for
        // 1,000 records of 1 KiB), at the ids given or, for `append_next`, at the partition's next
        // id as last seen; it is encoded again under the lock only if another append took those
        // ids meanwhile. A small one is encoded under the lock, straight into the queue: it takes
        // less than the detour, and concurrent small appends are where guessed ids go stale.
        // A laid-out batch is patched to the guessed ids here, and again under the lock on a race.
        let pre = match &mut input {
            Input::Records { records, owner } => {
                let bytes: usize = records.iter().map(|r| r.data.len()).sum();
                (bytes >= ENCODE_UNLOCKED_MIN).then(|| {
                    let guess = guess();
                    let t = self.phases.start();
                    let mut batch = WriteQueue::with_buffer(lock(&self.encode_buffers).pop().unwrap_or_default());
                    let mut offsets = Vec::with_capacity(records.len());
                    batch.push_batch(guess, records, *owner, &mut offsets);
                    self.phases.end(Phase::Encode, t);
                    (guess, batch, offsets)
                })
            }
            Input::Laid(b) => {
                let t = self.phases.start();
                b.set_first(guess());
                self.phases.end(Phase::Encode, t);
                None
            }
        };
        let seq = {
            let t = self.phases.start();
            let mut st = lock(&self.state);
            self.phases.end(Phase::LockWait, t);
            // Checked again under the lock: a failure may have happened while we waited for it.
            self.check_writable()?;
            let first_txid = first.unwrap_or(st.next_txid);
            if first_txid != st.next_txid {
                return Err(Error::NonDenseAppend { partition: self.id, expected: st.next_txid, got: first_txid });
            }
            if n == 0 {
                // Nothing to write, but durable only once everything queued before it is.
                return Ok(AppendTicket { seq: st.write_seq, first: first_txid, last: first_txid - 1 });
            }
            let needs_roll = {
                let tail = st.segments.last().unwrap();
                tail.count > 0 && tail.end >= self.opts.segment_size
            };
            if needs_roll {
                let t = self.phases.start();
                self.roll(&mut st).map_err(|e| self.poison(e))?;
                self.phases.end(Phase::Roll, t);
            }
            let t = self.phases.start();
            let encoded = match (input, pre) {
                (Input::Records { .. }, Some((guess, batch, offsets))) if guess == first_txid => {
                    Encoded::Before(batch, offsets)
                }
                (Input::Records { records, owner }, _) => Encoded::Here { first_txid, records, owner },
                (Input::Laid(b), _) => {
                    b.set_first(first_txid);
                    Encoded::Laid(b)
                }
            };
            self.write_batch(&mut st, n as u64, encoded).map_err(|e| self.poison(e))?;
            self.phases.end(Phase::Enqueue, t);
            st.write_seq += 1;
            let (seq, last) = (st.write_seq, first_txid + n as i64 - 1);
            st.inflight.push_back((seq, last));
            (seq, first_txid)
        };
        let (seq, first_txid) = seq;
        Ok(AppendTicket { seq, first: first_txid, last: first_txid + n as i64 - 1 })
    }

    /// Puts a batch of `n` records on the tail's write queue and its index entries on the
    /// in-memory index tail. Nothing touches the file here: the sync leader writes the whole queue
    /// in one write right before its fdatasync, so no append dirties the file while a sync runs
    /// (Linux's fdatasync would write those pages too).
    fn write_batch(&self, st: &mut State, n: u64, encoded: Encoded<'_>) -> Result<()> {
        let tail = st.segments.last().unwrap();
        let (logical_end, old_count, files) = (tail.end, tail.count, tail.files.clone());
        let mut p = files.index.pending.write().unwrap_or_else(|e| e.into_inner());
        // Kept on in production: a misplaced index tail would point reads at wrong records.
        if p.base + p.offsets.len() as u64 != old_count {
            return Err(Error::Invariant {
                partition: self.id,
                what: format!(
                    "index tail covers positions up to {} but the segment holds {} records",
                    p.base + p.offsets.len() as u64,
                    old_count
                ),
            });
        }
        let before = st.queue.len();
        let from = p.offsets.len();
        match encoded {
            Encoded::Before(batch, offsets) => {
                p.offsets.extend_from_slice(&offsets);
                st.queue.absorb(batch);
            }
            Encoded::Here { first_txid, records, owner } => {
                st.queue.push_batch(first_txid, records, owner, &mut p.offsets);
            }
            Encoded::Laid(b) => {
                p.offsets.extend(b.starts());
                st.queue.push_encoded(b.bytes(), b.ends());
            }
        }
        for o in &mut p.offsets[from..] {
            *o += logical_end;
        }
        drop(p);
        let written = st.queue.len() - before;
        st.queued_appends += 1;
        if st.leader_wants != 0 && st.queued_appends >= st.leader_wants {
            self.enqueued.notify_one();
        }
        let tail = st.segments.last_mut().unwrap();
        tail.end += written;
        tail.count += n;
        let half_full = tail.end >= self.opts.segment_size / 2;
        st.next_txid += n as i64;
        self.next_hint.store(st.next_txid, Ordering::Release);
        if half_full && !st.spare_requested {
            st.spare_requested = true;
            let zeros = self.opts.preallocate.min(self.opts.segment_size.saturating_sub(HEADER_LEN));
            self.spare.request(self.fs.clone(), &self.dir, zeros);
        }
        self.appends.fetch_add(1, Ordering::Relaxed);
        self.batch_records.observe(&BATCH_RECORDS_BOUNDS, n);
        self.records.fetch_add(n, Ordering::Relaxed);
        self.bytes.fetch_add(written, Ordering::Relaxed);
        Ok(())
    }

    /// Writes the queued batches to the tail's data file (one pwrite, or one pwritev when records
    /// are queued by reference). Called under the state lock, so file writes happen in id order.
    /// Index entries stay in memory until the records are synced (`write_checkpoint_windows`):
    /// writing them per append would also make every data fdatasync flush the index file's new
    /// blocks (ext4 ordered mode).
    fn flush_queue(&self, st: &mut State) -> Result<()> {
        if st.queue.is_empty() {
            return Ok(());
        }
        let tail = st.segments.last().unwrap();
        let files = tail.files.clone();
        let at = tail.end - st.queue.len();
        let written_end = tail.end;
        st.zero_filled = false;
        let t = self.phases.start();
        let result = self.write_queue(st, &files, at);
        self.phases.end(Phase::Write, t);
        let flushed = st.queue.len();
        let result = result.and_then(|padded| {
            self.preallocate(st, &files, written_end, flushed)?;
            // A direct write leaves zeros after the records up to its 4 KiB boundary.
            st.tail_allocated = st.tail_allocated.max(padded.unwrap_or(0));
            Ok(())
        });
        let mut reuse = Vec::new();
        st.queue.clear_into(&mut reuse);
        self.keep_buffers(reuse);
        // The queued bytes are gone whatever happened: nothing queued may be acknowledged now.
        result.map_err(|e| self.poison(e))
    }

    /// Keeps encoding buffers for the next appends (`enqueue_with`), at most ENCODE_BUFFERS_KEEP
    /// bytes of them.
    fn keep_buffers(&self, buffers: impl IntoIterator<Item = Vec<u8>>) {
        let mut pool = lock(&self.encode_buffers);
        let mut kept: usize = pool.iter().map(Vec::capacity).sum();
        for b in buffers {
            if kept + b.capacity() <= ENCODE_BUFFERS_KEEP {
                kept += b.capacity();
                pool.push(b);
            }
        }
    }

    /// Writes the queue at `at` so that the records written since the last completed fdatasync
    /// (from `synced_end`) end within `unsynced_bound` of it: recovery tells a write torn by a
    /// power loss from latent corruption by that bound (`segment::torn_write_with_survivors`). A
    /// queue that would pass it (a backlog of many MiB) is written in pieces of whole records with
    /// an fdatasync between them, under the state lock as a roll's sync is; the caller syncs the
    /// last piece. The check before each write stays on in production. A large queue in one piece
    /// goes past the page cache (`direct`); returns how far zeros may then follow the records.
    fn write_queue(&self, st: &mut State, files: &Arc<SegmentFiles>, at: u64) -> Result<Option<u64>> {
        let bound = unsynced_bound(self.opts.recover.max_record_size);
        let len = st.queue.len();
        if at >= st.synced_end && at + len <= st.synced_end + bound {
            let zeros_to = match st.direct.write(files, &st.queue, at).at(&files.data_path)? {
                direct::Flushed::Direct(padded) => return Ok(Some(padded)),
                direct::Flushed::Refused(padded) => Some(padded),
                direct::Flushed::NotDirect => None,
            };
            st.direct.forget(files);
            return st.queue.write_to(files.data.as_ref(), at).at(&files.data_path).map(|_| zeros_to);
        }
        st.direct.forget(files);
        let mut done = 0;
        while done < len {
            let room = (st.synced_end + bound).saturating_sub(at + done);
            match st.queue.record_end_within(done, room) {
                Some(to) if at + done >= st.synced_end => {
                    st.queue.write_range(files.data.as_ref(), at, done, to).at(&files.data_path)?;
                    done = to;
                }
                None if at + done > st.synced_end => {
                    files.data.sync_data().at(&files.data_path)?;
                    self.syncs.fetch_add(1, Ordering::Relaxed);
                    st.synced_end = at + done;
                }
                _ => {
                    return Err(Error::Invariant {
                        partition: self.id,
                        what: format!(
                            "records from offset {} would leave more than {bound} bytes unsynced after offset {}",
                            at + done,
                            st.synced_end
                        ),
                    })
                }
            }
        }
        Ok(None)
    }

    /// Seals the tail (its data and index synced whole) and starts the next segment.
    fn roll(&self, st: &mut State) -> Result<()> {
        self.flush_queue(st)?;
        let tail = st.segments.last().unwrap().files.clone();
        // A sealed segment ends at its last record (recovery proves it complete by that).
        let end = st.segments.last().unwrap().end;
        if st.tail_allocated > end {
            tail.data.set_len(end).at(&tail.data_path)?;
        }
        let durable = Durable::sync_data(&tail.data, &tail.data_path)?;
        // Its whole index only now: every record it points to is on the disk.
        tail.index.write_pending(1, true, durable)?;
        tail.index.sync()?;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        let header = Self::header(self.cluster_key, self.id, st.next_txid);
        let (seg, allocated) = match self.spare.take() {
            Some(s) => spare::install(s, self.fs.as_ref(), &self.dir, &header)?,
            None => {
                let seg = create_segment(self.fs.as_ref(), &self.dir, &header)?;
                let end = seg.end;
                (seg, end)
            }
        };
        st.tail_allocated = allocated;
        // The new header is synced (spare or not) and no record follows it yet.
        st.synced_end = seg.end;
        st.prealloc_retry_at = 0;
        st.index_retry_at = 0;
        st.spare_requested = false;
        st.direct.release();
        st.segments.push(seg);
        Ok(())
    }

    fn request_index_sync(&self, files: Arc<SegmentFiles>) {
        let (id, health) = (self.id, self.health.clone());
        self.checkpointer.request(
            id,
            files,
            move |e| health.poison(id, e),
            |e| {
                self.poison(e);
            },
        );
    }

    /// Commit delay: a new sync leader waits, at most as long as the last sync took and never more than
    /// MAX_COMMIT_DELAY, until as many appends are queued as the previous sync covered. With
    /// concurrent appenders this lets the woken ones re-enqueue before the snapshot, so each
    /// fsync keeps covering all of them; a lone appender (previous round of one) never waits, nor
    /// does a leader that was told nobody can join (`gather` false: `wait_durable_now`).
    fn gather_round<'a>(&self, mut st: MutexGuard<'a, State>, gather: bool) -> MutexGuard<'a, State> {
        let want = self.last_round.load(Ordering::Relaxed);
        if gather && want > 1 && st.queued_appends < want {
            let delay = Duration::from_nanos(self.last_sync_ns.load(Ordering::Relaxed)).min(MAX_COMMIT_DELAY);
            let deadline = Instant::now() + delay;
            st.leader_wants = want;
            while st.queued_appends < want {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                st = self.enqueued.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            }
            st.leader_wants = 0;
        }
        self.last_round.store(st.queued_appends.max(1), Ordering::Relaxed);
        st.queued_appends = 0;
        st
    }

    /// Blocks until the batch with this ticket sequence is durable (or the partition failed).
    pub fn wait_durable(&self, seq: u64) -> Result<()> {
        self.wait_synced(seq, true, true)
    }

    /// `wait_durable` for a caller that queued everything it had before waiting, and whose
    /// appends nobody else joins (a storage node's connection thread): the commit delay would
    /// only wait for appends that cannot come while it waits.
    pub fn wait_durable_now(&self, seq: u64) -> Result<()> {
        self.wait_synced(seq, false, true)
    }

    /// Waits until a sync covers ticket `seq`, leading one if nobody is. `own_ticket`: the
    /// caller holds that append's ticket, and learns here if a truncation cut it (anyone else
    /// waiting for the same point must not take that answer from it).
    fn wait_synced(&self, seq: u64, gather: bool, own_ticket: bool) -> Result<()> {
        let mut s = lock(&self.sync);
        loop {
            if own_ticket && s.cut.remove(&seq) {
                return Err(Error::AppendTruncated { partition: self.id });
            }
            if s.synced_seq >= seq {
                return Ok(());
            }
            if self.health.is_poisoned() {
                return Err(self.poison_error());
            }
            if s.leader {
                s = self.synced.wait(s).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            s.leader = true;
            drop(s);
            let (written, target_seq, target_txid, files, zero_filled, written_end) = {
                let t = self.phases.start();
                let mut st = self.gather_round(lock(&self.state), gather);
                self.phases.end(Phase::Gather, t);
                let w = self.flush_queue(&mut st);
                let zf = std::mem::take(&mut st.zero_filled);
                let tail = st.segments.last().unwrap();
                (w, st.write_seq, st.next_txid - 1, tail.files.clone(), zf, tail.end)
            };
            let started = Instant::now();
            let result = written.and_then(|_| files.data.sync_data().at(&files.data_path));
            let took = started.elapsed();
            let phase = if zero_filled { Phase::SyncZeros } else { Phase::Sync };
            self.phases.end(phase, phases::Timer::since(started, &self.phases));
            self.last_sync_ns.store(took.as_nanos() as u64, Ordering::Relaxed);
            self.sync_micros.observe(&SYNC_MICROS_BOUNDS, took.as_micros() as u64);
            self.syncs.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = result {
                let e = self.poison(e);
                let mut s2 = lock(&self.sync);
                s2.leader = false;
                self.synced.notify_all();
                drop(s2);
                return Err(e);
            }
            // A roll syncs the tail under the state lock; taking it here means any such sync has
            // finished, and poisoned the partition if it failed (its error may be the one this
            // sync did not see), before this sync counts as a success.
            let mut st = lock(&self.state);
            s = lock(&self.sync);
            s.leader = false;
            let counted = !self.health.is_poisoned();
            if counted {
                self.count_synced(&mut st, &mut s, target_seq, target_txid);
                // Unless a roll replaced the tail meanwhile (its own sync covered this one's bytes).
                if Arc::ptr_eq(&st.segments.last().unwrap().files, &files) {
                    st.synced_end = st.synced_end.max(written_end);
                }
            }
            drop(s);
            self.synced.notify_all();
            if counted {
                let t = self.phases.start();
                self.write_checkpoint_windows(&mut st);
                self.phases.end(Phase::Checkpoint, t);
            }
            drop(st);
            s = lock(&self.sync);
        }
    }

    /// Drops every transaction after `txid`, across segments. Crash-safe: the target is recorded
    /// in an intent file first, and an interrupted truncation is finished on the next open.
    /// Appends still in flight are made durable first; those it cuts fail with AppendTruncated.
    pub fn truncate(&self, txid: i64) -> Result<i64> {
        self.check_writable()?;
        self.acquire_leadership();
        let r = self.truncate_as_leader(txid);
        self.release_leadership();
        r
    }

    fn acquire_leadership(&self) {
        let mut s = lock(&self.sync);
        while s.leader {
            s = self.synced.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.leader = true;
    }

    fn release_leadership(&self) {
        let mut s = lock(&self.sync);
        s.leader = false;
        self.synced.notify_all();
    }

    fn truncate_as_leader(&self, txid: i64) -> Result<i64> {
        let mut st = lock(&self.state);
        // Again under the lock: a close or a failure may have happened while we waited.
        self.check_writable()?;
        let first = st.segments[0].first_txid();
        if txid < first - 1 {
            return Err(Error::BelowLogStart { partition: self.id, txid, first });
        }
        if txid >= st.next_txid - 1 {
            return Ok(st.next_txid - 1);
        }
        // Everything written so far becomes durable, so no acknowledgement can depend on bytes
        // this truncation removes without a sync.
        self.flush_queue(&mut st)?;
        let tail = st.segments.last().unwrap().files.clone();
        tail.data.sync_data().at(&tail.data_path).map_err(|e| self.poison(e))?;
        st.synced_end = st.segments.last().unwrap().end;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        {
            let mut s = lock(&self.sync);
            let acknowledged = s.synced_seq;
            s.synced_seq = st.write_seq;
            self.durable.fetch_max(st.next_txid - 1, Ordering::AcqRel);
            for (seq, last) in std::mem::take(&mut st.inflight) {
                if seq > acknowledged && last > txid {
                    s.cut.insert(seq);
                }
            }
        }
        let intent = self.dir.join(TRUNCATE_INTENT);
        write_file_atomically(self.fs.as_ref(), &intent, &encode_intent(txid))
            .at(&intent)
            .map_err(|e| self.poison(e))?;
        self.cut_files_after(&mut st, txid).map_err(|e| self.poison(e))?;
        self.finish_truncation(&mut st).map_err(|e| self.poison(e))?;
        Ok(txid)
    }

    fn finish_truncation(&self, _st: &mut State) -> Result<()> {
        let intent = self.dir.join(TRUNCATE_INTENT);
        if self.fs.exists(&intent) {
            self.fs.remove_file(&intent).at(&intent)?;
        }
        let tmp = tmp_path(&intent);
        if self.fs.exists(&tmp) {
            self.fs.remove_file(&tmp).at(&tmp)?;
        }
        self.fs.sync_dir(&self.dir).at(&self.dir)
    }

    /// Removes every record after `txid` from the files (the queue must be empty). The cut
    /// point is located from the data, never from an unverified index entry.
    fn cut_files_after(&self, st: &mut State, txid: i64) -> Result<()> {
        debug_assert!(st.queue.is_empty());
        // The tail's last block may be cut, or go with its segment.
        st.direct.release();
        while st.segments.len() > 1 && st.segments.last().unwrap().first_txid() > txid + 1 {
            let seg = st.segments.pop().unwrap();
            Self::delete_segment_files(self.fs.as_ref(), &self.dir, seg.first_txid())?;
        }
        let max = self.opts.recover.max_record_size;
        let tail = st.segments.last_mut().unwrap();
        let keep = (txid + 1 - tail.first_txid()).max(0) as u64;
        // Cut even when no record goes: preallocated zeros may follow the records, and the
        // bytes after the new end must be nothing or zeros, never an old record that a new,
        // shorter one could leave readable behind it.
        let new_end = if keep < tail.count { locate(&tail.files, keep, tail.end, max)? } else { tail.end };
        let f = &tail.files;
        if keep < tail.count || f.data.len().at(&f.data_path)? > new_end {
            f.data.set_len(new_end).at(&f.data_path)?;
            f.data.sync_data().at(&f.data_path)?;
        }
        if keep < tail.count {
            f.index.truncate(keep)?;
            tail.count = keep;
            tail.end = new_end;
        }
        st.tail_allocated = new_end;
        // Cut and synced (or synced before it, by a truncation): nothing after it is written.
        st.synced_end = new_end;
        st.prealloc_retry_at = 0;
        st.index_retry_at = 0;
        st.next_txid = tail.next_txid();
        self.next_hint.store(st.next_txid, Ordering::Release);
        self.durable.fetch_min(st.next_txid - 1, Ordering::AcqRel);
        Ok(())
    }

    /// A read-only view of a pending truncation: the same cut, in memory only.
    fn cut_in_memory(&self, st: &mut State, txid: i64) -> Result<()> {
        let max = self.opts.recover.max_record_size;
        let tail = st.segments.last_mut().unwrap();
        let keep = (txid + 1 - tail.first_txid()).max(0) as u64;
        if keep < tail.count {
            tail.end = locate(&tail.files, keep, tail.end, max)?;
            tail.count = keep;
            let mut p = tail.files.index.pending.write().unwrap_or_else(|e| e.into_inner());
            if keep < p.base {
                p.base = keep;
                p.offsets.clear();
            } else {
                let k = (keep - p.base) as usize;
                p.offsets.truncate(k);
            }
        }
        st.next_txid = tail.next_txid();
        self.next_hint.store(st.next_txid, Ordering::Release);
        self.durable.fetch_min(st.next_txid - 1, Ordering::AcqRel);
        Ok(())
    }

    /// After a write or sync failure: forget queued bytes and cut the files back to the last
    /// successful sync, so unsynced records (whose pages the kernel may have marked clean
    /// without writing them) do not come back as durable when the partition is reopened.
    fn discard_unsynced(&self) {
        let mut st = lock(&self.state);
        st.queue.clear();
        let durable = self.max_txid();
        if durable < st.next_txid - 1 {
            if let Err(e) = self.cut_files_after(&mut st, durable) {
                log::error!("partition {}: could not discard records after {durable}: {e}", self.id);
            }
        }
    }

    /// Deletes whole segments that hold only transactions below `txid` (never the last one).
    /// Returns the partition's new first transaction id.
    ///
    /// Off the append path: the doomed segments leave the partition's state under its lock
    /// (reads from then on start at the new first id), and their files are unlinked after the
    /// lock is released, lowest first, so a crash leaves a log that starts at some segment
    /// boundary. Readers that already hold a doomed segment keep its open file until they are
    /// done. A failed unlink is returned, not poisoning: the segments not yet deleted go back at
    /// the head of the log, which they still continue.
    pub fn drop_segments_before(&self, txid: i64) -> Result<i64> {
        self.drop_segments_paced(txid, None, &|| false)
    }

    /// `drop_segments_before`, freeing at most `rate` bytes per second (None: as fast as the
    /// file system goes). Freeing blocks is journal work, and an append's fdatasync that needs
    /// the journal waits behind it: at full speed a 5 GiB deletion doubled the appends' p99
    /// (docs/performance.md, "Retention"); paced, the journal commits stay small and spaced.
    /// Once `stop` returns true (or the partition closes) the segments not yet taken out of the
    /// log go back at its head; the one being freed is removed when the partition next opens.
    pub fn drop_segments_paced(&self, txid: i64, rate: Option<u64>, stop: &dyn Fn() -> bool) -> Result<i64> {
        self.check_writable()?;
        let _one = lock(&self.retention);
        let doomed: Vec<Segment> = {
            let mut st = lock(&self.state);
            self.check_writable()?;
            let n = st.segments.iter().skip(1).take_while(|s| s.first_txid() <= txid).count();
            st.segments.drain(..n).collect()
        };
        let stopped = || stop() || self.closed.load(Ordering::Acquire);
        let mut pace = Pace { rate: rate.filter(|r| *r > 0), began: Instant::now(), freed: 0, stop: &stopped };
        for (i, seg) in doomed.iter().enumerate() {
            if stopped() {
                let mut st = lock(&self.state);
                st.segments.splice(0..0, doomed[i..].to_vec());
                break;
            }
            let bytes = Self::disk_bytes(seg);
            if let Err(e) = Self::retire_segment(self.fs.as_ref(), &self.dir, seg.first_txid(), &mut pace) {
                let mut st = lock(&self.state);
                let back: Vec<Segment> = doomed[i..].to_vec();
                st.segments.splice(0..0, back);
                return Err(e);
            }
            self.reclaimed.fetch_add(bytes, Ordering::Relaxed);
        }
        Ok(self.first_txid())
    }

    /// Takes a head segment out of the log with one rename (its data file becomes a `.tmp`, which
    /// an open removes: a file whose creation never completed), then frees its blocks a few MiB at
    /// a time before unlinking it. Unlinking a whole segment frees it in one journal transaction,
    /// and every append's fdatasync that needs the journal then waits behind it (a p99 of 18 ms
    /// while 5 GiB went, docs/performance.md). Once renamed the segment is gone whatever follows:
    /// a failure after that is only logged.
    fn retire_segment(fs: &dyn FileSystem, dir: &Path, first: i64, pace: &mut Pace<'_>) -> Result<()> {
        let d = dir.join(data_name(first));
        let doomed = tmp_path(&d);
        fs.rename(&d, &doomed).at(&d)?;
        fs.sync_dir(dir).at(dir)?;
        let rest = (|| {
            let i = dir.join(index_name(first));
            if fs.exists(&i) {
                fs.remove_file(&i).at(&i)?;
            }
            let f = fs.open(&doomed, true).at(&doomed)?;
            let mut len = f.len().at(&doomed)?;
            while len > Pace::STEP {
                if !pace.wait() {
                    return Err(std::io::Error::other("stopped")).at(&doomed);
                }
                len -= Pace::STEP;
                f.set_len(len).at(&doomed)?;
            }
            pace.wait();
            drop(f);
            fs.remove_file(&doomed).at(&doomed)
        })();
        if let Err(e) = rest {
            log::warn!("{}: freeing a deleted segment: {e} (removed when the partition next opens)", d.display());
        }
        Ok(())
    }

    /// Every segment's span, oldest first; the creation times are read from the segments'
    /// headers, outside the state lock.
    pub fn segment_spans(&self) -> Result<Vec<SegmentSpan>> {
        self.check_open()?;
        let segs: Vec<Segment> = lock(&self.state).segments.clone();
        let mut out = Vec::with_capacity(segs.len());
        for s in &segs {
            let mut b = [0u8; 12];
            let got = s.files.data.read_full_at(&mut b, 0).at(&s.files.data_path)?;
            let creation_ms = if got == b.len() { be_i64(&b[4..12]) } else { -1 };
            out.push(SegmentSpan {
                first_txid: s.first_txid(),
                next_txid: s.next_txid(),
                bytes: Self::disk_bytes(s),
                creation_ms,
            });
        }
        Ok(out)
    }

    fn disk_bytes(s: &Segment) -> u64 {
        let index = s.files.index.file.as_ref().and_then(|f| f.len().ok()).unwrap_or(0);
        s.files.data.len().unwrap_or(s.end) + index
    }

    /// Bytes of segment files retention deleted since the partition was opened.
    pub fn reclaimed_bytes(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
    }

    fn snapshot(&self, from: i64) -> Result<(Vec<Segment>, i64)> {
        self.check_open()?;
        let st = lock(&self.state);
        let first = st.segments[0].first_txid();
        if from < first {
            return Err(Error::BelowLogStart { partition: self.id, txid: from, first });
        }
        let i = st.segments.partition_point(|s| s.first_txid() <= from).saturating_sub(1);
        Ok((st.segments[i..].to_vec(), self.max_txid()))
    }

    /// Visits records `from..=to` in order, reading the data files sequentially in large chunks
    /// and checking both checksums of every record. Stops early when `f` returns false.
    /// A damaged record ends the visit quietly when records were already visited, so the caller
    /// gets the good prefix and the next read, starting at the damaged record, gets the error.
    pub fn visit(
        &self,
        from: i64,
        to: i64,
        mut f: impl FnMut(&RecordHeader, &[u8]) -> bool,
        chunk_hint: usize,
    ) -> Result<()> {
        let (segs, durable) = self.snapshot(from)?;
        let to = to.min(durable);
        let max = self.opts.recover.max_record_size;
        let mut txid = from;
        let chunk = chunk_hint.clamp(READ_CHUNK_MIN, READ_CHUNK_MAX);
        let mut scratch = ReadBuf::take();
        let buf = &mut scratch.0;
        for seg in &segs {
            if txid > to {
                break;
            }
            if txid >= seg.next_txid() {
                continue;
            }
            let files = &seg.files;
            let mut pos = locate(files, (txid - seg.first_txid()) as u64, seg.end, max)?;
            let mut cap = chunk;
            while txid <= to && txid < seg.next_txid() {
                let want = ((seg.end.saturating_sub(pos)) as usize).min(cap);
                buf.resize(want, 0);
                let got = files.data.read_full_at(buf, pos).at(&files.data_path)?;
                let mut i = 0usize;
                while txid <= to && txid < seg.next_txid() {
                    match check_record(&buf[i..got], Some(txid), max) {
                        Ok(v) => {
                            let data = &buf[i + v.data_start..i + v.data_start + v.data_len];
                            if !f(&v.header, data) {
                                return Ok(());
                            }
                            i += v.total_len();
                            txid += 1;
                        }
                        Err(Invalid::Short { needed, .. }) if got == want && pos + i as u64 + needed <= seg.end => {
                            if i == 0 {
                                cap = cap.max(needed as usize);
                            }
                            break;
                        }
                        Err(_) if txid > from => return Ok(()),
                        Err(e) => {
                            return Err(Error::corruption(
                                &files.data_path,
                                pos + i as u64,
                                format!("reading transaction {txid}: {e}"),
                            ))
                        }
                    }
                }
                pos += i as u64;
            }
        }
        Ok(())
    }

    pub fn read_records(&self, from: i64, max_count: usize, max_bytes: usize) -> Result<Vec<Record>> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        self.visit(
            from,
            i64::MAX,
            |h, data| {
                if out.len() >= max_count || (!out.is_empty() && bytes + data.len() > max_bytes) {
                    return false;
                }
                bytes += data.len();
                out.push(Record { txid: h.txid, req_id: h.req_id, header: h.header, data: data.to_vec() });
                true
            },
            max_bytes.saturating_add(max_count.saturating_mul(RECORD_OVERHEAD)),
        )?;
        Ok(out)
    }

    pub fn read_headers(&self, from: i64, max_count: usize) -> Result<Vec<RecordHeader>> {
        let mut out = Vec::new();
        self.visit(
            from,
            i64::MAX,
            |h, _| {
                if out.len() >= max_count {
                    return false;
                }
                out.push(*h);
                true
            },
            READ_CHUNK_MAX,
        )?;
        Ok(out)
    }

    pub fn read_record(&self, txid: i64) -> Result<Option<Record>> {
        let mut out = None;
        self.visit(
            txid,
            txid,
            |h, data| {
                out = Some(Record { txid: h.txid, req_id: h.req_id, header: h.header, data: data.to_vec() });
                false
            },
            READ_CHUNK_MIN,
        )?;
        Ok(out)
    }

    pub fn read_header(&self, txid: i64) -> Result<Option<RecordHeader>> {
        let mut out = None;
        self.visit(
            txid,
            txid,
            |h, _| {
                out = Some(*h);
                false
            },
            READ_CHUNK_MIN,
        )?;
        Ok(out)
    }

    /// Records `from..=to` as columns, stopping before `max_bytes` of data (but always at least
    /// one record) or `max_count` records.
    pub fn scan(&self, from: i64, to: i64, max_count: usize, max_bytes: usize) -> Result<Columns> {
        let mut c = Columns::default();
        c.offsets.push(0);
        // Grown by doubling, the column would be copied about once more and fault in fresh
        // pages twice; untouched reserved pages cost nothing.
        c.payload.reserve(max_bytes.min(64 << 20));
        self.visit(
            from,
            to,
            |h, data| {
                if c.txids.len() >= max_count || (!c.txids.is_empty() && c.payload.len() + data.len() > max_bytes) {
                    return false;
                }
                c.txids.push(h.txid);
                c.headers.push(h.header);
                c.client_ids.push(h.req_id.client_id);
                c.generations.push(h.req_id.generation);
                c.req_partitions.push(h.req_id.partition_id);
                c.sequences.push(h.req_id.sequence);
                c.payload.extend_from_slice(data);
                c.offsets.push(c.payload.len() as i32);
                true
            },
            // Read about what the caller takes: a fixed READ_CHUNK_MAX per call read up to 8 MiB
            // from disk for a 1 MiB scan and threw the rest away.
            max_bytes.saturating_add(READ_CHUNK_MIN),
        )?;
        Ok(c)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.close();
    }
}

pub fn default_options() -> PartitionOptions {
    PartitionOptions {
        segment_size: 1 << 30,
        preallocate: DEFAULT_PREALLOCATE,
        recover: RecoverOptions {
            checkpoint_interval: 1000,
            max_record_size: 16 << 20,
            read_only: false,
            mode: RecoveryMode::Strict,
            low_water_mark: -1,
        },
    }
}

#[cfg(test)]
mod direct_tests;

#[cfg(test)]
mod faults;

#[cfg(test)]
mod prealloc;

#[cfg(test)]
mod order;

#[cfg(test)]
mod torn;

#[cfg(test)]
mod tests;
