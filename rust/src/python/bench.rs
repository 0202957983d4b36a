//! Benchmark-only bindings: the raw ceiling the engine benchmarks compare against, and writers
//! that append from native threads (as a storage node's connections do).
use super::errors::run;
use super::storage::PyPartition;
use crate::engine::error::Error;
use crate::engine::record::{NewRecord, ReqId};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The benchmark reference ("raw ceiling"), `benches/native/raw_append.rs`: appends `payload`
/// to a new file at `path` `iterations` times, each write followed by fdatasync. Returns each
/// iteration's latency in nanoseconds.
#[pyfunction]
fn raw_append_loop(py: Python<'_>, path: PathBuf, payload: Vec<u8>, iterations: usize) -> PyResult<Vec<u64>> {
    run(py, move || {
        crate::bench_raw_append::raw_append_loop(&path, &payload, iterations)
            .map_err(|e| Error::Io { path: path.clone(), source: e })
    })
}

/// `threads` native threads append single `size`-byte records to `partition` (`append_next`,
/// each waiting for its own durability) for `seconds`; returns the records appended. Group
/// commit without Python's wake-ups and GIL hand-offs between a sync and the next append.
#[pyfunction]
fn native_writers(py: Python<'_>, partition: &PyPartition, threads: usize, seconds: f64, size: usize) -> PyResult<u64> {
    let p = partition.0.clone();
    run(py, move || {
        let data = vec![0x5Au8; size];
        let until = Instant::now() + Duration::from_secs_f64(seconds);
        std::thread::scope(|s| {
            let writers: Vec<_> = (0..threads)
                .map(|k| {
                    let (p, data) = (&p, &data);
                    s.spawn(move || -> crate::engine::error::Result<u64> {
                        let mut n = 0u64;
                        while Instant::now() < until {
                            let req_id =
                                ReqId { client_id: k as i32, generation: 1, partition_id: p.id, sequence: n as i32 };
                            p.append_next(&[NewRecord { req_id, header: 0, data, data_crc: None }])?;
                            n += 1;
                        }
                        Ok(n)
                    })
                })
                .collect();
            writers.into_iter().map(|w| w.join().expect("writer thread panicked")).sum()
        })
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(raw_append_loop, m)?)?;
    m.add_function(wrap_pyfunction!(native_writers, m)?)
}
