//! Large flushes written past the page cache. The sync leader writes a flush of `DIRECT_MIN`
//! bytes or more with O_DIRECT: the tail's last partial 4 KiB block as it already lies in the
//! file, then the queued records, then zeros to the next 4 KiB boundary, from one aligned copy in
//! one write. The file's bytes up to the records' end are those a plain `pwritev` leaves; the
//! zeros after them are what preallocation leaves, and recovery and the roll treat them alike
//! (`tail_allocated`). The fdatasync that follows commits the size and the new blocks and
//! flushes the device's cache, as for a buffered write.
//!
//! Why: the fdatasync of 140 KB written through the page cache took 214 µs on this kind of
//! machine, the direct write of the same bytes from an aligned copy and its fdatasync 179 µs; at
//! 1.4 MB 739 against 486 µs (docs/performance.md, "Issue 38: large flushes past the page
//! cache"). Writing only the aligned middle directly and the partial blocks through the page
//! cache was slower than either: the dirty partial pages cost the sync an allocation of their own.
//!
//! The partial block is rewritten with the bytes it holds. They come from the last direct write
//! (kept here, with the file and the offset they end at) or, after any other write, an open, a
//! roll or a truncation, from a read of the file (the page cache has the block then). A torn rewrite leaves each
//! sector old or new, and the two agree up to the records' old end: what was acknowledged stays.
use crate::engine::fs::FileHandle;
use crate::engine::partition::queue::WriteQueue;
use crate::engine::segment::SegmentFiles;
use std::io;
use std::sync::{Arc, Mutex};

/// Flushes shorter than this go through the page cache: they land in zeros laid ahead, already
/// fast, and the direct path's gain falls with the size (13 % at 40 KB).
pub const DIRECT_MIN: u64 = 32 << 10;
/// O_DIRECT's alignment of offsets, lengths and memory: 4 KiB suits 512-byte and 4 KiB sectors.
const ALIGN: u64 = 4096;
/// Larger flushes go through the page cache: the aligned copy would be their size.
const DIRECT_MAX: u64 = 16 << 20;
/// Buffers for the aligned copies, shared by every partition of the process: a node's memory
/// grows with the flushes in progress at once, not with its partitions. At most `POOL_KEEP` are
/// kept; a fresh one costs its page faults (about 100 µs a MiB).
static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
const POOL_KEEP: usize = 8;
/// A buffer grown past this by a large flush is not kept.
const POOL_BUFFER_MAX: usize = 4 << 20;

/// The tail's file as the direct path knows it.
struct TailFile {
    files: Arc<SegmentFiles>,
    /// Its O_DIRECT handle; None where the file system refuses O_DIRECT.
    direct: Option<Arc<dyn FileHandle>>,
    /// The file's bytes from the last 4 KiB boundary before `end` up to `end`, as last written.
    last_block: Option<(u64, Vec<u8>)>,
}

/// What `DirectTail::write` did.
pub enum Flushed {
    /// Nothing: the caller writes the queue through the page cache.
    NotDirect,
    /// The records, and zeros after them up to this offset (their 4 KiB boundary).
    Direct(u64),
    /// The direct write failed part-way with EINVAL; the caller writes the queue through the page
    /// cache, and zeros may lie after the records up to this offset.
    Refused(u64),
}

#[derive(Default)]
pub struct DirectTail {
    tail: Option<TailFile>,
    /// Flushes written past the page cache so far.
    pub writes: u64,
}

/// Copies the queue's bytes, end to end, into `out` (exactly as long).
fn copy_queue(queue: &WriteQueue, out: &mut [u8]) {
    let mut at = 0;
    for s in queue.slices() {
        out[at..at + s.len()].copy_from_slice(&s);
        at += s.len();
    }
    debug_assert_eq!(at, out.len(), "the queue's pieces add up to its length");
}

