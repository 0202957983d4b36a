//! The file-system seam. Every byte the engine reads or writes goes through `FileSystem` and
//! `FileHandle`, so tests can inject write, sync and space failures without touching the kernel.
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

pub trait FileHandle: Send + Sync {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// fdatasync: data and the metadata needed to read it back (the size) are durable.
    fn sync_data(&self) -> io::Result<()>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
    /// Takes an exclusive advisory lock (flock) without waiting; false if another open file
    /// description holds it. Released when the handle is closed.
    fn try_lock_exclusive(&self) -> io::Result<bool>;

    /// Writes `bufs` end to end from `offset`. A file that can (`StdFile`) does it with `pwritev`,
    /// so the sync leader writes appenders' buffers where they are instead of copying them into
    /// one; wrappers and in-memory files write the pieces in turn through `write_all_at`.
    fn write_all_vectored_at(&self, bufs: &[io::IoSlice<'_>], offset: u64) -> io::Result<()> {
        let mut at = offset;
        for b in bufs {
            self.write_all_at(b, at)?;
            at += b.len() as u64;
        }
        Ok(())
    }

    /// A second handle on this file that writes past the page cache (O_DIRECT: offsets, lengths
    /// and memory 4 KiB aligned), for the sync leader's large flushes (`partition::direct`).
    /// None where the file system refuses it (tmpfs) or the file does not offer it.
    fn open_direct(&self) -> Option<Arc<dyn FileHandle>> {
        None
    }

    /// Reads exactly `buf.len()` bytes unless the file ends first; returns the count read.
    fn read_full_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
}

/// A file handle wrapping another (`inner`) that changes only some calls: a wrapper implements
/// this trait with the calls it changes, and is a `FileHandle` forwarding every other call to
/// `inner`. Fault injection and the tests' gates and order checks are such wrappers.
pub trait ForwardingFile: Send + Sync {
    fn inner(&self) -> &dyn FileHandle;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inner().read_at(buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner().write_all_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.inner().sync_data()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner().set_len(len)
    }
    fn len(&self) -> io::Result<u64> {
        self.inner().len()
    }
    fn try_lock_exclusive(&self) -> io::Result<bool> {
        self.inner().try_lock_exclusive()
    }
    /// None: a wrapper that sees every write (a gate, an order check) would not see the direct
    /// ones. One that can pass faults on (`FaultFile`) wraps the inner file's.
    fn open_direct(&self) -> Option<Arc<dyn FileHandle>> {
        None
    }
}

impl<T: ForwardingFile> FileHandle for T {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        ForwardingFile::read_at(self, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        ForwardingFile::write_all_at(self, buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        ForwardingFile::sync_data(self)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        ForwardingFile::set_len(self, len)
    }
    fn len(&self) -> io::Result<u64> {
        ForwardingFile::len(self)
    }
    fn try_lock_exclusive(&self) -> io::Result<bool> {
        ForwardingFile::try_lock_exclusive(self)
    }
    fn open_direct(&self) -> Option<Arc<dyn FileHandle>> {
        ForwardingFile::open_direct(self)
    }
}

/// Files are opened through it, so tests can wrap them (faults, gates, order checks). The
/// directory operations are the real ones unless a test file system overrides them.
pub trait FileSystem: Send + Sync {
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn FileHandle>>;
    /// Creates a new file, failing if it exists.
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn FileHandle>>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        private_dir_builder().create(path)
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }
    /// fsync of a directory, so that creations, renames and deletions inside it survive a crash.
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(path)? {
            out.push(entry?.path());
        }
        out.sort();
        Ok(out)
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
}

pub struct StdFile(File);

fn flock_exclusive(f: &File) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

impl FileHandle for StdFile {
    fn try_lock_exclusive(&self) -> io::Result<bool> {
        flock_exclusive(&self.0)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.0.read_at(buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_all_at(buf, offset)
    }
    fn write_all_vectored_at(&self, bufs: &[io::IoSlice<'_>], offset: u64) -> io::Result<()> {
        pwritev_all(&self.0, bufs, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn open_direct(&self) -> Option<Arc<dyn FileHandle>> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        // Through /proc/self/fd: the file may have been renamed since it was opened (a spare
        // segment), and its old path may name another file now.
        let path = format!("/proc/self/fd/{}", self.0.as_raw_fd());
        let d = OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(path).ok()?;
        let (a, b) = (self.0.metadata().ok()?, d.metadata().ok()?);
        (a.dev() == b.dev() && a.ino() == b.ino()).then(|| Arc::new(StdFile(d)) as Arc<dyn FileHandle>)
    }
}

/// Linux's IOV_MAX: the most slices one pwritev takes.
const IOV_MAX: usize = 1024;

/// `pwritev` of all of `bufs` from `offset`: at most IOV_MAX slices per call, a short write
/// resumed where it stopped, EINTR retried.
fn pwritev_all(f: &File, bufs: &[io::IoSlice<'_>], offset: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut slices: Vec<io::IoSlice<'_>> = bufs.to_vec();
    let mut rest: &mut [io::IoSlice<'_>] = &mut slices;
    io::IoSlice::advance_slices(&mut rest, 0);
    let mut at = offset;
    while !rest.is_empty() {
        let n = rest.len().min(IOV_MAX);
        let off = libc::off_t::try_from(at).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: IoSlice is ABI-compatible with iovec on Unix, and the n slices it points at
        // are borrowed for the duration of the call.
        let r = unsafe { libc::pwritev(f.as_raw_fd(), rest.as_ptr().cast::<libc::iovec>(), n as libc::c_int, off) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        at += r as u64;
        io::IoSlice::advance_slices(&mut rest, r as usize);
    }
    Ok(())
}

#[derive(Default)]
pub struct StdFs;

impl FileSystem for StdFs {
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn FileHandle>> {
        let f = OpenOptions::new().read(true).write(writable).open(path)?;
        Ok(Arc::new(StdFile(f)))
    }
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn FileHandle>> {
        let f = OpenOptions::new().read(true).write(true).create_new(true).mode(FILE_MODE).open(path)?;
        Ok(Arc::new(StdFile(f)))
    }
}

/// A `StdFs` that fails on command: the n-th and later syncs, or writes once a byte budget is
/// spent (disk full). Used by the Rust unit tests; Python tests use strace fault injection.
#[derive(Default)]
pub struct FaultFs {
    /// Syncs left before every further sync fails with EIO; negative means never fail.
    pub syncs_before_eio: Arc<AtomicI64>,
    /// Bytes that may still be written before writes fail with ENOSPC; u64::MAX means unlimited.
    pub write_budget: Arc<AtomicU64>,
}

impl FaultFs {
    pub fn new() -> Self {
        FaultFs { syncs_before_eio: Arc::new(AtomicI64::new(-1)), write_budget: Arc::new(AtomicU64::new(u64::MAX)) }
    }

    /// Puts `inner` under this file system's faults: a test's `WrapFs` can fault some files only.
    pub fn wrap(&self, inner: Arc<dyn FileHandle>) -> Arc<dyn FileHandle> {
        Arc::new(FaultFile {
            inner,
            syncs_before_eio: self.syncs_before_eio.clone(),
            write_budget: self.write_budget.clone(),
        })
    }
}

struct FaultFile {
    inner: Arc<dyn FileHandle>,
    syncs_before_eio: Arc<AtomicI64>,
    write_budget: Arc<AtomicU64>,
}

impl ForwardingFile for FaultFile {
    fn inner(&self) -> &dyn FileHandle {
        self.inner.as_ref()
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let budget = self.write_budget.load(Ordering::SeqCst);
        if budget != u64::MAX {
            if (buf.len() as u64) > budget {
                // A full disk accepts a prefix of the write, as a real one may.
                self.inner.write_all_at(&buf[..budget as usize], offset)?;
                self.write_budget.store(0, Ordering::SeqCst);
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            self.write_budget.store(budget - buf.len() as u64, Ordering::SeqCst);
        }
        self.inner.write_all_at(buf, offset)
    }
    fn open_direct(&self) -> Option<Arc<dyn FileHandle>> {
        Some(Arc::new(FaultFile {
            inner: self.inner.open_direct()?,
            syncs_before_eio: self.syncs_before_eio.clone(),
            write_budget: self.write_budget.clone(),
        }))
    }
    fn sync_data(&self) -> io::Result<()> {
        let left = self.syncs_before_eio.load(Ordering::SeqCst);
        if left == 0 {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if left > 0 {
            self.syncs_before_eio.fetch_sub(1, Ordering::SeqCst);
        }
        self.inner.sync_data()
    }
}

impl FileSystem for FaultFs {
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn FileHandle>> {
        Ok(self.wrap(StdFs.open(path, writable)?))
    }
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn FileHandle>> {
        Ok(self.wrap(StdFs.create_new(path)?))
    }
}

/// `StdFs` with every file it opens or creates passed through the closure: tests wrap the files
/// there (a gate on syncs, injected errors, a write-order check) and keep every other operation.
pub struct WrapFs<F>(pub F);

impl<F> FileSystem for WrapFs<F>
where
    F: Fn(&Path, Arc<dyn FileHandle>) -> io::Result<Arc<dyn FileHandle>> + Send + Sync,
{
    fn open(&self, path: &Path, writable: bool) -> io::Result<Arc<dyn FileHandle>> {
        (self.0)(path, StdFs.open(path, writable)?)
    }
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn FileHandle>> {
        (self.0)(path, StdFs.create_new(path)?)
    }
}

/// Writes a complete file under a temporary name, syncs it, renames it into place and syncs the
/// directory, so the file is either absent or whole after a crash.
pub fn write_file_atomically(fs: &dyn FileSystem, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = tmp_path(path);
    if fs.exists(&tmp) {
        fs.remove_file(&tmp)?;
    }
    let f = fs.create_new(&tmp)?;
    f.write_all_at(bytes, 0)?;
    f.sync_data()?;
    drop(f);
    fs.rename(&tmp, path)?;
    fs.sync_dir(parent_dir(path))
}

/// Mode of every file the engine creates: the control file and every segment header hold the
/// cluster key, and records are the applications' data, so only the node's own user reads them
/// (a umask of 022 left them readable to anyone on the host: issue 34).
pub const FILE_MODE: u32 = 0o600;
/// Mode of every directory the engine creates, the storage directory included.
pub const DIR_MODE: u32 = 0o700;

/// Creates directories with `DIR_MODE` (recursively when asked), whatever the umask.
pub fn private_dir_builder() -> std::fs::DirBuilder {
    let mut b = std::fs::DirBuilder::new();
    b.mode(DIR_MODE);
    b
}

/// The folder holding `path`; "." for a bare relative name (whose parent is the empty path).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_file_atomically(&StdFs, &p, b"one").unwrap();
        std::fs::write(tmp_path(&p), b"stale").unwrap();
        write_file_atomically(&StdFs, &p, b"two!").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two!");
        assert!(!tmp_path(&p).exists());
    }

    #[test]
    fn fault_fs_fails_syncs_and_writes_on_command() {
        let d = tempfile::tempdir().unwrap();
        let fs = FaultFs::new();
        let f = fs.create_new(&d.path().join("f")).unwrap();
        fs.syncs_before_eio.store(1, Ordering::SeqCst);
        f.sync_data().unwrap();
        assert_eq!(f.sync_data().unwrap_err().raw_os_error(), Some(libc::EIO));
        fs.write_budget.store(3, Ordering::SeqCst);
        assert_eq!(f.write_all_at(b"abcdef", 0).unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(f.len().unwrap(), 3);
    }
}
