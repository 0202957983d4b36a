//! The client protocol's reader for Python: frames decoded natively (`crate::client_protocol`)
//! straight into the message classes of `waltz.client_protocol`, which hands them over once as a
//! `ClientVocabulary`. A class whose fields are not the ones decoded here (a message changed in
//! Python only) is decoded by the Python decoder instead, as is a type only Python knows; the
//! parity test (tests/client/unit/test_client_protocol_parity.py) fails until Rust has caught up.
use super::errors::ProtocolError;
use crate::client_protocol::{ClientReader, DecodeError, FeedEntry, Message, MESSAGE_TYPES};
use crate::engine::record::ReqId;
use crate::node::protocol::{FrameError, DEFAULT_MAX_FRAME};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, intern, IntoPyObjectExt};

/// Each message class's dataclass fields, in order, by type code.
const FIELDS: [(u8, &[&str]); 19] = {
    use crate::client_protocol::msg::*;
    [
        (HELLO, &["min_version", "max_version", "role", "secret"]),
        (HELLO_OK, &["version"]),
        (MOUNT, &["seq", "partition", "client_id", "client_high_water_mark", "connection_seq", "client_token"]),
        (MOUNT_RESPONSE, &["seq", "partition", "status", "high_water_mark", "generation"]),
        (APPEND, &["req_id", "client_high_water_mark", "header", "data", "write_locks", "read_locks", "append_locks"]),
        (LOCK_FAILURE, &["req_id", "transaction_id"]),
        (FEED_REQUEST, &["seq", "partition", "after", "max_count"]),
        (FEED_DATA, &["seq", "partition", "entries"]),
        (FLUSH, &["seq", "partition"]),
        (FLUSH_RESPONSE, &["seq", "partition", "high_water_mark"]),
        (TRANSACTION_DATA_REQUEST, &["seq", "partition", "transaction_id"]),
        (TRANSACTION_DATA_RESPONSE, &["seq", "partition", "transaction_id", "data"]),
        (TRANSACTION_DATA_RANGE_REQUEST, &["seq", "partition", "first", "max_count", "max_bytes"]),
        (TRANSACTION_DATA_RANGE_RESPONSE, &["seq", "partition", "first", "data"]),
        (HIGH_WATER_MARK_REQUEST, &["seq", "partition"]),
        (HIGH_WATER_MARK_RESPONSE, &["seq", "partition", "high_water_mark"]),
        (CLIENT_ID_REQUEST, &["seq"]),
        (CLIENT_ID_RESPONSE, &["seq", "client_id"]),
        (FAILURE, &["seq", "partition", "kind", "message"]),
    ]
};
const FEED_ENTRY_FIELDS: &[&str] = &["transaction_id", "req_id", "header"];

/// A dataclass and its field names, interned: instances are made without running `__init__`
/// (a frozen dataclass sets each field through `object.__setattr__`, the slow part).
struct Class {
    cls: Py<PyType>,
    fields: Vec<Py<PyString>>,
}

impl Class {
    /// The class if its dataclass fields are exactly `fields`, else None.
    fn of(cls: &Bound<'_, PyType>, fields: &[&str]) -> PyResult<Option<Class>> {
        let py = cls.py();
        let fields_of = py.import("dataclasses")?.getattr("fields")?;
        let declared: Vec<String> =
            fields_of.call1((cls,))?.try_iter()?.map(|f| f?.getattr("name")?.extract()).collect::<PyResult<_>>()?;
        // Instances are made as object.__new__ makes them: a class with a __new__ of its own
        // is left to the Python decoder.
        let object_new = py.get_type::<pyo3::types::PyAny>().getattr(intern!(py, "__new__"))?;
        if declared != fields || !cls.getattr(intern!(py, "__new__"))?.is(&object_new) {
            return Ok(None);
        }
        Ok(Some(Class {
            cls: cls.clone().unbind(),
            fields: fields.iter().map(|f| PyString::intern(py, f).unbind()).collect(),
        }))
    }
}

