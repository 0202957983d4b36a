//! Segment files: `<first id, 19 digits>.seg` holds records, `.idx` one i64 offset per record.
//! Both begin with the same 128-byte header. This module opens one segment and recovers it:
//! it finds the last index checkpoint it can prove, scans the data file from there, rebuilds the
//! index tail and classifies whatever follows the last valid record as a torn tail (truncated)
//! or as corruption (an error, unless the caller asked for repair).
use crate::engine::error::{Error, IoContext, Result};
use crate::engine::format::{format_uuid, FORMAT_VERSION, HEADER_LEN};
use crate::engine::fs::{write_file_atomically, FileHandle, FileSystem};
use crate::engine::index::{verify_window, Durable, PendingIndex, SegmentIndex};
use crate::engine::record::{
    be_i32, be_i64, check_record, parse_prefix, Invalid, RecordView, RECORD_OVERHEAD, RECORD_PREFIX,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

const SCAN_CHUNK: usize = 4 << 20;
/// A read-only open of a live log looks again this many times, `LIVE_TAIL_PAUSE` apart, at
/// invalid bytes that end the last segment before it judges them (see `follow_live_tail`).
const LIVE_TAIL_LOOKS: u32 = 3;
const LIVE_TAIL_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);
/// At most this many rescans follow a writer that keeps appending: the open then reads up to there.
const LIVE_TAIL_MAX_RESCANS: u32 = 100;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    pub version: i32,
    pub creation_ms: i64,
    pub cluster_key: [u8; 16],
    pub partition_id: i32,
    pub first_txid: i64,
}

impl SegmentHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN as usize] {
        let mut b = [0u8; HEADER_LEN as usize];
        b[0..4].copy_from_slice(&self.version.to_be_bytes());
        b[4..12].copy_from_slice(&self.creation_ms.to_be_bytes());
        b[12..28].copy_from_slice(&self.cluster_key);
        b[28..32].copy_from_slice(&self.partition_id.to_be_bytes());
        b[32..40].copy_from_slice(&self.first_txid.to_be_bytes());
        b
    }
    pub fn decode(b: &[u8]) -> SegmentHeader {
        SegmentHeader {
            version: be_i32(&b[0..4]),
            creation_ms: be_i64(&b[4..12]),
            cluster_key: b[12..28].try_into().unwrap(),
            partition_id: be_i32(&b[28..32]),
            first_txid: be_i64(&b[32..40]),
        }
    }
}

pub fn data_name(first_txid: i64) -> String {
    format!("{first_txid:019}.seg")
}
pub fn index_name(first_txid: i64) -> String {
    format!("{first_txid:019}.idx")
}

/// Parses `0000000000000000042.seg` (or `.idx`) into 42; anything else is not a segment file.
pub fn parse_segment_name(name: &str, ext: &str) -> Option<i64> {
    let stem = name.strip_suffix(ext)?.strip_suffix('.')?;
    if stem.len() != 19 || !stem.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    stem.parse().ok()
}

/// How recovery treats a bad record that has valid records after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecoveryMode {
    /// A torn tail is truncated; corruption before the tail is an error.
    Strict,
    /// Corruption truncates the partition at the first bad record (explicit repair).
    TruncateAtCorruption,
}

#[derive(Clone, Debug)]
pub struct RecoverOptions {
    pub checkpoint_interval: u64,
    pub max_record_size: usize,
    pub read_only: bool,
    pub mode: RecoveryMode,
    /// The partition's low-water mark from the control file (-1: none): the records up to it are
    /// committed, so damage at or below it is never judged a torn write with survivors.
    pub low_water_mark: i64,
}

/// The writer never has more than `unsynced_bound` bytes of records past the end its last
/// completed fdatasync covered (a round that would pass it is written in pieces of whole
/// records, each fdatasynced: `Partition::write_queue`). A power loss may keep any subset of the
/// pages written since that sync, so after a torn write every surviving record lies in that span.
pub const UNSYNCED_SPAN: u64 = 16 << 20;

/// The bound for records of at most `max_record_size` bytes: `UNSYNCED_SPAN`, or one record if
/// that is larger (a record is never split between two syncs).
pub fn unsynced_bound(max_record_size: usize) -> u64 {
    UNSYNCED_SPAN.max((RECORD_OVERHEAD + max_record_size) as u64)
}

/// The open files of one segment: its data file and its index (the `.idx` file plus the
/// in-memory index tail, whose methods, the index checkpointing, are in `engine::index`).
pub struct SegmentFiles {
    pub first_txid: i64,
    pub data_path: PathBuf,
    pub data: Arc<dyn FileHandle>,
    pub index: SegmentIndex,
}

impl AsRef<SegmentIndex> for SegmentFiles {
    fn as_ref(&self) -> &SegmentIndex {
        &self.index
    }
}

/// A segment as the partition tracks it: files plus how many records and bytes are valid.
#[derive(Clone)]
pub struct Segment {
    pub files: Arc<SegmentFiles>,
    pub count: u64,
    pub end: u64,
}

impl Segment {
    pub fn first_txid(&self) -> i64 {
        self.files.first_txid
    }
    /// One past the last transaction id held.
    pub fn next_txid(&self) -> i64 {
        self.files.first_txid + self.count as i64
    }
}

