"""The workloads `waltz torture --workload` runs (docs/torture.md, "Workloads").

- `log` (the default): unique payloads, half of them under locks over a small pool; the
  checker judges the log itself (`waltz.torture.checker`).
- `bank`: transfers between accounts kept in one SQLite database that every client process
  shares through `waltz.client.sql.SqlCallbacks` (`waltz.torture.bank`).
- `list-append`: transactions append to keys' lists and read them under locks, checked the way
  Elle checks list-append histories (`waltz.torture.list_append`).
- `lock-fallback`: list-append over thousands of keys on servers whose lock table is squeezed
  to its hashed array, so the array answers the lock checks (issue 37, item 5).

A workload gives each worker its feed (the client callbacks) and its operations; the run asks it
to prepare shared state before the workers start and to check that state at the end.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from waltz.torture.drain import Record
from waltz.torture.feed import FeedRecorder
from waltz.torture.report import Anomaly

WORKLOADS = ("log", "bank", "list-append", "lock-fallback")


@dataclasses.dataclass(frozen=True)
class WorkloadSettings:
    """What the run derives from `--workload` (and passes to workers in their spec)."""

    name: str = "log"
    accounts: int = 5
    """bank: accounts per partition."""
    balance: int = 100
    """bank: each account's opening balance."""
    keys: int = 6
    """list-append: keys per partition."""
    hot_keys: int = 0
    """list-append: when > 0, 80% of the operations touch one of the first `hot_keys` keys."""
    lock_budget_bytes: int | None = None
    """The servers' `[partition] lock_budget_bytes` (None: the default)."""

    @classmethod
    def named(cls, name: str) -> WorkloadSettings:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        if name == "lock-fallback":
            # 4 KiB is below the hybrid's threshold (docs/locking.md): no exact share at all, a
            # hashed array of 512 slots answers every check, and 4,096 keys per partition are eight
            # times its slots, so a hot key's slots are overwritten by cold keys all the time.
            return cls(name, keys=4096, hot_keys=8, lock_budget_bytes=4096)
        return cls(name)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Workload:
    """The plain workload (`log`): what worker.py always ran."""

    def __init__(self, spec: Mapping[str, Any], directory: pathlib.Path, index: int) -> None:
        self.spec, self.directory, self.index = spec, directory, index
        self.settings = WorkloadSettings(**spec.get("workload", {}))

    def feed(self, on_record: Callable[[int, Record], None]) -> FeedRecorder:
        return FeedRecorder(on_record)

    def op(self, rng: random.Random, payload: str, partition: int, applied: Callable[[Any], None]) -> Any:
        from waltz.torture.worker import Op, _locks

        locks = _locks(rng, self.spec["lock_pool"])
        return Op(payload, partition, locks, rng.choice(self.spec["sizes"]), self.spec["op_timeout"], applied)


def workload_for(spec: Mapping[str, Any], directory: pathlib.Path, index: int) -> Workload:
    """The worker side of the spec's workload."""
    name = spec.get("workload", {}).get("name", "log")
    if name == "bank":
        from waltz.torture.bank import BankWorkload

        return BankWorkload(spec, directory, index)
    if name in ("list-append", "lock-fallback"):
        from waltz.torture.list_append import ListAppendWorkload

        return ListAppendWorkload(spec, directory, index)
    return Workload(spec, directory, index)


def prepare(settings: WorkloadSettings, directory: pathlib.Path, partitions: int) -> None:
    """Shared state the workers need before they start (the bank's database)."""
    if settings.name == "bank":
        from waltz.torture.bank import create_bank

        create_bank(directory, partitions, settings.accounts, settings.balance)


def check_workload(
    settings: WorkloadSettings, directory: pathlib.Path, log: Mapping[int, Sequence[Record]]
) -> list[Anomaly]:
    """The workload's own invariants over the committed log (the reference drain)."""
    if settings.name == "bank":
        from waltz.torture.bank import check_bank, read_bank

        return check_bank(log, read_bank(directory), settings.accounts, settings.balance)
    if settings.name in ("list-append", "lock-fallback"):
        from waltz.torture.list_append import check_list_append

        return check_list_append(log)
    return []
