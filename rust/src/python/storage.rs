//! Storage and Partition: the engine's handles.
use super::errors::{run, InvalidArgumentError};
use super::scan::PyScanChunk;
use super::types::{parse_key, parse_req_id, PyPartitionInfo, PyRecord, PyRecordBatch, PyRecordHeader};
use crate::engine::control::PartitionInfo;
use crate::engine::format::format_uuid;
use crate::engine::partition::{default_options, PartitionOptions};
use crate::engine::record::NewRecord;
use crate::engine::segment::RecoveryMode;
use crate::engine::storage;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::path::PathBuf;
use std::sync::Arc;

fn options(
    segment_size: u64,
    checkpoint_interval: u64,
    max_record_size: usize,
    preallocate: u64,
    read_only: bool,
    recovery: &str,
) -> PyResult<PartitionOptions> {
    if segment_size < 4096 {
        return Err(InvalidArgumentError::new_err("segment_size must be at least 4096 bytes"));
    }
    if checkpoint_interval == 0 {
        return Err(InvalidArgumentError::new_err("checkpoint_interval must be positive"));
    }
    if max_record_size == 0 || max_record_size > (1 << 30) {
        return Err(InvalidArgumentError::new_err("max_record_size must be between 1 byte and 1 GiB"));
    }
    let mode = match recovery {
        "strict" => RecoveryMode::Strict,
        "truncate" => RecoveryMode::TruncateAtCorruption,
        other => {
            return Err(InvalidArgumentError::new_err(format!(
                "recovery must be 'strict' or 'truncate', not {other:?}"
            )))
        }
    };
    if preallocate > (1 << 30) {
        return Err(InvalidArgumentError::new_err("preallocate must be between 0 (off) and 1 GiB"));
    }
    let mut o = default_options();
    o.segment_size = segment_size;
    o.preallocate = preallocate;
    o.recover.checkpoint_interval = checkpoint_interval;
    o.recover.max_record_size = max_record_size;
    o.recover.read_only = read_only;
    o.recover.mode = mode;
    Ok(o)
}

/// A storage directory: the control file and the partitions' segment files.
#[pyclass(name = "Storage", module = "waltz._native", frozen, weakref)]
pub struct PyStorage(pub(crate) Arc<storage::Storage>);

