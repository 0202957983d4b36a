//! The storage and admin protocol codec: request encoders, frame splitting, response decoding.
use super::errors::{InvalidArgumentError, ProtocolError};
use super::types::{parse_key, PyRecord, PyRecordBatch, PyRecordHeader};
use crate::engine::record::{crc32, Record};
use crate::node::protocol::{
    encode_append as encode_append_frame, split_frame, AdminRequest, Credential, FailureKind, FrameBuf, MsgHeader,
    Request, Response, RetentionOrder, WireRecord, MAGIC_STORAGE,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

/// An enum of request kinds exposed to Python (`RequestKind.MAX_TRANSACTION_ID`); a caller
/// may also name a kind as docs/protocol.md spells it ("max_transaction_id"), which `extract`
/// turns into the enum, so the encoders dispatch on the enum only.
macro_rules! request_kinds {
    ($(#[$doc:meta])* $py_name:literal $kind:ident, $what:literal { $($variant:ident $upper:literal $name:literal,)* }) => {
        $(#[$doc])*
        #[pyclass(name = $py_name, module = "waltz._native", eq, eq_int, frozen, skip_from_py_object)]
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub enum $kind {
            $(#[pyo3(name = $upper)] $variant,)*
        }

        impl $kind {
            fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
                if let Ok(k) = obj.cast::<$kind>() {
                    return Ok(*k.get());
                }
                let name: String = obj.extract()?;
                match name.as_str() {
                    $($name => Ok($kind::$variant),)*
                    other => Err(InvalidArgumentError::new_err(format!(concat!("unknown ", $what, " kind {:?}"), other))),
                }
            }
        }
    };
}

request_kinds! {
    /// A storage-protocol request an encoder can build (Append has its own, `encode_append`).
    "RequestKind" RequestKind, "request" {
        Hello "HELLO" "hello",
        Open "OPEN" "open",
        LastSessionInfo "LAST_SESSION_INFO" "last_session_info",
        MaxTransactionId "MAX_TRANSACTION_ID" "max_transaction_id",
        Truncate "TRUNCATE" "truncate",
        SetLowWaterMark "SET_LOW_WATER_MARK" "set_low_water_mark",
        RecordHeader "RECORD_HEADER" "record_header",
        Record "RECORD" "record",
        RecordHeaderList "RECORD_HEADER_LIST" "record_header_list",
        RecordList "RECORD_LIST" "record_list",
        RestartLog "RESTART_LOG" "restart_log",
    }
}

request_kinds! {
    /// An admin-protocol request an encoder can build (Append has its own, `encode_admin_append`).
    "AdminRequestKind" AdminRequestKind, "admin request" {
        Hello "HELLO" "hello",
        Open "OPEN" "open",
        Assign "ASSIGN" "assign",
        Unassign "UNASSIGN" "unassign",
        SetAvailability "SET_AVAILABILITY" "set_availability",
        Status "STATUS" "status",
        RecordList "RECORD_LIST" "record_list",
        SetPartitionInfo "SET_PARTITION_INFO" "set_partition_info",
        ResetFence "RESET_FENCE" "reset_fence",
        RestartLog "RESTART_LOG" "restart_log",
        Truncate "TRUNCATE" "truncate",
        RaiseFence "RAISE_FENCE" "raise_fence",
    }
}

/// A Hello's role secret: both or neither.
fn credential(role: Option<String>, secret: Option<Vec<u8>>) -> PyResult<Option<Credential>> {
    match (role, secret) {
        (None, None) => Ok(None),
        (Some(role), Some(secret)) => Ok(Some(Credential { role, secret })),
        _ => Err(InvalidArgumentError::new_err("hello: give both role and secret, or neither")),
    }
}

/// Encodes one storage-protocol request frame (everything but Append, see `encode_append`);
/// `kind` is a RequestKind or its protocol name.
#[pyfunction]
#[pyo3(signature = (kind, session_id=-1, seq=-1, partition_id=-1, *, txid=0, max_count=0, low_water_mark=-1, cluster_key=None, partition_count=0, min_version=1, max_version=1, role=None, secret=None))]
#[allow(clippy::too_many_arguments)]
fn encode_request<'py>(
    py: Python<'py>,
    kind: &Bound<'_, PyAny>,
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
    role: Option<String>,
    secret: Option<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let h = MsgHeader { session_id, seq, partition_id };
    let req = match RequestKind::extract(kind)? {
        RequestKind::Hello => Request::Hello { min_version, max_version, credential: credential(role, secret)? },
        RequestKind::Open => {
            let k = cluster_key.ok_or_else(|| InvalidArgumentError::new_err("open needs cluster_key"))?;
            Request::Open { h, cluster_key: parse_key(k)?, partition_count }
        }
        RequestKind::LastSessionInfo => Request::LastSessionInfo { h },
        RequestKind::MaxTransactionId => Request::MaxTransactionId { h },
        RequestKind::Truncate => Request::Truncate { h, txid },
        RequestKind::SetLowWaterMark => Request::SetLowWaterMark { h, low_water_mark },
        RequestKind::RecordHeader => Request::RecordHeader { h, txid },
        RequestKind::Record => Request::Record { h, txid },
        RequestKind::RecordHeaderList => Request::RecordHeaderList { h, txid, max_count },
        RequestKind::RecordList => Request::RecordList { h, txid, max_count },
        RequestKind::RestartLog => Request::RestartLog { h, first_txid: txid },
    };
    let mut out = Vec::new();
    req.encode(&mut out);
    Ok(PyBytes::new(py, &out))
}

/// Encodes a Set Retention request (docs/protocol.md): the partition's policy (-1: no limit),
/// the floor of transactions kept, the lowest held id (i64::MAX: none) and the order's lease.
#[pyfunction]
#[pyo3(signature = (session_id, seq, partition_id, *, max_age_ms=-1, max_bytes=-1, min_kept=0, hold_from=i64::MAX, lease_ms=30_000))]
#[allow(clippy::too_many_arguments)]
fn encode_set_retention<'py>(
    py: Python<'py>,
    session_id: i64,
    seq: i64,
    partition_id: i32,
    max_age_ms: i64,
    max_bytes: i64,
    min_kept: i64,
    hold_from: i64,
    lease_ms: i64,
) -> Bound<'py, PyBytes> {
    let h = MsgHeader { session_id, seq, partition_id };
    let mut out = Vec::new();
    Request::SetRetention(RetentionOrder { h, max_age_ms, max_bytes, min_kept, hold_from, lease_ms }).encode(&mut out);
    PyBytes::new(py, &out)
}

