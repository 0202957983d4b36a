//! The value types crossing the boundary: ReqId, RecordHeader, Record, RecordBatch,
//! PartitionInfo, and the argument parsers for cluster keys and ReqIds.
use super::errors::InvalidArgumentError;
use crate::engine::batch::LaidBatch;
use crate::engine::control::PartitionInfo;
use crate::engine::record::{crc32, NewRecord, Record, RecordHeader, ReqId};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

pub(crate) fn parse_key(obj: &Bound<'_, PyAny>) -> PyResult<[u8; 16]> {
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

pub(crate) fn parse_req_id(obj: &Bound<'_, PyAny>) -> PyResult<ReqId> {
    if let Ok(r) = obj.cast::<PyReqId>() {
        return Ok(r.borrow().0);
    }
    let (client_id, generation, partition_id, sequence): (i32, i32, i32, i32) = obj.extract().map_err(|_| {
        InvalidArgumentError::new_err(
            "req_id must be a ReqId or a tuple (client_id, generation, partition_id, sequence)",
        )
    })?;
    Ok(ReqId { client_id, generation, partition_id, sequence })
}

/// Identifies a client request: client id, generation, partition id and sequence number.
#[pyclass(name = "ReqId", module = "waltz._native", frozen, eq, hash, skip_from_py_object)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyReqId(pub(crate) ReqId);

#[pymethods]
impl PyReqId {
    #[new]
    fn new(client_id: i32, generation: i32, partition_id: i32, sequence: i32) -> Self {
        PyReqId(ReqId { client_id, generation, partition_id, sequence })
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
    pub(crate) fn __repr__(&self) -> String {
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
    pub(crate) txid: i64,
    #[pyo3(get)]
    pub(crate) req_id: PyReqId,
    #[pyo3(get)]
    pub(crate) header: i32,
}

impl From<RecordHeader> for PyRecordHeader {
    fn from(h: RecordHeader) -> Self {
        PyRecordHeader { txid: h.txid, req_id: PyReqId(h.req_id), header: h.header }
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
    pub(crate) txid: i64,
    #[pyo3(get)]
    pub(crate) req_id: PyReqId,
    #[pyo3(get)]
    pub(crate) header: i32,
    #[pyo3(get)]
    pub(crate) data: Py<PyBytes>,
}

impl PyRecord {
    pub(crate) fn new(py: Python<'_>, r: Record) -> Self {
        PyRecord { txid: r.txid, req_id: PyReqId(r.req_id), header: r.header, data: PyBytes::new(py, &r.data).unbind() }
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
/// transaction id, any number of times, without touching Python objects per record. The first
/// local append lays them out as they lie on disk (`LaidBatch`); later appends only patch their
/// ids. A batch only sent to storage nodes is never laid out (the wire has its own layout).
#[pyclass(name = "RecordBatch", module = "waltz._native")]
pub struct PyRecordBatch {
    /// None while an append has it (`checkout`): it lays it out or patches its ids in place.
    records: Mutex<Option<Records>>,
    returned: Condvar,
    /// Appends waiting in `checkout`, changed only under `records`' lock: the holder wakes one
    /// only when there is one (`notify_one` is a `futex` system call even with no waiter, and a
    /// store batch is checked out once per replica).
    waiting: AtomicUsize,
    count: usize,
    nbytes: usize,
}

pub(crate) enum Records {
    /// The data packed, and per record its ReqId, header, span in `data` and data CRC.
    Packed {
        data: Vec<u8>,
        spans: Vec<(ReqId, i32, usize, usize, u32)>,
    },
    Laid(LaidBatch),
}

impl Records {
    pub(crate) fn views(&self) -> Vec<NewRecord<'_>> {
        match self {
            Records::Packed { data, spans } => spans
                .iter()
                .map(|&(req_id, header, start, len, crc)| NewRecord {
                    req_id,
                    header,
                    data: &data[start..start + len],
                    data_crc: Some(crc),
                })
                .collect(),
            Records::Laid(b) => b.records(),
        }
    }

    /// The records laid out (at ids from `first` when they are laid out now).
    pub(crate) fn laid(&mut self, first: i64) -> &mut LaidBatch {
        if let Records::Packed { .. } = self {
            let mut b = LaidBatch::default();
            b.set_first(first);
            b.extend(&self.views());
            *self = Records::Laid(b);
        }
        match self {
            Records::Laid(b) => b,
            Records::Packed { .. } => unreachable!("laid out just above"),
        }
    }

    fn push(&mut self, req_id: ReqId, header: i32, data: &[u8]) {
        match self {
            Records::Packed { data: d, spans } => {
                spans.push((req_id, header, d.len(), data.len(), crc32(data)));
                d.extend_from_slice(data);
            }
            Records::Laid(b) => b.push(&NewRecord { req_id, header, data, data_crc: None }),
        }
    }
}

/// A RecordBatch's records, held by one user at a time: appends lay them out or patch their ids
/// in place, so a second append of the same batch waits until the first has queued it (not until
/// it is durable), and then patches a copy if the write queue still holds the buffer.
pub(crate) struct Checkout<'a> {
    batch: &'a PyRecordBatch,
    records: Option<Records>,
}

impl Deref for Checkout<'_> {
    type Target = Records;
    fn deref(&self) -> &Records {
        self.records.as_ref().expect("held until dropped")
    }
}

impl DerefMut for Checkout<'_> {
    fn deref_mut(&mut self) -> &mut Records {
        self.records.as_mut().expect("held until dropped")
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        let mut slot = self.batch.records.lock().unwrap_or_else(|e| e.into_inner());
        *slot = self.records.take();
        let waiting = self.batch.waiting.load(Ordering::Relaxed);
        drop(slot);
        if waiting > 0 {
            self.batch.returned.notify_one();
        }
    }
}

impl Default for PyRecordBatch {
    fn default() -> Self {
        let packed = Records::Packed { data: Vec::new(), spans: Vec::new() };
        PyRecordBatch {
            records: Mutex::new(Some(packed)),
            returned: Condvar::new(),
            waiting: AtomicUsize::new(0),
            count: 0,
            nbytes: 0,
        }
    }
}

impl PyRecordBatch {
    /// Takes the records, waiting while another append of this batch holds them. Call it with
    /// the GIL released when the holder may need it (it never does: appends run detached).
    pub(crate) fn checkout(&self) -> Checkout<'_> {
        let mut slot = self.records.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(records) = slot.take() {
                return Checkout { batch: self, records: Some(records) };
            }
            self.waiting.fetch_add(1, Ordering::Relaxed);
            slot = self.returned.wait(slot).unwrap_or_else(|e| e.into_inner());
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The records if no append holds them now, without waiting (so without releasing the GIL).
    pub(crate) fn try_checkout(&self) -> Option<Checkout<'_>> {
        let records = self.records.try_lock().ok()?.take()?;
        Some(Checkout { batch: self, records: Some(records) })
    }

    fn push(&mut self, req_id: ReqId, header: i32, data: &[u8]) {
        // `&mut self`: no append holds the records (it borrows the batch for as long).
        let records = self.records.get_mut().unwrap_or_else(|e| e.into_inner());
        records.as_mut().expect("no append holds them").push(req_id, header, data);
        self.count += 1;
        self.nbytes += data.len();
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
        self.count
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyReqId>()?;
    m.add_class::<PyRecord>()?;
    m.add_class::<PyRecordHeader>()?;
    m.add_class::<PyRecordBatch>()?;
    m.add_class::<PyPartitionInfo>()?;
    Ok(())
}
