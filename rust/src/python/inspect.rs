//! Offline inspection (`waltz disk`): control and segment files decoded without opening the storage.
use super::errors::{run, InvalidArgumentError};
use crate::engine::control::PartitionInfo;
use crate::engine::format::format_uuid;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;

fn info_dict<'py>(py: Python<'py>, (info, checksum_ok): (PartitionInfo, bool)) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("session_id", info.session_id)?;
    d.set_item("low_water_mark", info.low_water_mark)?;
    d.set_item("local_low_water_mark", info.local_low_water_mark)?;
    d.set_item("checksum_ok", checksum_ok)?;
    Ok(d)
}

/// Decodes a control file (or the one in a storage directory) without opening the storage:
/// the header and, per partition, both info structs with their checksum state.
#[pyfunction]
fn inspect_control<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let r = run(py, move || crate::engine::inspect::inspect_control(&crate::engine::fs::StdFs, &path))?;
    let d = PyDict::new(py);
    d.set_item("path", r.path.to_string_lossy())?;
    d.set_item("file_length", r.file_len)?;
    d.set_item("version", r.header.version)?;
    d.set_item("creation_time_ms", r.header.creation_ms)?;
    d.set_item("cluster_key", format_uuid(&r.header.cluster_key))?;
    d.set_item("partition_count", r.header.partition_count)?;
    d.set_item("problems", r.problems)?;
    let parts = PyList::empty(py);
    for (i, e) in r.entries.iter().enumerate() {
        let p = PyDict::new(py);
        p.set_item("partition", i)?;
        p.set_item("stored_partition_id", e.partition_id)?;
        p.set_item("structs", [info_dict(py, e.structs[0])?, info_dict(py, e.structs[1])?])?;
        // Numbered as in docs/format.md: struct 1 and struct 2.
        p.set_item("current", e.current(i as i32).map(|s| s + 1))?;
        parts.append(p)?;
    }
    d.set_item("partitions", parts)?;
    Ok(d)
}

/// Walks a segment data file and its index without opening the storage: header, record
/// count and range, the first invalid record (torn tail or corruption), the first `limit`
/// records, and whether the index agrees with the records.
#[pyfunction]
#[pyo3(signature = (path, limit=50, *, max_record_size=16<<20))]
fn inspect_segment<'py>(
    py: Python<'py>,
    path: PathBuf,
    limit: usize,
    max_record_size: usize,
) -> PyResult<Bound<'py, PyDict>> {
    if max_record_size == 0 || max_record_size > (1 << 30) {
        return Err(InvalidArgumentError::new_err("max_record_size must be between 1 byte and 1 GiB"));
    }
    let r = run(py, move || {
        crate::engine::inspect::inspect_segment(&crate::engine::fs::StdFs, &path, limit, max_record_size)
    })?;
    let d = PyDict::new(py);
    d.set_item("path", r.path.to_string_lossy())?;
    d.set_item("file_length", r.file_len)?;
    let h = PyDict::new(py);
    h.set_item("version", r.header.version)?;
    h.set_item("creation_time_ms", r.header.creation_ms)?;
    h.set_item("cluster_key", format_uuid(&r.header.cluster_key))?;
    h.set_item("partition_id", r.header.partition_id)?;
    h.set_item("first_txid", r.header.first_txid)?;
    h.set_item("reserved_zero", r.reserved_zero)?;
    d.set_item("header", h)?;
    d.set_item("name_txid", r.name_txid)?;
    d.set_item("record_count", r.record_count)?;
    let range = r.txid_range();
    d.set_item("first_txid", range.map(|x| x.0))?;
    d.set_item("last_txid", range.map(|x| x.1))?;
    d.set_item("valid_end", r.valid_end)?;
    d.set_item("preallocated_bytes", r.preallocated)?;
    let problem = match &r.problem {
        None => None,
        Some(p) => {
            let pd = PyDict::new(py);
            pd.set_item("offset", p.offset)?;
            pd.set_item("txid", p.txid)?;
            pd.set_item("reason", &p.reason)?;
            pd.set_item("torn_tail", p.next_valid.is_none())?;
            pd.set_item("next_valid_offset", p.next_valid)?;
            pd.set_item("may_be_torn_write", p.may_be_torn_write)?;
            Some(pd)
        }
    };
    d.set_item("problem", problem)?;
    let records = PyList::empty(py);
    for x in &r.records {
        let rd = PyDict::new(py);
        rd.set_item("offset", x.offset)?;
        rd.set_item("txid", x.txid)?;
        rd.set_item("client_id", x.req_id.client_id)?;
        rd.set_item("generation", x.req_id.generation)?;
        rd.set_item("partition_id", x.req_id.partition_id)?;
        rd.set_item("sequence", x.req_id.sequence)?;
        rd.set_item("header", x.header)?;
        rd.set_item("data_length", x.data_len)?;
        records.append(rd)?;
    }
    d.set_item("records", records)?;
    let index = match &r.index {
        None => None,
        Some(i) => {
            let id = PyDict::new(py);
            id.set_item("path", i.path.to_string_lossy())?;
            id.set_item("file_length", i.file_len)?;
            id.set_item("header_matches", i.header_matches)?;
            id.set_item("entries", i.entries)?;
            id.set_item("partial_bytes", i.partial_bytes)?;
            id.set_item("extra_entries", i.extra_entries)?;
            id.set_item("mismatch", i.mismatch.as_ref().map(|m| (m.position, m.found, m.expected)))?;
            Some(id)
        }
    };
    d.set_item("index", index)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(inspect_control, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_segment, m)?)?;
    Ok(())
}