/// The message classes, enums and exceptions of `waltz.client_protocol`, given once.
#[pyclass(name = "ClientVocabulary", module = "waltz._native", frozen)]
pub struct PyClientVocabulary {
    /// By position in MESSAGE_TYPES; None: the Python decoder decodes that type.
    classes: Vec<Option<Class>>,
    feed_entry: Class,
    mount_status: Py<PyDict>,
    failure_kind: Py<PyDict>,
    internal: Py<PyAny>,
    limit_exceeded: Py<PyType>,
    too_many_locks: Py<PyType>,
    python_decode: Py<PyAny>,
    python_types: Vec<u8>,
    /// object's tp_new: instances are made without a Python call.
    object_new: ffi::newfunc,
}

#[pymethods]
impl PyClientVocabulary {
    /// `messages`: type code -> message class; `mount_status` and `failure_kind`: the enums
    /// (an unknown failure kind becomes `failure_kind.INTERNAL`); `python_decode(type,
    /// payload, max_locks)`: the Python decoder, for what is not decoded here.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        messages: &Bound<'_, PyDict>,
        feed_entry: &Bound<'_, PyType>,
        mount_status: &Bound<'_, PyAny>,
        failure_kind: &Bound<'_, PyAny>,
        limit_exceeded: &Bound<'_, PyType>,
        too_many_locks: &Bound<'_, PyType>,
        python_decode: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let py = messages.py();
        let mut classes = Vec::new();
        for (t, fields) in FIELDS {
            classes.push(match messages.get_item(t)? {
                Some(cls) => Class::of(cls.cast()?, fields)?,
                None => None,
            });
        }
        let python_types = messages.keys().iter().map(|k| k.extract()).collect::<PyResult<_>>()?;
        let values = |e: &Bound<'_, PyAny>| -> PyResult<Py<PyDict>> {
            Ok(e.getattr(intern!(py, "_value2member_map_"))?.cast_into::<PyDict>()?.unbind())
        };
        Ok(PyClientVocabulary {
            classes,
            feed_entry: Class::of(feed_entry, FEED_ENTRY_FIELDS)?.ok_or_else(|| {
                pyo3::exceptions::PyTypeError::new_err(format!("FeedEntry's fields are not {FEED_ENTRY_FIELDS:?}"))
            })?,
            mount_status: values(mount_status)?,
            failure_kind: values(failure_kind)?,
            internal: failure_kind.getattr("INTERNAL")?.unbind(),
            limit_exceeded: limit_exceeded.clone().unbind(),
            too_many_locks: too_many_locks.clone().unbind(),
            python_decode: python_decode.clone().unbind(),
            python_types,
            // SAFETY: PyType_GetSlot on a static type is allowed since Python 3.10; object
            // always has a tp_new.
            object_new: unsafe {
                std::mem::transmute::<*mut std::ffi::c_void, ffi::newfunc>(ffi::PyType_GetSlot(
                    std::ptr::addr_of_mut!(ffi::PyBaseObject_Type),
                    ffi::Py_tp_new,
                ))
            },
        })
    }

    /// The message types decoded natively (the others, if any, by the Python decoder).
    #[getter]
    fn native_types<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, MESSAGE_TYPES.iter().zip(&self.classes).filter(|(_, c)| c.is_some()).map(|((t, _), _)| *t))
    }
}

fn req_id<'py>(py: Python<'py>, r: &ReqId) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyTuple::new(py, [r.client_id, r.generation, r.partition_id, r.sequence])?.into_any())
}

