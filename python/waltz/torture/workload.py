"""The plain workload (`log`) and what every workload's settings hold; the others
(`waltz.torture.bank`, `waltz.torture.list_append`) build on `Workload`, and
`waltz.torture.workloads` picks one by name."""

from __future__ import annotations

import dataclasses
import pathlib
import random
from collections.abc import Callable, Mapping
from typing import Any

from waltz.torture.drain import Record
from waltz.torture.feed import FeedRecorder
from waltz.torture.op import Op, pick_locks

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
        locks = pick_locks(rng, self.spec["lock_pool"])
        return Op(payload, partition, locks, rng.choice(self.spec["sizes"]), self.spec["op_timeout"], applied)
