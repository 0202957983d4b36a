"""The one exception hierarchy of Waltz.

Every error the native engine raises is one of these classes (they are defined in the extension
so that Rust errors map straight into them); pure-Python layers add their own subclasses of
`WaltzError` here. Messages keep the cause: the file, offset, partition or id involved.
"""

from waltz._native import (
    BelowLogStartError,
    ClusterKeyMismatch,
    CorruptionError,
    InternalError,
    InvalidArgumentError,
    NonDenseAppendError,
    NotInitialisedError,
    PartitionClosedError,
    PartitionCountMismatch,
    PartitionFailedError,
    PartitionNotFoundError,
    ReadOnlyError,
    RecordTooLargeError,
    StorageError,
    StorageExistsError,
    StorageClosedError,
    StorageIOError,
    StorageLockedError,
    WaltzError,
)

__all__ = [
    "BelowLogStartError",
    "ClusterKeyMismatch",
    "CorruptionError",
    "InternalError",
    "InvalidArgumentError",
    "NonDenseAppendError",
    "NotInitialisedError",
    "PartitionClosedError",
    "PartitionCountMismatch",
    "PartitionFailedError",
    "PartitionNotFoundError",
    "ReadOnlyError",
    "RecordTooLargeError",
    "StorageError",
    "StorageExistsError",
    "StorageClosedError",
    "StorageIOError",
    "StorageLockedError",
    "WaltzError",
]
