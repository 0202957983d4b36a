//! Waltz's native core. The modules hold plain Rust; this file is only the Python bindings.
pub mod control;
pub mod crc;
pub mod error;
pub mod fs;
pub mod inspect;
pub mod node;
pub mod partition;
pub mod protocol;
pub mod record;
pub mod segment;
pub mod storage;
pub mod tls;

#[cfg(feature = "python")]
mod pylog;

#[cfg(feature = "python")]
mod python {
    use crate::control::{format_uuid, PartitionInfo};
    use crate::error::Error;
    use crate::partition::{default_options, Columns, PartitionOptions};
    use crate::record::{crc32, NewRecord, Record, RecordHeader, ReqId};
    use crate::segment::RecoveryMode;
    use crate::storage;
    use pyo3::create_exception;
    use pyo3::exceptions::PyException;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::path::PathBuf;
    use std::sync::Arc;

    create_exception!(_native, WaltzError, PyException, "Root of every Waltz error.");
    create_exception!(_native, StorageError, WaltzError, "An error of the storage engine.");
    create_exception!(_native, StorageIOError, StorageError, "A read, write or sync failed.");
    create_exception!(_native, CorruptionError, StorageError, "Data on disk fails its checks.");
    create_exception!(_native, ClusterKeyMismatch, StorageError, "The files belong to another cluster.");
    create_exception!(_native, PartitionCountMismatch, StorageError, "The storage has another partition count.");
    create_exception!(_native, NonDenseAppendError, StorageError, "Appended ids do not continue the log.");
    create_exception!(_native, RecordTooLargeError, StorageError, "A record exceeds the maximum size.");
    create_exception!(_native, BelowLogStartError, StorageError, "The id was removed by retention.");
    create_exception!(_native, PartitionFailedError, StorageError, "A write or sync failed; reopen the partition.");
    create_exception!(_native, AppendTruncatedError, StorageError, "A truncation cut the append before it was acknowledged.");
    create_exception!(_native, PartitionNotFoundError, StorageError, "No such partition here.");
    create_exception!(_native, StorageExistsError, StorageError, "The directory is already a storage directory.");
    create_exception!(_native, NotInitialisedError, StorageError, "The directory is not a storage directory.");
    create_exception!(_native, ReadOnlyError, StorageError, "The storage was opened read-only.");
    create_exception!(_native, StorageClosedError, StorageError, "The storage handle was closed.");
    create_exception!(_native, StorageLockedError, StorageError, "Another writer has the storage directory open.");
    create_exception!(_native, PartitionClosedError, StorageError, "The partition handle was closed.");
    create_exception!(_native, InvalidArgumentError, WaltzError, "An argument is out of range.");
    create_exception!(_native, ProtocolError, WaltzError, "A peer sent bytes that are not a valid frame.");
    create_exception!(_native, InternalError, WaltzError, "A bug: an invariant of the engine failed.");

