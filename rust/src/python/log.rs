//! Rust `log` records into Python's `logging` (loggers `waltz.native.<module>`), so that what the
//! node logs (a bad frame, a failed TLS handshake) reaches the daemon's log in its format.
//!
//! No thread that logs ever waits for the GIL: records go through a bounded queue to one thread
//! that attaches to Python to emit them. A tokio worker, or an engine thread holding a partition
//! lock, must not block on the GIL while a Python thread holding it may wait for that lock.
use pyo3::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};

/// Records waiting for the Python side; past this, lines are counted and dropped.
const QUEUE: usize = 4096;

struct Bridge {
    tx: SyncSender<(log::Level, String, String)>,
    dropped: AtomicU64,
}

impl log::Log for Bridge {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }

    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let target = r.target().replacen("waltz_native", "waltz.native", 1).replace("::", ".");
        if let Err(TrySendError::Full(_)) = self.tx.try_send((r.level(), target, r.args().to_string())) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn flush(&self) {}
}

/// Installs the bridge once per process (a no-op if another logger is already installed).
pub fn install(py: Python<'_>) -> PyResult<()> {
    // As libraries should: a process that configured no logging (a CLI, an application) prints
    // nothing of ours through logging's last-resort handler; a daemon's handlers get everything.
    let logging = py.import("logging")?;
    logging
        .call_method1("getLogger", ("waltz.native",))?
        .call_method1("addHandler", (logging.call_method0("NullHandler")?,))?;
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let (tx, rx) = sync_channel(QUEUE);
        let bridge: &'static Bridge = Box::leak(Box::new(Bridge { tx, dropped: AtomicU64::new(0) }));
        if log::set_logger(bridge).is_err() {
            return;
        }
        log::set_max_level(log::LevelFilter::Info);
        let _ = std::thread::Builder::new().name("waltz-log".into()).spawn(move || {
            while let Ok((level, target, message)) = rx.recv() {
                let dropped = bridge.dropped.swap(0, Ordering::Relaxed);
                // None: the interpreter is shutting down, nobody is left to read the log.
                if Python::try_attach(|py| emit(py, level, &target, &message, dropped)).is_none() {
                    break;
                }
            }
        });
    });
    Ok(())
}

fn emit(py: Python<'_>, level: log::Level, target: &str, message: &str, dropped: u64) {
    let levelno = match level {
        log::Level::Error => 40,
        log::Level::Warn => 30,
        log::Level::Info => 20,
        log::Level::Debug => 10,
        log::Level::Trace => 5,
    };
    let logged = (|| -> PyResult<()> {
        let logger = py.import("logging")?.call_method1("getLogger", (target,))?;
        if dropped > 0 {
            logger.call_method1("warning", (format!("{dropped} log lines dropped: the log queue was full"),))?;
        }
        // No arguments: the message is never read as a %-format.
        logger.call_method1("log", (levelno, message))?;
        Ok(())
    })();
    if let Err(e) = logged {
        e.print(py);
    }
}
