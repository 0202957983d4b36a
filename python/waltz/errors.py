"""The one exception hierarchy of Waltz.

Every error the native engine raises is one of these classes (they are defined in the extension
so that Rust errors map straight into them); pure-Python layers add their own subclasses of
`WaltzError` here. Messages keep the cause: the file, offset, partition or id involved.
"""

# BEGIN generated exceptions imports (scripts/gen_exceptions.py from waltz._native.EXCEPTIONS)
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
    RefusedError,
    StorageClosedError,
    StorageError,
    StorageExistsError,
    StorageIOError,
    StorageLockedError,
    WaltzError,
)

# END generated exceptions imports


class ConfigError(WaltzError, ValueError):
    """A configuration file is missing, unreadable, or has a bad key or value."""


class TlsError(WaltzError, ConnectionError):
    """A TLS handshake with a peer failed, or a peer speaks TLS where we do not (or the other way
    round). The message names the peer and the cause: a CA that does not match, a missing or
    refused client certificate, or a plaintext port."""


class HelloRefusedError(ProtocolError):
    """A server refused our Hello: the role of our certificate, or our role secret, is not
    admitted on its port (the message says why). Retrying does not help until the credential
    changes, so readers raise it at once; `WaltzClient` keeps retrying (a credential can be fixed
    without restarting it)."""


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


class MetadataError(WaltzError):
    """The cluster metadata store (ZooKeeper or the embedded store) refused or failed an operation."""


class MetadataNotFoundError(MetadataError, KeyError):
    """No entry at that path (or a parent of the entry to create is missing)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MetadataExistsError(MetadataError):
    """An entry already exists at that path."""


class MetadataVersionError(MetadataError):
    """A compare-and-set lost: the entry's version is not the one the caller read."""


class MetadataNotEmptyError(MetadataError):
    """The entry has children and was not deleted recursively."""


class MetadataSessionLostError(MetadataError):
    """The metadata session expired: its ephemeral entries are gone and must be re-created."""


class MetadataUnavailableError(MetadataError, ConnectionError):
    """The metadata store cannot be reached; the operation's outcome may be unknown."""


class MetadataTransactionError(MetadataError):
    """A multi-operation transaction failed as a whole; `index` is the operation that failed and
    `cause` its error. Nothing of the transaction was applied."""

    def __init__(self, message: str, index: int, cause: MetadataError) -> None:
        super().__init__(message)
        self.index = index
        self.cause = cause


class StoreSessionError(WaltzError):
    """A partition's store session ended (a lost quorum, or fenced by a newer session): it
    accepts no more appends, and appends in flight have an unknown outcome."""


class RecoveryNeededError(StoreSessionError):
    """The recovery vote stayed undecidable (too many replicas of the last session unreachable)
    for as long as the session waited; the partition retries with a new session."""


class StaleGenerationError(WaltzError):
    """The partition has moved on to a newer generation: this server no longer owns it."""


class MissingExtraError(WaltzError, ImportError):
    """A feature was used whose optional dependencies are not installed; the message names the
    extra that installs them (`waltz._extras.require`)."""


class ClusterError(WaltzError):
    """A cluster administration request cannot be done as asked (the message says why)."""


class PartitionNotServedError(ClusterError):
    """No live server holds the partition right now (unassigned, or its server is gone)."""