impl DirectTail {
    /// Forgets the tail's last block: the file was written or cut some other way (a write
    /// through the page cache, a truncation); the next direct write reads the block from it.
    /// `files` is the tail's (an older tail's descriptors are closed here, so that a segment
    /// retention deletes does not stay open).
    pub fn forget(&mut self, files: &Arc<SegmentFiles>) {
        match &mut self.tail {
            Some(t) if Arc::ptr_eq(&t.files, files) => t.last_block = None,
            _ => self.tail = None,
        }
    }

    /// The data file whose descriptors this holds, if any.
    #[cfg(test)]
    pub fn held(&self) -> Option<&Arc<SegmentFiles>> {
        self.tail.as_ref().map(|t| &t.files)
    }

    /// Closes the O_DIRECT descriptor and forgets everything (a roll, a truncation, a close).
    pub fn release(&mut self) {
        self.tail = None;
    }

    fn tail_for(&mut self, files: &Arc<SegmentFiles>) -> &mut TailFile {
        if !self.tail.as_ref().is_some_and(|t| Arc::ptr_eq(&t.files, files)) {
            self.tail = Some(TailFile { files: files.clone(), direct: files.data.open_direct(), last_block: None });
        }
        self.tail.as_mut().unwrap()
    }

    /// Writes the queue at `at` (the tail's written end) past the page cache, if it is large
    /// enough and the file system allows. An error of the direct write is the flush's error.
    pub fn write(&mut self, files: &Arc<SegmentFiles>, queue: &WriteQueue, at: u64) -> io::Result<Flushed> {
        let len = queue.len();
        if !(DIRECT_MIN..=DIRECT_MAX).contains(&len) {
            return Ok(Flushed::NotDirect);
        }
        let tail = self.tail_for(files);
        let Some(direct) = tail.direct.clone() else {
            return Ok(Flushed::NotDirect);
        };
        let mut scratch = POOL.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        let written = Self::write_from(&mut scratch, tail, files, &direct, queue, at);
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOL_KEEP && scratch.len() <= POOL_BUFFER_MAX {
            pool.push(scratch);
        }
        drop(pool);
        if let Ok(Flushed::Direct(_)) = written {
            self.writes += 1;
        }
        written
    }

    /// `write`, with `scratch` for the aligned copy.
    fn write_from(
        scratch: &mut Vec<u8>,
        tail: &mut TailFile,
        files: &Arc<SegmentFiles>,
        direct: &Arc<dyn FileHandle>,
        queue: &WriteQueue,
        at: u64,
    ) -> io::Result<Flushed> {
        let len = queue.len();
        let start = at / ALIGN * ALIGN;
        let head = (at - start) as usize;
        let end = at + len;
        let padded = end.next_multiple_of(ALIGN);
        let total = (padded - start) as usize;
        if scratch.len() < total + ALIGN as usize {
            scratch.resize(total + ALIGN as usize, 0);
        }
        let skip = scratch.as_ptr().align_offset(ALIGN as usize);
        let buf = &mut scratch[skip..skip + total];
        match tail.last_block.take() {
            Some((e, bytes)) if e == at && bytes.len() == head => buf[..head].copy_from_slice(&bytes),
            _ => {
                if files.data.read_full_at(&mut buf[..head], start)? != head {
                    return Ok(Flushed::NotDirect); // shorter than its records: the plain write's case
                }
            }
        }
        copy_queue(queue, &mut buf[head..head + len as usize]);
        buf[head + len as usize..].fill(0);
        if let Err(e) = direct.write_all_at(buf, start) {
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
            // Accepted at open, refused at write (a device that wants a larger alignment): this
            // file's flushes go through the page cache; the caller rewrites whatever went out.
            log::warn!(
                "{}: O_DIRECT write refused ({e}); large flushes go through the page cache",
                files.data_path.display()
            );
            tail.direct = None;
            return Ok(Flushed::Refused(padded));
        }
        let block = end / ALIGN * ALIGN;
        tail.last_block = Some((end, buf[(block - start) as usize..(end - start) as usize].to_vec()));
        Ok(Flushed::Direct(padded))
    }
}
