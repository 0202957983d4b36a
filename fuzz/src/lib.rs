//! Shared pieces of the fuzz targets: an in-memory `FileSystem` (the engine's own seam, so the
//! targets run recovery exactly as a storage node does, without paying for real fsyncs), a
//! splitter that cuts one fuzz input into several files, and the CRC fix-up that lets the
//! fuzzer reach the message decoders behind the frame checksum.
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use waltz_native::engine::fs::{FileHandle, FileSystem};

/// No in-memory file may grow past this: a decoder that sizes a write from damaged bytes gets
/// ENOSPC instead of exhausting the fuzzer's memory (the real disk would refuse it too).
pub const MAX_FILE: u64 = 64 << 20;

#[derive(Default)]
pub struct MemFile {
    data: Mutex<Vec<u8>>,
}

impl MemFile {
    pub fn bytes(&self) -> Vec<u8> {
        self.data.lock().unwrap().clone()
    }
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(28)
}

impl FileHandle for MemFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let d = self.data.lock().unwrap();
        if offset >= d.len() as u64 {
            return Ok(0);
        }
        let o = offset as usize;
        let n = buf.len().min(d.len() - o);
        buf[..n].copy_from_slice(&d[o..o + n]);
        Ok(n)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset.checked_add(buf.len() as u64).ok_or_else(enospc)?;
        if end > MAX_FILE {
            return Err(enospc());
        }
        let mut d = self.data.lock().unwrap();
        if d.len() < end as usize {
            d.resize(end as usize, 0);
        }
        d[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        if len > MAX_FILE {
            return Err(enospc());
        }
        self.data.lock().unwrap().resize(len as usize, 0);
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.data.lock().unwrap().len() as u64)
    }
    fn try_lock_exclusive(&self) -> io::Result<bool> {
        Ok(true)
    }
}

/// A directory tree in memory. Paths are taken as given (absolute, no `..`).
#[derive(Default)]
pub struct MemFs {
    files: Mutex<BTreeMap<PathBuf, Arc<MemFile>>>,
    dirs: Mutex<BTreeSet<PathBuf>>,
}

fn not_found(p: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{}: no such file", p.display()))
}

impl MemFs {
    pub fn new() -> Self {
        let fs = MemFs::default();
        fs.dirs.lock().unwrap().insert(PathBuf::from("/"));
        fs
    }
    pub fn mkdir(&self, p: &Path) {
        let mut dirs = self.dirs.lock().unwrap();
        for a in p.ancestors() {
            dirs.insert(a.to_path_buf());
        }
    }
    pub fn put(&self, p: &Path, bytes: &[u8]) {
        if let Some(parent) = p.parent() {
            self.mkdir(parent);
        }
        let f = MemFile::default();
        *f.data.lock().unwrap() = bytes.to_vec();
        self.files.lock().unwrap().insert(p.to_path_buf(), Arc::new(f));
    }
    pub fn get(&self, p: &Path) -> Option<Vec<u8>> {
        self.files.lock().unwrap().get(p).map(|f| f.bytes())
    }
}

impl FileSystem for MemFs {
    fn open(&self, path: &Path, _writable: bool) -> io::Result<Arc<dyn FileHandle>> {
        match self.files.lock().unwrap().get(path) {
            Some(f) => Ok(f.clone()),
            None => Err(not_found(path)),
        }
    }
    fn create_new(&self, path: &Path) -> io::Result<Arc<dyn FileHandle>> {
        let mut files = self.files.lock().unwrap();
        if files.contains_key(path) || self.dirs.lock().unwrap().contains(path) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists"));
        }
        let f = Arc::new(MemFile::default());
        files.insert(path.to_path_buf(), f.clone());
        Ok(f)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut files = self.files.lock().unwrap();
        if let Some(f) = files.remove(from) {
            files.insert(to.to_path_buf(), f);
            return Ok(());
        }
        let mut dirs = self.dirs.lock().unwrap();
        if !dirs.contains(from) {
            return Err(not_found(from));
        }
        let moved_dirs: Vec<PathBuf> = dirs.iter().filter(|d| d.starts_with(from)).cloned().collect();
        for d in moved_dirs {
            dirs.remove(&d);
            dirs.insert(to.join(d.strip_prefix(from).unwrap()));
        }
        let moved: Vec<PathBuf> = files.keys().filter(|p| p.starts_with(from)).cloned().collect();
        for p in moved {
            let f = files.remove(&p).unwrap();
            files.insert(to.join(p.strip_prefix(from).unwrap()), f);
        }
        Ok(())
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.files.lock().unwrap().remove(path).map(|_| ()).ok_or_else(|| not_found(path))
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.dirs.lock().unwrap().insert(path.to_path_buf());
        Ok(())
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        self.files.lock().unwrap().retain(|p, _| !p.starts_with(path));
        self.dirs.lock().unwrap().retain(|p| !p.starts_with(path));
        Ok(())
    }
    fn sync_dir(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<PathBuf>> {
        if !self.dirs.lock().unwrap().contains(path) {
            return Err(not_found(path));
        }
        let mut out: Vec<PathBuf> =
            self.files.lock().unwrap().keys().filter(|p| p.parent() == Some(path)).cloned().collect();
        out.extend(self.dirs.lock().unwrap().iter().filter(|p| p.parent() == Some(path)).cloned());
        out.sort();
        Ok(out)
    }
    fn exists(&self, path: &Path) -> bool {
        self.files.lock().unwrap().contains_key(path) || self.dirs.lock().unwrap().contains(path)
    }
}