#[pymethods]
impl PyStorage {
    /// Initialises `path` as a storage directory of the given cluster.
    #[staticmethod]
    #[pyo3(signature = (path, cluster_key, partition_count, *, segment_size=1<<30, checkpoint_interval=1000, max_record_size=16<<20, preallocate=1<<20))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        path: PathBuf,
        cluster_key: &Bound<'_, PyAny>,
        partition_count: i32,
        segment_size: u64,
        checkpoint_interval: u64,
        max_record_size: usize,
        preallocate: u64,
    ) -> PyResult<Self> {
        let key = parse_key(cluster_key)?;
        let o = options(segment_size, checkpoint_interval, max_record_size, preallocate, false, "strict")?;
        let s = run(py, move || storage::Storage::create(&path, key, partition_count, o))?;
        Ok(PyStorage(Arc::new(s)))
    }

    /// Opens an existing storage directory, checking the cluster key and partition count
    /// when given.
    #[staticmethod]
    #[pyo3(signature = (path, cluster_key=None, partition_count=None, *, read_only=false, recovery="strict", segment_size=1<<30, checkpoint_interval=1000, max_record_size=16<<20, preallocate=1<<20))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        cluster_key: Option<&Bound<'_, PyAny>>,
        partition_count: Option<i32>,
        read_only: bool,
        recovery: &str,
        segment_size: u64,
        checkpoint_interval: u64,
        max_record_size: usize,
        preallocate: u64,
    ) -> PyResult<Self> {
        let key = cluster_key.map(parse_key).transpose()?;
        let o = options(segment_size, checkpoint_interval, max_record_size, preallocate, read_only, recovery)?;
        let s = run(py, move || storage::Storage::open(&path, key, partition_count, o))?;
        Ok(PyStorage(Arc::new(s)))
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.0.path.clone()
    }
    #[getter]
    fn cluster_key(&self) -> String {
        format_uuid(&self.0.cluster_key)
    }
    #[getter]
    fn partition_count(&self) -> i32 {
        self.0.partition_count
    }
    #[getter]
    fn creation_time_ms(&self) -> i64 {
        self.0.creation_ms()
    }
    fn partition_ids(&self, py: Python<'_>) -> PyResult<Vec<i32>> {
        let s = self.0.clone();
        run(py, move || s.partition_ids())
    }
    fn add_partition(&self, py: Python<'_>, partition_id: i32) -> PyResult<()> {
        let s = self.0.clone();
        run(py, move || s.add_partition(partition_id))
    }
    #[pyo3(signature = (partition_id, *, delete_files=false))]
    fn remove_partition(&self, py: Python<'_>, partition_id: i32, delete_files: bool) -> PyResult<()> {
        let s = self.0.clone();
        run(py, move || s.remove_partition(partition_id, delete_files))
    }
    fn partition(&self, py: Python<'_>, partition_id: i32) -> PyResult<PyPartition> {
        let s = self.0.clone();
        Ok(PyPartition(run(py, move || s.partition(partition_id))?))
    }
    fn reopen_partition(&self, py: Python<'_>, partition_id: i32) -> PyResult<PyPartition> {
        let s = self.0.clone();
        Ok(PyPartition(run(py, move || s.reopen_partition(partition_id))?))
    }
    /// Reopens a partition cutting it at the first corrupt record (and everything after).
    fn repair_partition(&self, py: Python<'_>, partition_id: i32) -> PyResult<PyPartition> {
        let s = self.0.clone();
        Ok(PyPartition(run(py, move || s.repair_partition(partition_id))?))
    }
    fn close_partition(&self, partition_id: i32) {
        self.0.close_partition(partition_id)
    }
    /// Writes every open partition's in-memory index tail to its index file and syncs it.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.0.clone();
        run(py, move || s.flush())
    }
    /// Closes every open partition; handles obtained before raise PartitionClosedError.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.0.clone();
        run(py, move || {
            s.close();
            Ok(())
        })
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    fn __exit__(
        &self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
    fn partition_info(&self, py: Python<'_>, partition_id: i32) -> PyResult<PyPartitionInfo> {
        let s = self.0.clone();
        Ok(run(py, move || s.partition_info(partition_id))?.into())
    }
    fn set_low_water_mark(
        &self,
        py: Python<'_>,
        partition_id: i32,
        session_id: i64,
        low_water_mark: i64,
    ) -> PyResult<PyPartitionInfo> {
        let s = self.0.clone();
        Ok(run(py, move || s.set_low_water_mark(partition_id, session_id, low_water_mark))?.into())
    }
    fn set_partition_info(
        &self,
        py: Python<'_>,
        partition_id: i32,
        session_id: i64,
        low_water_mark: i64,
        local_low_water_mark: i64,
    ) -> PyResult<()> {
        let s = self.0.clone();
        let info = PartitionInfo { session_id, low_water_mark, local_low_water_mark };
        run(py, move || s.set_partition_info(partition_id, info))
    }
    fn __repr__(&self) -> String {
        format!(
            "Storage(path={:?}, cluster_key={}, partition_count={})",
            self.0.path,
            format_uuid(&self.0.cluster_key),
            self.0.partition_count
        )
    }
}