/// Creates an empty segment: the index first, then the data file, each written whole under a
/// temporary name and renamed, so a crash leaves either no segment or a complete header.
pub fn create_segment(fs: &dyn FileSystem, dir: &Path, header: &SegmentHeader) -> Result<Segment> {
    let data_path = dir.join(data_name(header.first_txid));
    let index_path = dir.join(index_name(header.first_txid));
    let bytes = header.encode();
    write_file_atomically(fs, &index_path, &bytes).at(&index_path)?;
    write_file_atomically(fs, &data_path, &bytes).at(&data_path)?;
    let data = fs.open(&data_path, true).at(&data_path)?;
    let index = fs.open(&index_path, true).at(&index_path)?;
    Ok(Segment {
        files: Arc::new(SegmentFiles {
            first_txid: header.first_txid,
            data_path,
            data,
            index: SegmentIndex { path: index_path, file: Some(index), pending: RwLock::new(PendingIndex::default()) },
        }),
        count: 0,
        end: HEADER_LEN,
    })
}

/// What recovery found at the end of one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tail {
    Clean,
    /// Bytes after the last valid record that are an unfinished write: no valid record follows,
    /// or (`survivor`: the first one's offset) only records within the writer's unsynced bound.
    Torn {
        offset: u64,
        bytes: u64,
        reason: String,
        survivor: Option<u64>,
    },
    /// A bad record with valid records after it, cut away because repair was asked for.
    CorruptionCut {
        offset: u64,
        reason: String,
    },
}

pub struct Recovered {
    pub segment: Segment,
    pub tail: Tail,
    /// Whether the index had to be rebuilt past its last checkpoint (a measure of recovery work).
    pub scanned_records: u64,
}

pub struct SegmentContext<'a> {
    pub fs: &'a dyn FileSystem,
    pub dir: &'a Path,
    pub cluster_key: [u8; 16],
    pub partition_id: i32,
    pub first_txid: i64,
    /// The next segment's first id, when this one is not the last.
    pub next_first: Option<i64>,
    pub opts: &'a RecoverOptions,
}

pub fn check_header(path: &Path, b: &[u8], ctx: &SegmentContext<'_>) -> Result<()> {
    let h = SegmentHeader::decode(b);
    if h.version != FORMAT_VERSION {
        return Err(Error::corruption(path, 0, format!("unknown format version {}", h.version)));
    }
    if h.cluster_key != ctx.cluster_key {
        return Err(Error::ClusterKeyMismatch {
            path: path.to_path_buf(),
            expected: format_uuid(&ctx.cluster_key),
            found: format_uuid(&h.cluster_key),
        });
    }
    if h.partition_id != ctx.partition_id {
        return Err(Error::corruption(
            path,
            28,
            format!("header names partition {}, file is in partition {}", h.partition_id, ctx.partition_id),
        ));
    }
    if h.first_txid != ctx.first_txid {
        return Err(Error::corruption(
            path,
            32,
            format!("header says first transaction {}, file name says {}", h.first_txid, ctx.first_txid),
        ));
    }
    Ok(())
}

/// Whether a segment starting at `first_txid` has ids for every record a data file of
/// `data_len` bytes could hold, and for the one after them (its next id). Ids are dense from 0,
/// so a first id that high is damage, not a log; refusing it keeps the id arithmetic of
/// recovery from overflowing.
pub fn ids_fit(first_txid: i64, data_len: u64) -> bool {
    let room = (data_len.saturating_sub(HEADER_LEN) / RECORD_OVERHEAD as u64) as i64;
    first_txid >= 0 && first_txid.checked_add(room).is_some()
}

/// Recovers one segment: checks its header, opens (or rebuilds) its index, finds the last
/// checkpoint window proven against the data, scans from there, judges what stops the scan
/// (preallocated zeros, a torn tail, corruption) and settles the index file.
pub fn recover_segment(ctx: &SegmentContext<'_>) -> Result<Recovered> {
    let opts = ctx.opts;
    let (data_path, data, mut data_len, hb) = open_data_file(ctx)?;
    let index_path = ctx.dir.join(index_name(ctx.first_txid));
    let opened = open_index_file(ctx, &index_path, &hb, data_len)?;
    let (index, claimed, file_entries, index_len) = (opened.file, opened.claimed, opened.file_entries, opened.len);

    let mut files = SegmentFiles {
        first_txid: ctx.first_txid,
        data_path: data_path.clone(),
        data: data.clone(),
        index: SegmentIndex {
            path: index_path.clone(),
            file: index.clone(),
            pending: RwLock::new(PendingIndex::default()),
        },
    };

    if let Some(end) = sealed_and_complete(ctx, &files, claimed, index_len, data_len) {
        // The index file holds every entry: nothing is pending.
        files.index.pending = RwLock::new(PendingIndex { base: claimed, offsets: Vec::new() });
        return Ok(Recovered {
            segment: Segment { files: Arc::new(files), count: claimed, end },
            tail: Tail::Clean,
            scanned_records: 0,
        });
    }

    let (cp, start) = last_proven_checkpoint(ctx, &files, claimed, data_len);
    let mut scan = scan_forward(&data, &data_path, start, data_len, ctx.first_txid + cp as i64, opts.max_record_size)?;
    let mut zero_tail = None;
    if opts.read_only && ctx.next_first.is_none() {
        (zero_tail, data_len) =
            follow_live_tail(&data, &data_path, &mut scan, data_len, ctx.first_txid + cp as i64, opts.max_record_size)?;
    }
    let count = cp + scan.offsets.len() as u64;
    let (tail, end) = judge_stop(ctx, &data, &data_path, &scan, zero_tail, data_len, count)?;
    check_reaches_next(ctx, &data_path, &tail, count, end)?;
    settle_index(ctx, &mut files, scan.offsets, cp, file_entries, index_len, end, data_len)?;
    Ok(Recovered { segment: Segment { files: Arc::new(files), count, end }, tail, scanned_records: count - cp })
}

