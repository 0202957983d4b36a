//! The exception tree every engine error maps into, and `run`, which releases the GIL around
//! engine work and turns a panic into InternalError.
use crate::engine::error::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

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

pub(crate) fn to_py(e: Error) -> PyErr {
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
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
