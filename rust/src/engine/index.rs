//! Index checkpointing: a segment's `.idx` file holds one i64 offset per record, written in
//! windows of `checkpoint_interval` entries once the records they point at are durable, synced
//! in the background, and trusted on open only after each window is proven against the data.
//! Entries not yet in the file stay in memory (`PendingIndex`) and are rebuilt by recovery.
use crate::engine::error::{Error, IoContext, Result};
use crate::engine::format::HEADER_LEN;
use crate::engine::record::{be_i64, parse_prefix, RECORD_OVERHEAD, RECORD_PREFIX};
use crate::engine::segment::{read_record_at, SegmentFiles};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// Index syncs are at most this often (see `run_checkpointer`).
const INDEX_SYNC_INTERVAL: Duration = Duration::from_millis(250);

/// How many of a segment's first records a successful fdatasync of its data file covers. It is
/// the only way an index entry reaches the file (`SegmentFiles::write_pending` writes none past
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

    /// Syncs the segment's data file; every record in it is then durable.
    pub fn sync_data(files: &SegmentFiles) -> Result<Durable> {
        files.data.sync_data().at(&files.data_path)?;
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

impl SegmentFiles {
    /// Byte offset in the data file of the record at position `i` of this segment.
    pub fn offset_of(&self, i: u64) -> Result<u64> {
        {
            let p = self.pending.read().unwrap_or_else(|e| e.into_inner());
            if i >= p.base && i - p.base < p.offsets.len() as u64 {
                return Ok(p.offsets[(i - p.base) as usize]);
            }
        }
        let idx =
            self.index.as_ref().ok_or_else(|| Error::corruption(&self.index_path, 0, "index entry not available"))?;
        let mut b = [0u8; 8];
        let pos = HEADER_LEN + 8 * i;
        let n = idx.read_full_at(&mut b, pos).at(&self.index_path)?;
        if n != 8 {
            return Err(Error::corruption(&self.index_path, pos, "index entry missing"));
        }
        let off = be_i64(&b);
        // Range-checked so no later offset arithmetic can overflow on a damaged entry.
        if off < HEADER_LEN as i64 || off > (1i64 << 48) {
            return Err(Error::corruption(&self.index_path, pos, format!("index entry {off} is out of range")));
        }
        Ok(off as u64)
    }

    /// Writes pending entries up to the last multiple of `interval` (all of them when `all`) to
    /// the index file, never for positions `durable` does not cover (see `Durable`).
    /// Returns whether anything was written; the caller syncs the index.
    pub fn write_pending(&self, interval: u64, all: bool, durable: Durable) -> Result<bool> {
        let idx = match &self.index {
            Some(i) => i,
            None => return Ok(false),
        };
        let mut p = self.pending.write().unwrap_or_else(|e| e.into_inner());
        let end = durable.limit(p.base + p.offsets.len() as u64);
        let upto = if all { end } else { (end / interval) * interval };
        if upto <= p.base {
            return Ok(false);
        }
        let file_len = idx.len().at(&self.index_path)?;
        if file_len != HEADER_LEN + 8 * p.base {
            return Err(Error::corruption(
                &self.index_path,
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
            return Err(e).at(&self.index_path);
        }
        p.offsets.drain(..n);
        p.base = upto;
        Ok(true)
    }

    /// Drops index entries at positions >= `keep`, in the file and in memory.
    pub fn truncate_index(&self, keep: u64) -> Result<()> {
        let mut p = self.pending.write().unwrap_or_else(|e| e.into_inner());
        if keep < p.base {
            if let Some(idx) = &self.index {
                idx.set_len(HEADER_LEN + 8 * keep).at(&self.index_path)?;
                idx.sync_data().at(&self.index_path)?;
            }
            p.base = keep;
            p.offsets.clear();
        } else {
            let k = (keep - p.base) as usize;
            p.offsets.truncate(k);
        }
        Ok(())
    }
}

/// Checks index entries [lo, hi): each points at a record with the right id, each record starts
/// where the previous one ends, and the last is whole and valid. Returns the end of the last.
pub(crate) fn verify_window(
    files: &SegmentFiles,
    lo: u64,
    hi: u64,
    first: i64,
    max: usize,
    data_len: u64,
) -> Option<u64> {
    let idx = files.index.as_ref()?;
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
        files.data.read_full_at(&mut prefix, off).ok()?;
        let (h, len, _) = parse_prefix(&prefix, max).ok()?;
        if h.txid != first + (lo + j as u64) as i64 {
            return None;
        }
        prev_end = Some(off + (RECORD_OVERHEAD + len) as u64);
    }
    let last_off = files.offset_of(hi - 1).ok()?;
    let total = read_record_at(&files.data, &files.data_path, last_off, first + (hi - 1) as i64, max, data_len).ok()?;
    Some(last_off + total as u64)
}

/// Byte offset of the record at position `i` of a segment, proven against the data: the index
/// entry when the record there carries the right id, otherwise found by walking forward from the
/// nearest earlier entry that does (or from the segment start). A damaged index entry thus costs
/// a short scan instead of a record. `end` is where the segment's records end; the record at `i`
/// must exist (every caller asks for one), so an entry equal to `end` is damaged, not the end.
pub fn locate(files: &SegmentFiles, i: u64, end: u64, max: usize) -> Result<u64> {
    let want = files.first_txid + i as i64;
    let id_at = |off: u64| -> Option<(i64, u64)> {
        if off < HEADER_LEN || off.checked_add(RECORD_OVERHEAD as u64)? > end {
            return None;
        }
        let mut prefix = [0u8; RECORD_PREFIX];
        files.data.read_full_at(&mut prefix, off).ok()?;
        let (h, len, _) = parse_prefix(&prefix, max).ok()?;
        Some((h.txid, off + (RECORD_OVERHEAD + len) as u64))
    };
    if let Ok(off) = files.offset_of(i) {
        if id_at(off).is_some_and(|(t, _)| t == want) {
            return Ok(off);
        }
    }
    log::warn!(
        "{}: index entry {i} does not match the data; locating the record by scanning",
        files.index_path.display()
    );
    let (mut pos, mut t) = (HEADER_LEN, files.first_txid);
    for j in (0..i).rev() {
        if let Some(off) =
            files.offset_of(j).ok().filter(|o| id_at(*o).is_some_and(|(t, _)| t == files.first_txid + j as i64))
        {
            pos = off;
            t = files.first_txid + j as i64;
            break;
        }
    }
    while t < want {
        match id_at(pos) {
            Some((found, next)) if found == t => {
                pos = next;
                t += 1;
            }
            _ => {
                return Err(Error::corruption(
                    &files.data_path,
                    pos,
                    format!("cannot locate transaction {want}: record {t} is not where expected"),
                ))
            }
        }
    }
    Ok(pos)
}

/// Syncs index files written at checkpoints, off the acknowledgement path: recovery verifies
/// every checkpoint window against the data before trusting it, so these syncs only bound how
/// much a recovery after power loss rescans. A failure still stops the partition.
/// Index syncs are coalesced to at most one per INDEX_SYNC_INTERVAL: each costs the concurrent
/// data fdatasyncs a journal commit (measured: +40% latency at one checkpoint per append), and
/// it only shortens a recovery after power loss, by at most this interval's worth of appends.
fn run_checkpointer(rx: mpsc::Receiver<Arc<SegmentFiles>>, poison: impl Fn(&Error)) {
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
            if let Some(idx) = &files.index {
                if let Err(e) = idx.sync_data().at(&files.index_path) {
                    poison(&e);
                }
            }
        }
    }
}

/// The thread that syncs a partition's index files after checkpoint windows were written
/// (`run_checkpointer`), started on the first request.
#[derive(Default)]
pub(crate) struct Checkpointer(Mutex<Option<mpsc::Sender<Arc<SegmentFiles>>>>);

impl Checkpointer {
    /// Has `files`' index synced in the background. A failed sync calls `poison_from_thread`
    /// there; with no thread to spare the index is synced here, and a failure calls `poison`.
    pub(crate) fn request(
        &self,
        partition: i32,
        files: Arc<SegmentFiles>,
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
                    if let Some(idx) = &files.index {
                        if let Err(e) = idx.sync_data().at(&files.index_path) {
                            poison(e);
                        }
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
pub(crate) fn write_all_durable(files: &SegmentFiles, durable: Durable) -> Result<()> {
    if files.write_pending(1, true, durable)? {
        if let Some(idx) = &files.index {
            idx.sync_data().at(&files.index_path)?;
        }
    }
    Ok(())
}
