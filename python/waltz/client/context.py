"""What an application writes: a `TransactionContext` builds its transaction with a
`TransactionBuilder` each time the client (re-)executes it."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Iterable
from typing import Any

from waltz import clock
from waltz.client.serializers import BYTES, Serializer
from waltz.client_protocol import lock_hash

_I32 = (-(2**31), 2**31 - 1)


@dataclasses.dataclass(frozen=True)
class PartitionLocalLock:
    """A lock named by the application (`PartitionLocalLock("account", 42)`): transactions of one
    partition that take the same lock conflict (docs/locking.md)."""

    name: str
    id: int

    @property
    def hash(self) -> int:
        return lock_hash(self.name, self.id)


class TransactionBuilder:
    """Collects one execution's transaction: header, data and locks."""

    def __init__(self, partition: int, client_high_water_mark: int) -> None:
        self.partition = partition
        self.client_high_water_mark = client_high_water_mark
        """The application's high-water mark read before `execute` ran: the locks are checked
        against it, so everything `execute` read must be at least this new."""
        self.header = 0
        self.data = b""
        self.write_locks: list[PartitionLocalLock] = []
        self.read_locks: list[PartitionLocalLock] = []
        self.append_locks: list[PartitionLocalLock] = []

    def set_header(self, header: int) -> None:
        """An application-defined 32-bit integer delivered with the feed (without the data)."""
        if not isinstance(header, int) or not _I32[0] <= header <= _I32[1]:
            raise ValueError(f"the header must be a 32-bit integer, not {header!r}")
        self.header = header

    def set_data(self, value: Any, serializer: Serializer[Any] = BYTES) -> None:
        self.data = serializer.serialize(value)

    def add_write_locks(self, *locks: PartitionLocalLock) -> None:
        """Fails the transaction if another transaction wrote one of these locks after the
        client high-water mark; a success makes this transaction their newest writer."""
        self.write_locks.extend(_checked(locks))

    def add_read_locks(self, *locks: PartitionLocalLock) -> None:
        """Fails the transaction if another transaction wrote one of these locks after the
        client high-water mark."""
        self.read_locks.extend(_checked(locks))

    def add_append_locks(self, *locks: PartitionLocalLock) -> None:
        """Never fails; makes this transaction the locks' newest writer (others' read and
        write locks on them then conflict)."""
        self.append_locks.extend(_checked(locks))


def _checked(locks: Iterable[PartitionLocalLock]) -> list[PartitionLocalLock]:
    out = list(locks)
    for lock in out:
        if not isinstance(lock, PartitionLocalLock):
            raise TypeError(f"locks are PartitionLocalLock(name, id), not {lock!r}")
    return out


class TransactionContext:
    """Subclass it: `execute` builds the transaction and is run again whenever an append fails
    or loses a lock race, until it succeeds, declines (returns False) or expires.

    Any method may be `async def` (it then runs on the client's event loop); plain methods run
    in the client's callback threads (`WaltzClient.submit` runs the first `execute` in the
    submitting thread)."""

    timeout: float | None = None
    """Seconds from submit after which the context expires; None: the client's
    `transaction_timeout`."""
    committed_transaction_id: int = -1
    """The id of the transaction it committed, set by the client before `on_completion(True)`
    (-1 until then, and for a context that declined or failed)."""

    def __init__(self) -> None:
        self.creation_time = clock.time()

    def partition_id(self, num_partitions: int) -> int:
        """The partition this transaction goes to (0 unless overridden)."""
        return 0

    def execute(self, builder: TransactionBuilder) -> bool | Awaitable[bool]:
        """Sets the transaction's header, data and locks; returns False to drop it."""
        raise NotImplementedError("a TransactionContext must implement execute(builder)")

    def on_completion(self, result: bool) -> None | Awaitable[None]:
        """Once, at the end: True when the transaction committed, False when `execute` declined."""

    def on_application(self) -> None | Awaitable[None]:
        """Once the committed transaction has been applied by this client's `apply_transaction`
        (read-your-writes from here)."""

    def on_lock_failure(self, transaction_id: int) -> None | Awaitable[None]:
        """An attempt lost a lock race to `transaction_id`; the client re-executes once it has
        applied that transaction."""

    def on_exception(self, exc: BaseException) -> None | Awaitable[None]:
        """`execute` raised: no retry."""

    def on_expiration(self) -> None | Awaitable[None]:
        """The context expired before it could complete: no retry."""


class Append(TransactionContext):
    """A plain append of fixed data (`client.append(partition, data, locks=...)`): the same
    transaction on every execution. Its locks are checked against the application's
    high-water mark when it runs, as any context's are; a lost lock race executes it again with
    the newer mark, so a write lock here orders the append after the lock's last writer without
    reading anything (a context that reads state to decide must be a `TransactionContext` of
    its own)."""

    def __init__(
        self,
        partition: int,
        data: Any,
        *,
        serializer: Serializer[Any] = BYTES,
        header: int = 0,
        locks: Iterable[PartitionLocalLock] = (),
        read_locks: Iterable[PartitionLocalLock] = (),
        append_locks: Iterable[PartitionLocalLock] = (),
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(partition, int) or isinstance(partition, bool) or partition < 0:
            raise ValueError(f"partition must be a partition id, not {partition!r}")
        self.partition, self.header = partition, header
        self.data = serializer.serialize(data)
        self.locks, self.read_locks, self.append_locks = _checked(locks), _checked(read_locks), _checked(append_locks)
        self.timeout = timeout

    def partition_id(self, num_partitions: int) -> int:
        if self.partition >= num_partitions:
            raise ValueError(f"no partition {self.partition}: the cluster has {num_partitions}")
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.header)
        builder.data = self.data
        builder.add_write_locks(*self.locks)
        builder.add_read_locks(*self.read_locks)
        builder.add_append_locks(*self.append_locks)
        return True