/// Opens the data file and checks its header; returns the path, the file, its length and the
/// header bytes (the index file must carry the same).
fn open_data_file(ctx: &SegmentContext<'_>) -> Result<(PathBuf, Arc<dyn FileHandle>, u64, [u8; HEADER_LEN as usize])> {
    let (fs, opts) = (ctx.fs, ctx.opts);
    let data_path = ctx.dir.join(data_name(ctx.first_txid));
    let data = fs.open(&data_path, !opts.read_only).at(&data_path)?;
    let data_len = data.len().at(&data_path)?;
    let mut hb = [0u8; HEADER_LEN as usize];
    if data.read_full_at(&mut hb, 0).at(&data_path)? < HEADER_LEN as usize {
        return Err(Error::corruption(&data_path, 0, "file is shorter than its 128-byte header"));
    }
    check_header(&data_path, &hb, ctx)?;
    if !ids_fit(ctx.first_txid, data_len) {
        return Err(Error::corruption(
            &data_path,
            32,
            format!("first transaction id {} leaves no room for the file's records", ctx.first_txid),
        ));
    }
    Ok((data_path, data, data_len, hb))
}

/// An index file as recovery found it: the handle (None in a read-only open of a missing or
/// unusable one), how many entries it claims (at most as many as fit the segment), how many it
/// holds and its length.
struct OpenedIndex {
    file: Option<Arc<dyn FileHandle>>,
    claimed: u64,
    file_entries: u64,
    len: u64,
}

/// The index: usable when it exists and carries the same header; otherwise rebuilt from zero.
fn open_index_file(
    ctx: &SegmentContext<'_>,
    index_path: &Path,
    hb: &[u8; HEADER_LEN as usize],
    data_len: u64,
) -> Result<OpenedIndex> {
    let (fs, opts) = (ctx.fs, ctx.opts);
    let mut index: Option<Arc<dyn FileHandle>> = None;
    let mut claimed = 0u64;
    let mut file_entries = 0u64;
    let mut index_len = HEADER_LEN;
    if fs.exists(index_path) {
        let f = fs.open(index_path, !opts.read_only).at(index_path)?;
        let len = f.len().at(index_path)?;
        let mut ib = [0u8; HEADER_LEN as usize];
        let header_ok = len >= HEADER_LEN
            && f.read_full_at(&mut ib, 0).at(index_path)? == HEADER_LEN as usize
            && ib[..40] == hb[..40];
        if header_ok {
            claimed = (len - HEADER_LEN) / 8;
            file_entries = claimed;
            index_len = len;
        } else if !opts.read_only {
            log::warn!("{}: index header unusable, rebuilding the index", index_path.display());
            f.set_len(0).at(index_path)?;
            f.write_all_at(hb, 0).at(index_path)?;
            f.sync_data().at(index_path)?;
        }
        if header_ok || !opts.read_only {
            index = Some(f);
        }
    } else if !opts.read_only {
        log::warn!("{}: index missing, rebuilding it", index_path.display());
        write_file_atomically(fs, index_path, hb).at(index_path)?;
        index = Some(fs.open(index_path, true).at(index_path)?);
    }
    if let Some(next) = ctx.next_first {
        claimed = claimed.min((next - ctx.first_txid).max(0) as u64);
    }
    // An index never holds more entries than records fit in the data file (keeps ids in range).
    claimed = claimed.min((data_len - HEADER_LEN) / RECORD_OVERHEAD as u64);
    Ok(OpenedIndex { file: index, claimed, file_entries, len: index_len })
}

/// Sealed segments were synced whole before the next one was created: when the index agrees
/// with the next segment and its last entry ends the file exactly, the segment is complete.
/// Returns where its records end then.
fn sealed_and_complete(
    ctx: &SegmentContext<'_>,
    files: &SegmentFiles,
    claimed: u64,
    index_len: u64,
    data_len: u64,
) -> Option<u64> {
    let next = ctx.next_first?;
    if claimed > 0 && index_len == HEADER_LEN + 8 * claimed && ctx.first_txid + claimed as i64 == next {
        if let Ok(end) = record_end(files, claimed - 1, ctx.first_txid, ctx.opts.max_record_size, data_len) {
            if end == data_len {
                return Some(end);
            }
        }
    }
    None
}

/// The highest checkpoint whose whole window of index entries is proven against the data, and
/// where the records after it start.
fn last_proven_checkpoint(ctx: &SegmentContext<'_>, files: &SegmentFiles, claimed: u64, data_len: u64) -> (u64, u64) {
    let opts = ctx.opts;
    let n = opts.checkpoint_interval.max(1);
    let mut cp = (claimed / n) * n;
    let mut start = HEADER_LEN;
    while cp > 0 {
        let (lo, max) = (cp.saturating_sub(n), opts.max_record_size);
        let read_record = |off, txid| read_record_at(&files.data, &files.data_path, off, txid, max, data_len);
        if let Some(end) = verify_window(&files.index, &files.data, lo, cp, ctx.first_txid, max, data_len, read_record)
        {
            start = end;
            break;
        }
        log::warn!(
            "{}: index checkpoint at record {} does not match the data, trying the one before",
            files.index.path.display(),
            cp
        );
        cp -= n;
    }
    (cp, start)
}