/// Encodes one admin-protocol request frame; `kind` is an AdminRequestKind or its protocol
/// name (hello, open, assign, unassign, set_availability, status, record_list,
/// set_partition_info, reset_fence, truncate, raise_fence).
#[pyfunction]
#[pyo3(signature = (kind, seq=0, partition_id=0, *, cluster_key=None, partition_count=0, delete_files=false, readable=true, writable=true, txid=0, max_count=0, session_id=-1, low_water_mark=-1, force=false, role=None, secret=None))]
#[allow(clippy::too_many_arguments)]
fn encode_admin_request<'py>(
    py: Python<'py>,
    kind: &Bound<'_, PyAny>,
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
    force: bool,
    role: Option<String>,
    secret: Option<Vec<u8>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let h = MsgHeader { session_id: -1, seq, partition_id };
    let req = match AdminRequestKind::extract(kind)? {
        AdminRequestKind::Hello => {
            AdminRequest::Hello { min_version: 1, max_version: 1, credential: credential(role, secret)? }
        }
        AdminRequestKind::Open => {
            let k = cluster_key.ok_or_else(|| InvalidArgumentError::new_err("open needs cluster_key"))?;
            AdminRequest::Open { h, cluster_key: parse_key(k)?, partition_count }
        }
        AdminRequestKind::Assign => AdminRequest::Assign { h },
        AdminRequestKind::Unassign => AdminRequest::Unassign { h, delete_files },
        AdminRequestKind::SetAvailability => AdminRequest::SetAvailability { h, readable, writable },
        AdminRequestKind::Status => AdminRequest::Status { h },
        AdminRequestKind::RecordList => AdminRequest::RecordList { h, txid, max_count },
        AdminRequestKind::SetPartitionInfo => AdminRequest::SetPartitionInfo { h, session_id, low_water_mark },
        AdminRequestKind::ResetFence => AdminRequest::ResetFence { h, session_id },
        AdminRequestKind::RestartLog => AdminRequest::RestartLog { h, first_txid: txid },
        AdminRequestKind::Truncate => AdminRequest::Truncate { h, txid, force },
        AdminRequestKind::RaiseFence => AdminRequest::RaiseFence { h, session_id, force },
    };
    let mut out = Vec::new();
    req.encode(&mut out);
    Ok(PyBytes::new(py, &out))
}

