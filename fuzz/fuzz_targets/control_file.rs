//! The storage directory's own files: the control file (`waltz-storage.ctl`) and the fence file
//! (`waltz-storage.fence`), opened as a storage node opens its directory (`Storage::open_with`,
//! which decodes both) and as `waltz disk dump-control` reads it (`inspect_control`).
//! Oracles: no panic; a partition whose info decodes can be updated and its fence raised, and
//! both read back the same after the directory is closed and opened again.
//!
//! Input: flags (bit 0: no fence file; bit 1: open read-only), fix-ups (bit 0: rewrite the CRC of
//! every info struct of the control file; bit 1: the fence file's CRC), then the control file
//! and the fence file as length-prefixed parts (see `Parts`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;
use std::sync::Arc;
use waltz_fuzz::{fix_trailing_crc, MemFs, Parts};
use waltz_native::engine::control::{PartitionInfo, CONTROL_FILE};
use waltz_native::engine::inspect::inspect_control;
use waltz_native::engine::partition::default_options;
use waltz_native::engine::storage::{Storage, FENCE_FILE};

fuzz_target!(|data: &[u8]| {
    let mut parts = Parts::new(data);
    let (flags, fix) = (parts.byte(), parts.byte());
    let (mut ctl, mut fence) = (parts.part().to_vec(), parts.part().to_vec());
    if fix & 1 != 0 {
        for entry in ctl.get_mut(128..).unwrap_or_default().chunks_exact_mut(60) {
            fix_trailing_crc(&mut entry[4..32], 0);
            fix_trailing_crc(&mut entry[32..60], 0);
        }
    }
    if fix & 2 != 0 {
        fix_trailing_crc(&mut fence, 0);
    }
    let (ctl, fence) = (&ctl[..], &fence[..]);
    let dir = Path::new("/s");
    let fs = Arc::new(MemFs::new());
    fs.put(&dir.join(CONTROL_FILE), ctl);
    if flags & 1 == 0 {
        fs.put(&dir.join(FENCE_FILE), fence);
    }

    if let Ok(r) = inspect_control(fs.as_ref(), &dir.join(CONTROL_FILE)) {
        assert_eq!(r.entries.len(), r.header.partition_count as usize);
        assert_eq!(r.file_len, ctl.len() as u64);
    }

    let mut opts = default_options();
    opts.recover.read_only = flags & 2 != 0;
    let Ok(s) = Storage::open_with(fs.clone(), dir, None, None, opts.clone()) else { return };
    let count = s.partition_count;
    assert!(count >= 0 && 128 + 60 * count as usize <= ctl.len());
    let mut written = Vec::new();
    for pid in 0..count.min(8) {
        let (Ok(info), Ok(fence)) = (s.partition_info(pid), s.fence(pid)) else { continue };
        assert!(fence >= info.session_id);
        // Sessions only grow (the newer of the two structs is the one with the higher session):
        // write the next one, as a storage node would.
        let Some(session_id) = info.session_id.checked_add(1).filter(|_| !opts.recover.read_only) else { continue };
        let next =
            PartitionInfo { session_id, low_water_mark: info.low_water_mark ^ 5, local_low_water_mark: pid as i64 };
        s.set_partition_info(pid, next).unwrap();
        assert_eq!(s.partition_info(pid).unwrap(), next);
        let raised = s.fence(pid).unwrap().saturating_add(1);
        assert_eq!(s.raise_fence(pid, raised).unwrap(), Ok(()));
        written.push((pid, next, raised));
    }
    assert!(s.partition_info(count).is_err() && s.partition_info(-1).is_err());
    s.close();
    drop(s);
    if written.is_empty() {
        return;
    }
    let s = Storage::open_with(fs.clone(), dir, None, None, opts).expect("a directory this target just wrote reopens");
    for (pid, info, fence) in written {
        assert_eq!(s.partition_info(pid).unwrap(), info);
        assert_eq!(s.fence(pid).unwrap(), fence.max(info.session_id));
    }
});