impl PyClientVocabulary {
    /// `object.__new__(cls)`, then each field set as `object.__setattr__` sets it (what a frozen
    /// dataclass's `__init__` does), without the Python calls.
    fn make<'py>(&self, py: Python<'py>, class: &Class, values: &[Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
        let args = PyTuple::empty(py);
        // SAFETY: object_new is object's tp_new, called as `object.__new__(cls)` would call it,
        // with a class that derives from object; every pointer passed is alive for the call.
        unsafe {
            let obj = (self.object_new)(class.cls.as_ptr().cast(), args.as_ptr(), std::ptr::null_mut());
            let obj = Bound::from_owned_ptr_or_err(py, obj)?;
            for (name, v) in class.fields.iter().zip(values) {
                if ffi::PyObject_GenericSetAttr(obj.as_ptr(), name.as_ptr(), v.as_ptr()) < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            Ok(obj)
        }
    }

    fn entry<'py>(&self, py: Python<'py>, e: FeedEntry) -> PyResult<Bound<'py, PyAny>> {
        self.make(
            py,
            &self.feed_entry,
            &[e.txid.into_bound_py_any(py)?, req_id(py, &e.req_id)?, e.header.into_bound_py_any(py)?],
        )
    }

    /// The message as an instance of its Python class.
    fn message<'py>(&self, py: Python<'py>, class: &Class, m: Message<'_>) -> PyResult<Bound<'py, PyAny>> {
        macro_rules! make {
            ($($v:expr),* $(,)?) => { self.make(py, class, &[$($v.into_bound_py_any(py)?),*]) };
        }
        let bytes = |b: &[u8]| PyBytes::new(py, b);
        let locks = |l: crate::client_protocol::Locks<'_>| PyTuple::new(py, l.iter());
        match m {
            Message::Hello { min_version, max_version, credential } => {
                let (role, secret) = credential.unwrap_or(("", b""));
                make!(min_version, max_version, role, bytes(secret))
            }
            Message::HelloOk { version } => make!(version),
            Message::Mount { seq, partition, client_id, client_high_water_mark, connection_seq, client_token } => {
                make!(seq, partition, client_id, client_high_water_mark, connection_seq, bytes(&client_token))
            }
            Message::MountResponse { seq, partition, status, high_water_mark, generation } => {
                let Some(status) = self.mount_status.bind(py).get_item(status)? else {
                    return Err(ProtocolError::new_err(format!("mount response: unknown status {status}")));
                };
                make!(seq, partition, status, high_water_mark, generation)
            }
            Message::Append {
                req_id: r,
                client_high_water_mark,
                write_locks,
                read_locks,
                append_locks,
                header,
                data,
            } => {
                make!(
                    req_id(py, &r)?,
                    client_high_water_mark,
                    header,
                    bytes(data),
                    locks(write_locks)?,
                    locks(read_locks)?,
                    locks(append_locks)?,
                )
            }
            Message::LockFailure { req_id: r, txid } => make!(req_id(py, &r)?, txid),
            Message::FeedRequest { seq, partition, after, max_count } => make!(seq, partition, after, max_count),
            Message::FeedData { seq, partition, entries } => {
                let items = entries.iter().map(|e| self.entry(py, e)).collect::<PyResult<Vec<_>>>()?;
                make!(seq, partition, PyTuple::new(py, items)?)
            }
            Message::Flush { seq, partition } | Message::HighWaterMarkRequest { seq, partition } => {
                make!(seq, partition)
            }
            Message::ClientIdRequest { seq } => make!(seq),
            Message::ClientIdResponse { seq, client_id } => make!(seq, client_id),
            Message::FlushResponse { seq, partition, high_water_mark: v }
            | Message::HighWaterMarkResponse { seq, partition, high_water_mark: v }
            | Message::TransactionDataRequest { seq, partition, txid: v } => make!(seq, partition, v),
            Message::TransactionDataResponse { seq, partition, txid, data } => make!(seq, partition, txid, bytes(data)),
            Message::TransactionDataRangeRequest { seq, partition, first, max_count, max_bytes } => {
                make!(seq, partition, first, max_count, max_bytes)
            }
            Message::TransactionDataRangeResponse { seq, partition, first, data } => {
                make!(seq, partition, first, PyTuple::new(py, data.into_iter().map(bytes))?)
            }
            Message::Failure { seq, partition, kind, message } => {
                let kind = match self.failure_kind.bind(py).get_item(kind)? {
                    Some(k) => k,
                    None => self.internal.bind(py).clone(),
                };
                make!(seq, partition, kind, message)
            }
        }
    }

    /// One frame's message, or the error the Python decoder raises for it.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        msg_type: u8,
        payload: &[u8],
        decoded: Result<Message<'_>, DecodeError>,
        max_locks: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let class = MESSAGE_TYPES.iter().position(|(t, _)| *t == msg_type).and_then(|i| self.classes[i].as_ref());
        match (class, decoded) {
            (None, _) if self.python_types.contains(&msg_type) => {
                self.python_decode.bind(py).call1((msg_type, PyBytes::new(py, payload), max_locks))
            }
            (None, _) => Err(ProtocolError::new_err(DecodeError::UnknownType(msg_type).to_string())),
            (Some(class), Ok(m)) => self.message(py, class, m),
            (Some(_), Err(DecodeError::TooManyLocks { message, .. })) => {
                Err(PyErr::from_value(self.too_many_locks.bind(py).call1((message, PyBytes::new(py, payload)))?))
            }
            (Some(_), Err(e)) => Err(ProtocolError::new_err(e.to_string())),
        }
    }
}

