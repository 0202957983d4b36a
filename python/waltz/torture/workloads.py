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

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from waltz.torture.drain import Record
from waltz.torture.report import Anomaly
from waltz.torture.workload import Workload, WorkloadSettings


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