/// Judges what stopped the scan: preallocated zeros end the log; a bad record with nothing
/// valid after it in the last segment is a torn tail; anything else is corruption, cut in a
/// repair and an error otherwise. Returns the tail and where the valid records end.
#[allow(clippy::too_many_arguments)]
fn judge_stop(
    ctx: &SegmentContext<'_>,
    data: &Arc<dyn FileHandle>,
    data_path: &Path,
    scan: &ScanResult,
    zero_tail: Option<bool>,
    data_len: u64,
    count: u64,
) -> Result<(Tail, u64)> {
    let opts = ctx.opts;
    let mut end = scan.end;
    let mut tail = Tail::Clean;
    let mut stopped = scan.stopped.clone();
    if let Some((bad_at, _)) = &stopped {
        // Zeros from the last valid record to the end of the file are preallocated space the
        // appender had not reached (it zero-fills ahead of its writes): the end of the log, not
        // a tear. Damage cannot hide here: no valid record is all zeros (see ZERO_PREFIX), and
        // zeros followed by anything else still go through the checks below.
        let zeros = match zero_tail {
            Some(known) => known,
            None => is_zero_range(data, data_path, *bad_at, data_len)?,
        };
        if zeros {
            log::debug!(
                "{}: {} bytes of preallocated space after offset {}",
                data_path.display(),
                data_len - bad_at,
                bad_at
            );
            end = *bad_at;
            stopped = None;
        }
    }
    if let Some((bad_at, why)) = stopped {
        let expected = ctx.first_txid + count as i64;
        let later = find_valid_record_after(data, data_path, bad_at + 1, data_len, expected, opts.max_record_size)?;
        let is_last = ctx.next_first.is_none();
        let torn_write = match later {
            Some(valid_at) if is_last => {
                torn_write_with_survivors(ctx, data, data_path, bad_at, valid_at, expected, data_len)?
            }
            _ => Err(String::new()),
        };
        match later {
            None if is_last => {
                log::warn!(
                    "{}: torn tail of {} bytes at offset {} ({}), truncating",
                    data_path.display(),
                    data_len - bad_at,
                    bad_at,
                    why
                );
                tail = Tail::Torn { offset: bad_at, bytes: data_len - bad_at, reason: why.to_string(), survivor: None };
            }
            Some(valid_at) if torn_write.is_ok() => {
                log::warn!(
                    "{}: torn write at offset {} ({}, transaction {}) with valid records after it from offset {}, \
                     nothing but zeros {} bytes past it (the most the writer leaves unsynced) and above the \
                     low-water mark: records that were never synced; truncating {} bytes",
                    data_path.display(),
                    bad_at,
                    why,
                    expected,
                    valid_at,
                    unsynced_bound(opts.max_record_size),
                    data_len - bad_at
                );
                tail = Tail::Torn {
                    offset: bad_at,
                    bytes: data_len - bad_at,
                    reason: why.to_string(),
                    survivor: Some(valid_at),
                };
            }
            _ if opts.mode == RecoveryMode::TruncateAtCorruption => {
                log::warn!(
                    "{}: corruption at offset {} ({}); repair truncates the partition here",
                    data_path.display(),
                    bad_at,
                    why
                );
                tail = Tail::CorruptionCut { offset: bad_at, reason: why.to_string() };
            }
            Some(valid_at) => {
                let not_torn = torn_write.err().unwrap_or_default();
                return Err(Error::corruption(
                    data_path,
                    bad_at,
                    format!(
                        "{why} (transaction {expected}), with a valid record after it at offset {valid_at}{not_torn}; \
                         open with recovery mode 'truncate' to cut the partition here"
                    ),
                ));
            }
            None => {
                return Err(Error::corruption(
                    data_path,
                    bad_at,
                    format!("{why} (transaction {expected}) in a sealed segment that has later segments"),
                ));
            }
        }
        end = bad_at;
    }
    Ok((tail, end))
}

/// Whether a bad record at `bad_at` (transaction `expected`) of the last segment, with valid
/// records after it from `valid_at`, is a write a power loss tore. The writer acknowledges
/// nothing before an fdatasync covers it, so a hole a torn write left holds records never synced,
/// but a disk may persist any subset of the blocks written since the last completed fdatasync:
/// valid records may survive after the hole. Latent corruption of synced data is the other
/// explanation; two pieces of evidence the writer guarantees tell them apart:
/// - Where: the writer bounds that span (`unsynced_bound`) and starts it at a record boundary,
///   so the hole, the first bad record, is no earlier than its start, and everything written
///   since lies before `bad_at + bound`: a non-zero byte from there on is synced data.
/// - What: a block the disk did not write keeps what it held, and past the synced end the
///   writer only ever leaves zeros (preallocated, or beyond the end of the file), so a tear
///   leaves zeros that end at a block boundary or where the survivors begin. A flipped bit or
///   garbage in a record is damage, not a tear (`unwritten_space`).
///
/// Records at or below the low-water mark are committed: damage there is corruption whatever
/// follows. Err says why not (a clause for the corruption error).
fn torn_write_with_survivors(
    ctx: &SegmentContext<'_>,
    data: &Arc<dyn FileHandle>,
    path: &Path,
    bad_at: u64,
    valid_at: u64,
    expected: i64,
    data_len: u64,
) -> Result<std::result::Result<(), String>> {
    let low_water_mark = ctx.opts.low_water_mark;
    if expected <= low_water_mark {
        return Ok(Err(format!(" (at or below the low-water mark {low_water_mark}: committed)")));
    }
    Ok(not_a_torn_write(data, path, bad_at, valid_at, expected, data_len, ctx.opts.max_record_size)?
        .map_or(Ok(()), Err))
}

