//! Retention on the storage node: the standing order of each partition's store session, and the
//! background thread that deletes whole segments by it, off the append path.
//!
//! Safety does not rest on the order alone: the node never deletes an id above its own local
//! low-water mark (its control file: the committed prefix this replica holds, which no recovery
//! ever truncates), minus the order's floor of transactions kept, nor at or above the order's
//! hold. An order stands for its lease only, and only while its session is the newest this node
//! has seen: a deposed server's order lapses at the next session's fence, and a server that
//! stopped renewing leaves a partition that keeps everything.
use super::connection::Shared;
use crate::engine::error::Result;
use crate::engine::format::now_ms;
use crate::engine::partition::lock;
use crate::engine::retention::{retention_start, RetentionPolicy};
use crate::node::protocol::RetentionOrder;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
struct Standing {
    order: RetentionOrder,
    until: Instant,
}

/// The retention orders of a node's partitions and its deletion thread's stop signal.
#[derive(Default)]
pub struct Retention {
    orders: Mutex<HashMap<i32, Standing>>,
    stop: (Mutex<bool>, Condvar),
}

impl Retention {
    pub(super) fn set(&self, order: RetentionOrder) {
        let lease = Duration::from_millis(order.lease_ms.clamp(0, 3_600_000) as u64);
        lock(&self.orders).insert(order.h.partition_id, Standing { order, until: Instant::now() + lease });
    }

    /// The order standing for `pid` now, if its lease runs and its session is the newest seen.
    fn standing(&self, shared: &Shared, pid: i32) -> Option<RetentionOrder> {
        let s = lock(&self.orders).get(&pid).copied()?;
        let fence = shared.storage.fence(pid).ok()?;
        if s.until <= Instant::now() || s.order.h.session_id < fence {
            lock(&self.orders).remove(&pid);
            return None;
        }
        Some(s.order)
    }

    /// The highest first id the partition may move to now (-1: no standing order), for status.
    pub(super) fn limit(&self, shared: &Shared, pid: i32) -> i64 {
        match self.standing(shared, pid) {
            Some(o) => limit(shared, pid, &o).unwrap_or(-1),
            None => -1,
        }
    }

    /// The standing order's hold for `pid` (i64::MAX: none active), -1 when no order stands.
    pub(super) fn hold(&self, shared: &Shared, pid: i32) -> i64 {
        self.standing(shared, pid).map_or(-1, |o| o.hold_from)
    }

    pub(super) fn stop(&self) {
        *lock(&self.stop.0) = true;
        self.stop.1.notify_all();
    }

    /// Waits `d` or until stopped; false once stopped.
    fn pause(&self, d: Duration) -> bool {
        let g = lock(&self.stop.0);
        let (g, _) = self.stop.1.wait_timeout_while(g, d, |stopped| !*stopped).unwrap_or_else(|e| e.into_inner());
        !*g
    }
}

/// Every id at or above this stays: one past the local low-water mark, less the floor, and no
/// higher than the hold.
fn limit(shared: &Shared, pid: i32, o: &RetentionOrder) -> Result<i64> {
    let info = shared.storage.partition_info(pid)?;
    let own = info.local_low_water_mark.saturating_add(1).saturating_sub(o.min_kept.max(0));
    Ok(own.min(o.hold_from))
}

fn policy(o: &RetentionOrder) -> RetentionPolicy {
    RetentionPolicy {
        max_age_ms: (o.max_age_ms >= 0).then_some(o.max_age_ms),
        max_bytes: (o.max_bytes >= 0).then_some(o.max_bytes as u64),
    }
}

/// One pass over the partitions with a standing order.
fn pass(shared: &Shared) {
    let pids: Vec<i32> = lock(&shared.retention.orders).keys().copied().collect();
    for pid in pids {
        let Some(order) = shared.retention.standing(shared, pid) else { continue };
        let writable = lock(&shared.availability).get(&pid).is_none_or(|a| a.1);
        // An admin holding the partition unwritable is copying or inspecting it: leave it be.
        if !writable {
            continue;
        }
        let Some((part, _)) = shared.storage.open_partition_info(pid) else { continue };
        let outcome = (|| {
            let cap = limit(shared, pid, &order)?;
            let spans = part.segment_spans()?;
            let start = retention_start(&spans, &policy(&order), cap, now_ms());
            if start > part.first_txid() {
                let before = part.reclaimed_bytes();
                let stopping = || *lock(&shared.retention.stop.0);
                let first = part.drop_segments_paced(start, shared.opts.retention_rate, &stopping)?;
                log::info!(
                    "partition {pid}: retention deleted ids below {first} ({} bytes; limit {cap})",
                    part.reclaimed_bytes() - before
                );
            }
            Ok::<_, crate::engine::error::Error>(())
        })();
        if let Err(e) = outcome {
            log::warn!("partition {pid}: retention pass failed: {e}");
        }
    }
}

/// Starts the deletion thread: a pass every `interval` until the node stops.
pub(super) fn spawn(shared: &Arc<Shared>, interval: Duration) -> std::io::Result<std::thread::JoinHandle<()>> {
    let weak: Weak<Shared> = Arc::downgrade(shared);
    std::thread::Builder::new().name("waltz-retention".into()).spawn(move || loop {
        let Some(sh) = weak.upgrade() else { return };
        if !sh.retention.pause(interval) {
            return;
        }
        pass(&sh);
    })
}
