"""A small application for client tests and benchmarks: in-memory state per partition, contexts
that write JSON payloads with optional locks, and recorders of what was executed and applied."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from waltz.client import (
    JSON,
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)


class MemoryApp(WaltzClientCallbacks):
    """Applies every transaction into lists per partition; checks order as it goes."""

    def __init__(self, fetch_data: bool = True, start: dict[int, int] | None = None) -> None:
        self.lock = threading.Lock()
        self.marks: dict[int, int] = collections.defaultdict(lambda: -1)
        self.marks.update(start or {})
        self.applied: dict[int, list[tuple[int, Any]]] = collections.defaultdict(list)
        self.applied_at: dict[tuple[int, int], float] = {}
        self.counters: dict[int, int] = collections.defaultdict(int)
        self.fetch_data = fetch_data
        self.errors: list[str] = []

    def get_client_high_water_mark(self, partition: int) -> int:
        with self.lock:
            return self.marks[partition]

    def apply_transaction(self, transaction: Transaction) -> None:
        data = transaction.data(JSON) if self.fetch_data else None
        with self.lock:
            p = transaction.partition
            if transaction.transaction_id != self.marks[p] + 1:
                self.errors.append(f"partition {p}: {transaction.transaction_id} after {self.marks[p]}")
            if isinstance(data, dict) and "add" in data:
                if data["seen"] != self.counters[p]:  # computed on stale state: the lock failed to protect it
                    self.errors.append(
                        f"partition {p}: transaction {transaction.transaction_id} saw {data['seen']}, counter is "
                        f"{self.counters[p]}"
                    )
                self.counters[p] += data["add"]
            self.applied[p].append((transaction.transaction_id, data))
            self.applied_at[(p, transaction.transaction_id)] = time.perf_counter()
            self.marks[p] = transaction.transaction_id


class AsyncMemoryApp(MemoryApp):
    async def get_client_high_water_mark(self, partition: int) -> int:  # type: ignore[override]
        return self.marks[partition]

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        data = await transaction.data_async(JSON)
        p = transaction.partition
        if transaction.transaction_id != self.marks[p] + 1:
            self.errors.append(f"partition {p}: {transaction.transaction_id} after {self.marks[p]}")
        self.applied[p].append((transaction.transaction_id, data))
        self.marks[p] = transaction.transaction_id


class Write(TransactionContext):
    """Writes {"id": payload id, ...} to a partition, with optional write locks."""

    def __init__(
        self, payload: str, partition: int = 0, locks: tuple[PartitionLocalLock, ...] = (), header: int = 0
    ) -> None:
        super().__init__()
        self.payload, self.partition, self.locks, self.header = payload, partition, locks, header
        self.executions = 0
        self.events: list[str] = []

    def partition_id(self, num_partitions: int) -> int:
        return self.partition % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        builder.set_header(self.header)
        builder.set_data({"id": self.payload}, JSON)
        builder.add_write_locks(*self.locks)
        return True

    def on_completion(self, result: bool) -> None:
        self.events.append(f"completion:{result}")

    def on_application(self) -> None:
        self.events.append("application")

    def on_lock_failure(self, transaction_id: int) -> None:
        self.events.append(f"lock_failure:{transaction_id}")


class Increment(TransactionContext):
    """Read-modify-write of the app's counter under one write lock: a lost update would show
    as a final counter below the number of increments."""

    def __init__(self, app: MemoryApp, partition: int = 0) -> None:
        super().__init__()
        self.app, self.partition = app, partition
        self.executions = 0
        self.lock_failures = 0

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        with self.app.lock:
            seen = self.app.counters[self.partition]
        builder.set_data({"add": 1, "seen": seen}, JSON)
        builder.add_write_locks(PartitionLocalLock("counter", 0))
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.lock_failures += 1
