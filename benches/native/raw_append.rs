//! The benchmark reference ("raw ceiling"): one `write` + `fdatasync` of the same payload per
//! iteration to a fresh file, in a minimal native loop with no engine code in it. The Python
//! benchmarks (benches/engine.py, storage_node.py, peers/loadgen.py) call it in-process through
//! `waltz._native.raw_append_loop`, so that the ceiling and the engine are timed alike; the
//! crate compiles this file as `waltz_native::bench_raw_append`.
use std::io::Write;
use std::path::Path;

/// Appends `payload` to a new file at `path` `iterations` times, each write followed by
/// fdatasync. Returns each iteration's latency in nanoseconds.
pub fn raw_append_loop(path: &Path, payload: &[u8], iterations: usize) -> std::io::Result<Vec<u64>> {
    let mut f = std::fs::OpenOptions::new().create_new(true).write(true).open(path)?;
    let mut out = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let t = std::time::Instant::now();
        f.write_all(payload).and_then(|_| f.sync_data())?;
        out.push(t.elapsed().as_nanos() as u64);
    }
    Ok(out)
}
