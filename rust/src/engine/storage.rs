//! A storage directory: the control file plus one folder per partition.
use crate::engine::control::{ControlFile, PartitionInfo, CONTROL_FILE};
use crate::engine::format::format_uuid;

use crate::engine::error::{Error, IoContext, Result};
use crate::engine::fs::{parent_dir, FileSystem, StdFs};
use crate::engine::partition::{lock, Partition, PartitionOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub struct Storage {
    pub path: PathBuf,
    fs: Arc<dyn FileSystem>,
    opts: PartitionOptions,
    /// None once closed: dropping the control file releases the directory's writer lock.
    control: Mutex<Option<ControlFile>>,
    creation_ms: i64,
    partitions: Mutex<HashMap<i32, Arc<Partition>>>,
    fences: Mutex<HashMap<i32, i64>>,
    gates: Mutex<HashMap<i32, Arc<std::sync::RwLock<()>>>>,
    pub cluster_key: [u8; 16],
    pub partition_count: i32,
}

const DELETING_SUFFIX: &str = ".deleting";
const UNASSIGNED_SUFFIX: &str = ".unassigned";
/// The newest session id seen per partition (the storage node's fence), kept apart from the
/// control file, whose session is the last session that set a low-water mark.
pub const FENCE_FILE: &str = "waltz-storage.fence";

/// `waltz-storage.fence`: version i32, count i32, then (partition id i32, session id i64) per
/// entry, then CRC-32 of everything before it; always replaced whole (write, sync, rename).
fn encode_fences(fences: &HashMap<i32, i64>) -> Vec<u8> {
    let mut ids: Vec<_> = fences.iter().collect();
    ids.sort();
    let mut b = Vec::with_capacity(12 + 12 * ids.len());
    b.extend_from_slice(&1i32.to_be_bytes());
    b.extend_from_slice(&(ids.len() as i32).to_be_bytes());
    for (pid, session) in ids {
        b.extend_from_slice(&pid.to_be_bytes());
        b.extend_from_slice(&session.to_be_bytes());
    }
    let crc = crate::engine::record::crc32(&b);
    b.extend_from_slice(&crc.to_be_bytes());
    b
}

fn decode_fences(path: &Path, b: &[u8]) -> Result<HashMap<i32, i64>> {
    use crate::engine::record::{be_i32, be_i64, be_u32, crc32};
    let bad = |why: &str| Error::corruption(path, 0, why.to_string());
    if b.len() < 12 || crc32(&b[..b.len() - 4]) != be_u32(&b[b.len() - 4..]) {
        return Err(bad("fence file fails its checksum"));
    }
    if be_i32(&b[0..4]) != 1 {
        return Err(bad("unknown fence file version"));
    }
    let n = be_i32(&b[4..8]);
    if n < 0 || b.len() != 12 + 12 * n as usize {
        return Err(bad("fence file length does not match its count"));
    }
    Ok((0..n as usize).map(|i| (be_i32(&b[8 + 12 * i..]), be_i64(&b[12 + 12 * i..]))).collect())
}

impl Storage {
    pub fn create(path: &Path, cluster_key: [u8; 16], partition_count: i32, opts: PartitionOptions) -> Result<Storage> {
        Self::create_with(Arc::new(StdFs), path, cluster_key, partition_count, opts)
    }

    pub fn create_with(
        fs: Arc<dyn FileSystem>,
        path: &Path,
        cluster_key: [u8; 16],
        partition_count: i32,
        opts: PartitionOptions,
    ) -> Result<Storage> {
        if partition_count <= 0 {
            return Err(Error::InvalidArgument(format!("partition count must be positive, got {partition_count}")));
        }
        if fs.exists(&path.join(CONTROL_FILE)) {
            return Err(Error::AlreadyExists { path: path.to_path_buf() });
        }
        if !fs.exists(path) {
            crate::engine::fs::private_dir_builder().recursive(true).create(path).at(path)?;
            let parent = parent_dir(path);
            fs.sync_dir(parent).at(parent)?;
        } else {
            // An empty directory made for it (by an operator, a unit file): it holds the key now.
            use std::os::unix::fs::PermissionsExt;
            let private = std::fs::Permissions::from_mode(crate::engine::fs::DIR_MODE);
            std::fs::set_permissions(path, private).at(path)?;
        }
        ControlFile::create(fs.as_ref(), path, cluster_key, partition_count)?;
        Self::open_with(fs, path, Some(cluster_key), Some(partition_count), opts)
    }

    pub fn open(
        path: &Path,
        cluster_key: Option<[u8; 16]>,
        partition_count: Option<i32>,
        opts: PartitionOptions,
    ) -> Result<Storage> {
        Self::open_with(Arc::new(StdFs), path, cluster_key, partition_count, opts)
    }

    pub fn open_with(
        fs: Arc<dyn FileSystem>,
        path: &Path,
        cluster_key: Option<[u8; 16]>,
        partition_count: Option<i32>,
        opts: PartitionOptions,
    ) -> Result<Storage> {
        let control = ControlFile::open(fs.as_ref(), path, opts.recover.read_only)?;
        if let Some(k) = cluster_key {
            if k != control.header.cluster_key {
                return Err(Error::ClusterKeyMismatch {
                    path: control.path.clone(),
                    expected: format_uuid(&k),
                    found: format_uuid(&control.header.cluster_key),
                });
            }
        }
        if let Some(n) = partition_count {
            if n != control.header.partition_count {
                return Err(Error::PartitionCountMismatch {
                    path: control.path.clone(),
                    expected: n,
                    found: control.header.partition_count,
                });
            }
        }
        if !opts.recover.read_only {
            // A removal that crashed after renaming the folder aside: finish it.
            for p in fs.list_dir(path).at(path)? {
                if p.to_string_lossy().ends_with(DELETING_SUFFIX) {
                    fs.remove_dir_all(&p).at(&p)?;
                    fs.sync_dir(path).at(path)?;
                }
            }
        }
        let fence_path = path.join(FENCE_FILE);
        let fences = if fs.exists(&fence_path) {
            let f = fs.open(&fence_path, false).at(&fence_path)?;
            let mut b = vec![0u8; f.len().at(&fence_path)?.min(1 << 24) as usize];
            f.read_full_at(&mut b, 0).at(&fence_path)?;
            decode_fences(&fence_path, &b)?
        } else {
            HashMap::new()
        };
        Ok(Storage {
            fences: Mutex::new(fences),
            gates: Mutex::new(HashMap::new()),
            path: path.to_path_buf(),
            cluster_key: control.header.cluster_key,
            partition_count: control.header.partition_count,
            creation_ms: control.header.creation_ms,
            fs,
            opts,
            control: Mutex::new(Some(control)),
            partitions: Mutex::new(HashMap::new()),
        })
    }

    pub fn creation_ms(&self) -> i64 {
        self.creation_ms
    }

    fn with_control<T>(&self, f: impl FnOnce(&mut ControlFile) -> Result<T>) -> Result<T> {
        match lock(&self.control).as_mut() {
            Some(c) => f(c),
            None => Err(Error::StorageClosed { path: self.path.clone() }),
        }
    }

    fn check_pid(&self, pid: i32) -> Result<()> {
        if pid < 0 || pid >= self.partition_count {
            return Err(Error::PartitionOutOfRange { partition: pid, count: self.partition_count });
        }
        Ok(())
    }

    fn partition_dir(&self, pid: i32) -> PathBuf {
        self.path.join(pid.to_string())
    }

    /// Partition ids with a folder in this directory.
    pub fn partition_ids(&self) -> Result<Vec<i32>> {
        let mut ids = Vec::new();
        for p in self.fs.list_dir(&self.path).at(&self.path)? {
            if let Some(name) = p.file_name().and_then(|n| n.to_str()) {
                if let Ok(id) = name.parse::<i32>() {
                    if id >= 0 && id < self.partition_count && id.to_string() == name {
                        ids.push(id);
                    }
                }
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// Assigns the partition here: restores its files if it was unassigned without deleting
    /// them, otherwise creates them (and resets its session info, which a deleted replica of
    /// the same id may have left). Idempotent.
    pub fn add_partition(&self, pid: i32) -> Result<()> {
        self.check_pid(pid)?;
        self.with_control(|_| Ok(()))?;
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        let _map = lock(&self.partitions);
        let dir = self.partition_dir(pid);
        let parked = self.path.join(format!("{pid}{UNASSIGNED_SUFFIX}"));
        if !self.fs.exists(&dir) && self.fs.exists(&parked) {
            self.fs.rename(&parked, &dir).at(&parked)?;
            self.fs.sync_dir(&self.path).at(&self.path)?;
            return Ok(());
        }
        // New files hold no session: the control entry says so before the folder exists, so no
        // crash between the two leaves empty files beside an old session's info.
        if !self.fs.exists(&dir) && self.with_control(|c| c.info(pid))? != PartitionInfo::NONE {
            self.with_control(|c| c.update(pid, PartitionInfo::NONE))?;
        }
        Partition::create(self.fs.as_ref(), &dir, pid, self.cluster_key)?;
        Ok(())
    }

    /// Unassigns the partition: closes it and either deletes its files or parks them as
    /// `<id>.unassigned` (kept, not served, restored by `add_partition`). Renamed aside first,
    /// under the partition map's lock, so no request can reopen it half way. Deleting also
    /// deletes files parked before: `add_partition` would otherwise bring them back (the
    /// damaged copy a repair meant to replace).
    pub fn remove_partition(&self, pid: i32, delete_files: bool) -> Result<()> {
        self.check_pid(pid)?;
        let mut map = lock(&self.partitions);
        if let Some(p) = map.remove(&pid) {
            p.close();
        }
        let parked = self.path.join(format!("{pid}{UNASSIGNED_SUFFIX}"));
        let parked_doomed = self.path.join(format!("{pid}{UNASSIGNED_SUFFIX}{DELETING_SUFFIX}"));
        let dir = self.partition_dir(pid);
        let delete_parked = delete_files && self.fs.exists(&parked);
        let live = self.fs.exists(&dir);
        if !delete_parked && !live {
            return Ok(());
        }
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        // Everything is renamed away under the map's lock, so no request can reopen it half
        // way, and deleted after it (a large partition takes a while; an open finishes a
        // deletion a crash interrupted).
        if delete_parked {
            if self.fs.exists(&parked_doomed) {
                self.fs.remove_dir_all(&parked_doomed).at(&parked_doomed)?;
            }
            self.fs.rename(&parked, &parked_doomed).at(&parked)?;
        }
        let aside = self.path.join(format!("{pid}{}", if delete_files { DELETING_SUFFIX } else { UNASSIGNED_SUFFIX }));
        if live {
            if self.fs.exists(&aside) {
                self.fs.remove_dir_all(&aside).at(&aside)?;
            }
            self.fs.rename(&dir, &aside).at(&dir)?;
        }
        self.fs.sync_dir(&self.path).at(&self.path)?;
        drop(map);
        if delete_parked {
            self.fs.remove_dir_all(&parked_doomed).at(&parked_doomed)?;
        }
        if delete_files && live {
            self.fs.remove_dir_all(&aside).at(&aside)?;
        }
        if delete_files {
            self.fs.sync_dir(&self.path).at(&self.path)?;
        }
        Ok(())
    }

    /// The lock that orders a partition's writes and acknowledgements against a newer session:
    /// raising the fence takes it exclusively, a write holds it shared from its fence check to
    /// its effect, so no write of an older session lands after a newer session was served.
    pub fn fence_gate(&self, pid: i32) -> Arc<std::sync::RwLock<()>> {
        lock(&self.gates).entry(pid).or_default().clone()
    }

    /// The partition if it is already open (no I/O), with its session info.
    pub fn open_partition_info(&self, pid: i32) -> Option<(Arc<Partition>, PartitionInfo)> {
        let p = lock(&self.partitions).get(&pid).cloned()?;
        let info = self.partition_info(pid).ok()?;
        Some((p, info))
    }

    /// The open partition, recovering it on first use.
    pub fn partition(&self, pid: i32) -> Result<Arc<Partition>> {
        self.check_pid(pid)?;
        self.with_control(|_| Ok(()))?;
        let mut map = lock(&self.partitions);
        if let Some(p) = map.get(&pid) {
            return Ok(p.clone());
        }
        let dir = self.partition_dir(pid);
        if !self.fs.exists(&dir) {
            return Err(Error::PartitionNotFound { partition: pid });
        }
        // A partition whose control entry is unreadable must not serve: its session is unknown.
        let opts = self.partition_options(pid, self.opts.clone())?;
        let p = Arc::new(Partition::open(self.fs.clone(), &dir, pid, self.cluster_key, opts)?);
        map.insert(pid, p.clone());
        Ok(p)
    }

    /// Restarts the partition's log empty at `first` (`Partition::restart_files`), holding the
    /// open partitions' lock throughout so nothing opens it meanwhile. Refused unless `first` is
    /// past everything the partition holds: it replaces a log its peers no longer continue, it
    /// never cuts one.
    pub fn restart_partition(&self, pid: i32, first: i64) -> Result<Arc<Partition>> {
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        let p = self.partition(pid)?;
        let mut map = lock(&self.partitions);
        let max = p.settled_max_txid()?;
        if first <= max + 1 {
            return Err(Error::InvalidArgument(format!(
                "partition {pid} holds up to {max}: a restart at {first} would not be past its end"
            )));
        }
        if let Some(open) = map.remove(&pid) {
            open.close();
        }
        let dir = self.partition_dir(pid);
        Partition::restart_files(self.fs.as_ref(), &dir, pid, self.cluster_key, first)?;
        let opts = self.partition_options(pid, self.opts.clone())?;
        let reopened = Arc::new(Partition::open(self.fs.clone(), &dir, pid, self.cluster_key, opts)?);
        map.insert(pid, reopened.clone());
        Ok(reopened)
    }

    /// Writes every open partition's index tail and syncs it: the files are then complete as
    /// they would be after a clean close (before copying a live directory, say).
    /// One partition's failure does not keep the others from being flushed; the first error is
    /// returned.
    pub fn flush(&self) -> Result<()> {
        let mut parts: Vec<(i32, Arc<Partition>)> =
            lock(&self.partitions).iter().map(|(&id, p)| (id, p.clone())).collect();
        parts.sort_unstable_by_key(|&(id, _)| id); // in id order, so that a failure is reported the same way each time
        let mut first_error = None;
        for (_, p) in parts {
            if let Err(e) = p.flush_index() {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The newest session id seen for the partition: the higher of the persisted fence and the
    /// session recorded by the last Set Low-water Mark.
    pub fn fence(&self, pid: i32) -> Result<i64> {
        let fences = lock(&self.fences);
        let recorded = self.partition_info(pid)?.session_id;
        Ok(fences.get(&pid).copied().unwrap_or(-1).max(recorded))
    }

    /// Raises the partition's fence to `session` and makes it durable before returning; a
    /// session older than the fence is refused with the fence's value. The fence lock is held
    /// from the check to the write (and always taken before the control file's).
    pub fn raise_fence(&self, pid: i32, session: i64) -> Result<std::result::Result<(), i64>> {
        self.check_pid(pid)?;
        let gate = self.fence_gate(pid);
        let _exclusive = gate.write().unwrap_or_else(|e| e.into_inner());
        let mut fences = lock(&self.fences);
        let recorded = self.partition_info(pid)?.session_id;
        let current = fences.get(&pid).copied().unwrap_or(-1).max(recorded);
        if session < current {
            return Ok(Err(current));
        }
        if session > current {
            let mut next = fences.clone();
            next.insert(pid, session);
            let path = self.path.join(FENCE_FILE);
            crate::engine::fs::write_file_atomically(self.fs.as_ref(), &path, &encode_fences(&next)).at(&path)?;
            *fences = next;
        }
        Ok(Ok(()))
    }

    /// Lowers the partition's fence to `session` (an operator's repair of a fence raised by a
    /// request no server sent: `waltz storage reset-fence`), durably. Refused below the session
    /// the control file records (the last one that set a low-water mark: it wrote through this
    /// fence) and when `session` is not below the fence. Returns the fence it replaced.
    pub fn lower_fence(&self, pid: i32, session: i64) -> Result<i64> {
        self.check_pid(pid)?;
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        let gate = self.fence_gate(pid);
        let _exclusive = gate.write().unwrap_or_else(|e| e.into_inner());
        let mut fences = lock(&self.fences);
        let recorded = self.partition_info(pid)?.session_id;
        let current = fences.get(&pid).copied().unwrap_or(-1).max(recorded);
        if session < recorded {
            return Err(Error::InvalidArgument(format!(
                "partition {pid}: session {recorded} set its low-water mark here; the fence cannot go below it"
            )));
        }
        if session >= current {
            return Err(Error::InvalidArgument(format!(
                "partition {pid}: the fence is {current}, not above {session}: nothing to lower"
            )));
        }
        let mut next = fences.clone();
        next.insert(pid, session);
        let path = self.path.join(FENCE_FILE);
        crate::engine::fs::write_file_atomically(self.fs.as_ref(), &path, &encode_fences(&next)).at(&path)?;
        *fences = next;
        Ok(current)
    }

    /// Closes every open partition (their index tails are flushed) and releases the directory
    /// for another writer. Later calls on this handle fail with `StorageClosed`.
    pub fn close(&self) {
        for (_, p) in lock(&self.partitions).drain() {
            p.close();
        }
        lock(&self.control).take();
    }

    pub fn close_partition(&self, pid: i32) {
        if let Some(p) = lock(&self.partitions).remove(&pid) {
            p.close();
        }
    }

    /// Closes and recovers the partition again: the way out of a failed (poisoned) state.
    pub fn reopen_partition(&self, pid: i32) -> Result<Arc<Partition>> {
        self.close_partition(pid);
        self.partition(pid)
    }

    /// Opens a partition with a one-off recovery mode (repair), replacing any open handle.
    pub fn repair_partition(&self, pid: i32) -> Result<Arc<Partition>> {
        self.check_pid(pid)?;
        self.with_control(|_| Ok(()))?;
        self.close_partition(pid);
        let mut opts = self.partition_options(pid, self.opts.clone())?;
        opts.recover.mode = crate::engine::segment::RecoveryMode::TruncateAtCorruption;
        let dir = self.partition_dir(pid);
        if !self.fs.exists(&dir) {
            return Err(Error::PartitionNotFound { partition: pid });
        }
        let p = Arc::new(Partition::open(self.fs.clone(), &dir, pid, self.cluster_key, opts)?);
        lock(&self.partitions).insert(pid, p.clone());
        Ok(p)
    }

    /// `opts` for opening partition `pid`: its recovery knows the control file's low-water mark
    /// (records up to it are committed: never cut as a torn write).
    fn partition_options(&self, pid: i32, mut opts: PartitionOptions) -> Result<PartitionOptions> {
        opts.recover.low_water_mark = self.with_control(|c| c.info(pid))?.low_water_mark;
        Ok(opts)
    }

    pub fn partition_info(&self, pid: i32) -> Result<PartitionInfo> {
        self.with_control(|c| c.info(pid))
    }

    /// Records a new store session for the partition: its id, the cluster's high-water mark when
    /// it started (the low-water mark), and the local low-water mark (the highest id held here,
    /// capped by the low-water mark). Durable before returning.
    pub fn set_low_water_mark(&self, pid: i32, session_id: i64, low_water_mark: i64) -> Result<PartitionInfo> {
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        let local = self.partition(pid)?.max_txid().min(low_water_mark);
        let info = PartitionInfo { session_id, low_water_mark, local_low_water_mark: local };
        self.with_control(|c| c.update(pid, info))?;
        Ok(info)
    }

    /// Stores session information as given (the storage node records the newest session here).
    pub fn set_partition_info(&self, pid: i32, info: PartitionInfo) -> Result<()> {
        if self.opts.recover.read_only {
            return Err(Error::ReadOnly);
        }
        self.with_control(|c| c.update(pid, info))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::partition::default_options;

    #[test]
    fn create_open_and_mismatches() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("s");
        let s = Storage::create(&path, [1; 16], 3, default_options()).unwrap();
        assert!(matches!(Storage::create(&path, [1; 16], 3, default_options()), Err(Error::AlreadyExists { .. })));
        s.add_partition(1).unwrap();
        assert_eq!(s.partition_ids().unwrap(), vec![1]);
        assert!(matches!(s.add_partition(3), Err(Error::PartitionOutOfRange { .. })));
        assert!(matches!(s.partition(0), Err(Error::PartitionNotFound { .. })));
        drop(s);
        assert!(matches!(
            Storage::open(&path, Some([2; 16]), None, default_options()),
            Err(Error::ClusterKeyMismatch { .. })
        ));
        assert!(matches!(
            Storage::open(&path, None, Some(4), default_options()),
            Err(Error::PartitionCountMismatch { .. })
        ));
        let s = Storage::open(&path, Some([1; 16]), Some(3), default_options()).unwrap();
        assert_eq!(s.partition(1).unwrap().max_txid(), -1);
    }

    #[test]
    fn low_water_mark_is_capped_by_what_the_partition_holds() {
        let d = tempfile::tempdir().unwrap();
        let s = Storage::create(d.path(), [1; 16], 1, default_options()).unwrap();
        s.add_partition(0).unwrap();
        let info = s.set_low_water_mark(0, 4, 100).unwrap();
        assert_eq!((info.session_id, info.low_water_mark, info.local_low_water_mark), (4, 100, -1));
        assert_eq!(s.partition_info(0).unwrap(), info);
    }

    #[test]
    fn removal_deletes_files_crash_safely() {
        let d = tempfile::tempdir().unwrap();
        let s = Storage::create(d.path(), [1; 16], 2, default_options()).unwrap();
        s.add_partition(0).unwrap();
        let p = s.partition(0).unwrap();
        s.remove_partition(0, true).unwrap();
        assert!(matches!(p.read_record(0), Err(Error::Closed { .. })));
        assert!(!d.path().join("0").exists());
        assert!(s.partition_ids().unwrap().is_empty());
    }

    /// Files deleted and the partition added again: its session info is NONE, and stays so
    /// across a restart (before, the restart brought back the session it held nothing of, and
    /// recovery counted the empty replica as clean in it).
    #[test]
    fn a_partition_added_again_after_deletion_has_no_session_after_a_restart() {
        let d = tempfile::tempdir().unwrap();
        let s = Storage::create(d.path(), [1; 16], 1, default_options()).unwrap();
        s.add_partition(0).unwrap();
        s.set_low_water_mark(0, 4, 80).unwrap();
        s.set_low_water_mark(0, 5, 100).unwrap();
        s.remove_partition(0, true).unwrap();
        s.add_partition(0).unwrap();
        assert_eq!(s.partition_info(0).unwrap(), PartitionInfo::NONE);
        drop(s);
        let s = Storage::open(d.path(), Some([1; 16]), Some(1), default_options()).unwrap();
        assert_eq!(s.partition_info(0).unwrap(), PartitionInfo::NONE);
    }

    /// Parked, then deleted (the repair in docs/operations.md run on a node where the partition
    /// was already unassigned): the parked files go too, and adding it again starts empty.
    #[test]
    fn deleting_a_parked_partition_deletes_its_files() {
        let d = tempfile::tempdir().unwrap();
        let s = Storage::create(d.path(), [1; 16], 1, default_options()).unwrap();
        s.add_partition(0).unwrap();
        s.set_low_water_mark(0, 5, -1).unwrap();
        let rec =
            crate::engine::record::NewRecord { req_id: Default::default(), header: 0, data: b"old", data_crc: None };
        s.partition(0).unwrap().append(0, &[rec]).unwrap();
        s.remove_partition(0, false).unwrap();
        assert!(d.path().join(format!("0{UNASSIGNED_SUFFIX}")).exists());
        s.remove_partition(0, true).unwrap();
        assert!(!d.path().join(format!("0{UNASSIGNED_SUFFIX}")).exists(), "the parked files are still there");
        s.add_partition(0).unwrap();
        assert_eq!(s.partition(0).unwrap().max_txid(), -1);
        assert_eq!(s.partition_info(0).unwrap(), PartitionInfo::NONE);
    }

    /// One partition's index cannot be written (its disk is full): `flush` reports that and
    /// still writes the others' index tails (it used to stop at the first error).
    #[test]
    fn flush_goes_on_past_a_partition_that_fails() {
        let d = tempfile::tempdir().unwrap();
        drop(Storage::create(d.path(), [1; 16], 3, default_options()).unwrap());
        let faults = crate::engine::fs::FaultFs::new();
        let budget = faults.write_budget.clone();
        let fs = crate::engine::fs::WrapFs(
            move |path: &Path,
                  f: Arc<dyn crate::engine::fs::FileHandle>|
                  -> std::io::Result<Arc<dyn crate::engine::fs::FileHandle>> {
                let in_partition_0 = path.parent().and_then(|p| p.file_name()).is_some_and(|n| n == "0");
                Ok(if in_partition_0 && path.extension().is_some_and(|e| e == "idx") { faults.wrap(f) } else { f })
            },
        );
        let s = Storage::open_with(Arc::new(fs), d.path(), None, None, default_options()).unwrap();
        let index_len = |pid: i32| {
            std::fs::metadata(d.path().join(pid.to_string()).join(crate::engine::segment::index_name(0))).unwrap().len()
        };
        for pid in [0, 1, 2] {
            s.add_partition(pid).unwrap();
            let rec =
                crate::engine::record::NewRecord { req_id: Default::default(), header: 0, data: b"x", data_crc: None };
            s.partition(pid).unwrap().append(0, &[rec]).unwrap(); // one record: no checkpoint window is complete
        }
        let before = [1, 2].map(index_len);
        budget.store(0, std::sync::atomic::Ordering::SeqCst);
        let err = s.flush().unwrap_err();
        assert!(err.to_string().contains("No space left"), "{err}");
        assert_eq!([1, 2].map(index_len), before.map(|n| n + 8), "partitions 1 and 2 must get their index entry");
    }
}
