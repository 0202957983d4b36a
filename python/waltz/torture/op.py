"""One operation of a torture worker: a `TransactionContext` whose bytes say what it is (its
payload, the locks it takes, the mark it was checked at) so the checker can judge it from the log."""

from __future__ import annotations

import random
from typing import Any

from waltz.client import PartitionLocalLock, TransactionBuilder, TransactionContext
from waltz.torture.payload import encode_payload, lock_name

LOCK = "k"


class Op(TransactionContext):
    lock = LOCK
    """The name of its locks (`PartitionLocalLock(lock, id)`); workloads name theirs."""

    def __init__(
        self, payload: str, partition: int, locks: dict[str, list[int]], size: int, timeout: float, on_applied: Any
    ) -> None:
        super().__init__()
        self.payload, self.partition, self.locks, self.size = payload, partition, locks, size
        self.timeout = timeout
        self._on_applied = on_applied

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def lock_names(self, kind: str) -> list[str]:
        return [lock_name(self.lock, i) for i in self.locks[kind]]

    def extra(self, client_high_water_mark: int) -> Any:
        """What a workload's operation does, decided at each execution (the payload's "x")."""
        return None

    def execute(self, builder: TransactionBuilder) -> bool:
        # The bytes carry the mark this execution was checked at: the checker judges the locks by
        # what the server saw, whatever the history says of the first execution.
        builder.set_data(
            encode_payload(
                self.payload,
                client_hwm=builder.client_high_water_mark,
                write_locks=self.lock_names("w"),
                read_locks=self.lock_names("r"),
                append_locks=self.lock_names("a"),
                size=self.size,
                extra=self.extra(builder.client_high_water_mark),
            )
        )
        builder.add_write_locks(*(PartitionLocalLock(self.lock, i) for i in self.locks["w"]))
        builder.add_read_locks(*(PartitionLocalLock(self.lock, i) for i in self.locks["r"]))
        builder.add_append_locks(*(PartitionLocalLock(self.lock, i) for i in self.locks["a"]))
        return True

    def on_application(self) -> None:
        self._on_applied(self)


def pick_locks(rng: random.Random, pool: int) -> dict[str, list[int]]:
    """Half the operations take no lock; the rest write, read or append-lock ids of a small pool,
    so that lock races are frequent."""
    locks: dict[str, list[int]] = {"w": [], "r": [], "a": []}
    if pool and rng.random() < 0.5:
        ids = rng.sample(range(pool), k=min(pool, rng.choice([1, 1, 2, 3])))
        for i in ids:
            locks[rng.choices("wra", weights=(6, 3, 1))[0]].append(i)
    return locks