/// Why a bad record at `bad_at`, the first valid record after it at `valid_at`, cannot be a
/// write a power loss tore (None: it can, the low-water mark aside): data further past it than
/// the writer leaves unsynced, or no unwritten space in the hole (`torn_write_with_survivors`).
pub(crate) fn not_a_torn_write(
    data: &Arc<dyn FileHandle>,
    path: &Path,
    bad_at: u64,
    valid_at: u64,
    expected: i64,
    data_len: u64,
    max_record_size: usize,
) -> Result<Option<String>> {
    let bound = unsynced_bound(max_record_size);
    let past = bad_at.saturating_add(bound);
    if past < data_len && !is_zero_range(data, path, past, data_len)? {
        return Ok(Some(format!(" (and data {bound} bytes or more past it, further than the writer leaves unsynced)")));
    }
    if valid_at > past || !unwritten_space(data, path, bad_at, valid_at, expected)? {
        return Ok(Some(" (and no unwritten space before it: damage, not a torn write)".into()));
    }
    Ok(None)
}

/// The finest unit a disk writes whole (a sector): a power loss keeps or loses whole ones.
const SECTOR: u64 = 512;

/// Whether `[from, to)` (a bad record for transaction `expected` at `from`, the first valid
/// record after it at `to`) holds what a block the disk never wrote leaves there: zeros that
/// begin at `from` or at a sector boundary, end at `to` or at one, and are more than a valid
/// record's bytes can be. From `from`, 8 of them: the record's id, never all zero but for
/// transaction 0 (then 40: a record's overhead, never all zero). Up to `to`, 4: the checksum
/// that ends the record before it, zero once in 2^32. From a sector boundary to another: a
/// whole sector.
fn unwritten_space(data: &Arc<dyn FileHandle>, path: &Path, from: u64, to: u64, expected: i64) -> Result<bool> {
    let mut buf = vec![0u8; (to - from) as usize];
    let got = data.read_full_at(&mut buf, from).at(path)?;
    buf.truncate(got);
    let to = from + got as u64;
    let mut i = 0usize;
    while i < buf.len() {
        if buf[i] != 0 {
            i += 1;
            continue;
        }
        let run = buf[i..].iter().take_while(|b| **b == 0).count();
        let (s, e) = (from + i as u64, from + (i + run) as u64);
        let s = if s == from { s } else { s.next_multiple_of(SECTOR) };
        let e = if e == to { e } else { e / SECTOR * SECTOR };
        let least = match (s == from, e == to) {
            (_, true) => 4,
            (true, false) if expected != 0 => 8,
            (true, false) => RECORD_OVERHEAD as u64,
            (false, false) => 1,
        };
        if e >= s + least {
            return Ok(true);
        }
        i += run;
    }
    Ok(false)
}

/// A sealed segment must end where the next one starts.
fn check_reaches_next(ctx: &SegmentContext<'_>, data_path: &Path, tail: &Tail, count: u64, end: u64) -> Result<()> {
    if let Some(next) = ctx.next_first {
        if *tail == Tail::Clean && ctx.first_txid + count as i64 != next {
            return Err(Error::corruption(
                data_path,
                end,
                format!(
                    "segment holds transactions up to {} but the next segment starts at {}",
                    ctx.first_txid + count as i64 - 1,
                    next
                ),
            ));
        }
    }
    Ok(())
}

/// Index entries past the checkpoint that agree with the scan stay in the file (a cleanly
/// closed log is reopened without changing a byte); the file is cut where they disagree.
/// The rest of the rebuilt entries stay in memory as the index tail, and complete checkpoint
/// windows among them are written back so the next open does not rescan them. A writable
/// open also cuts the data file at `end`.
#[allow(clippy::too_many_arguments)]
fn settle_index(
    ctx: &SegmentContext<'_>,
    files: &mut SegmentFiles,
    mut offsets: Vec<u64>,
    cp: u64,
    file_entries: u64,
    index_len: u64,
    end: u64,
    data_len: u64,
) -> Result<()> {
    let opts = ctx.opts;
    let n = opts.checkpoint_interval.max(1);
    let (data, data_path, index, index_path) =
        (files.data.clone(), files.data_path.clone(), files.index.file.clone(), files.index.path.clone());
    let mut kept = 0usize;
    if file_entries > cp && !offsets.is_empty() {
        let n_cmp = ((file_entries - cp) as usize).min(offsets.len());
        let mut raw = vec![0u8; n_cmp * 8];
        let idx = index.as_ref().expect("entries were counted from an index file");
        let got = idx.read_full_at(&mut raw, HEADER_LEN + 8 * cp).at(&index_path)?;
        kept = raw[..got - got % 8]
            .chunks_exact(8)
            .zip(offsets.iter())
            .take_while(|(e, o)| be_i64(e) as u64 == **o)
            .count();
    }
    let base = cp + kept as u64;
    offsets.drain(..kept);
    files.index.pending = RwLock::new(PendingIndex { base, offsets });
    if !opts.read_only {
        if end < data_len {
            data.set_len(end).at(&data_path)?;
        }
        let idx = index.as_ref().expect("writable opens always have an index file");
        let mut changed = index_len != HEADER_LEN + 8 * base;
        // What the scan read may be page cache a crashed process left unsynced: it is made
        // durable (with the cut) before any index entry that points into it is written.
        // (With nothing synced, nothing is pending past `base` either.)
        let durable =
            if end < data_len || !files.index.pending.read().unwrap_or_else(|e| e.into_inner()).offsets.is_empty() {
                Durable::sync_data(&files.data, &files.data_path)?
            } else {
                Durable::first(base)
            };
        if changed {
            idx.set_len(HEADER_LEN + 8 * base).at(&index_path)?;
        }
        changed |= files.index.write_pending(n, ctx.next_first.is_some(), durable)?;
        if changed {
            idx.sync_data().at(&index_path)?;
        }
    }
    Ok(())
}

