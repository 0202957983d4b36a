"""Planning a scan: which replica directory serves each partition, up to which id (committed
only), and the id ranges the input partitions cover. Pure decisions over small facts, so that
they are tested without Spark; `survey` is the only part that touches files."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence

from waltz import errors
from waltz._native import Storage
from waltz.spark.options import EARLIEST, LATEST, OffsetSpec, OptionError, resolve

log = logging.getLogger("waltz.spark")


@dataclasses.dataclass(frozen=True)
class Replica:
    """What a storage directory holds of one partition."""

    path: str
    partition: int
    first: int
    last: int
    """The highest id in the files (-1: none), committed or not."""
    session_id: int
    low_water_mark: int
    """Committed for sure: the high-water mark when its last store session started."""


@dataclasses.dataclass(frozen=True)
class Bound:
    replica: Replica
    last: int
    """The highest id to read from it."""
    why: str


@dataclasses.dataclass(frozen=True)
class Range:
    """Transactions `start..end-1` of a partition, read from `path` (None: from the cluster)."""

    partition: int
    start: int
    end: int
    path: str | None = None

    def __len__(self) -> int:
        return max(0, self.end - self.start)


def survey(paths: Iterable[str], cluster_key: str | None = None) -> dict[int, list[Replica]]:
    """Partition → the replicas the directories hold, in the order the paths were given. Opens
    read-only (no lock, no repair), so a running storage node's directory can be read."""
    found: dict[int, list[Replica]] = {}
    for path in paths:
        try:
            with Storage.open(path, cluster_key, read_only=True) as storage:
                for pid in storage.partition_ids():
                    part, info = storage.partition(pid), storage.partition_info(pid)
                    found.setdefault(pid, []).append(
                        Replica(path, pid, part.first_transaction_id, part.max_transaction_id, info.session_id, info.low_water_mark)
                    )
        except errors.ClusterKeyMismatch as e:
            raise OptionError(f"path {path} belongs to another cluster: {e}") from e
        except errors.WaltzError as e:
            raise OptionError(f"path {path} is not a readable Waltz storage directory: {e}") from e
    return found


def bound(replicas: Sequence[Replica], *, committed_only: bool, high_water_mark: int | None, session: int | None) -> Bound:
    """The replica to read and how far. Above its low-water mark a replica may hold a dirty
    tail (appends no majority acknowledged, truncated at the next recovery), unless it is in
    the partition's current session, where everything up to the cluster's high-water mark is
    committed; so the cluster's mark is only trusted for such replicas."""
    assert replicas, "bound needs at least one replica"
    best: Bound | None = None
    for r in replicas:
        if not committed_only:
            b = Bound(r, r.last, f"everything in {r.path} (committedOnly=false)")
        elif high_water_mark is not None and r.session_id == session:
            b = Bound(r, min(high_water_mark, r.last), f"the cluster's high-water mark {high_water_mark} ({r.path} is in session {session})")
        else:
            why = (
                f"not in the current session {session} (its session is {r.session_id})"
                if high_water_mark is not None
                else "the cluster was not asked: set option cluster for the newest committed transactions"
            )
            b = Bound(r, min(r.low_water_mark, r.last), f"{r.path}'s low-water mark {r.low_water_mark}: {why}")
        if best is None or b.last > best.last:
            best = b
    assert best is not None
    return best


def ranges(
    firsts: dict[int, int], lasts: dict[int, int], starting: OffsetSpec, ending: OffsetSpec, paths: dict[int, str | None]
) -> list[Range]:
    """Per partition, the range the offsets select within `firsts[p]..lasts[p]`."""
    out = []
    for p in sorted(lasts):
        first, last = firsts[p], lasts[p]
        start = resolve(starting, p, first, last + 1, missing=EARLIEST)
        end = resolve(ending, p, first, last + 1, missing=LATEST)
        out.append(Range(p, start, max(start, end), paths[p]))
    return out


def split(parts: Iterable[Range], *, min_splits: int, max_per_split: int) -> list[Range]:
    """Cuts ranges so there are at least `min_splits` (when there are that many transactions)
    and none longer than `max_per_split`: one huge partition still keeps every core busy."""
    parts = [r for r in parts if len(r)]
    total = sum(len(r) for r in parts)
    if not total:
        return []
    size = max(1, min(max_per_split, math.ceil(total / min_splits)))
    out: list[Range] = []
    for r in parts:
        pieces = math.ceil(len(r) / size)
        step = math.ceil(len(r) / pieces)
        out.extend(Range(r.partition, s, min(s + step, r.end), r.path) for s in range(r.start, r.end, step))
    return out


def capped(start: dict[str, int], latest: dict[str, int], budget: int | None) -> dict[str, int]:
    """`latest`, but at most `budget` transactions past `start` in all, shared in proportion to
    each partition's backlog (every partition with a backlog moves while the budget allows)."""
    begin = {p: int(start.get(p, latest[p])) for p in latest}
    backlog = {p: max(0, latest[p] - begin[p]) for p in latest}
    total = sum(backlog.values())
    if budget is None or total <= budget:
        return {p: max(begin[p], latest[p]) for p in latest}
    share = {p: backlog[p] * budget // total for p in latest}
    left = budget - sum(share.values())
    for p in sorted(latest, key=lambda q: backlog[q] - share[q], reverse=True):
        if left <= 0:
            break
        if backlog[p] > share[p]:
            share[p] += 1
            left -= 1
    return {p: begin[p] + share[p] for p in latest}