    fn to_py(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::Io { .. } => StorageIOError::new_err(msg),
            Error::Corruption { .. } => CorruptionError::new_err(msg),
            Error::ClusterKeyMismatch { .. } => ClusterKeyMismatch::new_err(msg),
            Error::PartitionCountMismatch { .. } => PartitionCountMismatch::new_err(msg),
            Error::NonDenseAppend { .. } => NonDenseAppendError::new_err(msg),
            Error::RecordTooLarge { .. } => RecordTooLargeError::new_err(msg),
            Error::BelowLogStart { .. } => BelowLogStartError::new_err(msg),
            Error::PartitionFailed { .. } => PartitionFailedError::new_err(msg),
            Error::AppendTruncated { .. } => AppendTruncatedError::new_err(msg),
            Error::PartitionNotFound { .. } | Error::PartitionOutOfRange { .. } => PartitionNotFoundError::new_err(msg),
            Error::AlreadyExists { .. } => StorageExistsError::new_err(msg),
            Error::NotInitialised { .. } => NotInitialisedError::new_err(msg),
            Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
            Error::Closed { .. } => PartitionClosedError::new_err(msg),
            Error::StorageClosed { .. } => StorageClosedError::new_err(msg),
            Error::ReadOnly => ReadOnlyError::new_err(msg),
            Error::Locked { .. } => StorageLockedError::new_err(msg),
            Error::Invariant { .. } => InternalError::new_err(msg),
        }
    }

    /// Runs engine work without the GIL; a panic becomes InternalError instead of unwinding
    /// into the interpreter.
    fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::error::Result<T> + Send) -> PyResult<T> {
        match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
            Ok(r) => r.map_err(to_py),
            Err(p) => {
                let what = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(InternalError::new_err(format!("internal error in the storage engine: {what}")))
            }
        }
    }

    fn parse_key(obj: &Bound<'_, PyAny>) -> PyResult<[u8; 16]> {
        if let Ok(b) = obj.getattr("bytes") {
            if let Ok(v) = b.extract::<Vec<u8>>() {
                if let Ok(k) = <[u8; 16]>::try_from(v.as_slice()) {
                    return Ok(k);
                }
            }
        }
        if let Ok(s) = obj.extract::<String>() {
            let hex: String = s.chars().filter(|c| *c != '-').collect();
            if hex.len() == 32 {
                let mut k = [0u8; 16];
                let mut ok = true;
                for i in 0..16 {
                    match u8::from_str_radix(&hex[2 * i..2 * i + 2], 16) {
                        Ok(v) => k[i] = v,
                        Err(_) => ok = false,
                    }
                }
                if ok {
                    return Ok(k);
                }
            }
            return Err(InvalidArgumentError::new_err(format!("not a UUID: {s:?}")));
        }
        if let Ok(v) = obj.extract::<Vec<u8>>() {
            if let Ok(k) = <[u8; 16]>::try_from(v.as_slice()) {
                return Ok(k);
            }
        }
        Err(InvalidArgumentError::new_err("cluster key must be a uuid.UUID, a UUID string or 16 bytes"))
    }

    fn parse_req_id(obj: &Bound<'_, PyAny>) -> PyResult<ReqId> {
        if let Ok(r) = obj.cast::<PyReqId>() {
            return Ok(r.borrow().0);
        }
        let (client_id, generation, partition_id, sequence): (i32, i32, i32, i32) = obj.extract().map_err(|_| {
            InvalidArgumentError::new_err("req_id must be a ReqId or a tuple (client_id, generation, partition_id, sequence)")
        })?;
        Ok(ReqId {
            client_id,
            generation,
            partition_id,
            sequence,
        })
    }

    /// Identifies a client request: client id, generation, partition id and sequence number.
    #[pyclass(name = "ReqId", module = "waltz._native", frozen, eq, hash, skip_from_py_object)]
    #[derive(Clone, PartialEq, Eq, Hash)]
    pub struct PyReqId(ReqId);

    #[pymethods]
    impl PyReqId {
        #[new]
        fn new(client_id: i32, generation: i32, partition_id: i32, sequence: i32) -> Self {
            PyReqId(ReqId {
                client_id,
                generation,
                partition_id,
                sequence,
            })
        }
        #[getter]
        fn client_id(&self) -> i32 {
            self.0.client_id
        }
        #[getter]
        fn generation(&self) -> i32 {
            self.0.generation
        }
        #[getter]
        fn partition_id(&self) -> i32 {
            self.0.partition_id
        }
        #[getter]
        fn sequence(&self) -> i32 {
            self.0.sequence
        }
        fn as_tuple(&self) -> (i32, i32, i32, i32) {
            (self.0.client_id, self.0.generation, self.0.partition_id, self.0.sequence)
        }
        fn __repr__(&self) -> String {
            format!(
                "ReqId(client_id={}, generation={}, partition_id={}, sequence={})",
                self.0.client_id, self.0.generation, self.0.partition_id, self.0.sequence
            )
        }
    }

    /// A transaction's metadata: id, ReqId and the application's header.
    #[pyclass(name = "RecordHeader", module = "waltz._native", frozen, eq, skip_from_py_object)]
    #[derive(Clone, PartialEq)]
    pub struct PyRecordHeader {
        #[pyo3(get)]
        txid: i64,
        #[pyo3(get)]
        req_id: PyReqId,
        #[pyo3(get)]
        header: i32,
    }

    impl From<RecordHeader> for PyRecordHeader {
        fn from(h: RecordHeader) -> Self {
            PyRecordHeader {
                txid: h.txid,
                req_id: PyReqId(h.req_id),
                header: h.header,
            }
        }
    }

    #[pymethods]
    impl PyRecordHeader {
        fn __repr__(&self) -> String {
            format!("RecordHeader(txid={}, req_id={}, header={})", self.txid, self.req_id.__repr__(), self.header)
        }
    }

    /// A stored transaction: id, ReqId, header and data.
    #[pyclass(name = "Record", module = "waltz._native", frozen)]
    pub struct PyRecord {
        #[pyo3(get)]
        txid: i64,
        #[pyo3(get)]
        req_id: PyReqId,
        #[pyo3(get)]
        header: i32,
        #[pyo3(get)]
        data: Py<PyBytes>,
    }

    impl PyRecord {
        fn new(py: Python<'_>, r: Record) -> Self {
            PyRecord {
                txid: r.txid,
                req_id: PyReqId(r.req_id),
                header: r.header,
                data: PyBytes::new(py, &r.data).unbind(),
            }
        }
    }

    #[pymethods]
    impl PyRecord {
        fn __repr__(&self, py: Python<'_>) -> String {
            format!(
                "Record(txid={}, req_id={}, header={}, data=<{} bytes>)",
                self.txid,
                self.req_id.__repr__(),
                self.header,
                self.data.bind(py).as_bytes().len()
            )
        }
        fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> bool {
            match other.cast::<PyRecord>() {
                Ok(o) => {
                    let o = o.get();
                    o.txid == self.txid
                        && o.req_id == self.req_id
                        && o.header == self.header
                        && o.data.bind(py).as_bytes() == self.data.bind(py).as_bytes()
                }
                Err(_) => false,
            }
        }
    }

    /// Records packed once (data contiguous, checksums computed) so they can be appended at any
    /// transaction id, any number of times, without touching Python objects per record.
    #[pyclass(name = "RecordBatch", module = "waltz._native")]
    #[derive(Default)]
    pub struct PyRecordBatch {
        data: Vec<u8>,
        spans: Vec<(ReqId, i32, usize, usize, u32)>,
    }

    impl PyRecordBatch {
        fn records(&self) -> Vec<NewRecord<'_>> {
            self.spans
                .iter()
                .map(|&(req_id, header, start, len, crc)| NewRecord {
                    req_id,
                    header,
                    data: &self.data[start..start + len],
                    data_crc: Some(crc),
                })
                .collect()
        }
        fn push(&mut self, req_id: ReqId, header: i32, data: &[u8]) {
            let start = self.data.len();
            self.data.extend_from_slice(data);
            self.spans.push((req_id, header, start, data.len(), crc32(data)));
        }
    }

    #[pymethods]
    impl PyRecordBatch {
        #[new]
        #[pyo3(signature = (records=None))]
        fn new(records: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
            let mut b = PyRecordBatch::default();
            if let Some(rs) = records {
                for item in rs.try_iter()? {
                    let item = item?;
                    let (r, h, d) = unpack_record(&item)?;
                    b.push(r, h, &d);
                }
            }
            Ok(b)
        }
        /// Adds one record: its ReqId, header and data.
        fn add(&mut self, req_id: &Bound<'_, PyAny>, header: i32, data: &[u8]) -> PyResult<()> {
            let r = parse_req_id(req_id)?;
            self.push(r, header, data);
            Ok(())
        }
        fn __len__(&self) -> usize {
            self.spans.len()
        }
        #[getter]
        fn nbytes(&self) -> usize {
            self.data.len()
        }
    }

    fn unpack_record(item: &Bound<'_, PyAny>) -> PyResult<(ReqId, i32, Vec<u8>)> {
        // A Record read from a node goes in as it is (catch-up and recovery copies).
        if let Ok(r) = item.cast::<PyRecord>() {
            let r = r.get();
            return Ok((r.req_id.0, r.header, r.data.bind(item.py()).as_bytes().to_vec()));
        }
        let t = item
            .cast::<PyTuple>()
            .map_err(|_| InvalidArgumentError::new_err("each record must be a Record or a tuple (req_id, header, data)"))?;
        if t.len() != 3 {
            return Err(InvalidArgumentError::new_err("each record must be a tuple (req_id, header, data)"));
        }
        let r = parse_req_id(&t.get_item(0)?)?;
        let h: i32 = t.get_item(1)?.extract()?;
        let d: Vec<u8> = t.get_item(2)?.extract()?;
        Ok((r, h, d))
    }

    /// A scanned range as columns: little-endian arrays plus packed data and i32 offsets, the
    /// buffers of an Arrow binary column.
    #[pyclass(name = "ScanChunk", module = "waltz._native", frozen)]
    pub struct PyScanChunk(Columns, Arc<Vec<u8>>);

    impl PyScanChunk {
        fn new(mut columns: Columns) -> Self {
            let payload = Arc::new(std::mem::take(&mut columns.payload));
            PyScanChunk(columns, payload)
        }
    }

    /// A chunk's packed data lent to Python through the buffer protocol: Arrow wraps it
    /// (`pyarrow.py_buffer`) without the copy a `bytes` would cost, and it lives as long as any
    /// view of it does.
    #[pyclass(name = "ScanPayload", module = "waltz._native", frozen)]
    pub struct PyScanPayload(Arc<Vec<u8>>);

    #[pymethods]
    impl PyScanPayload {
        fn __len__(&self) -> usize {
            self.0.len()
        }
        fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.0)
        }
        /// # Safety
        /// `view` comes from the interpreter's buffer machinery; the bytes it points at are
        /// owned by this object, which the view keeps alive (`obj`), and never change.
        unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut pyo3::ffi::Py_buffer, flags: std::os::raw::c_int) -> PyResult<()> {
            if flags & pyo3::ffi::PyBUF_WRITABLE == pyo3::ffi::PyBUF_WRITABLE {
                return Err(pyo3::exceptions::PyBufferError::new_err("a scanned payload is read-only"));
            }
            let data = &slf.get().0;
            let rc = unsafe {
                pyo3::ffi::PyBuffer_FillInfo(
                    view,
                    slf.as_ptr(),
                    data.as_ptr() as *mut std::os::raw::c_void,
                    data.len() as pyo3::ffi::Py_ssize_t,
                    1,
                    flags,
                )
            };
            if rc != 0 {
                return Err(PyErr::fetch(slf.py()));
            }
            Ok(())
        }
        unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
    }

    fn le_bytes<'py, T: Copy>(py: Python<'py>, v: &[T]) -> Bound<'py, PyBytes> {
        // Native endianness is what Arrow and numpy expect; the engine only runs little-endian.
        let n = std::mem::size_of_val(v);
        let p = v.as_ptr() as *const u8;
        PyBytes::new(py, unsafe { std::slice::from_raw_parts(p, n) })
    }

    #[pymethods]
    impl PyScanChunk {
        fn __len__(&self) -> usize {
            self.0.txids.len()
        }
        #[getter]
        fn first_txid(&self) -> Option<i64> {
            self.0.txids.first().copied()
        }
        #[getter]
        fn last_txid(&self) -> Option<i64> {
            self.0.txids.last().copied()
        }
        /// The column buffers: txid (int64), header, client_id, generation, partition, sequence
        /// (int32), offsets (int32, n + 1) and payload.
        fn buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            let c = &self.0;
            d.set_item("txid", le_bytes(py, &c.txids))?;
            d.set_item("header", le_bytes(py, &c.headers))?;
            d.set_item("client_id", le_bytes(py, &c.client_ids))?;
            d.set_item("generation", le_bytes(py, &c.generations))?;
            d.set_item("partition", le_bytes(py, &c.req_partitions))?;
            d.set_item("sequence", le_bytes(py, &c.sequences))?;
            d.set_item("offsets", le_bytes(py, &c.offsets))?;
            d.set_item("payload", PyScanPayload(self.1.clone()))?;
            Ok(d)
        }
        #[getter]
        fn payload_nbytes(&self) -> usize {
            self.1.len()
        }
    }

    /// Session information a partition keeps in the control file.
    #[pyclass(name = "PartitionInfo", module = "waltz._native", frozen, eq, skip_from_py_object)]
    #[derive(Clone, PartialEq)]
    pub struct PyPartitionInfo {
        #[pyo3(get)]
        session_id: i64,
        #[pyo3(get)]
        low_water_mark: i64,
        #[pyo3(get)]
        local_low_water_mark: i64,
    }

    impl From<PartitionInfo> for PyPartitionInfo {
        fn from(i: PartitionInfo) -> Self {
            PyPartitionInfo {
                session_id: i.session_id,
                low_water_mark: i.low_water_mark,
                local_low_water_mark: i.local_low_water_mark,
            }
        }
    }

    #[pymethods]
    impl PyPartitionInfo {
        fn __repr__(&self) -> String {
            format!(
                "PartitionInfo(session_id={}, low_water_mark={}, local_low_water_mark={})",
                self.session_id, self.low_water_mark, self.local_low_water_mark
            )
        }
    }

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
    pub struct PyStorage(Arc<storage::Storage>);

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
        fn __exit__(&self, py: Python<'_>, _t: &Bound<'_, PyAny>, _v: &Bound<'_, PyAny>, _tb: &Bound<'_, PyAny>) -> PyResult<bool> {
            self.close(py)?;
            Ok(false)
        }
        fn partition_info(&self, py: Python<'_>, partition_id: i32) -> PyResult<PyPartitionInfo> {
            let s = self.0.clone();
            Ok(run(py, move || s.partition_info(partition_id))?.into())
        }
        fn set_low_water_mark(&self, py: Python<'_>, partition_id: i32, session_id: i64, low_water_mark: i64) -> PyResult<PyPartitionInfo> {
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
            let info = PartitionInfo {
                session_id,
                low_water_mark,
                local_low_water_mark,
            };
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
                let recs = batch.records();
                return run(py, move || p.append_at_opt(first, &recs));
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
    pub struct PyPartition(Arc<crate::partition::Partition>);

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
                "corruption_cut",
                r.corruption_cut.as_ref().map(|(p, o)| (p.to_string_lossy().into_owned(), *o)),
            )?;
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

        /// Retention: deletes whole segments holding only ids below `txid`; returns the new
        /// first transaction id.
        fn drop_segments_before(&self, py: Python<'_>, txid: i64) -> PyResult<i64> {
            let p = self.0.clone();
            run(py, move || p.drop_segments_before(txid))
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
        fn read_records<'py>(&self, py: Python<'py>, txid: i64, max_count: usize, max_bytes: usize) -> PyResult<Bound<'py, PyList>> {
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
        fn scan(&self, py: Python<'_>, start: i64, end: Option<i64>, max_count: usize, max_bytes: usize) -> PyResult<PyScanChunk> {
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

    /// The benchmark reference ("raw ceiling"): appends `payload` to a new file at `path`
    /// `iterations` times, each write followed by fdatasync, in a minimal native loop. Returns
    /// each iteration's latency in nanoseconds.
    #[pyfunction]
    fn raw_append_loop(py: Python<'_>, path: PathBuf, payload: Vec<u8>, iterations: usize) -> PyResult<Vec<u64>> {
        run(py, move || {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(&path)
                .map_err(|e| Error::Io { path: path.clone(), source: e })?;
            let mut out = Vec::with_capacity(iterations);
            for _ in 0..iterations {
                let t = std::time::Instant::now();
                f.write_all(&payload)
                    .and_then(|_| f.sync_data())
                    .map_err(|e| Error::Io { path: path.clone(), source: e })?;
                out.push(t.elapsed().as_nanos() as u64);
            }
            Ok(out)
        })
    }

    // ---- offline inspection (`waltz disk`) ------------------------------------------------------

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
        let r = run(py, move || crate::inspect::inspect_control(&crate::fs::StdFs, &path))?;
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
    fn inspect_segment<'py>(py: Python<'py>, path: PathBuf, limit: usize, max_record_size: usize) -> PyResult<Bound<'py, PyDict>> {
        if max_record_size == 0 || max_record_size > (1 << 30) {
            return Err(InvalidArgumentError::new_err("max_record_size must be between 1 byte and 1 GiB"));
        }
        let r = run(py, move || crate::inspect::inspect_segment(&crate::fs::StdFs, &path, limit, max_record_size))?;
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

    // ---- storage protocol codec and the storage node -------------------------------------------

    use crate::protocol::{split_frame, FailureKind, FrameBuf, MsgHeader, Request, Response, WireRecord, MAGIC_STORAGE};

    /// Encodes one storage-protocol request frame (everything but Append, see `encode_append`).
    #[pyfunction]
    #[pyo3(signature = (kind, session_id=-1, seq=-1, partition_id=-1, *, txid=0, max_count=0, low_water_mark=-1, cluster_key=None, partition_count=0, min_version=1, max_version=1))]
    #[allow(clippy::too_many_arguments)]
    fn encode_request<'py>(
        py: Python<'py>,
        kind: &str,
        session_id: i64,
        seq: i64,
        partition_id: i32,
        txid: i64,
        max_count: i32,
        low_water_mark: i64,
        cluster_key: Option<&Bound<'_, PyAny>>,
        partition_count: i32,
        min_version: u8,
        max_version: u8,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let h = MsgHeader { session_id, seq, partition_id };
        let req = match kind {
            "hello" => Request::Hello { min_version, max_version },
            "open" => {
                let k = cluster_key.ok_or_else(|| InvalidArgumentError::new_err("open needs cluster_key"))?;
                Request::Open { h, cluster_key: parse_key(k)?, partition_count }
            }
            "last_session_info" => Request::LastSessionInfo { h },
            "max_transaction_id" => Request::MaxTransactionId { h },
            "truncate" => Request::Truncate { h, txid },
            "set_low_water_mark" => Request::SetLowWaterMark { h, low_water_mark },
            "record_header" => Request::RecordHeader { h, txid },
            "record" => Request::Record { h, txid },
            "record_header_list" => Request::RecordHeaderList { h, txid, max_count },
            "record_list" => Request::RecordList { h, txid, max_count },
            other => return Err(InvalidArgumentError::new_err(format!("unknown request kind {other:?}"))),
        };
        let mut out = Vec::new();
        req.encode(&mut out);
        Ok(PyBytes::new(py, &out))
    }

    /// Encodes one admin-protocol request frame: hello, open, assign, unassign,
    /// set_availability, status, record_list, set_partition_info.
    #[pyfunction]
    #[pyo3(signature = (kind, seq=0, partition_id=0, *, cluster_key=None, partition_count=0, delete_files=false, readable=true, writable=true, txid=0, max_count=0, session_id=-1, low_water_mark=-1))]
    #[allow(clippy::too_many_arguments)]
    fn encode_admin_request<'py>(
        py: Python<'py>,
        kind: &str,
        seq: i64,
        partition_id: i32,
        cluster_key: Option<&Bound<'_, PyAny>>,
        partition_count: i32,
        delete_files: bool,
        readable: bool,
        writable: bool,
        txid: i64,
        max_count: i32,
        session_id: i64,
        low_water_mark: i64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        use crate::protocol::AdminRequest;
        let h = MsgHeader { session_id: -1, seq, partition_id };
        let req = match kind {
            "hello" => AdminRequest::Hello { min_version: 1, max_version: 1 },
            "open" => {
                let k = cluster_key.ok_or_else(|| InvalidArgumentError::new_err("open needs cluster_key"))?;
                AdminRequest::Open { h, cluster_key: parse_key(k)?, partition_count }
            }
            "assign" => AdminRequest::Assign { h },
            "unassign" => AdminRequest::Unassign { h, delete_files },
            "set_availability" => AdminRequest::SetAvailability { h, readable, writable },
            "status" => AdminRequest::Status { h },
            "record_list" => AdminRequest::RecordList { h, txid, max_count },
            "set_partition_info" => AdminRequest::SetPartitionInfo { h, session_id, low_water_mark },
            other => return Err(InvalidArgumentError::new_err(format!("unknown admin request kind {other:?}"))),
        };
        let mut out = Vec::new();
        req.encode(&mut out);
        Ok(PyBytes::new(py, &out))
    }

    /// An admin Append frame carrying `records` (Records read from another node) unchanged.
    #[pyfunction]
    fn encode_admin_append<'py>(py: Python<'py>, seq: i64, partition_id: i32, records: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        use crate::protocol::AdminRequest;
        let h = MsgHeader { session_id: -1, seq, partition_id };
        let mut out_records = Vec::new();
        for item in records.try_iter()? {
            let item = item?;
            let r = item.cast::<PyRecord>()?.get();
            let data = r.data.bind(py).as_bytes().to_vec();
            out_records.push(WireRecord { txid: r.txid, req_id: r.req_id.0, header: r.header, data_crc: crc32(&data), data });
        }
        let mut out = Vec::new();
        AdminRequest::Append { h, records: out_records }.encode(&mut out);
        Ok(PyBytes::new(py, &out))
    }

    /// Encodes an Append frame of `batch` as transactions first_txid, first_txid + 1, ...
    #[pyfunction]
    fn encode_append<'py>(
        py: Python<'py>,
        session_id: i64,
        seq: i64,
        partition_id: i32,
        first_txid: i64,
        batch: PyRef<'_, PyRecordBatch>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let h = MsgHeader { session_id, seq, partition_id };
        let records: Vec<WireRecord> = batch
            .records()
            .iter()
            .enumerate()
            .map(|(i, r)| WireRecord {
                txid: first_txid + i as i64,
                req_id: r.req_id,
                header: r.header,
                data: r.data.to_vec(),
                data_crc: r.data_crc.unwrap_or_else(|| crc32(r.data)),
            })
            .collect();
        let mut out = Vec::new();
        Request::Append { h, records }.encode(&mut out);
        Ok(PyBytes::new(py, &out))
    }

    fn failure_name(k: FailureKind) -> &'static str {
        match k {
            FailureKind::Internal => "internal",
            FailureKind::BadRequest => "bad_request",
            FailureKind::ClusterKeyMismatch => "cluster_key_mismatch",
            FailureKind::PartitionCountMismatch => "partition_count_mismatch",
            FailureKind::PartitionNotAssigned => "partition_not_assigned",
            FailureKind::PartitionNotReadable => "partition_not_readable",
            FailureKind::PartitionNotWritable => "partition_not_writable",
            FailureKind::StaleSession => "stale_session",
            FailureKind::NonDenseAppend => "non_dense_append",
            FailureKind::RecordTooLarge => "record_too_large",
            FailureKind::BelowLogStart => "below_log_start",
            FailureKind::PartitionFailed => "partition_failed",
            FailureKind::Corruption => "corruption",
            FailureKind::Io => "io",
            FailureKind::NotOpened => "not_opened",
            FailureKind::AppendTruncated => "append_truncated",
        }
    }

    /// (kind, seq, session_id, partition_id, value): what ResponseReader yields for either protocol.
    fn response_tuple<'py>(py: Python<'py>, kind: &str, h: MsgHeader, value: Py<PyAny>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(
            py,
            [
                kind.into_pyobject(py)?.into_any().unbind(),
                h.seq.into_pyobject(py)?.into_any().unbind(),
                h.session_id.into_pyobject(py)?.into_any().unbind(),
                h.partition_id.into_pyobject(py)?.into_any().unbind(),
                value,
            ],
        )
    }

    fn wire_record(py: Python<'_>, r: WireRecord) -> PyRecord {
        PyRecord::new(py, Record { txid: r.txid, req_id: r.req_id, header: r.header, data: r.data })
    }

    /// One frame of the shared framing (docs/protocol.md) around `payload`.
    #[pyfunction]
    fn encode_frame<'py>(py: Python<'py>, magic: u16, msg_type: u8, payload: &[u8]) -> Bound<'py, PyBytes> {
        let mut out = Vec::with_capacity(payload.len() + crate::protocol::FRAME_OVERHEAD);
        crate::protocol::encode_frame(&mut out, magic, msg_type, |o| o.extend_from_slice(payload));
        PyBytes::new(py, &out)
    }

    /// Splits a byte stream into frames of one protocol (magic), checking length bounds, magic,
    /// version and CRC; the payloads are parsed by the caller (the client protocol's codec).
    #[pyclass(name = "FrameReader", module = "waltz._native")]
    pub struct PyFrameReader {
        buf: FrameBuf,
        magic: u16,
        max_frame: usize,
    }

    #[pymethods]
    impl PyFrameReader {
        #[new]
        #[pyo3(signature = (magic, max_frame=crate::protocol::DEFAULT_MAX_FRAME))]
        fn new(magic: u16, max_frame: usize) -> Self {
            PyFrameReader { buf: FrameBuf::default(), magic, max_frame }
        }
        fn feed(&mut self, data: &[u8]) {
            self.buf.extend_from_slice(data);
        }
        /// (message type, payload) of the next whole frame, or None until more bytes arrive.
        /// Raises ProtocolError; the connection is then unusable.
        fn next_frame<'py>(&mut self, py: Python<'py>) -> PyResult<Option<(u8, Bound<'py, PyBytes>)>> {
            match split_frame(self.buf.pending(), self.magic, self.max_frame) {
                Ok(Some(f)) => {
                    let (out, size) = ((f.msg_type, PyBytes::new(py, f.payload)), f.size);
                    self.buf.consume(size);
                    Ok(Some(out))
                }
                Ok(None) => Ok(None),
                Err(e) => Err(ProtocolError::new_err(e.to_string())),
            }
        }
        /// Bytes received but not yet returned as frames.
        fn buffered(&self) -> usize {
            self.buf.pending().len()
        }
    }

    /// Splits a byte stream from a storage node into decoded responses. Each response is a tuple
    /// (kind, seq, session_id, partition_id, value); see docs/protocol.md for the kinds.
    #[pyclass(name = "ResponseReader", module = "waltz._native")]
    pub struct PyResponseReader {
        buf: FrameBuf,
        max_frame: usize,
        admin: bool,
    }

    #[pymethods]
    impl PyResponseReader {
        #[new]
        #[pyo3(signature = (max_frame=crate::protocol::DEFAULT_MAX_FRAME, *, admin=false))]
        fn new(max_frame: usize, admin: bool) -> Self {
            PyResponseReader { buf: FrameBuf::default(), max_frame, admin }
        }
        fn feed(&mut self, data: &[u8]) {
            self.buf.extend_from_slice(data);
        }
        /// The next whole response, or None until more bytes arrive. Raises ProtocolError.
        fn next_response<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
            if self.admin {
                return self.next_admin(py);
            }
            let (size, resp) = match split_frame(self.buf.pending(), MAGIC_STORAGE, self.max_frame) {
                Ok(Some(f)) => (f.size, Response::decode(&f)),
                Ok(None) => return Ok(None),
                Err(e) => return Err(ProtocolError::new_err(e.to_string())),
            };
            self.buf.consume(size);
            let resp = resp.map_err(|e| ProtocolError::new_err(e.to_string()))?;
            let none = || py.None();
            let (kind, h, value): (&str, MsgHeader, Py<PyAny>) = match resp {
                Response::HelloOk { version } => ("hello_ok", MsgHeader::default(), version.into_pyobject(py)?.into_any().unbind()),
                Response::Success { h } => ("success", h, none()),
                Response::Failure { h, kind, message } => {
                    ("failure", h, (failure_name(kind), message).into_pyobject(py)?.into_any().unbind())
                }
                Response::LastSessionInfo { h, session_id, low_water_mark } => {
                    ("last_session_info", h, (session_id, low_water_mark).into_pyobject(py)?.into_any().unbind())
                }
                Response::MaxTransactionId { h, txid } => ("max_transaction_id", h, txid.into_pyobject(py)?.into_any().unbind()),
                Response::RecordHeader { h, header } => (
                    "record_header",
                    h,
                    match header {
                        Some(x) => Py::new(py, PyRecordHeader::from(x))?.into_any(),
                        None => none(),
                    },
                ),
                Response::Record { h, record } => (
                    "record",
                    h,
                    match record {
                        Some(r) => Py::new(py, wire_record(py, r))?.into_any(),
                        None => none(),
                    },
                ),
                Response::RecordHeaderList { h, headers } => {
                    let items: Vec<PyRecordHeader> = headers.into_iter().map(Into::into).collect();
                    ("record_header_list", h, items.into_pyobject(py)?.into_any().unbind())
                }
                Response::RecordList { h, records } => {
                    let items = PyList::empty(py);
                    for r in records {
                        items.append(Py::new(py, wire_record(py, r))?)?;
                    }
                    ("record_list", h, items.into_any().unbind())
                }
            };
            response_tuple(py, kind, h, value).map(Some)
        }
    }

    impl PyResponseReader {
        fn next_admin<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
            use crate::protocol::{AdminResponse, MAGIC_ADMIN};
            let (size, resp) = match split_frame(self.buf.pending(), MAGIC_ADMIN, self.max_frame) {
                Ok(Some(f)) => (f.size, AdminResponse::decode(&f)),
                Ok(None) => return Ok(None),
                Err(e) => return Err(ProtocolError::new_err(e.to_string())),
            };
            self.buf.consume(size);
            let resp = resp.map_err(|e| ProtocolError::new_err(e.to_string()))?;
            let (kind, h, value): (&str, MsgHeader, Py<PyAny>) = match resp {
                AdminResponse::HelloOk { version } => ("hello_ok", MsgHeader::default(), version.into_pyobject(py)?.into_any().unbind()),
                AdminResponse::Success { h } => ("success", h, py.None()),
                AdminResponse::Failure { h, kind, message } => {
                    ("failure", h, (failure_name(kind), message).into_pyobject(py)?.into_any().unbind())
                }
                AdminResponse::Status { h, partitions } => {
                    let list = PyList::empty(py);
                    for p in partitions {
                        let d = PyDict::new(py);
                        d.set_item("partition", p.partition_id)?;
                        d.set_item("first_transaction_id", p.first_txid)?;
                        d.set_item("max_transaction_id", p.max_txid)?;
                        d.set_item("session_id", p.session_id)?;
                        d.set_item("low_water_mark", p.low_water_mark)?;
                        d.set_item("local_low_water_mark", p.local_low_water_mark)?;
                        d.set_item("newest_session", p.newest_session)?;
                        d.set_item("readable", p.readable)?;
                        d.set_item("writable", p.writable)?;
                        d.set_item("failure", if p.failure.is_empty() { None } else { Some(p.failure) })?;
                        list.append(d)?;
                    }
                    ("status", h, list.into_any().unbind())
                }
                AdminResponse::RecordList { h, records } => {
                    let items = PyList::empty(py);
                    for r in records {
                        items.append(Py::new(py, wire_record(py, r))?)?;
                    }
                    ("record_list", h, items.into_any().unbind())
                }
            };
            response_tuple(py, kind, h, value).map(Some)
        }
    }

    /// A storage node serving `storage` over TCP (the storage protocol) on its own tokio runtime.
    #[pyclass(name = "StorageNode", module = "waltz._native", frozen)]
    pub struct PyStorageNode {
        handle: std::sync::Mutex<Option<crate::node::NodeHandle>>,
        addr: std::net::SocketAddr,
        admin_addr: Option<std::net::SocketAddr>,
    }

    #[pymethods]
    impl PyStorageNode {
        #[staticmethod]
        #[pyo3(signature = (storage, host="127.0.0.1", port=0, *, admin_port=None, max_frame=crate::protocol::DEFAULT_MAX_FRAME, max_list_count=10_000, max_list_bytes=16<<20, idle_timeout=300.0, max_in_flight=1024, max_connections=4096, tls_ca=None, tls_cert=None, tls_key=None))]
        #[allow(clippy::too_many_arguments)]
        fn start(
            py: Python<'_>,
            storage: &PyStorage,
            host: &str,
            port: u16,
            admin_port: Option<u16>,
            max_frame: usize,
            max_list_count: usize,
            max_list_bytes: usize,
            idle_timeout: f64,
            max_in_flight: usize,
            max_connections: usize,
            tls_ca: Option<std::path::PathBuf>,
            tls_cert: Option<std::path::PathBuf>,
            tls_key: Option<std::path::PathBuf>,
        ) -> PyResult<Self> {
            if !(idle_timeout > 0.0 && idle_timeout.is_finite() && idle_timeout <= 86_400.0) || max_in_flight == 0 || max_frame < 64 || max_connections == 0 {
                return Err(InvalidArgumentError::new_err(
                    "idle_timeout must be finite, positive and at most a day; max_in_flight, max_connections and max_frame positive",
                ));
            }
            let tls = match (tls_ca, tls_cert, tls_key) {
                (None, None, None) => None,
                (Some(ca), Some(cert), Some(key)) => Some(
                    py.detach(|| crate::tls::server_config(&ca, &cert, &key))
                        .map_err(|e| InvalidArgumentError::new_err(format!("TLS: {e}")))?,
                ),
                _ => return Err(InvalidArgumentError::new_err("TLS: give all of tls_ca, tls_cert and tls_key, or none")),
            };
            let opts = crate::node::NodeOptions {
                max_frame,
                max_list_count,
                max_list_bytes,
                idle_timeout: std::time::Duration::from_secs_f64(idle_timeout),
                max_in_flight,
                tls,
                max_connections,
            };
            let s = storage.0.clone();
            let bind = format!("{host}:{port}");
            let admin_bind = admin_port.map(|p| format!("{host}:{p}"));
            let h = py
                .detach(move || crate::node::start(s, &bind, admin_bind.as_deref(), opts))
                .map_err(|e| StorageIOError::new_err(format!("cannot listen on {host}:{port}: {e}")))?;
            let (addr, admin_addr) = (h.addr, h.admin_addr);
            Ok(PyStorageNode { handle: std::sync::Mutex::new(Some(h)), addr, admin_addr })
        }
        /// (host, port) the node listens on.
        #[getter]
        fn address(&self) -> (String, u16) {
            (self.addr.ip().to_string(), self.addr.port())
        }
        /// (host, port) of the admin port, or None when it was not started.
        #[getter]
        fn admin_address(&self) -> Option<(String, u16)> {
            self.admin_addr.map(|a| (a.ip().to_string(), a.port()))
        }
        fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
            use std::sync::atomic::Ordering::Relaxed;
            let d = PyDict::new(py);
            if let Some(h) = self.handle.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                let s = h.stats();
                d.set_item("connections", s.connections.load(Relaxed))?;
                d.set_item("requests", s.requests.load(Relaxed))?;
                d.set_item("failures", s.failures.load(Relaxed))?;
                d.set_item("closed_bad_frames", s.closed_bad_frames.load(Relaxed))?;
                d.set_item("appended_records", s.appended_records.load(Relaxed))?;
                d.set_item("bytes_in", s.bytes_in.load(Relaxed))?;
                d.set_item("bytes_out", s.bytes_out.load(Relaxed))?;
                d.set_item("tls_handshake_failures", s.tls_handshake_failures.load(Relaxed))?;
                d.set_item("refused_connections", s.refused_connections.load(Relaxed))?;
                let by_kind = PyDict::new(py);
                for (code, c) in s.failures_by_kind.iter().enumerate() {
                    let n = c.load(Relaxed);
                    if n > 0 {
                        let name = crate::protocol::FailureKind::from_u16(code as u16).map(failure_name).unwrap_or("internal");
                        by_kind.set_item(name, n)?;
                    }
                }
                d.set_item("failures_by_kind", by_kind)?;
            }
            Ok(d)
        }
        /// Stops accepting, closes connections; queued appends finish their fsync first.
        fn stop(&self, py: Python<'_>) {
            let h = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(mut h) = h {
                py.detach(move || h.stop());
            }
        }
        fn __enter__(slf: Py<Self>) -> Py<Self> {
            slf
        }
        fn __exit__(&self, py: Python<'_>, _t: &Bound<'_, PyAny>, _v: &Bound<'_, PyAny>, _tb: &Bound<'_, PyAny>) -> bool {
            self.stop(py);
            false
        }
    }

    #[pymodule]
    fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let py = m.py();
        crate::pylog::install(py)?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("SYNC_MICROS_BOUNDS", crate::partition::SYNC_MICROS_BOUNDS.to_vec())?;
        m.add("BATCH_RECORDS_BOUNDS", crate::partition::BATCH_RECORDS_BOUNDS.to_vec())?;
        m.add_function(wrap_pyfunction!(raw_append_loop, m)?)?;
        m.add_function(wrap_pyfunction!(encode_request, m)?)?;
        m.add_function(wrap_pyfunction!(encode_append, m)?)?;
        m.add_function(wrap_pyfunction!(encode_admin_request, m)?)?;
        m.add_function(wrap_pyfunction!(encode_admin_append, m)?)?;
        m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
        m.add_class::<PyFrameReader>()?;
        m.add_function(wrap_pyfunction!(inspect_control, m)?)?;
        m.add_function(wrap_pyfunction!(inspect_segment, m)?)?;
        m.add_class::<PyResponseReader>()?;
        m.add_class::<PyStorageNode>()?;
        m.add_class::<PyStorage>()?;
        m.add_class::<PyPartition>()?;
        m.add_class::<PyReqId>()?;
        m.add_class::<PyRecord>()?;
        m.add_class::<PyRecordHeader>()?;
        m.add_class::<PyRecordBatch>()?;
        m.add_class::<PyScanChunk>()?;
        m.add_class::<PyScanPayload>()?;
        m.add_class::<PyPartitionInfo>()?;
        for (name, ty) in [
            ("WaltzError", py.get_type::<WaltzError>()),
            ("StorageError", py.get_type::<StorageError>()),
            ("StorageIOError", py.get_type::<StorageIOError>()),
            ("CorruptionError", py.get_type::<CorruptionError>()),
            ("ClusterKeyMismatch", py.get_type::<ClusterKeyMismatch>()),
            ("PartitionCountMismatch", py.get_type::<PartitionCountMismatch>()),
            ("NonDenseAppendError", py.get_type::<NonDenseAppendError>()),
            ("RecordTooLargeError", py.get_type::<RecordTooLargeError>()),
            ("BelowLogStartError", py.get_type::<BelowLogStartError>()),
            ("PartitionFailedError", py.get_type::<PartitionFailedError>()),
            ("AppendTruncatedError", py.get_type::<AppendTruncatedError>()),
            ("PartitionNotFoundError", py.get_type::<PartitionNotFoundError>()),
            ("StorageExistsError", py.get_type::<StorageExistsError>()),
            ("NotInitialisedError", py.get_type::<NotInitialisedError>()),
            ("ReadOnlyError", py.get_type::<ReadOnlyError>()),
            ("StorageLockedError", py.get_type::<StorageLockedError>()),
            ("StorageClosedError", py.get_type::<StorageClosedError>()),
            ("PartitionClosedError", py.get_type::<PartitionClosedError>()),
            ("InvalidArgumentError", py.get_type::<InvalidArgumentError>()),
            ("ProtocolError", py.get_type::<ProtocolError>()),
            ("InternalError", py.get_type::<InternalError>()),
        ] {
            m.add(name, ty)?;
        }
        Ok(())
    }
}
