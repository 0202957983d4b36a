//! StorageNode: the storage node's tokio server run from Python.
use super::errors::{InvalidArgumentError, StorageIOError};
use super::protocol::failure_name;
use super::storage::PyStorage;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A storage node serving `storage` over TCP (the storage protocol) on its own tokio runtime.
#[pyclass(name = "StorageNode", module = "waltz._native", frozen)]
pub struct PyStorageNode {
    handle: std::sync::Mutex<Option<crate::node::server::NodeHandle>>,
    addr: std::net::SocketAddr,
    admin_addr: Option<std::net::SocketAddr>,
}

#[pymethods]
impl PyStorageNode {
    #[staticmethod]
    #[pyo3(signature = (storage, host="127.0.0.1", port=0, *, admin_port=None, max_frame=crate::node::protocol::DEFAULT_MAX_FRAME, max_list_count=10_000, max_list_bytes=16<<20, idle_timeout=300.0, max_in_flight=1024, max_connections=4096, retention_interval=1.0, retention_rate=crate::node::connection::DEFAULT_RETENTION_RATE, tls_ca=None, tls_cert=None, tls_key=None, role_secrets=None))]
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
        retention_interval: f64,
        retention_rate: u64,
        tls_ca: Option<std::path::PathBuf>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        role_secrets: Option<std::collections::BTreeMap<String, String>>,
    ) -> PyResult<Self> {
        if !(idle_timeout > 0.0 && idle_timeout.is_finite() && idle_timeout <= 86_400.0)
            || max_in_flight == 0
            || max_frame < 64
            || max_connections == 0
            || !(retention_interval > 0.0 && retention_interval <= 86_400.0)
        {
            return Err(InvalidArgumentError::new_err(
                "idle_timeout and retention_interval must be positive and at most a day; max_in_flight, max_connections and max_frame positive",
            ));
        }
        let tls = match (tls_ca, tls_cert, tls_key) {
            (None, None, None) => None,
            (Some(ca), Some(cert), Some(key)) => Some(
                py.detach(|| crate::node::tls::server_config(&ca, &cert, &key))
                    .map_err(|e| InvalidArgumentError::new_err(format!("TLS: {e}")))?,
            ),
            _ => return Err(InvalidArgumentError::new_err("TLS: give all of tls_ca, tls_cert and tls_key, or none")),
        };
        let opts = crate::node::server::NodeOptions {
            max_frame,
            max_list_count,
            max_list_bytes,
            idle_timeout: std::time::Duration::from_secs_f64(idle_timeout),
            max_in_flight,
            tls,
            max_connections,
            retention_interval: std::time::Duration::from_secs_f64(retention_interval),
            retention_rate: (retention_rate > 0).then_some(retention_rate),
            role_secrets: crate::node::secrets::RoleSecrets::new(
                role_secrets.iter().flatten().map(|(role, secret)| (role.as_str(), secret.as_bytes())),
            ),
        };
        let s = storage.0.clone();
        let bind = format!("{host}:{port}");
        let admin_bind = admin_port.map(|p| format!("{host}:{p}"));
        let h = py
            .detach(move || crate::node::server::start(s, &bind, admin_bind.as_deref(), opts))
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
            d.set_item("tls_role_refusals", s.tls_role_refusals.load(Relaxed))?;
            d.set_item("refused_connections", s.refused_connections.load(Relaxed))?;
            d.set_item("secret_refusals", s.secret_refusals.load(Relaxed))?;
            d.set_item("role_request_refusals", s.role_request_refusals.load(Relaxed))?;
            let by_kind = PyDict::new(py);
            for (code, c) in s.failures_by_kind.iter().enumerate() {
                let n = c.load(Relaxed);
                if n > 0 {
                    let name = crate::node::protocol::FailureKind::from_u16(code as u16)
                        .map(failure_name)
                        .unwrap_or("internal");
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStorageNode>()
}
