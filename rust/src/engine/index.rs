//! Index checkpointing: a segment's `.idx` file holds one i64 offset per record, written in
//! windows of `checkpoint_interval` entries once the records they point at are durable, synced
//! in the background, and trusted on open only after each window is proven against the data.
//! Entries not yet in the file stay in memory (`PendingIndex`) and are rebuilt by recovery.
//! This module knows the index file and the data file's bytes, never a segment: the segment
//! (`segment.rs`) owns one `SegmentIndex` and lends the index what it reads of the data.
use crate::engine::error::{Error, IoContext, Result};
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::FileHandle;
use crate::engine::record::{be_i64, parse_prefix, RECORD_OVERHEAD};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Index syncs are at most this often (see `run_checkpointer`).
const INDEX_SYNC_INTERVAL: Duration = Duration::from_millis(250);

/// How many of a segment's first records a successful fdatasync of its data file covers. It is
/// the only way an index entry reaches the file (`SegmentIndex::write_pending` writes none past
/// it), which keeps the rule "an index entry never lands before its record is synced" in one
/// place: recovery checks a window's record prefixes and its last record, not every byte in
/// between, so a window written ahead of its data could survive a power loss that took the
/// data, and point recovery at records that were never durable.
#[derive(Clone, Copy, Debug)]
pub struct Durable(u64);

impl Durable {
    /// The segment's first `n` records, which the caller knows durable: the partition counts
    /// a record durable only after a sync that covered it succeeded.
    pub(crate) fn first(n: u64) -> Durable {
        Durable(n)
    }

    /// Syncs the segment's data file (`data`, at `data_path`); every record in it is then durable.
    pub fn sync_data(data: &Arc<dyn FileHandle>, data_path: &Path) -> Result<Durable> {
        data.sync_data().at(data_path)?;
        Ok(Durable(u64::MAX))
    }

    /// `end` (a count of records with entries), cut at what is durable.
    fn limit(self, end: u64) -> u64 {
        end.min(self.0)
    }
}

/// Index entries not (yet) in the index file: those written since the last checkpoint, or, in a
/// read-only open, those recovery rebuilt. Entries cover segment positions [base, base + len).
#[derive(Debug, Default)]
pub struct PendingIndex {
    pub base: u64,
    pub offsets: Vec<u64>,
}

/// A segment's index: the `.idx` file (None in a read-only open of a missing or unusable one)
/// and the entries not yet in it.
pub struct SegmentIndex {
    pub path: PathBuf,
    pub file: Option<Arc<dyn FileHandle>>,
    pub pending: RwLock<PendingIndex>,
}

impl SegmentIndex {
    /// Byte offset in the data file of the record at position `i` of this segment.
    pub fn offset_of(&self, i: u64) -> Result<u64> {
        {
            let p = self.pending.read().unwrap_or_else(|e| e.into_inner());
            if i >= p.base && i - p.base < p.offsets.len() as u64 {
                return Ok(p.offsets[(i - p.base) as usize]);
            }
        }
        let idx = self.file.as_ref().ok_or_else(|| Error::corruption(&self.path, 0, "index entry not available"))?;
        let mut b = [0u8; 8];
        let pos = HEADER_LEN + 8 * i;
        let n = idx.read_full_at(&mut b, pos).at(&self.path)?;
        if n != 8 {
            return Err(Error::corruption(&self.path, pos, "index entry missing"));
        }
        let off = be_i64(&b);
        // Range-checked so no later offset arithmetic can overflow on a damaged entry.
        if off < HEADER_LEN as i64 || off > (1i64 << 48) {
            return Err(Error::corruption(&self.path, pos, format!("index entry {off} is out of range")));
        }
        Ok(off as u64)
    }

    /// Writes pending entries up to the last multiple of `interval` (all of them when `all`) to
    /// the index file, never for positions `durable` does not cover (see `Durable`).
    /// Returns whether anything was written; the caller syncs the index.
    pub fn write_pending(&self, interval: u64, all: bool, durable: Durable) -> Result<bool> {
        let idx = match &self.file {
            Some(i) => i,
            None => return Ok(false),
        };
        let mut p = self.pending.write().unwrap_or_else(|e| e.into_inner());
        let end = durable.limit(p.base + p.offsets.len() as u64);
        let upto = if all { end } else { (end / interval) * interval };
        if upto <= p.base {
            return Ok(false);
        }
        let file_len = idx.len().at(&self.path)?;
        if file_len != HEADER_LEN + 8 * p.base {
            return Err(Error::corruption(
                &self.path,
                file_len,
                format!(
                    "index file holds {} entries, expected {} (internal invariant)",
                    (file_len.saturating_sub(HEADER_LEN)) / 8,
                    p.base
                ),
            ));
        }
        let n = (upto - p.base) as usize;
        let mut buf = Vec::with_capacity(n * 8);
        for o in &p.offsets[..n] {
            buf.extend_from_slice(&(*o as i64).to_be_bytes());
        }
        if let Err(e) = idx.write_all_at(&buf, HEADER_LEN + 8 * p.base) {
            // Part of the window may be in the file: cut it back, so the file keeps ending at
            // `base` and a later write can retry these entries.
            let _ = idx.set_len(file_len);
            return Err(e).at(&self.path);
        }
        p.offsets.drain(..n);
        p.base = upto;
        Ok(true)
    }

