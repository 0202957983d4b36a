//! Read-only inspection of storage files for the offline tools (`waltz disk ...`). Unlike
//! recovery, which repairs or refuses, these functions report what the bytes say: every
//! struct of the control file with its checksum, and a segment's records, where they stop being
//! valid and why, and whether its index agrees. Files are opened read-only and read in bounded
//! chunks; every length read from disk is checked before anything is allocated for it.
use crate::engine::control::{ControlEntry, ControlHeader, CONTROL_FILE, ENTRY_LEN};
use crate::engine::error::{Error, IoContext, Result};
use crate::engine::format::{FORMAT_VERSION, HEADER_LEN};
use crate::engine::fs::{FileHandle, FileSystem};
use crate::engine::record::{be_i64, ReqId};
use crate::engine::segment::{
    find_valid_record_after, ids_fit, index_name, is_zero_range, not_a_torn_write, parse_segment_name, scan_records,
    SegmentHeader,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Control entries decoded per read.
const ENTRIES_PER_READ: u64 = 4096;
/// Index entries compared per read.
const INDEX_ENTRIES_PER_READ: usize = 64 * 1024;

pub struct ControlReport {
    pub path: PathBuf,
    pub file_len: u64,
    pub header: ControlHeader,
    /// Entry `i` is the one stored for partition `i`, whatever id it holds.
    pub entries: Vec<ControlEntry>,
    /// Deviations from the format that do not stop the decoding.
    pub problems: Vec<String>,
}

/// Decodes `path`, a control file or a storage directory holding one.
pub fn inspect_control(fs: &dyn FileSystem, path: &Path) -> Result<ControlReport> {
    let path = if path.is_dir() {
        let p = path.join(CONTROL_FILE);
        if !fs.exists(&p) {
            return Err(Error::NotInitialised { path: path.to_path_buf() });
        }
        p
    } else {
        path.to_path_buf()
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if parse_segment_name(name, "seg").is_some() || parse_segment_name(name, "idx").is_some() {
        return Err(Error::InvalidArgument(format!("{} is a segment file, not a control file", path.display())));
    }
    let file = fs.open(&path, false).at(&path)?;
    let len = file.len().at(&path)?;
    if len < HEADER_LEN {
        return Err(Error::corruption(&path, 0, format!("{len} bytes: too short for a control file's header")));
    }
    let mut hb = [0u8; HEADER_LEN as usize];
    file.read_full_at(&mut hb, 0).at(&path)?;
    let header = ControlHeader::decode(&path, &hb, len)?;
    if header.partition_count == 0 {
        return Err(Error::corruption(&path, 28, "header claims 0 partitions: not a control file"));
    }
    let mut problems = Vec::new();
    if hb[32..].iter().any(|b| *b != 0) {
        problems.push("reserved header bytes 32..128 are not zero".to_string());
    }
    let expected_len = HEADER_LEN + ENTRY_LEN * header.partition_count as u64;
    if len > expected_len {
        problems.push(format!("{} bytes after the last partition entry", len - expected_len));
    }
    let count = header.partition_count as u64;
    let mut entries = Vec::with_capacity(count as usize);
    let mut buf = Vec::new();
    let mut done = 0u64;
    while done < count {
        let n = (count - done).min(ENTRIES_PER_READ);
        buf.resize((n * ENTRY_LEN) as usize, 0);
        file.read_full_at(&mut buf, HEADER_LEN + done * ENTRY_LEN).at(&path)?;
        entries.extend(buf.chunks_exact(ENTRY_LEN as usize).map(ControlEntry::decode));
        done += n;
    }
    Ok(ControlReport { path, file_len: len, header, entries, problems })
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordSummary {
    pub offset: u64,
    pub txid: i64,
    pub req_id: ReqId,
    pub header: i32,
    pub data_len: u64,
}

/// The first bytes that are not the expected record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordProblem {
    pub offset: u64,
    /// The id the record there should have carried.
    pub txid: i64,
    pub reason: String,
    /// A valid record found further on: the damage is corruption, not an unfinished write,
    /// unless `may_be_torn_write`. None means a torn tail (nothing valid follows).
    pub next_valid: Option<u64>,
    /// The valid records after it may be a torn write's survivors: unwritten space in the hole,
    /// nothing past the writer's unsynced bound (in the last segment, above the low-water mark,
    /// recovery cuts them: `segment::torn_write_with_survivors`).
    pub may_be_torn_write: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexMismatch {
    /// Position of the entry (record `first_txid + position`).
    pub position: u64,
    pub found: i64,
    pub expected: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexReport {
    pub path: PathBuf,
    pub file_len: u64,
    /// Its 128-byte header is byte for byte the data file's.
    pub header_matches: bool,
    pub entries: u64,
    /// Bytes of an incomplete entry at the end of the file.
    pub partial_bytes: u64,
    /// The first entry that is not the offset of the record it indexes.
    pub mismatch: Option<IndexMismatch>,
    /// Entries past the last valid record. (Fewer entries than records is the normal state of
    /// an index not yet checkpointed.)
    pub extra_entries: u64,
}

pub struct SegmentReport {
    pub path: PathBuf,
    pub file_len: u64,
    pub header: SegmentHeader,
    /// Whether the reserved header bytes 40..128 are zero.
    pub reserved_zero: bool,
    /// The first transaction id the file name gives.
    pub name_txid: i64,
    pub record_count: u64,
    /// Where the valid records end.
    pub valid_end: u64,
    /// Zeros from `valid_end` to the end of the file: space preallocated for later records.
    pub preallocated: u64,
    pub problem: Option<RecordProblem>,
    /// The first `limit` valid records.
    pub records: Vec<RecordSummary>,
    /// None when the segment has no index file.
    pub index: Option<IndexReport>,
}

impl SegmentReport {
    /// Ids of the first and last valid records, None when there are none.
    pub fn txid_range(&self) -> Option<(i64, i64)> {
        (self.record_count > 0).then(|| (self.header.first_txid, self.header.first_txid + self.record_count as i64 - 1))
    }
}

/// Compares index entries with the offsets of the records a walk finds, a chunk at a time.
struct IndexCheck {
    file: Arc<dyn FileHandle>,
    path: PathBuf,
    entries: u64,
    /// Record offsets not yet compared; the first is record `base`.
    pending: Vec<u64>,
    base: u64,
    raw: Vec<u8>,
    mismatch: Option<IndexMismatch>,
}

impl IndexCheck {
    fn push(&mut self, off: u64) -> Result<()> {
        self.pending.push(off);
        if self.pending.len() == INDEX_ENTRIES_PER_READ {
            self.compare()?;
        }
        Ok(())
    }

    fn compare(&mut self) -> Result<()> {
        let n = (self.pending.len() as u64).min(self.entries.saturating_sub(self.base)) as usize;
        if self.mismatch.is_none() && n > 0 {
            self.raw.resize(n * 8, 0);
            self.file.read_full_at(&mut self.raw, HEADER_LEN + 8 * self.base).at(&self.path)?;
            let hit = self.raw.chunks_exact(8).zip(&self.pending).position(|(e, o)| be_i64(e) != *o as i64);
            if let Some(j) = hit {
                self.mismatch = Some(IndexMismatch {
                    position: self.base + j as u64,
                    found: be_i64(&self.raw[8 * j..]),
                    expected: self.pending[j],
                });
            }
        }
        self.base += self.pending.len() as u64;
        self.pending.clear();
        Ok(())
    }
}

/// Walks the segment data file `path` (`<first txid>.seg`) and its `.idx` if there is one.
/// `max_record_size` bounds every record length read, as the engine's option does.
pub fn inspect_segment(
    fs: &dyn FileSystem,
    path: &Path,
    limit: usize,
    max_record_size: usize,
) -> Result<SegmentReport> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let name_txid = parse_segment_name(name, "seg").ok_or_else(|| {
        Error::InvalidArgument(format!("{} is not a segment data file (<first id, 19 digits>.seg)", path.display()))
    })?;
    let data = fs.open(path, false).at(path)?;
    let file_len = data.len().at(path)?;
    let mut hb = [0u8; HEADER_LEN as usize];
    if data.read_full_at(&mut hb, 0).at(path)? < HEADER_LEN as usize {
        return Err(Error::corruption(path, 0, format!("{file_len} bytes: shorter than the 128-byte segment header")));
    }
    let header = SegmentHeader::decode(&hb);
    if header.version != FORMAT_VERSION {
        return Err(Error::corruption(path, 0, format!("unknown segment format version {}", header.version)));
    }
    if !ids_fit(header.first_txid, file_len) {
        return Err(Error::corruption(
            path,
            32,
            format!("first transaction id {} leaves no room for the file's records", header.first_txid),
        ));
    }

    let index_path = path.with_file_name(index_name(name_txid));
    let mut check = None;
    let mut index = None;
    if fs.exists(&index_path) {
        let f = fs.open(&index_path, false).at(&index_path)?;
        let len = f.len().at(&index_path)?;
        let mut ib = [0u8; HEADER_LEN as usize];
        let header_matches = len >= HEADER_LEN && f.read_full_at(&mut ib, 0).at(&index_path)? == ib.len() && ib == hb;
        let body = len.saturating_sub(HEADER_LEN);
        index = Some(IndexReport {
            path: index_path.clone(),
            file_len: len,
            header_matches,
            entries: body / 8,
            partial_bytes: body % 8,
            mismatch: None,
            extra_entries: 0,
        });
        check = Some(IndexCheck {
            file: f,
            path: index_path,
            entries: body / 8,
            pending: Vec::new(),
            base: 0,
            raw: Vec::new(),
            mismatch: None,
        });
    }

    let mut records = Vec::new();
    let mut count = 0u64;
    let (valid_end, stopped) =
        scan_records(&data, path, HEADER_LEN, file_len, header.first_txid, max_record_size, |off, v| {
            if records.len() < limit {
                records.push(RecordSummary {
                    offset: off,
                    txid: v.header.txid,
                    req_id: v.header.req_id,
                    header: v.header.header,
                    data_len: v.data_len as u64,
                });
            }
            count += 1;
            match check.as_mut() {
                Some(c) => c.push(off),
                None => Ok(()),
            }
        })?;
    if let (Some(c), Some(r)) = (check.as_mut(), index.as_mut()) {
        c.compare()?;
        r.mismatch = c.mismatch.take();
        r.extra_entries = r.entries.saturating_sub(count);
    }
    let mut preallocated = 0;
    let problem = match stopped {
        None => None,
        Some((offset, _)) if is_zero_range(&data, path, offset, file_len)? => {
            preallocated = file_len - offset;
            None
        }
        Some((offset, why)) => {
            let txid = header.first_txid + count as i64;
            let next_valid = find_valid_record_after(&data, path, offset + 1, file_len, txid, max_record_size)?;
            let may_be_torn_write = match next_valid {
                Some(v) => not_a_torn_write(&data, path, offset, v, txid, file_len, max_record_size)?.is_none(),
                None => false,
            };
            Some(RecordProblem { offset, txid, reason: why.to_string(), next_valid, may_be_torn_write })
        }
    };
    Ok(SegmentReport {
        path: path.to_path_buf(),
        file_len,
        header,
        reserved_zero: hb[40..].iter().all(|b| *b == 0),
        name_txid,
        record_count: count,
        valid_end,
        preallocated,
        problem,
        records,
        index,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::control::{ControlFile, PartitionInfo};
    use crate::engine::fs::StdFs;
    use crate::engine::record::{encode_record, NewRecord};
    use crate::engine::segment::{create_segment, data_name};
    use std::os::unix::fs::FileExt;

    const KEY: [u8; 16] = [3; 16];
    const MAX: usize = 1 << 20;

    fn flip(path: &Path, off: u64) {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).unwrap();
        b[0] ^= 0xff;
        f.write_all_at(&b, off).unwrap();
    }

    /// A segment of records `first..first + n` with the first `indexed` of them in its index.
    fn write_segment(dir: &Path, first: i64, n: i64, indexed: usize) -> (PathBuf, Vec<u64>) {
        let h = SegmentHeader {
            version: FORMAT_VERSION,
            creation_ms: 5,
            cluster_key: KEY,
            partition_id: 1,
            first_txid: first,
        };
        let seg = create_segment(&StdFs, dir, &h).unwrap();
        let (mut buf, mut offs) = (Vec::new(), Vec::new());
        for t in first..first + n {
            offs.push(HEADER_LEN + buf.len() as u64);
            let d = vec![t as u8; 3 + t as usize % 17];
            let req_id = ReqId { client_id: 7, generation: 2, partition_id: 1, sequence: t as i32 };
            encode_record(&mut buf, t, &NewRecord { req_id, header: 40 + t as i32, data: &d, data_crc: None });
        }
        seg.files.data.write_all_at(&buf, HEADER_LEN).unwrap();
        let idx: Vec<u8> = offs[..indexed].iter().flat_map(|o| (*o as i64).to_be_bytes()).collect();
        seg.files.index.file.as_ref().unwrap().write_all_at(&idx, HEADER_LEN).unwrap();
        (dir.join(data_name(first)), offs)
    }

    #[test]
    fn control_shows_both_structs_and_which_is_current() {
        let d = tempfile::tempdir().unwrap();
        let mut c = ControlFile::create(&StdFs, d.path(), KEY, 2).unwrap();
        let a = PartitionInfo { session_id: 4, low_water_mark: 10, local_low_water_mark: 12 };
        let b = PartitionInfo { session_id: 5, low_water_mark: 20, local_low_water_mark: 20 };
        c.update(1, a).unwrap();
        c.update(1, b).unwrap();
        let r = inspect_control(&StdFs, d.path()).unwrap();
        assert_eq!(r.header.partition_count, 2);
        assert_eq!(r.header.cluster_key, KEY);
        assert_eq!(r.file_len, HEADER_LEN + 2 * ENTRY_LEN);
        assert!(r.problems.is_empty());
        let e = r.entries[1];
        assert_eq!(e.partition_id, 1);
        assert_eq!(e.structs, [(b, true), (a, true)]);
        assert_eq!(e.current(1), Some(0));
        assert_eq!(r.entries[0].structs[0], (PartitionInfo::NONE, true));

        // Damage the current struct: still shown, with its checksum failing; the other is current.
        flip(&r.path, HEADER_LEN + ENTRY_LEN + 4 + 9);
        let r = inspect_control(&StdFs, &r.path).unwrap();
        let e = r.entries[1];
        assert!(!e.structs[0].1);
        assert_ne!(e.structs[0].0, b);
        assert_eq!(e.structs[1], (a, true));
        assert_eq!(e.current(1), Some(1));
        // The engine agrees.
        assert_eq!(ControlFile::open(&StdFs, d.path(), true).unwrap().info(1).unwrap(), a);
    }

    #[test]
    fn control_refuses_what_is_not_a_control_file() {
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(inspect_control(&StdFs, d.path()), Err(Error::NotInitialised { .. })));
        let (seg, _) = write_segment(d.path(), 0, 2, 2);
        assert!(matches!(inspect_control(&StdFs, &seg), Err(Error::InvalidArgument(_))));
        let other = d.path().join("other");
        std::fs::write(&other, [0u8; 200]).unwrap();
        assert!(matches!(inspect_control(&StdFs, &other), Err(Error::Corruption { .. })));
        assert!(matches!(inspect_control(&StdFs, &d.path().join("missing")), Err(Error::Io { .. })));
    }

    #[test]
    fn a_healthy_segment_lists_its_records_and_a_matching_index() {
        let d = tempfile::tempdir().unwrap();
        let (seg, offs) = write_segment(d.path(), 100, 30, 30);
        let r = inspect_segment(&StdFs, &seg, 3, MAX).unwrap();
        assert_eq!(r.name_txid, 100);
        assert_eq!(r.header.partition_id, 1);
        assert!(r.reserved_zero);
        assert_eq!(r.record_count, 30);
        assert_eq!(r.txid_range(), Some((100, 129)));
        assert_eq!(r.valid_end, r.file_len);
        assert_eq!(r.problem, None);
        assert_eq!(r.records.len(), 3);
        assert_eq!(
            r.records[1],
            RecordSummary {
                offset: offs[1],
                txid: 101,
                req_id: ReqId { client_id: 7, generation: 2, partition_id: 1, sequence: 101 },
                header: 141,
                data_len: 3 + 101 % 17,
            }
        );
        let i = r.index.unwrap();
        assert!(i.header_matches);
        assert_eq!((i.entries, i.partial_bytes, i.extra_entries), (30, 0, 0));
        assert_eq!(i.mismatch, None);
    }

    #[test]
    fn a_short_index_is_fine_a_wrong_or_long_one_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let (seg, offs) = write_segment(d.path(), 0, 10, 4);
        let r = inspect_segment(&StdFs, &seg, 0, MAX).unwrap();
        let i = r.index.unwrap();
        assert_eq!((i.entries, i.mismatch, i.extra_entries), (4, None, 0));

        let idx = d.path().join(index_name(0));
        flip(&idx, HEADER_LEN + 8 * 2 + 7);
        let i = inspect_segment(&StdFs, &seg, 0, MAX).unwrap().index.unwrap();
        assert_eq!(i.mismatch, Some(IndexMismatch { position: 2, found: (offs[2] ^ 0xff) as i64, expected: offs[2] }));

        // Entries for records the data file does not hold, and half an entry.
        let extra: Vec<u8> = (0..12).flat_map(|k: i64| (1000 + k).to_be_bytes()).chain([1u8, 2, 3]).collect();
        std::fs::OpenOptions::new().write(true).open(&idx).unwrap().write_all_at(&extra, HEADER_LEN).unwrap();
        let i = inspect_segment(&StdFs, &seg, 0, MAX).unwrap().index.unwrap();
        assert_eq!((i.entries, i.partial_bytes, i.extra_entries), (12, 3, 2));
        assert_eq!(i.mismatch.unwrap().position, 0);

        flip(&idx, 20);
        assert!(!inspect_segment(&StdFs, &seg, 0, MAX).unwrap().index.unwrap().header_matches);
        std::fs::remove_file(&idx).unwrap();
        assert!(inspect_segment(&StdFs, &seg, 0, MAX).unwrap().index.is_none());
    }

    #[test]
    fn a_torn_tail_and_corruption_are_told_apart() {
        let d = tempfile::tempdir().unwrap();
        let (seg, offs) = write_segment(d.path(), 0, 8, 8);
        let len = std::fs::metadata(&seg).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(len - 5).unwrap();
        let r = inspect_segment(&StdFs, &seg, 100, MAX).unwrap();
        assert_eq!(r.record_count, 7);
        assert_eq!(r.valid_end, offs[7]);
        let p = r.problem.unwrap();
        assert_eq!((p.offset, p.txid, p.next_valid), (offs[7], 7, None));
        assert!(p.reason.contains("only"), "{}", p.reason);
        // The index names a record that is no longer whole: one extra entry, not a mismatch.
        let i = r.index.unwrap();
        assert_eq!((i.extra_entries, i.mismatch), (1, None));

        flip(&seg, offs[3] + 38);
        let r = inspect_segment(&StdFs, &seg, 100, MAX).unwrap();
        assert_eq!(r.record_count, 3);
        assert_eq!(r.records.len(), 3);
        let p = r.problem.unwrap();
        assert_eq!((p.offset, p.txid, p.next_valid), (offs[3], 3, Some(offs[4])));
        assert_eq!(p.reason, "data checksum mismatch");
    }

    #[test]
    fn lengths_from_disk_are_bounded_and_wrong_files_refused() {
        let d = tempfile::tempdir().unwrap();
        let (seg, offs) = write_segment(d.path(), 0, 3, 3);
        // A length field claiming 2 GiB - 1: refused before anything is allocated for it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .write_all_at(&i32::MAX.to_be_bytes(), offs[1] + 28)
            .unwrap();
        let p = inspect_segment(&StdFs, &seg, 0, MAX).unwrap().problem.unwrap();
        assert_eq!(p.reason, format!("impossible data length {}", i32::MAX));
        assert_eq!(p.next_valid, Some(offs[2]));

        let idx = d.path().join(index_name(0));
        assert!(matches!(inspect_segment(&StdFs, &idx, 0, MAX), Err(Error::InvalidArgument(_))));
        let short = d.path().join(data_name(9));
        std::fs::write(&short, [0u8; 100]).unwrap();
        assert!(matches!(inspect_segment(&StdFs, &short, 0, MAX), Err(Error::Corruption { offset: 0, .. })));
        let ctl = d.path().join(data_name(10));
        std::fs::write(&ctl, [7u8; 300]).unwrap();
        assert!(matches!(inspect_segment(&StdFs, &ctl, 0, MAX), Err(Error::Corruption { .. })));
    }
}
