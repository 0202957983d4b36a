//! Opt-in timing of the append path's phases, to find what stalls an append (docs/performance.md,
//! "Where an append's time goes"). Off unless `WALTZ_ENGINE_PHASES=1` was set when the process
//! first opened a partition: then each phase costs two clock reads and three relaxed atomic adds;
//! off, one predictable branch on a cached flag.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The phases, in the order an append meets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the state lock in `enqueue`.
    LockWait = 0,
    /// Before the state lock: encoding a large batch (prefix CRCs, the copy of the records'
    /// bytes), or patching a laid-out batch's ids (`LaidBatch`).
    Encode,
    /// Putting the batch on the write queue and its entries on the index tail, under the state
    /// lock: encoding it there when it is small (or when `append_next` guessed its ids wrong).
    Enqueue,
    /// The sync leader's commit delay, waiting for more appenders to join its round.
    Gather,
    /// The leader's write of the queued records to the data file.
    Write,
    /// Zero-filling the tail ahead of its records (preallocation).
    Prealloc,
    /// The data file's fdatasync.
    Sync,
    /// The same, when the flush before it zero-filled ahead (the sync writes the zeros too).
    SyncZeros,
    /// Writing complete index checkpoint windows after a sync.
    Checkpoint,
    /// Sealing the tail and creating the next segment.
    Roll,
}

pub const PHASE_NAMES: [&str; N] =
    ["lock_wait", "encode", "enqueue", "gather", "write", "prealloc", "sync", "sync_zeros", "checkpoint", "roll"];
const N: usize = 10;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("WALTZ_ENGINE_PHASES").is_ok_and(|v| v == "1"))
}

#[derive(Default)]
struct Counter {
    count: AtomicU64,
    total_ns: AtomicU64,
    max_ns: AtomicU64,
}

/// One partition's phase counters (`None` inside when timing is off).
pub struct Phases(Option<Box<[Counter; N]>>);

impl Default for Phases {
    fn default() -> Self {
        Phases(enabled().then(|| Box::new(std::array::from_fn(|_| Counter::default()))))
    }
}

/// A phase being timed; `end` records it. Holds no clock when timing is off.
pub struct Timer(Option<Instant>);

impl Timer {
    /// A phase that started at `t0`, a clock read the caller made anyway.
    pub fn since(t0: Instant, phases: &Phases) -> Timer {
        Timer(phases.0.as_ref().map(|_| t0))
    }
}

impl Phases {
    pub fn start(&self) -> Timer {
        Timer(self.0.as_ref().map(|_| Instant::now()))
    }

    pub fn end(&self, phase: Phase, t: Timer) {
        if let (Some(c), Some(t0)) = (&self.0, t.0) {
            let ns = t0.elapsed().as_nanos() as u64;
            let c = &c[phase as usize];
            c.count.fetch_add(1, Ordering::Relaxed);
            c.total_ns.fetch_add(ns, Ordering::Relaxed);
            c.max_ns.fetch_max(ns, Ordering::Relaxed);
        }
    }

    /// (name, count, total ns, max ns) per phase, or None when timing is off.
    pub fn snapshot(&self) -> Option<Vec<(&'static str, u64, u64, u64)>> {
        let c = self.0.as_ref()?;
        Some(
            PHASE_NAMES
                .iter()
                .zip(c.iter())
                .map(|(n, c)| {
                    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
                    (*n, load(&c.count), load(&c.total_ns), load(&c.max_ns))
                })
                .collect(),
        )
    }
}
