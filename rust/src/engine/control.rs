//! `waltz-storage.ctl`: a 128-byte header (version, creation time, cluster key, partition count)
//! then 60 bytes per partition: its id and two checksummed info structs written alternately, so a
//! torn update leaves the previous struct to fall back to.
use crate::engine::error::{Error, IoContext, Result};
use crate::engine::format::{now_ms, FORMAT_VERSION, HEADER_LEN};
use crate::engine::fs::{write_file_atomically, FileHandle, FileSystem};
use crate::engine::record::{be_i32, be_i64, be_u32, crc32};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const CONTROL_FILE: &str = "waltz-storage.ctl";
pub const ENTRY_LEN: u64 = 60;
const STRUCT_LEN: u64 = 28;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartitionInfo {
    pub session_id: i64,
    pub low_water_mark: i64,
    pub local_low_water_mark: i64,
}

impl PartitionInfo {
    pub const NONE: PartitionInfo = PartitionInfo { session_id: -1, low_water_mark: -1, local_low_water_mark: -1 };

    fn encode(&self) -> [u8; STRUCT_LEN as usize] {
        let mut b = [0u8; STRUCT_LEN as usize];
        b[0..8].copy_from_slice(&self.session_id.to_be_bytes());
        b[8..16].copy_from_slice(&self.low_water_mark.to_be_bytes());
        b[16..24].copy_from_slice(&self.local_low_water_mark.to_be_bytes());
        let crc = crc32(&b[0..24]);
        b[24..28].copy_from_slice(&crc.to_be_bytes());
        b
    }

    /// The struct's fields and whether its checksum holds.
    fn decode(b: &[u8]) -> (PartitionInfo, bool) {
        let info = PartitionInfo {
            session_id: be_i64(&b[0..8]),
            low_water_mark: be_i64(&b[8..16]),
            local_low_water_mark: be_i64(&b[16..24]),
        };
        (info, crc32(&b[0..24]) == be_u32(&b[24..28]))
    }

    /// Newer of two valid structs: sessions only grow, and within one session the marks only rise.
    fn order_key(&self) -> (i64, i64, i64) {
        (self.session_id, self.low_water_mark, self.local_low_water_mark)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlHeader {
    pub version: i32,
    pub creation_ms: i64,
    pub cluster_key: [u8; 16],
    pub partition_count: i32,
}

impl ControlHeader {
    /// Decodes the 128-byte header of a control file of `len` bytes, refusing an unknown version
    /// or a partition count the file is too short to hold.
    pub fn decode(path: &Path, hb: &[u8], len: u64) -> Result<ControlHeader> {
        let header = ControlHeader {
            version: be_i32(&hb[0..4]),
            creation_ms: be_i64(&hb[4..12]),
            cluster_key: hb[12..28].try_into().unwrap(),
            partition_count: be_i32(&hb[28..32]),
        };
        if header.version != FORMAT_VERSION {
            return Err(Error::corruption(path, 0, format!("unknown control file version {}", header.version)));
        }
        if header.partition_count < 0 || HEADER_LEN + ENTRY_LEN * header.partition_count as u64 > len {
            return Err(Error::corruption(
                path,
                28,
                format!("header claims {} partitions but the file holds {} bytes", header.partition_count, len),
            ));
        }
        Ok(header)
    }
}

/// One 60-byte partition entry as stored: the partition id and both structs, each with whether
/// its checksum holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlEntry {
    pub partition_id: i32,
    pub structs: [(PartitionInfo, bool); 2],
}

impl ControlEntry {
    pub fn decode(e: &[u8]) -> ControlEntry {
        ControlEntry {
            partition_id: be_i32(&e[0..4]),
            structs: [PartitionInfo::decode(&e[4..32]), PartitionInfo::decode(&e[32..60])],
        }
    }