/// Cuts a fuzz input into parts: each part is a u16 big-endian length then that many bytes
/// (fewer when the input ends first; empty once it has ended).
pub struct Parts<'a> {
    rest: &'a [u8],
}

impl<'a> Parts<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Parts { rest: data }
    }
    pub fn byte(&mut self) -> u8 {
        match self.rest.split_first() {
            Some((b, r)) => {
                self.rest = r;
                *b
            }
            None => 0,
        }
    }
    pub fn part(&mut self) -> &'a [u8] {
        let n = ((self.byte() as usize) << 8) | self.byte() as usize;
        let n = n.min(self.rest.len());
        let (p, r) = self.rest.split_at(n);
        self.rest = r;
        p
    }
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }
}

/// Builds a fuzz input from parts, as `Parts` reads it (for seeds and reproducers).
pub fn join_parts(flags: u8, parts: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![flags];
    for p in parts {
        let p = &p[..p.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(p.len() as u16).to_be_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// Rewrites the CRC of every whole frame in a byte stream (length u32, then body whose last
/// four bytes are the CRC-32 of the rest), so mutations of a payload reach its decoder instead
/// of stopping at the checksum. Stops at the first length that does not fit.
pub fn fix_frame_crcs(stream: &mut [u8]) {
    let mut pos = 0usize;
    while stream.len() - pos >= 4 {
        let len = u32::from_be_bytes(stream[pos..pos + 4].try_into().unwrap()) as usize;
        if len < 8 || stream.len() - pos - 4 < len {
            return;
        }
        let body = &mut stream[pos + 4..pos + 4 + len];
        let crc = crc32fast_hash(&body[..len - 4]);
        body[len - 4..].copy_from_slice(&crc.to_be_bytes());
        pos += 4 + len;
    }
}

fn crc32fast_hash(b: &[u8]) -> u32 {
    waltz_native::engine::record::crc32(b)
}

/// Rewrites both checksums of every whole record in a segment data file (records from byte
/// 128 on, laid out as in `waltz_native::engine::record`), so mutated ids, lengths and headers reach
/// recovery's logic instead of failing the CRC check. Stops at the first impossible length.
pub fn fix_record_crcs(file: &mut [u8]) {
    use waltz_native::engine::record::{crc32, RECORD_OVERHEAD, RECORD_PREFIX};
    let mut pos = 128usize;
    while file.len() >= pos + RECORD_OVERHEAD {
        let len = i32::from_be_bytes(file[pos + 28..pos + 32].try_into().unwrap());
        if len < 0 || file.len() - pos - RECORD_OVERHEAD < len as usize {
            return;
        }
        let len = len as usize;
        let data_crc = crc32(&file[pos + RECORD_PREFIX..pos + RECORD_PREFIX + len]);
        file[pos + 32..pos + 36].copy_from_slice(&data_crc.to_be_bytes());
        let crc = crc32(&file[pos..pos + RECORD_PREFIX + len]);
        file[pos + RECORD_PREFIX + len..pos + RECORD_OVERHEAD + len].copy_from_slice(&crc.to_be_bytes());
        pos += RECORD_OVERHEAD + len;
    }
}

/// Sets the last four bytes of `b` to the CRC-32 of `b[from..len - 4]` (when `b` is long enough).
pub fn fix_trailing_crc(b: &mut [u8], from: usize) {
    if b.len() >= from + 4 {
        let n = b.len();
        let crc = waltz_native::engine::record::crc32(&b[from..n - 4]);
        b[n - 4..].copy_from_slice(&crc.to_be_bytes());
    }
}

/// The body of a protocol target: one flags byte (bit 0: leave frame CRCs as they are instead of
/// fixing them up; bit 1: a 64-byte frame maximum instead of the default), then a byte stream
/// split into frames as a connection loop does, each frame decoded as `$req` and as `$resp`.
/// Oracles: no panic, no frame bigger than the stream or the maximum, and whatever decodes
/// re-encodes to the same bytes (responses but for failures, whose unknown kinds decode as
/// Internal) and decodes again to the same message.
#[macro_export]
macro_rules! protocol_stream {
    ($data:expr, $magic:expr, $req:ty, $resp:ty) => {{
        use waltz_native::node::protocol::{msg, split_frame, DEFAULT_MAX_FRAME, FRAME_OVERHEAD};
        let data: &[u8] = $data;
        let Some((&flags, rest)) = data.split_first() else { return };
        let mut stream = rest.to_vec();
        if flags & 1 == 0 {
            $crate::fix_frame_crcs(&mut stream);
        }
        let max = if flags & 2 != 0 { 64 } else { DEFAULT_MAX_FRAME };
        let mut pos = 0usize;
        while let Ok(Some(f)) = split_frame(&stream[pos..], $magic, max) {
            assert!(f.size >= FRAME_OVERHEAD && f.size - 4 <= max && f.size <= stream.len() - pos);
            assert_eq!(f.payload.len() + FRAME_OVERHEAD, f.size);
            let bytes = &stream[pos..pos + f.size];
            if let Ok(req) = <$req>::decode(&f) {
                let mut again = Vec::new();
                req.encode(&mut again);
                assert_eq!(again, bytes, "{req:?} re-encodes differently");
                let _ = req.header();
            }
            if let Ok(resp) = <$resp>::decode(&f) {
                let mut again = Vec::new();
                resp.encode(&mut again);
                if f.msg_type != msg::FAILURE {
                    assert_eq!(again, bytes, "{resp:?} re-encodes differently");
                }
                let f2 = split_frame(&again, $magic, usize::MAX).unwrap().unwrap();
                assert_eq!(<$resp>::decode(&f2).unwrap(), resp);
            }
            pos += f.size;
        }
    }};
}
