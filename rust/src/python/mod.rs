//! The bindings that make the engine and the node `waltz._native`, one file per surface; each
//! registers its own names, the module only calls them.
use pyo3::prelude::*;

mod bench;
mod client_protocol;
mod errors;
mod inspect;
mod log;
mod node;
mod protocol;
mod scan;
mod storage;
mod types;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    log::install(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    bench::register(m)?;
    protocol::register(m)?;
    client_protocol::register(m)?;
    inspect::register(m)?;
    node::register(m)?;
    storage::register(m)?;
    types::register(m)?;
    scan::register(m)?;
    errors::register(m)?;
    Ok(())
}