impl PyPartition {
    fn append_impl(&self, py: Python<'_>, first: Option<i64>, records: &Bound<'_, PyAny>) -> PyResult<(i64, i64)> {
        let p = self.0.clone();
        if let Ok(batch) = records.cast::<PyRecordBatch>() {
            let batch = batch.borrow();
            let batch: &PyRecordBatch = &batch;
            return run(py, move || {
                // Handed back once queued: another append of the same batch need not wait for
                // this one's sync.
                let mut records = batch.checkout();
                let t = p.enqueue_laid(first, records.laid(first.unwrap_or_else(|| p.max_txid() + 1)))?;
                drop(records);
                p.wait_durable(t.seq)?;
                Ok((t.first, t.last))
            });
        }
        // Tuples of bytes: borrow the bytes in place (they are immutable) instead of copying.
        let mut metas = Vec::new();
        let mut holders: Vec<Bound<'_, PyBytes>> = Vec::new();
        let mut copies: Vec<Vec<u8>> = Vec::new();
        for item in records.try_iter()? {
            let item = item?;
            let t = item
                .cast::<PyTuple>()
                .map_err(|_| InvalidArgumentError::new_err("each record must be a tuple (req_id, header, data)"))?;
            if t.len() != 3 {
                return Err(InvalidArgumentError::new_err("each record must be a tuple (req_id, header, data)"));
            }
            let r = parse_req_id(&t.get_item(0)?)?;
            let h: i32 = t.get_item(1)?.extract()?;
            let d = t.get_item(2)?;
            match d.cast_into::<PyBytes>() {
                Ok(b) => {
                    metas.push((r, h, true, holders.len()));
                    holders.push(b);
                }
                Err(e) => {
                    let v: Vec<u8> = e.into_inner().extract().map_err(|_| {
                        InvalidArgumentError::new_err("record data must be bytes or a bytes-like object")
                    })?;
                    metas.push((r, h, false, copies.len()));
                    copies.push(v);
                }
            }
        }
        let slices: Vec<&[u8]> = holders.iter().map(|b| b.as_bytes()).collect();
        let recs: Vec<NewRecord<'_>> = metas
            .iter()
            .map(|&(req_id, header, is_bytes, i)| NewRecord {
                req_id,
                header,
                data: if is_bytes { slices[i] } else { copies[i].as_slice() },
                data_crc: None,
            })
            .collect();
        run(py, move || p.append_at_opt(first, &recs))
    }
}

/// One partition's log.
#[pyclass(name = "Partition", module = "waltz._native", frozen)]
pub struct PyPartition(pub(crate) Arc<crate::engine::partition::Partition>);

