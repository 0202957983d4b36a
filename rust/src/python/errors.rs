//! The exception tree every engine error maps into, and `run`, which releases the GIL around
//! engine work and turns a panic into InternalError.
use crate::engine::error::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The one table of Waltz's native exceptions: name, base, docstring, and the engine errors
/// that map to it. It generates the classes, `to_py`, the registration and `EXCEPTIONS`, the
/// table Python reads (scripts/gen_exceptions.py writes `waltz.errors`' imports and the stub
/// from it; tests/unit/test_exception_table.py checks they are up to date). Bases come before
/// their subclasses. Every message keeps the cause (`Error`'s text: file, offset, partition).
macro_rules! exceptions {
    ($($name:ident($base:ident) $doc:literal $([$from:pat])?;)*) => {
        $(create_exception!(_native, $name, $base, $doc);)*

        /// The engine error as the exception of its kind.
        pub(crate) fn to_py(e: Error) -> PyErr {
            let msg = e.to_string();
            match e {
                $($($from => $name::new_err(msg),)?)*
            }
        }

        /// Adds each exception, and `EXCEPTIONS`: (name, base name, docstring) of each, bases first.
        pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            let mut table: Vec<(&str, String, &str)> = Vec::new();
            $(
                m.add(stringify!($name), py.get_type::<$name>())?;
                table.push((stringify!($name), py.get_type::<$base>().name()?.to_string(), $doc));
            )*
            m.add("EXCEPTIONS", table)?;
            Ok(())
        }
    };
}

exceptions! {
    WaltzError(PyException) "Root of every Waltz error.";
    StorageError(WaltzError) "An error of the storage engine.";
    StorageIOError(StorageError) "A read, write or sync failed." [Error::Io { .. }];
    CorruptionError(StorageError) "Data on disk fails its checks." [Error::Corruption { .. }];
    ClusterKeyMismatch(StorageError) "The files belong to another cluster." [Error::ClusterKeyMismatch { .. }];
    PartitionCountMismatch(StorageError) "The storage has another partition count." [Error::PartitionCountMismatch { .. }];
    NonDenseAppendError(StorageError) "Appended ids do not continue the log." [Error::NonDenseAppend { .. }];
    RecordTooLargeError(StorageError) "A record exceeds the maximum size." [Error::RecordTooLarge { .. }];
    BelowLogStartError(StorageError) "The id was removed by retention." [Error::BelowLogStart { .. }];
    PartitionFailedError(StorageError) "A write or sync failed; reopen the partition." [Error::PartitionFailed { .. }];
    AppendTruncatedError(StorageError) "A truncation cut the append before it was acknowledged." [Error::AppendTruncated { .. }];
    RefusedError(StorageError) "A replica refused a destructive request its state shows no server needs.";
    PartitionNotFoundError(StorageError) "No such partition here."
        [Error::PartitionNotFound { .. } | Error::PartitionOutOfRange { .. }];
    StorageExistsError(StorageError) "The directory is already a storage directory." [Error::AlreadyExists { .. }];
    NotInitialisedError(StorageError) "The directory is not a storage directory." [Error::NotInitialised { .. }];
    ReadOnlyError(StorageError) "The storage was opened read-only." [Error::ReadOnly];
    StorageLockedError(StorageError) "Another writer has the storage directory open." [Error::Locked { .. }];
    StorageClosedError(StorageError) "The storage handle was closed." [Error::StorageClosed { .. }];
    PartitionClosedError(StorageError) "The partition handle was closed." [Error::Closed { .. }];
    InvalidArgumentError(WaltzError) "An argument is out of range." [Error::InvalidArgument(_)];
    ProtocolError(WaltzError) "A peer sent bytes that are not a valid frame.";
    InternalError(WaltzError) "A bug: an invariant of the engine failed." [Error::Invariant { .. }];
}

/// Runs engine work without the GIL; a panic becomes InternalError instead of unwinding
/// into the interpreter.
pub(crate) fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::engine::error::Result<T> + Send) -> PyResult<T> {
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