/// An admin Append frame carrying `records` (Records read from another node) unchanged.
#[pyfunction]
fn encode_admin_append<'py>(
    py: Python<'py>,
    seq: i64,
    partition_id: i32,
    records: &Bound<'_, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let h = MsgHeader { session_id: -1, seq, partition_id };
    let mut out_records = Vec::new();
    for item in records.try_iter()? {
        let item = item?;
        let r = item.cast::<PyRecord>()?.get();
        let data = r.data.bind(py).as_bytes().to_vec();
        out_records.push(WireRecord {
            txid: r.txid,
            req_id: r.req_id.0,
            header: r.header,
            data_crc: crc32(&data),
            data,
        });
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
    let batch: &PyRecordBatch = &batch;
    // A batch is held only while a local append of it queues it: take a free one without
    // releasing the GIL (a GIL hand-over per replica per store batch otherwise).
    let held = match batch.try_checkout() {
        Some(held) => held,
        None => py.detach(|| batch.checkout()),
    };
    let mut out = Vec::new();
    encode_append_frame(&mut out, &h, first_txid, &held.views());
    drop(held);
    Ok(PyBytes::new(py, &out))
}

pub(crate) fn failure_name(k: FailureKind) -> &'static str {
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
        FailureKind::Refused => "refused",
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
    let mut out = Vec::with_capacity(payload.len() + crate::node::protocol::FRAME_OVERHEAD);
    crate::node::protocol::encode_frame(&mut out, magic, msg_type, |o| o.extend_from_slice(payload));
    PyBytes::new(py, &out)
}

/// Splits a byte stream into frames of one protocol (magic), checking length bounds, magic,
/// version and CRC; the payloads are parsed by the caller (the client protocol's codec).
#[pyclass(name = "FrameReader", module = "waltz._native")]
pub struct PyFrameReader {
    buf: FrameBuf,
    magic: u16,
    /// The largest frame accepted, checked when a frame's length arrives (before its bytes are
    /// buffered); a server lowers it for peers that have not authenticated yet.
    #[pyo3(get, set)]
    max_frame: usize,
}

#[pymethods]
impl PyFrameReader {
    #[new]
    #[pyo3(signature = (magic, max_frame=crate::node::protocol::DEFAULT_MAX_FRAME))]
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
    #[pyo3(signature = (max_frame=crate::node::protocol::DEFAULT_MAX_FRAME, *, admin=false))]
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
            Response::HelloOk { version } => {
                ("hello_ok", MsgHeader::default(), version.into_pyobject(py)?.into_any().unbind())
            }
            Response::Success { h } => ("success", h, none()),
            Response::Failure { h, kind, message } => {
                ("failure", h, (failure_name(kind), message).into_pyobject(py)?.into_any().unbind())
            }
            Response::LastSessionInfo { h, session_id, low_water_mark } => {
                ("last_session_info", h, (session_id, low_water_mark).into_pyobject(py)?.into_any().unbind())
            }
            Response::MaxTransactionId { h, txid } => {
                ("max_transaction_id", h, txid.into_pyobject(py)?.into_any().unbind())
            }
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
            Response::Retention { h, first_txid } => {
                ("retention", h, first_txid.into_pyobject(py)?.into_any().unbind())
            }
        };
        response_tuple(py, kind, h, value).map(Some)
    }
}

impl PyResponseReader {
    fn next_admin<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        use crate::node::protocol::{AdminResponse, MAGIC_ADMIN};
        let (size, resp) = match split_frame(self.buf.pending(), MAGIC_ADMIN, self.max_frame) {
            Ok(Some(f)) => (f.size, AdminResponse::decode(&f)),
            Ok(None) => return Ok(None),
            Err(e) => return Err(ProtocolError::new_err(e.to_string())),
        };
        self.buf.consume(size);
        let resp = resp.map_err(|e| ProtocolError::new_err(e.to_string()))?;
        let (kind, h, value): (&str, MsgHeader, Py<PyAny>) = match resp {
            AdminResponse::HelloOk { version } => {
                ("hello_ok", MsgHeader::default(), version.into_pyobject(py)?.into_any().unbind())
            }
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
                    d.set_item("bytes_on_disk", p.bytes_on_disk)?;
                    d.set_item("oldest_ms", p.oldest_ms)?;
                    d.set_item("reclaimed_bytes", p.reclaimed_bytes)?;
                    d.set_item("retention_limit", p.retention_limit)?;
                    d.set_item("retention_hold", p.retention_hold)?;
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_request, m)?)?;
    m.add_function(wrap_pyfunction!(encode_append, m)?)?;
    m.add_function(wrap_pyfunction!(encode_admin_request, m)?)?;
    m.add_function(wrap_pyfunction!(encode_admin_append, m)?)?;
    m.add_function(wrap_pyfunction!(encode_set_retention, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_class::<RequestKind>()?;
    m.add_class::<AdminRequestKind>()?;
    m.add_class::<PyFrameReader>()?;
    m.add_class::<PyResponseReader>()?;
    Ok(())
}
