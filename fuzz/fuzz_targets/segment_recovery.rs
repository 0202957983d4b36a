//! A partition folder as recovery finds it after a crash or on a damaged disk: up to two
//! segments (data `.seg` and index `.idx` files) and a truncation intent, all from the fuzz
//! input, opened by `Partition::open` (the storage node's path: segment headers, index
//! checkpoints, the record scan, torn tails, corruption, the intent) and walked by
//! `inspect_segment` (`waltz disk dump-segment` / `verify`).
//! Oracles: no panic, no runaway allocation or loop; records read from an opened partition
//! come in id order; a writable open of a log whose every record reads back leaves files that
//! take one more append and then reopen to exactly that log. (Damage behind a proven index
//! checkpoint is found when the record is read, not at open, by design: such logs are
//! exempt from the reopen oracle.)
//!
//! Input: flags, fix-ups, then five length-prefixed parts (see `Parts`): data and index of segment A,
//! data and index of segment B, the intent file. A segment's file name is the first id its
//! header gives (bytes 32..40) when that is a valid name, otherwise 0 (A) or 1 (B).
//! Flags: bit 0 read-only, bit 1 repair mode, bit 2 A has its index, bit 3 segment B exists,
//! bit 4 B has its index, bit 5 the intent file exists, bit 6 checkpoint every record
//! (otherwise every 4), bit 7 records of at most 64 bytes (otherwise 1 MiB).
//! Fix-ups (so mutations get past the checksums): bit 0 rewrites both CRCs of every record of
//! both data files, bit 1 the intent's CRC.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;
use std::sync::Arc;
use waltz_fuzz::{fix_record_crcs, fix_trailing_crc, MemFs, Parts};
use waltz_native::engine::inspect::inspect_segment;
use waltz_native::engine::partition::{default_options, Partition, TRUNCATE_INTENT};
use waltz_native::engine::record::{NewRecord, ReqId};
use waltz_native::engine::segment::{data_name, index_name, RecoveryMode};

pub const KEY: [u8; 16] = [7; 16];
pub const PID: i32 = 3;

fn name_of(data: &[u8], default: i64) -> i64 {
    match data.get(32..40) {
        Some(b) => Some(i64::from_be_bytes(b.try_into().unwrap())).filter(|t| *t >= 0).unwrap_or(default),
        None => default,
    }
}

fuzz_target!(|data: &[u8]| {
    let mut parts = Parts::new(data);
    let (flags, fix) = (parts.byte(), parts.byte());
    let (mut a_data, a_idx, mut b_data, b_idx, mut intent) =
        (parts.part().to_vec(), parts.part(), parts.part().to_vec(), parts.part(), parts.part().to_vec());
    if fix & 1 != 0 {
        fix_record_crcs(&mut a_data);
        fix_record_crcs(&mut b_data);
    }
    if fix & 2 != 0 && intent.len() >= 12 {
        fix_trailing_crc(&mut intent[..12], 0);
    }
    let (a_data, b_data, intent) = (&a_data[..], &b_data[..], &intent[..]);
    let dir = Path::new("/s/3");
    let fs = Arc::new(MemFs::new());
    fs.mkdir(dir);
    let a = name_of(a_data, 0);
    fs.put(&dir.join(data_name(a)), a_data);
    if flags & 4 != 0 {
        fs.put(&dir.join(index_name(a)), a_idx);
    }
    if flags & 8 != 0 {
        let b = name_of(b_data, 1);
        if b != a {
            fs.put(&dir.join(data_name(b)), b_data);
            if flags & 16 != 0 {
                fs.put(&dir.join(index_name(b)), b_idx);
            }
        }
    }
    if flags & 32 != 0 {
        fs.put(&dir.join(TRUNCATE_INTENT), intent);
    }
    let mut opts = default_options();
    opts.segment_size = 1 << 20;
    opts.recover.read_only = flags & 1 != 0;
    opts.recover.mode = if flags & 2 != 0 { RecoveryMode::TruncateAtCorruption } else { RecoveryMode::Strict };
    opts.recover.checkpoint_interval = if flags & 64 != 0 { 1 } else { 4 };
    opts.recover.max_record_size = if flags & 128 != 0 { 64 } else { 1 << 20 };
    let max = opts.recover.max_record_size;

    if let Ok(r) = inspect_segment(fs.as_ref(), &dir.join(data_name(a)), 16, max) {
        assert!(r.valid_end <= r.file_len && r.records.len() as u64 <= r.record_count);
    }

    let Ok(p) = Partition::open(fs.clone(), dir, PID, KEY, opts.clone()) else { return };
    let (first, last) = (p.first_txid(), p.max_txid());
    assert!(last >= first - 1);
    let mut next = first;
    while next <= last {
        match p.read_records(next, 64, 1 << 16) {
            Ok(recs) if !recs.is_empty() => {
                for r in &recs {
                    assert_eq!(r.txid, next);
                    next += 1;
                }
            }
            _ => break,
        }
    }
    let all_read = next > last;
    let _ = p.read_headers(first, 8);
    let _ = p.scan(first, last, 8, 1 << 12);
    if opts.recover.read_only || !all_read {
        return;
    }
    // The engine's id arithmetic needs the id after the appended one (2^63 ids: no real log).
    if last >= i64::MAX - 2 {
        return;
    }
    let new_id = last + 1;
    let rec = NewRecord {
        req_id: ReqId { client_id: 1, generation: 2, partition_id: PID, sequence: 3 },
        header: 9,
        data: b"fuzz",
        data_crc: None,
    };
    if p.append(new_id, &[rec]).is_err() {
        return;
    }
    p.close();
    drop(p);
    opts.recover.mode = RecoveryMode::Strict;
    let p = match Partition::open(fs.clone(), dir, PID, KEY, opts) {
        Ok(p) => p,
        Err(e) => panic!("recovered and appended to, the partition no longer opens: {e}"),
    };
    assert_eq!(p.max_txid(), new_id);
    let got = p.read_record(new_id).expect("the appended record reads back").expect("present");
    assert_eq!(got.data, b"fuzz");
});