/// A read-only open takes no lock, so a running node may be appending to the last segment as
/// it is scanned: the invalid bytes the scan stopped at may be a record still being written, or
/// preallocated zeros that records filled right after the scan read them (the checks after the
/// scan then saw "damage with valid records after it" in a healthy log). So the scan goes on from
/// there while that finds more records; bytes that stay invalid `LIVE_TAIL_LOOKS` times running
/// are judged as in any open. Returns whether what ends the scan is known to be all zeros (None:
/// not checked) and the file's length as last read.
fn follow_live_tail(
    data: &Arc<dyn FileHandle>,
    path: &Path,
    scan: &mut ScanResult,
    mut data_len: u64,
    first_id: i64,
    max: usize,
) -> Result<(Option<bool>, u64)> {
    let (mut unchanged, mut rescans) = (0, 0);
    while let Some((bad_at, _)) = scan.stopped {
        if is_zero_range(data, path, bad_at, data_len)? {
            return Ok((Some(true), data_len));
        }
        if unchanged == LIVE_TAIL_LOOKS || rescans == LIVE_TAIL_MAX_RESCANS {
            return Ok((Some(false), data_len));
        }
        std::thread::sleep(LIVE_TAIL_PAUSE);
        data_len = data.len().at(path)?;
        let more = scan_forward(data, path, bad_at, data_len, first_id + scan.offsets.len() as i64, max)?;
        unchanged = if more.offsets.is_empty() { unchanged + 1 } else { 0 };
        rescans += 1;
        scan.offsets.extend(more.offsets);
        scan.end = more.end;
        scan.stopped = more.stopped;
    }
    Ok((None, data_len))
}

