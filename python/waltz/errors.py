"""The one exception hierarchy of Waltz.

Every error the native engine raises is one of these classes (they are defined in the extension
so that Rust errors map straight into them); pure-Python layers add their own subclasses of
`WaltzError` here. Messages keep the cause: the file, offset, partition or id involved.
"""

from waltz._native import (
    AppendTruncatedError,
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
    ProtocolError,
    ReadOnlyError,
    RecordTooLargeError,
    StorageError,
    StorageExistsError,
    StorageClosedError,
    StorageIOError,
    StorageLockedError,
    WaltzError,
)



class StorageRequestError(StorageError):
    """A storage node answered a request with a Failure; `kind` says which (docs/protocol.md)."""

    def __init__(self, message: str, kind: str = "internal") -> None:
        super().__init__(message)
        self.kind = kind


class StaleSessionError(StorageRequestError):
    """The request's store session is older than the newest one the node has seen (fenced)."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage node did not answer within the request timeout; the outcome is unknown."""


class StorageConnectionError(StorageError, ConnectionError):
    """The connection to a storage node failed or was closed; in-flight requests are unknown."""


__all__ = [
    "AppendTruncatedError",
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
    "ProtocolError",
    "ReadOnlyError",
    "RecordTooLargeError",
    "StorageError",
    "StorageExistsError",
    "StorageClosedError",
    "StaleSessionError",
    "StorageConnectionError",
    "StorageIOError",
    "StorageLockedError",
    "StorageRequestError",
    "StorageTimeoutError",
    "WaltzError",
]