class ClientError(WaltzError):
    """The client library cannot do what was asked (the message says why).

    `outcome_unknown` is True when the transaction it fails was sent and may still commit (it
    then arrives in the feed, like any other: do not submit it again on your own); False when it
    definitely did not commit."""

    def __init__(self, message: str = "", *, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown


class ClientClosedError(ClientError):
    """The client is closed (or closing): nothing more can be submitted."""


class MountTimeoutError(ClientError, TimeoutError):
    """A partition could not be mounted (no server serving it, or its feed's replay making no
    progress) for `mount_timeout`. Whether a transaction already sent committed is then unknown:
    if it did, it arrives in the feed like any other."""


class ClientAheadError(ClientError):
    """The application's high-water mark is above the partition's: it read a different cluster,
    or its database was restored from a newer backup. Refused rather than papered over."""


class ClientBehindRetentionError(ClientError):
    """The application's high-water mark is below what the cluster still holds: retention
    deleted the transactions after it (`partition`, the application's `high_water_mark`, the
    `first_id` the cluster holds). Refused for good: bootstrap the application's database from
    a snapshot taken at a known high-water mark at or above `first_id - 1` (docs/client.md)."""

    def __init__(
        self,
        message: str = "",
        *,
        outcome_unknown: bool = False,
        partition: int = -1,
        high_water_mark: int = -2,
        first_id: int = -1,
    ) -> None:
        super().__init__(message, outcome_unknown=outcome_unknown)
        self.partition, self.high_water_mark, self.first_id = partition, high_water_mark, first_id


class TransactionsDeletedError(WaltzError):
    """Transactions a reader asked for were deleted by retention: `partition`, the range gone
    (`first_missing`..`last_missing`, inclusive) and the `first_id` still held (-1 when not known)."""

    def __init__(
        self,
        message: str = "",
        *,
        partition: int = -1,
        first_missing: int = -1,
        last_missing: int = -1,
        first_id: int = -1,
    ) -> None:
        super().__init__(message)
        self.partition, self.first_missing, self.last_missing, self.first_id = (
            partition,
            first_missing,
            last_missing,
            first_id,
        )


def transactions_deleted(partition: int, first_missing: int, first_id: int) -> TransactionsDeletedError:
    """The error naming what retention deleted below `first_id` from `first_missing` on."""
    return TransactionsDeletedError(
        f"partition {partition}: transactions {first_missing}..{first_id - 1} were deleted by retention "
        f"(the log starts at {first_id})",
        partition=partition,
        first_missing=first_missing,
        last_missing=first_id - 1,
        first_id=first_id,
    )


def log_start_in(message: str) -> int:
    """The first id held that a `transactions_deleted` message names, -1 when it names none."""
    import re

    m = re.search(r"\(the log starts at (-?\d+)\)", message)
    return int(m.group(1)) if m else -1


class TransactionExpiredError(ClientError, TimeoutError):
    """A transaction context was not completed within its timeout and is not retried any more."""


class RequestFailedError(ClientError):
    """A server refused a request; `kind` is the protocol's failure kind (docs/protocol.md)."""

    def __init__(self, message: str, kind: str = "internal") -> None:
        super().__init__(message)
        self.kind = kind


class RequestTimeoutError(RequestFailedError, TimeoutError):
    """A request got no answer within `request_timeout`, retries included."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "timeout")


class PartitionNotMountedError(ClientError, ValueError):
    """An append or request for a partition outside the client's `ClientConfig.partitions`:
    another instance of the service mounts it. Nothing was sent."""


class ApplicationStateError(ClientError):
    """The application's stored high-water mark does not fit the feed (a gap: the database was
    restored, or another cluster's feed was applied to it)."""


__all__ = [
    "ApplicationStateError",
    "ConfigError",
    "PartitionNotMountedError",
    "TlsError",
    "ClientAheadError",
    "ClientBehindRetentionError",
    "TransactionsDeletedError",
    "ClientClosedError",
    "ClientError",
    "ClusterError",
    "MountTimeoutError",
    "RequestFailedError",
    "RequestTimeoutError",
    "TransactionExpiredError",
    "RecoveryNeededError",
    "StaleGenerationError",
    "StoreSessionError",
    "MetadataError",
    "MetadataExistsError",
    "MetadataNotEmptyError",
    "MetadataNotFoundError",
    "MetadataSessionLostError",
    "MissingExtraError",
    "MetadataTransactionError",
    "MetadataUnavailableError",
    "MetadataVersionError",
    "StaleSessionError",
    "StorageConnectionError",
    "HelloRefusedError",
    "StorageRequestError",
    "StorageTimeoutError",
]
# BEGIN generated exceptions exports (scripts/gen_exceptions.py from waltz._native.EXCEPTIONS)
__all__ += [
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
    "RefusedError",
    "StorageClosedError",
    "StorageError",
    "StorageExistsError",
    "StorageIOError",
    "StorageLockedError",
    "WaltzError",
]
# END generated exceptions exports