    /// The slot (0 or 1) an open uses for partition `pid`: the newest struct whose checksum
    /// holds; None when both fail or the entry names another partition.
    pub fn current(&self, pid: i32) -> Option<usize> {
        if self.partition_id != pid {
            return None;
        }
        match self.structs {
            [(x, true), (y, true)] => Some(if y.order_key() > x.order_key() { 1 } else { 0 }),
            [(_, true), _] => Some(0),
            [_, (_, true)] => Some(1),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The slot holding the newest valid struct; None when both fail their checksum.
    current: Option<u8>,
    info: Option<PartitionInfo>,
}

pub struct ControlFile {
    pub path: PathBuf,
    file: Arc<dyn FileHandle>,
    pub header: ControlHeader,
    entries: Vec<Entry>,
}

fn entry_offset(pid: i32) -> u64 {
    HEADER_LEN + ENTRY_LEN * pid as u64
}

impl ControlFile {
    pub fn create(fs: &dyn FileSystem, dir: &Path, cluster_key: [u8; 16], partition_count: i32) -> Result<ControlFile> {
        let path = dir.join(CONTROL_FILE);
        let mut b = vec![0u8; (HEADER_LEN + ENTRY_LEN * partition_count as u64) as usize];
        b[0..4].copy_from_slice(&FORMAT_VERSION.to_be_bytes());
        b[4..12].copy_from_slice(&now_ms().to_be_bytes());
        b[12..28].copy_from_slice(&cluster_key);
        b[28..32].copy_from_slice(&partition_count.to_be_bytes());
        let none = PartitionInfo::NONE.encode();
        for pid in 0..partition_count {
            let o = entry_offset(pid) as usize;
            b[o..o + 4].copy_from_slice(&pid.to_be_bytes());
            b[o + 4..o + 32].copy_from_slice(&none);
            b[o + 32..o + 60].copy_from_slice(&none);
        }
        write_file_atomically(fs, &path, &b).at(&path)?;
        ControlFile::open(fs, dir, false)
    }

    pub fn open(fs: &dyn FileSystem, dir: &Path, read_only: bool) -> Result<ControlFile> {
        let path = dir.join(CONTROL_FILE);
        if !fs.exists(&path) {
            return Err(Error::NotInitialised { path: dir.to_path_buf() });
        }
        let file = fs.open(&path, !read_only).at(&path)?;
        // One writer per storage directory; read-only opens may watch a live directory.
        if !read_only && !file.try_lock_exclusive().at(&path)? {
            return Err(Error::Locked { path: dir.to_path_buf() });
        }
        let len = file.len().at(&path)?;
        if len < HEADER_LEN {
            return Err(Error::corruption(&path, 0, "control file is shorter than its header"));
        }
        let mut hb = [0u8; HEADER_LEN as usize];
        file.read_full_at(&mut hb, 0).at(&path)?;
        let header = ControlHeader::decode(&path, &hb, len)?;
        let mut body = vec![0u8; (ENTRY_LEN * header.partition_count as u64) as usize];
        file.read_full_at(&mut body, HEADER_LEN).at(&path)?;
        let mut entries = Vec::with_capacity(header.partition_count as usize);
        for (pid, e) in body.chunks_exact(ENTRY_LEN as usize).enumerate() {
            let decoded = ControlEntry::decode(e);
            let current = decoded.current(pid as i32);
            let info = current.map(|slot| decoded.structs[slot].0);
            if info.is_some() && !(decoded.structs[0].1 && decoded.structs[1].1) {
                log::warn!("{}: partition {} has one damaged info struct, using the other", path.display(), pid);
            }
            entries.push(Entry { current: current.map(|s| s as u8), info });
        }
        Ok(ControlFile { path, file, header, entries })
    }

    fn check_pid(&self, pid: i32) -> Result<()> {
        if pid < 0 || pid >= self.header.partition_count {
            return Err(Error::PartitionOutOfRange { partition: pid, count: self.header.partition_count });
        }
        Ok(())
    }

    /// The partition's newest valid info; corruption when both structs fail their checksum.
    pub fn info(&self, pid: i32) -> Result<PartitionInfo> {
        self.check_pid(pid)?;
        self.entries[pid as usize].info.ok_or_else(|| {
            Error::corruption(
                &self.path,
                entry_offset(pid),
                format!("both info structs of partition {pid} fail their checksum"),
            )
        })
    }

    /// Writes `info` into the slot not holding the current struct and syncs before returning.
    /// An open takes the struct with the larger (session, low-water mark, local low-water mark),
    /// not the one written last, so a lower one (a partition reset to NONE after losing its
    /// files) overwrites both slots, the current one first: a restart must not bring back the
    /// struct it replaced (the replica would then claim a session it holds nothing of, and
    /// recovery would not see that it forgot). Until the second write lands, an open finds the
    /// other slot's struct, which is older than the one replaced.
    pub fn update(&mut self, pid: i32, info: PartitionInfo) -> Result<()> {
        let current = self.info(pid)?;
        let entry = self.entries[pid as usize];
        let (now, other) = match entry.current {
            Some(0) => (0u8, 1u8),
            _ => (1u8, 0u8),
        };
        if info.order_key() < current.order_key() {
            self.write_slot(pid, now, &info)?;
        }
        self.write_slot(pid, other, &info)?;
        self.entries[pid as usize] = Entry { current: Some(other), info: Some(info) };
        Ok(())
    }

    fn write_slot(&self, pid: i32, slot: u8, info: &PartitionInfo) -> Result<()> {
        let off = entry_offset(pid) + 4 + STRUCT_LEN * slot as u64;
        self.file.write_all_at(&info.encode(), off).at(&self.path)?;
        self.file.sync_data().at(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::fs::StdFs;
    use std::os::unix::fs::FileExt;

    fn corrupt(path: &Path, off: u64) {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).unwrap();
        b[0] ^= 0xff;
        f.write_all_at(&b, off).unwrap();
    }

    #[test]
    fn updates_alternate_and_fall_back() {
        let d = tempfile::tempdir().unwrap();
        let mut c = ControlFile::create(&StdFs, d.path(), [7; 16], 3).unwrap();
        assert_eq!(c.info(1).unwrap(), PartitionInfo::NONE);
        let first = PartitionInfo { session_id: 5, low_water_mark: 10, local_low_water_mark: 9 };
        let second = PartitionInfo { session_id: 6, low_water_mark: 20, local_low_water_mark: 20 };
        c.update(1, first).unwrap();
        c.update(1, second).unwrap();
        let c2 = ControlFile::open(&StdFs, d.path(), true).unwrap();
        assert_eq!(c2.info(1).unwrap(), second);
        // Fresh entries start on slot 0, so the first update went to slot 1 and the second
        // back to slot 0; damaging slot 0 falls back to the first update.
        corrupt(&c.path, entry_offset(1) + 4 + 3);
        let c3 = ControlFile::open(&StdFs, d.path(), true).unwrap();
        assert_eq!(c3.info(1).unwrap(), first);
        // Both damaged: this partition refuses, the others still open.
        corrupt(&c.path, entry_offset(1) + 4 + 28 + 5);
        let c4 = ControlFile::open(&StdFs, d.path(), true).unwrap();
        assert!(matches!(c4.info(1), Err(Error::Corruption { .. })));
        assert_eq!(c4.info(0).unwrap(), PartitionInfo::NONE);
        assert!(matches!(c4.info(3), Err(Error::PartitionOutOfRange { .. })));
    }

    /// A lower struct (a reset to NONE) survives a reopen: the open picks the larger struct, so
    /// before, the one it replaced came back from the other slot.
    #[test]
    fn a_lower_update_is_not_undone_by_a_reopen() {
        let d = tempfile::tempdir().unwrap();
        let mut c = ControlFile::create(&StdFs, d.path(), [7; 16], 2).unwrap();
        let older = PartitionInfo { session_id: 4, low_water_mark: 80, local_low_water_mark: 80 };
        let newer = PartitionInfo { session_id: 5, low_water_mark: 100, local_low_water_mark: 90 };
        c.update(1, older).unwrap();
        c.update(1, newer).unwrap();
        c.update(1, PartitionInfo::NONE).unwrap();
        assert_eq!(c.info(1).unwrap(), PartitionInfo::NONE);
        drop(c);
        let mut c2 = ControlFile::open(&StdFs, d.path(), false).unwrap();
        assert_eq!(c2.info(1).unwrap(), PartitionInfo::NONE);
        // Later updates alternate again from there.
        c2.update(1, older).unwrap();
        c2.update(1, newer).unwrap();
        assert_eq!(ControlFile::open(&StdFs, d.path(), true).unwrap().info(1).unwrap(), newer);
        // Half way through a reset (the current slot overwritten, not yet the other): the older
        // struct, never the one replaced.
        let off = entry_offset(1) + 4 + STRUCT_LEN * c2.entries[1].current.unwrap() as u64;
        c2.file.write_all_at(&PartitionInfo::NONE.encode(), off).unwrap();
        assert_eq!(ControlFile::open(&StdFs, d.path(), true).unwrap().info(1).unwrap(), older);
    }
}