    /// Drops index entries at positions >= `keep`, in the file and in memory.
    pub fn truncate(&self, keep: u64) -> Result<()> {
        let mut p = self.pending.write().unwrap_or_else(|e| e.into_inner());
        if keep < p.base {
            if let Some(idx) = &self.file {
                idx.set_len(HEADER_LEN + 8 * keep).at(&self.path)?;
                idx.sync_data().at(&self.path)?;
            }
            p.base = keep;
            p.offsets.clear();
        } else {
            let k = (keep - p.base) as usize;
            p.offsets.truncate(k);
        }
        Ok(())
    }

    /// Syncs the index file, when there is one.
    pub fn sync(&self) -> Result<()> {
        if let Some(idx) = &self.file {
            idx.sync_data().at(&self.path)?;
        }
        Ok(())
    }
}

/// Checks index entries [lo, hi): each points at a record with the right id, each record starts
/// where the previous one ends, and the last is whole and valid. Returns the end of the last.
/// `data` is the segment's data file; `read_record(offset, txid)` validates the record there
/// whole and returns its length.
#[allow(clippy::too_many_arguments)]
pub(crate) fn verify_window(
    index: &SegmentIndex,
    data: &Arc<dyn FileHandle>,
    lo: u64,
    hi: u64,
    first: i64,
    max: usize,
    data_len: u64,
    read_record: impl FnOnce(u64, i64) -> Result<usize>,
) -> Option<u64> {
    let idx = index.file.as_ref()?;
    let mut raw = vec![0u8; ((hi - lo) * 8) as usize];
    if idx.read_full_at(&mut raw, HEADER_LEN + 8 * lo).ok()? != raw.len() {
        return None;
    }
    let mut prev_end: Option<u64> = None;
    for (j, chunk) in raw.chunks_exact(8).enumerate() {
        let off = be_i64(chunk);
        if off < HEADER_LEN as i64 || off as u64 + RECORD_OVERHEAD as u64 > data_len {
            return None;
        }
        let off = off as u64;
        if let Some(p) = prev_end {
            if p != off {
                return None;
            }
        }
        let mut prefix = [0u8; 36];
        data.read_full_at(&mut prefix, off).ok()?;
        let (h, len, _) = parse_prefix(&prefix, max).ok()?;
        if h.txid != first + (lo + j as u64) as i64 {
            return None;
        }
        prev_end = Some(off + (RECORD_OVERHEAD + len) as u64);
    }
    let last_off = index.offset_of(hi - 1).ok()?;
    let total = read_record(last_off, first + (hi - 1) as i64).ok()?;
    Some(last_off + total as u64)
}

/// Syncs index files written at checkpoints, off the acknowledgement path: recovery verifies
/// every checkpoint window against the data before trusting it, so these syncs only bound how
/// much a recovery after power loss rescans. A failure still stops the partition.
/// Index syncs are coalesced to at most one per INDEX_SYNC_INTERVAL: each costs the concurrent
/// data fdatasyncs a journal commit (measured: +40% latency at one checkpoint per append), and
/// it only shortens a recovery after power loss, by at most this interval's worth of appends.
fn run_checkpointer<T: AsRef<SegmentIndex>>(rx: mpsc::Receiver<Arc<T>>, poison: impl Fn(&Error)) {
    let mut last_sync: Option<Instant> = None;
    while let Ok(first) = rx.recv() {
        if let Some(t) = last_sync {
            let next = t + INDEX_SYNC_INTERVAL;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
        }
        last_sync = Some(Instant::now());
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        batch.dedup_by(|a, b| Arc::ptr_eq(a, b));
        for files in batch {
            if let Err(e) = (*files).as_ref().sync() {
                poison(&e);
            }
        }
    }
}

/// The thread that syncs a partition's index files after checkpoint windows were written
/// (`run_checkpointer`), started on the first request. It is handed what owns the index
/// (a segment's files) and keeps that alive until the index is synced.
pub(crate) struct Checkpointer<T>(Mutex<Option<mpsc::Sender<Arc<T>>>>);

impl<T> Default for Checkpointer<T> {
    fn default() -> Self {
        Checkpointer(Mutex::new(None))
    }
}

impl<T: AsRef<SegmentIndex> + Send + Sync + 'static> Checkpointer<T> {
    /// Has `files`' index synced in the background. A failed sync calls `poison_from_thread`
    /// there; with no thread to spare the index is synced here, and a failure calls `poison`.
    pub(crate) fn request(
        &self,
        partition: i32,
        files: Arc<T>,
        poison_from_thread: impl Fn(&Error) + Send + 'static,
        poison: impl FnOnce(Error),
    ) {
        let mut tx = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (sender, rx) = mpsc::channel();
            let spawned = std::thread::Builder::new()
                .name(format!("waltz-checkpoint-{partition}"))
                .spawn(move || run_checkpointer(rx, poison_from_thread));
            match spawned {
                Ok(_) => *tx = Some(sender),
                Err(e) => {
                    // No thread to spare: sync inline rather than skip the checkpoint.
                    log::warn!("partition {partition}: no checkpointer thread ({e}); syncing the index inline");
                    if let Err(e) = (*files).as_ref().sync() {
                        poison(e);
                    }
                    return;
                }
            }
        }
        if let Some(tx) = tx.as_ref() {
            let _ = tx.send(files);
        }
    }
}

/// Writes the segment's index entries for every durable record and syncs the index file when
/// anything was written: the index is then as complete as after a clean close.
pub(crate) fn write_all_durable(index: &SegmentIndex, durable: Durable) -> Result<()> {
    if index.write_pending(1, true, durable)? {
        index.sync()?;
    }
    Ok(())
}