/// Bytes in, `waltz.client_protocol` messages out (framing and decoding in native code);
/// `waltz.client_protocol.MessageReader` is this class with the module's vocabulary.
#[pyclass(name = "ClientMessageReader", module = "waltz._native", subclass)]
pub struct PyClientMessageReader {
    reader: ClientReader,
    vocabulary: Py<PyClientVocabulary>,
}

#[pymethods]
impl PyClientMessageReader {
    #[new]
    #[pyo3(signature = (vocabulary, max_frame=DEFAULT_MAX_FRAME, max_locks=None))]
    fn new(vocabulary: Py<PyClientVocabulary>, max_frame: usize, max_locks: Option<u64>) -> Self {
        PyClientMessageReader { reader: ClientReader::new(max_frame, max_locks), vocabulary }
    }

    /// The largest frame accepted: a frame declaring more is refused as soon as its length
    /// arrives, none of it buffered (LimitExceeded).
    #[getter]
    fn get_max_frame(&self) -> usize {
        self.reader.max_frame
    }
    #[setter]
    fn set_max_frame(&mut self, value: usize) {
        self.reader.max_frame = value;
    }
    /// The most locks an Append may declare in all (TooManyLocks beyond), or None.
    #[getter]
    fn get_max_locks(&self) -> Option<u64> {
        self.reader.max_locks
    }
    #[setter]
    fn set_max_locks(&mut self, value: Option<u64>) {
        self.reader.max_locks = value;
    }

    fn feed(&mut self, data: &[u8]) {
        self.reader.feed(data);
    }

    /// Bytes received but not yet returned as messages.
    fn buffered(&self) -> usize {
        self.reader.buffered()
    }

    /// The next message, or None until a whole frame has arrived. Raises ProtocolError (the
    /// connection is then unusable), LimitExceeded for a frame above max_frame, TooManyLocks
    /// for an Append above max_locks (its frame consumed: the connection may go on).
    fn next_message<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let vocabulary = self.vocabulary.get();
        let max_locks = self.reader.max_locks;
        match self.reader.next_with(|t, payload, decoded| vocabulary.decode(py, t, payload, decoded, max_locks)) {
            Ok(None) => Ok(None),
            Ok(Some(m)) => m.map(Some),
            Err(e @ FrameError::TooLarge { .. }) => {
                Err(PyErr::from_value(vocabulary.limit_exceeded.bind(py).call1((e.to_string(),))?))
            }
            Err(e) => Err(ProtocolError::new_err(e.to_string())),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyClientVocabulary>()?;
    m.add_class::<PyClientMessageReader>()?;
    Ok(())
}