/// End offset of record `i`, validated whole (both checksums, id and bounds).
fn record_end(files: &SegmentFiles, i: u64, first: i64, max: usize, data_len: u64) -> Result<u64> {
    let off = files.index.offset_of(i)?;
    let v = read_record_at(&files.data, &files.data_path, off, first + i as i64, max, data_len)?;
    Ok(off + v as u64)
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
    if let Ok(off) = files.index.offset_of(i) {
        if id_at(off).is_some_and(|(t, _)| t == want) {
            return Ok(off);
        }
    }
    log::warn!(
        "{}: index entry {i} does not match the data; locating the record by scanning",
        files.index.path.display()
    );
    let (mut pos, mut t) = (HEADER_LEN, files.first_txid);
    for j in (0..i).rev() {
        if let Some(off) =
            files.index.offset_of(j).ok().filter(|o| id_at(*o).is_some_and(|(t, _)| t == files.first_txid + j as i64))
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

/// Reads and validates the record at `off`; returns its total length.
pub fn read_record_at(
    data: &Arc<dyn FileHandle>,
    path: &Path,
    off: u64,
    txid: i64,
    max: usize,
    data_len: u64,
) -> Result<usize> {
    if off < HEADER_LEN || off.checked_add(RECORD_OVERHEAD as u64).is_none_or(|e| e > data_len) {
        return Err(Error::corruption(path, off, "offset outside the data file"));
    }
    let mut prefix = [0u8; 36];
    data.read_full_at(&mut prefix, off).at(path)?;
    let (_, len, _) = parse_prefix(&prefix, max).map_err(|e| Error::corruption(path, off, e.to_string()))?;
    let total = RECORD_OVERHEAD + len;
    if off.checked_add(total as u64).is_none_or(|e| e > data_len) {
        return Err(Error::corruption(path, off, "record runs past the end of the file"));
    }
    let mut buf = vec![0u8; total];
    data.read_full_at(&mut buf, off).at(path)?;
    check_record(&buf, Some(txid), max).map_err(|e| Error::corruption(path, off, e.to_string()))?;
    Ok(total)
}

struct ScanResult {
    offsets: Vec<u64>,
    end: u64,
    stopped: Option<(u64, Invalid)>,
}

/// Validates records from `start` until the end of the file or the first invalid one.
fn scan_forward(
    data: &Arc<dyn FileHandle>,
    path: &Path,
    start: u64,
    data_len: u64,
    expected: i64,
    max: usize,
) -> Result<ScanResult> {
    let mut offsets = Vec::new();
    let (end, stopped) = scan_records(data, path, start, data_len, expected, max, |off, _| {
        offsets.push(off);
        Ok(())
    })?;
    Ok(ScanResult { offsets, end, stopped })
}

/// Validates records from `start` (ids from `expected`) in chunks of at most a few MiB (more
/// only for a record that is larger and fits in the file), calling `visit` with each valid
/// record's offset. Returns where the valid records end and, when an invalid record stopped
/// the walk before the end of the file, its offset and why.
pub(crate) fn scan_records(
    data: &Arc<dyn FileHandle>,
    path: &Path,
    start: u64,
    data_len: u64,
    mut expected: i64,
    max: usize,
    mut visit: impl FnMut(u64, &RecordView) -> Result<()>,
) -> Result<(u64, Option<(u64, Invalid)>)> {
    let mut pos = start;
    let mut cap = SCAN_CHUNK;
    let mut buf: Vec<u8> = Vec::new();
    while pos < data_len {
        buf.resize(((data_len - pos) as usize).min(cap), 0);
        let got = data.read_full_at(&mut buf, pos).at(path)?;
        buf.truncate(got);
        if got == 0 {
            break;
        }
        let mut i = 0usize;
        let mut needs = None;
        while i < buf.len() {
            match check_record(&buf[i..], Some(expected), max) {
                Ok(v) => {
                    visit(pos + i as u64, &v)?;
                    i += v.total_len();
                    expected += 1;
                }
                // The record is whole on disk but continues past this chunk.
                Err(Invalid::Short { needed, .. }) if pos + i as u64 + needed <= data_len => {
                    needs = Some(needed as usize);
                    break;
                }
                Err(e) => {
                    let at = pos + i as u64;
                    return Ok((at, Some((at, e))));
                }
            }
        }
        if i == 0 {
            match needs {
                Some(n) => cap = cap.max(n),
                None => break,
            }
        }
        pos += i as u64;
    }
    Ok((pos, None))
}

/// Whether every byte of [from, to) is zero: preallocated space nothing was written into.
pub(crate) fn is_zero_range(data: &Arc<dyn FileHandle>, path: &Path, from: u64, to: u64) -> Result<bool> {
    let mut pos = from;
    let mut buf = vec![0u8; (to.saturating_sub(from) as usize).min(SCAN_CHUNK)];
    while pos < to {
        let want = ((to - pos) as usize).min(buf.len());
        let got = data.read_full_at(&mut buf[..want], pos).at(path)?;
        if got == 0 {
            break;
        }
        if buf[..got].iter().any(|b| *b != 0) {
            return Ok(false);
        }
        pos += got as u64;
    }
    Ok(true)
}

/// A valid record never starts with this many zero bytes: they would give it data length 0 and
/// a zero record checksum, and the CRC32 of its 36 zero header bytes is 0x6ab6b2d5.
const ZERO_PREFIX: usize = RECORD_OVERHEAD;

/// Looks for any valid record at or after `from` whose id could follow `expected`. A hit means
/// the bad bytes are not an unfinished tail but damage inside written data.
pub(crate) fn find_valid_record_after(
    data: &Arc<dyn FileHandle>,
    path: &Path,
    from: u64,
    data_len: u64,
    expected: i64,
    max: usize,
) -> Result<Option<u64>> {
    if from >= data_len {
        return Ok(None);
    }
    // Saturating: near i64::MAX there are simply no ids left to find.
    let max_id = expected.saturating_add(((data_len - from) / RECORD_OVERHEAD as u64) as i64 + 1);
    let mut pos = from;
    let mut buf = vec![0u8; SCAN_CHUNK + 8];
    while pos + RECORD_OVERHEAD as u64 <= data_len {
        let got = data.read_full_at(&mut buf, pos).at(path)?;
        if got < 8 {
            break;
        }
        // Runs of zeros (preallocated space after a torn record) are skipped without a read
        // per byte: with expected id 0 every position of them would otherwise be a candidate.
        let mut zeros_until = 0usize;
        for i in 0..=(got - 8) {
            if i >= zeros_until {
                let run = buf[i..got].iter().take_while(|b| **b == 0).count();
                zeros_until = if run >= ZERO_PREFIX { i + run - ZERO_PREFIX + 1 } else { i };
            }
            if i < zeros_until {
                continue;
            }
            let txid = be_i64(&buf[i..i + 8]);
            if txid < expected || txid > max_id {
                continue;
            }
            let at = pos + i as u64;
            if read_record_at(data, path, at, txid, max, data_len).is_ok() {
                return Ok(Some(at));
            }
        }
        pos += (got - 7) as u64;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::fs::StdFs;
    use crate::engine::record::{encode_record, NewRecord, ReqId};
    use std::os::unix::fs::FileExt;

    const KEY: [u8; 16] = [9; 16];

    fn header(first: i64) -> SegmentHeader {
        SegmentHeader { version: FORMAT_VERSION, creation_ms: 1, cluster_key: KEY, partition_id: 2, first_txid: first }
    }

    fn opts(read_only: bool) -> RecoverOptions {
        RecoverOptions {
            checkpoint_interval: 4,
            max_record_size: 1 << 20,
            read_only,
            mode: RecoveryMode::Strict,
            low_water_mark: -1,
        }
    }

    /// A segment of `n` records written directly (no index entries beyond `indexed`).
    fn write_segment(dir: &Path, first: i64, n: i64, indexed: i64) -> Vec<u64> {
        let seg = create_segment(&StdFs, dir, &header(first)).unwrap();
        let mut buf = Vec::new();
        let mut offs = Vec::new();
        for t in first..first + n {
            offs.push(HEADER_LEN + buf.len() as u64);
            let d = vec![t as u8; 10 + t as usize];
            encode_record(&mut buf, t, &NewRecord { req_id: ReqId::default(), header: 0, data: &d, data_crc: None });
        }
        seg.files.data.write_all_at(&buf, HEADER_LEN).unwrap();
        let idx: Vec<u8> = offs[..indexed as usize].iter().flat_map(|o| (*o as i64).to_be_bytes()).collect();
        seg.files.index.file.as_ref().unwrap().write_all_at(&idx, HEADER_LEN).unwrap();
        offs
    }

    fn ctx<'a>(dir: &'a Path, first: i64, next: Option<i64>, o: &'a RecoverOptions) -> SegmentContext<'a> {
        SegmentContext {
            fs: &StdFs,
            dir,
            cluster_key: KEY,
            partition_id: 2,
            first_txid: first,
            next_first: next,
            opts: o,
        }
    }

    #[test]
    fn header_and_names_round_trip() {
        let h = header(42);
        assert_eq!(SegmentHeader::decode(&h.encode()), h);
        assert_eq!(data_name(42), "0000000000000000042.seg");
        assert_eq!(parse_segment_name("0000000000000000042.seg", "seg"), Some(42));
        assert_eq!(parse_segment_name("000000000000000042.seg", "seg"), None);
        assert_eq!(parse_segment_name("0000000000000000042.idx", "seg"), None);
        assert_eq!(parse_segment_name("00000000000000000x2.seg", "seg"), None);
    }

    #[test]
    fn recovery_rebuilds_the_index_past_the_last_proven_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let offs = write_segment(d.path(), 0, 10, 6);
        let o = opts(false);
        let r = recover_segment(&ctx(d.path(), 0, None, &o)).unwrap();
        assert_eq!(r.segment.count, 10);
        assert_eq!(r.tail, Tail::Clean);
        assert_eq!(r.scanned_records, 6); // checkpoint 4 proven, records 4..10 scanned
        for (i, off) in offs.iter().enumerate() {
            assert_eq!(r.segment.files.index.offset_of(i as u64).unwrap(), *off);
        }
    }

    #[test]
    fn read_only_recovery_keeps_the_rebuilt_index_in_memory() {
        let d = tempfile::tempdir().unwrap();
        let offs = write_segment(d.path(), 5, 9, 0);
        let idx_before = std::fs::read(d.path().join(index_name(5))).unwrap();
        let o = opts(true);
        let r = recover_segment(&ctx(d.path(), 5, None, &o)).unwrap();
        assert_eq!(r.segment.count, 9);
        assert_eq!(r.segment.files.index.offset_of(8).unwrap(), offs[8]);
        assert_eq!(std::fs::read(d.path().join(index_name(5))).unwrap(), idx_before);
    }

    #[test]
    fn a_sealed_segment_with_a_gap_before_the_next_is_corruption() {
        let d = tempfile::tempdir().unwrap();
        write_segment(d.path(), 0, 6, 6);
        let o = opts(false);
        assert!(recover_segment(&ctx(d.path(), 0, Some(6), &o)).is_ok());
        let e = recover_segment(&ctx(d.path(), 0, Some(9), &o)).err().unwrap();
        assert!(matches!(e, Error::Corruption { .. }), "{e}");
    }

    #[test]
    fn header_mismatches_are_refused() {
        let d = tempfile::tempdir().unwrap();
        write_segment(d.path(), 0, 2, 2);
        let o = opts(false);
        let mut c = ctx(d.path(), 0, None, &o);
        c.cluster_key = [1; 16];
        assert!(matches!(recover_segment(&c), Err(Error::ClusterKeyMismatch { .. })));
        let mut c = ctx(d.path(), 0, None, &o);
        c.partition_id = 3;
        assert!(matches!(recover_segment(&c), Err(Error::Corruption { offset: 28, .. })));
    }

    /// Found while fuzzing: a segment whose first id lies near i64::MAX overflowed the id
    /// arithmetic of the record scan (`expected += 1`) and of the search for a valid record
    /// after a bad one (fuzz/regressions/segment_recovery/inspect-find-valid-record-id-overflow).
    #[test]
    fn first_ids_near_the_top_of_the_range_do_not_overflow() {
        let top = i64::MAX - 2;
        let record = |t: i64| {
            let mut b = Vec::new();
            encode_record(&mut b, t, &NewRecord { req_id: ReqId::default(), header: 0, data: b"x", data_crc: None });
            b
        };
        let o = opts(true);
        for (body, recovers) in [
            // Garbage after the header: a torn tail, and the search past it runs out of ids.
            (vec![0x5Au8; 100], true),
            // Two records fit below i64::MAX (the next id is i64::MAX itself).
            ([record(top), record(top + 1)].concat(), true),
            // A file long enough for three records would need id i64::MAX + 1: damage.
            ([record(top), record(top + 1), vec![0; 41]].concat(), false),
        ] {
            let d = tempfile::tempdir().unwrap();
            let mut bytes = header(top).encode().to_vec();
            bytes.extend_from_slice(&body);
            std::fs::write(d.path().join(data_name(top)), &bytes).unwrap();
            let r = recover_segment(&ctx(d.path(), top, None, &o));
            if recovers {
                let r = r.ok().expect("recovers");
                assert_eq!(r.segment.next_txid(), top + r.segment.count as i64);
            } else {
                assert!(matches!(r, Err(Error::Corruption { offset: 32, .. })));
            }
            let report = crate::engine::inspect::inspect_segment(&StdFs, &d.path().join(data_name(top)), 10, 1 << 20);
            assert_eq!(report.is_ok(), recovers);
        }
    }

    #[test]
    fn a_lone_valid_record_after_garbage_makes_it_corruption() {
        let d = tempfile::tempdir().unwrap();
        let offs = write_segment(d.path(), 0, 6, 0);
        let f = std::fs::OpenOptions::new().write(true).open(d.path().join(data_name(0))).unwrap();
        f.write_all_at(&[0xAB; 7], offs[2]).unwrap();
        // Committed records: a torn write cannot explain the garbage (`torn_write_with_survivors`).
        let mut o = opts(false);
        o.low_water_mark = 5;
        match recover_segment(&ctx(d.path(), 0, None, &o)) {
            Err(Error::Corruption { offset, reason, .. }) => {
                assert_eq!(offset, offs[2]);
                assert!(reason.contains(&format!("offset {}", offs[3])), "{reason}");
            }
            _ => panic!("expected corruption"),
        }
    }
}
