"""A partition's lock table: for each lock, the id of the last transaction that wrote it.

The spec keeps one fixed array of high-water marks indexed by several hashes of the lock and
estimates a lock's version as the minimum over its slots: never below the truth (no false
negative), but a busy partition fills the array and every lock looks recently written (false
positives). Here the recently used locks keep their exact version in an LRU map, within a fixed
memory budget (`docs/locking.md`); a lock leaving the map folds its version into the hashed array, which then only
answers for locks not written recently. The map evicts its oldest write first (its order is
write order, and ids rise), so the array only ever holds versions older than every exact one.
Every answer is still an upper bound of the truth, so a
conflict is never missed; a lock in the map is answered exactly, so hot locks do not fail
spuriously. A failure decided by the array may be a false positive: those are counted
(`fallback_failures`), an upper bound of the false positives.

A new table starts with every lock at the partition's high-water mark at that moment (the server
does not know older versions): a client behind that mark fails its locked transactions until it
catches up, never the other way round.

Semantics per transaction with client high-water mark C:
- write lock: fails if the lock's version > C; on success its version becomes the transaction id;
- read lock: fails if the lock's version > C; its version is unchanged;
- append lock: never fails; its version becomes the transaction id.
A transaction's checks all pass before any version moves (all or nothing).
"""

from __future__ import annotations

import array
import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from waltz.client_protocol import lock_hash as lock_hash  # the hash is the protocol's; kept here for its users

# Rough CPython cost of one exact entry (OrderedDict node, key and value ints): sizes the map.
EXACT_ENTRY_BYTES = 120
SLOT_BYTES = 8
HASHES = 3
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads a 64-bit value over all bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclasses.dataclass(frozen=True)
class LockFailure:
    lock: int
    """The lock hash that failed."""
    transaction_id: int
    """The (upper bound of the) id of the transaction that last wrote it."""
    exact: bool
    """False when the version came from the hashed array (possibly a false positive)."""


# How the budget is split. An exact entry costs ~15 array slots, so exact entries pay only when
# they can hold the partition's hot locks; below EXACT_FROM the table is the spec's array alone,
# from there the array keeps ARRAY_BYTES and the rest holds exact entries (benches/lock_table.py
# measures the crossover: at 1 MiB with a 20,000-lock hot set the array alone is better, from
# 2 MiB the hybrid has fewer false positives, and it checks about twice as fast).
EXACT_FROM = 2 << 20
ARRAY_BYTES = 256 << 10


class LockTable:
    """One partition's lock versions within `budget_bytes` (see EXACT_FROM for the split)."""

    def __init__(self, high_water_mark: int, budget_bytes: int = 8 << 20, array_bytes: int | None = None) -> None:
        if budget_bytes < 64 * SLOT_BYTES:
            raise ValueError(f"lock table budget of {budget_bytes} bytes is too small (at least {64 * SLOT_BYTES})")
        if array_bytes is None:
            array_bytes = budget_bytes if budget_bytes < EXACT_FROM else ARRAY_BYTES
        array_bytes = min(array_bytes, budget_bytes)
        self.max_exact = (budget_bytes - array_bytes) // EXACT_ENTRY_BYTES
        slots = array_bytes // SLOT_BYTES
        self._slots = array.array("q", [high_water_mark]) * slots
        self._exact: OrderedDict[int, int] = OrderedDict()
        self.checks = 0
        self.failures = 0
        self.fallback_failures = 0
        self.evictions = 0

    @property
    def slots(self) -> int:
        return len(self._slots)

    def _indexes(self, lock: int) -> list[int]:
        h = lock & _MASK
        n = len(self._slots)
        return [_mix(h + i) % n for i in range(HASHES)]

    def version(self, lock: int) -> tuple[int, bool]:
        """(version, exact): exact from the map, else the array's upper bound."""
        v = self._exact.get(lock)
        if v is not None:
            return v, True
        return min(self._slots[i] for i in self._indexes(lock)), False

    def check_and_update(
        self,
        client_high_water_mark: int,
        transaction_id: int,
        write: Iterable[int] = (),
        read: Iterable[int] = (),
        append: Iterable[int] = (),
    ) -> LockFailure | None:
        """Checks the write and read locks against the client's high-water mark; on success moves
        the write and append locks to `transaction_id` and returns None, else changes nothing
        and returns the first failure."""
        write, read, append = list(write), list(read), list(append)
        self.checks += 1
        for lock in write + read:
            v, exact = self.version(lock)
            if v > client_high_water_mark:
                self.failures += 1
                if not exact:
                    self.fallback_failures += 1
                return LockFailure(lock, v, exact)
        for lock in write + append:
            self._set(lock, transaction_id)
        return None

    def _set(self, lock: int, transaction_id: int) -> None:
        current = self._exact.get(lock)
        # Versions only rise (ids are assigned in order; max guards against misuse).
        self._exact[lock] = transaction_id if current is None else max(current, transaction_id)
        self._exact.move_to_end(lock)
        while len(self._exact) > self.max_exact:  # with no exact share: straight into the array
            old, v = self._exact.popitem(last=False)
            for i in self._indexes(old):
                if self._slots[i] < v:
                    self._slots[i] = v
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "exact_entries": len(self._exact),
            "max_exact_entries": self.max_exact,
            "slots": len(self._slots),
            "checks": self.checks,
            "failures": self.failures,
            "fallback_failures": self.fallback_failures,
            "evictions": self.evictions,
        }
