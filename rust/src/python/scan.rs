//! Partition.scan's result: columns as Arrow-ready buffers, the payload lent without a copy.
use crate::engine::partition::Columns;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Arc;

/// buffers of an Arrow binary column.
#[pyclass(name = "ScanChunk", module = "waltz._native", frozen)]
pub struct PyScanChunk(Columns, Arc<Vec<u8>>);

impl PyScanChunk {
    pub(crate) fn new(mut columns: Columns) -> Self {
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
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScanChunk>()?;
    m.add_class::<PyScanPayload>()?;
    Ok(())
}
