//! The next segment, prepared ahead of the roll on a thread of its own.
//!
//! Creating a segment costs two new files, each written, fdatasynced (a new file's blocks: a
//! journal commit), renamed and its directory fsynced: about 0.5–1 ms that the append crossing
//! `segment_size` used to pay under the state lock (docs/performance.md, "Where an append's time
//! goes"). A spare is the same two files made ahead with a placeholder header (and the first
//! stretch of preallocated zeros), synced, under names that end in `.tmp`: an open removes them
//! as files whose creation never completed, a read-only open and the inspection tools ignore
//! them, so a spare is never taken for log data. The roll writes the real header (its first id
//! and creation time are only known then) into both, syncs them (overwrites: no journal commit), renames
//! both files into place and fsyncs the directory once: a record of the new segment is
//! acknowledged only after that fsync, so its name survives a crash.
use crate::engine::error::{IoContext, Result};
use crate::engine::format::HEADER_LEN;
use crate::engine::fs::{FileHandle, FileSystem};
use crate::engine::index::{PendingIndex, SegmentIndex};
use crate::engine::segment::{data_name, index_name, Segment, SegmentFiles, SegmentHeader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

pub const SPARE_DATA: &str = "spare.seg.tmp";
pub const SPARE_INDEX: &str = "spare.idx.tmp";

/// A prepared spare: both files exist, synced, with `data_len` bytes in the data file (the
/// header's place, then zeros).
pub struct Spare {
    data_len: u64,
}

/// The partition's spare: none, being prepared, or ready (the thread's result).
#[derive(Default)]
pub struct SpareSlot(Mutex<Option<JoinHandle<Option<Spare>>>>);

impl SpareSlot {
    /// Starts preparing a spare unless one is prepared or being prepared.
    pub fn request(&self, fs: Arc<dyn FileSystem>, dir: &Path, zeros: u64) {
        let mut slot = super::lock(&self.0);
        if slot.is_some() {
            return;
        }
        let dir = dir.to_path_buf();
        let spawned = std::thread::Builder::new().name("waltz-spare".into()).spawn(move || {
            prepare(fs.as_ref(), &dir, zeros)
                .map_err(|e| {
                    log::warn!("{}: next segment not prepared ahead ({e}); the roll creates it", dir.display())
                })
                .ok()
        });
        match spawned {
            Ok(h) => *slot = Some(h),
            Err(e) => log::warn!("next segment not prepared ahead: no thread ({e})"),
        }
    }

    /// The spare, waiting for its preparation if it is under way (the roll would otherwise
    /// create the segment itself, which takes longer); None when there is none or it failed.
    pub fn take(&self) -> Option<Spare> {
        let h = super::lock(&self.0).take()?;
        h.join().ok().flatten()
    }

    /// Forgets the spare and removes its files (closing): a closed log's folder holds its
    /// segments only.
    /// A preparation that failed halfway may have left one file: it goes too.
    pub fn discard(&self, fs: &dyn FileSystem, dir: &Path) {
        let _ = self.take();
        for name in [SPARE_DATA, SPARE_INDEX] {
            let p = dir.join(name);
            if fs.exists(&p) {
                if let Err(e) = fs.remove_file(&p) {
                    log::debug!("{}: {e} (removed when the partition next opens)", p.display());
                }
            }
        }
    }
}

fn prepare(fs: &dyn FileSystem, dir: &Path, zeros: u64) -> std::io::Result<Spare> {
    let placeholder = [0u8; HEADER_LEN as usize];
    for name in [SPARE_INDEX, SPARE_DATA] {
        let p = dir.join(name);
        if fs.exists(&p) {
            fs.remove_file(&p)?;
        }
        let f = fs.create_new(&p)?;
        f.write_all_at(&placeholder, 0)?;
        if name == SPARE_DATA {
            write_zeros(f.as_ref(), HEADER_LEN, zeros)?;
        }
        f.sync_data()?;
    }
    Ok(Spare { data_len: HEADER_LEN + zeros })
}

fn write_zeros(f: &dyn FileHandle, from: u64, n: u64) -> std::io::Result<()> {
    let mut at = from;
    while at < from + n {
        let k = ((from + n - at) as usize).min(super::ZEROS.len());
        f.write_all_at(&super::ZEROS[..k], at)?;
        at += k as u64;
    }
    Ok(())
}

/// Makes `spare` the segment `header` describes: header written and synced, files renamed into
/// place (index first: an index alone is a leftover an open removes), the directory fsynced.
/// Returns the segment and its data file's length (its zeros count as preallocated).
pub fn install(spare: Spare, fs: &dyn FileSystem, dir: &Path, header: &SegmentHeader) -> Result<(Segment, u64)> {
    let bytes = header.encode();
    let (index_tmp, data_tmp) = (dir.join(SPARE_INDEX), dir.join(SPARE_DATA));
    let open = |p: &PathBuf| fs.open(p, true).at(p);
    // Both synced before the renames: a data file under a segment's name must carry that
    // segment's header, and an index whose header differs is damage to `waltz disk verify`.
    for p in [&index_tmp, &data_tmp] {
        let f = open(p)?;
        f.write_all_at(&bytes, 0).at(p)?;
        f.sync_data().at(p)?;
    }
    let index_path = dir.join(index_name(header.first_txid));
    let data_path = dir.join(data_name(header.first_txid));
    fs.rename(&index_tmp, &index_path).at(&index_path)?;
    fs.rename(&data_tmp, &data_path).at(&data_path)?;
    fs.sync_dir(dir).at(dir)?;
    // Opened again under their names: a file system seam may key its files by path.
    let (index, data) = (open(&index_path)?, open(&data_path)?);
    let files = SegmentFiles {
        first_txid: header.first_txid,
        data_path,
        data,
        index: SegmentIndex { path: index_path, file: Some(index), pending: RwLock::new(PendingIndex::default()) },
    };
    Ok((Segment { files: Arc::new(files), count: 0, end: HEADER_LEN }, spare.data_len))
}