#[pymethods]
impl PyPartition {
    #[getter]
    fn id(&self) -> i32 {
        self.0.id
    }
    #[getter]
    fn max_transaction_id(&self) -> i64 {
        self.0.max_txid()
    }
    #[getter]
    fn first_transaction_id(&self) -> i64 {
        self.0.first_txid()
    }
    #[getter]
    fn segment_count(&self) -> usize {
        self.0.segment_count()
    }
    /// Why the partition refuses appends, or None while it is healthy.
    #[getter]
    fn failed(&self) -> Option<String> {
        self.0.is_failed()
    }
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.0.stats();
        let d = PyDict::new(py);
        d.set_item("appends", s.appends)?;
        d.set_item("records", s.records)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("syncs", s.syncs)?;
        d.set_item("sync_micros", s.sync_micros)?;
        d.set_item("batch_records", s.batch_records)?;
        if let Some(phases) = s.phases {
            // Only with WALTZ_ENGINE_PHASES=1: {phase: (count, total ns, max ns)}.
            let p = PyDict::new(py);
            for (name, count, total, max) in phases {
                p.set_item(name, (count, total, max))?;
            }
            d.set_item("phases", p)?;
        }
        Ok(d)
    }
    /// What opening the partition found and did.
    #[getter]
    fn recovery<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = &self.0.recovery;
        let d = PyDict::new(py);
        d.set_item("segments", r.segments)?;
        d.set_item("scanned_records", r.scanned_records)?;
        d.set_item("torn_bytes", r.torn_bytes)?;
        d.set_item(
            "torn_survivors",
            r.torn_survivors.as_ref().map(|(p, hole, first)| (p.to_string_lossy().into_owned(), *hole, *first)),
        )?;
        d.set_item("corruption_cut", r.corruption_cut.as_ref().map(|(p, o)| (p.to_string_lossy().into_owned(), *o)))?;
        d.set_item("finished_truncation", r.finished_truncation)?;
        let paths = |v: &Vec<PathBuf>| v.iter().map(|p| p.to_string_lossy().into_owned()).collect::<Vec<_>>();
        d.set_item("removed_files", paths(&r.removed_files))?;
        d.set_item("foreign_files", paths(&r.foreign_files))?;
        Ok(d)
    }

    /// Appends records as transactions `first_txid`, `first_txid + 1`, ...; returns the last
    /// id once it is durable (fdatasync returned). `records` is a RecordBatch or a sequence
    /// of (req_id, header, data) tuples.
    fn append(&self, py: Python<'_>, first_txid: i64, records: &Bound<'_, PyAny>) -> PyResult<i64> {
        Ok(self.append_impl(py, Some(first_txid), records)?.1)
    }

    /// Appends records at the partition's next ids; returns (first, last) once durable.
    /// Threads appending concurrently share fsyncs.
    fn append_next(&self, py: Python<'_>, records: &Bound<'_, PyAny>) -> PyResult<(i64, i64)> {
        self.append_impl(py, None, records)
    }

    /// Drops every transaction after `txid`; returns the new max transaction id.
    fn truncate(&self, py: Python<'_>, txid: i64) -> PyResult<i64> {
        let p = self.0.clone();
        run(py, move || p.truncate(txid))
    }

    /// Retention: deletes whole segments holding only ids below `txid`, freeing at most `rate`
    /// bytes per second (None: unpaced); returns the new first transaction id.
    #[pyo3(signature = (txid, rate=None))]
    fn drop_segments_before(&self, py: Python<'_>, txid: i64, rate: Option<u64>) -> PyResult<i64> {
        let p = self.0.clone();
        run(py, move || p.drop_segments_paced(txid, rate, &|| false))
    }

    /// What retention reports of the partition: first id, segment bytes on disk, creation of
    /// the oldest segment (ms since the epoch, -1 unknown), bytes deleted since it was opened.
    fn retention<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.0.clone();
        let spans = run(py, move || p.segment_spans())?;
        let d = PyDict::new(py);
        d.set_item("first_transaction_id", self.0.first_txid())?;
        d.set_item("segments", spans.len())?;
        d.set_item("bytes_on_disk", spans.iter().map(|s| s.bytes).sum::<u64>())?;
        d.set_item("oldest_ms", spans.first().map_or(-1, |s| s.creation_ms))?;
        d.set_item("reclaimed_bytes", self.0.reclaimed_bytes())?;
        Ok(d)
    }

    fn read_record(&self, py: Python<'_>, txid: i64) -> PyResult<Option<PyRecord>> {
        let p = self.0.clone();
        let r = run(py, move || p.read_record(txid))?;
        Ok(r.map(|r| PyRecord::new(py, r)))
    }

    fn read_header(&self, py: Python<'_>, txid: i64) -> PyResult<Option<PyRecordHeader>> {
        let p = self.0.clone();
        Ok(run(py, move || p.read_header(txid))?.map(Into::into))
    }

    #[pyo3(signature = (txid, max_count=1000, max_bytes=4<<20))]
    fn read_records<'py>(
        &self,
        py: Python<'py>,
        txid: i64,
        max_count: usize,
        max_bytes: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let p = self.0.clone();
        let rs = run(py, move || p.read_records(txid, max_count, max_bytes))?;
        PyList::new(py, rs.into_iter().map(|r| PyRecord::new(py, r)))
    }

    #[pyo3(signature = (txid, max_count=1000))]
    fn read_headers(&self, py: Python<'_>, txid: i64, max_count: usize) -> PyResult<Vec<PyRecordHeader>> {
        let p = self.0.clone();
        Ok(run(py, move || p.read_headers(txid, max_count))?.into_iter().map(Into::into).collect())
    }

    /// Reads `start..=end` (end defaults to the max transaction id) as a ScanChunk, stopping
    /// before `max_bytes` of data or `max_count` records; call again from the next id.
    #[pyo3(signature = (start, end=None, max_count=1<<20, max_bytes=16<<20))]
    fn scan(
        &self,
        py: Python<'_>,
        start: i64,
        end: Option<i64>,
        max_count: usize,
        max_bytes: usize,
    ) -> PyResult<PyScanChunk> {
        if max_bytes > i32::MAX as usize {
            return Err(InvalidArgumentError::new_err("max_bytes must fit Arrow's int32 offsets"));
        }
        let p = self.0.clone();
        let end = end.unwrap_or(i64::MAX);
        Ok(PyScanChunk::new(run(py, move || p.scan(start, end, max_count, max_bytes))?))
    }

    fn __repr__(&self) -> String {
        format!(
            "Partition(id={}, first_transaction_id={}, max_transaction_id={})",
            self.0.id,
            self.0.first_txid(),
            self.0.max_txid()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SYNC_MICROS_BOUNDS", crate::engine::partition::SYNC_MICROS_BOUNDS.to_vec())?;
    m.add("BATCH_RECORDS_BOUNDS", crate::engine::partition::BATCH_RECORDS_BOUNDS.to_vec())?;
    m.add_class::<PyStorage>()?;
    m.add_class::<PyPartition>()?;
    Ok(())
}
