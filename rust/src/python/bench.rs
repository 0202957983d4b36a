//! Benchmark-only bindings: the raw ceiling the engine benchmarks compare against.
use super::errors::run;
use crate::engine::error::Error;
use pyo3::prelude::*;
use std::path::PathBuf;

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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(raw_append_loop, m)?)
}
