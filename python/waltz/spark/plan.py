"""Planning a scan: which replica directories serve each partition, up to which id (committed
only), and the id ranges the input partitions cover, each read from one directory. Pure
decisions over small facts, so that they are tested without Spark; `survey` is the only part
that touches files."""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from collections.abc import Iterable, Mapping, Sequence

from waltz import errors
from waltz._native import Storage
from waltz.spark.options import DataLossError, OffsetSpec, OptionError, check_partitions, select

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

    def serves(self) -> Range:
        """The ids to read from it, as a range (empty when it holds nothing below its bound)."""
        r = self.replica
        return Range(r.partition, r.first, max(r.first, self.last + 1), r.path)


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
    read-only (no lock, no repair), so a running storage node's directory can be read. Without
    the cluster's key, the directories must still agree on one: a union of two clusters' logs
    would pass for one log."""
    found: dict[int, list[Replica]] = {}
    first_key: tuple[str, str] | None = None
    for path in paths:
        try:
            with Storage.open(path, cluster_key, read_only=True) as storage:
                if first_key is None:
                    first_key = (path, str(storage.cluster_key))
                elif str(storage.cluster_key) != first_key[1]:
                    raise OptionError(
                        # Not the keys themselves: Spark logs the error, and a key is its cluster's credential.
                        f"path {path} belongs to another cluster than {first_key[0]} (their cluster keys differ): "
                        "read one cluster's directories at a time"
                    )
                for pid in storage.partition_ids():
                    part, info = storage.partition(pid), storage.partition_info(pid)
                    if part.max_transaction_id < info.local_low_water_mark:
                        # The replica held these durably when its session started; the read-only
                        # open stops at the first invalid record: one it acknowledged is damaged.
                        raise errors.CorruptionError(
                            f"partition {pid} holds transactions only up to {part.max_transaction_id}, below "
                            f"{info.local_low_water_mark}, "
                            "the mark up to which it held them durably: a record is damaged or lost (waltz disk verify "
                            "shows where)"
                        )
                    found.setdefault(pid, []).append(
                        Replica(
                            path,
                            pid,
                            part.first_transaction_id,
                            part.max_transaction_id,
                            info.session_id,
                            info.low_water_mark,
                        )
                    )
        except errors.ClusterKeyMismatch as e:
            raise OptionError(f"path {path} belongs to another cluster: {e}") from e
        except errors.WaltzError as e:
            raise OptionError(f"path {path} is not a readable Waltz storage directory: {e}") from e
    return found


NOT_ASKED = "the cluster was not asked: set option cluster for the newest committed transactions"


def bound(
    r: Replica, *, committed_only: bool, high_water_mark: int | None, session: int | None, unasked: str = NOT_ASKED
) -> Bound:
    """How far to read a replica. Above its low-water mark a replica may hold a dirty tail
    (appends no majority acknowledged, truncated at the next recovery), unless it is in the
    partition's current session, where everything up to the cluster's high-water mark is
    committed; so the cluster's mark is only trusted for such replicas. `unasked` says why
    there is no mark."""
    if not committed_only:
        return Bound(r, r.last, f"everything in {r.path} (committedOnly=false)")
    if high_water_mark is not None and r.session_id == session:
        return Bound(
            r,
            min(high_water_mark, r.last),
            f"the cluster's high-water mark {high_water_mark} ({r.path} is in session {session})",
        )
    why = (
        f"not in the current session {session} (its session is {r.session_id})"
        if high_water_mark is not None
        else unasked
    )
    return Bound(r, min(r.low_water_mark, r.last), f"{r.path}'s low-water mark {r.low_water_mark}: {why}")


def bounds(
    replicas: Sequence[Replica],
    *,
    committed_only: bool,
    high_water_mark: int | None,
    session: int | None,
    unasked: str = NOT_ASKED,
) -> list[Bound]:
    """Each replica's bound, the fullest first (ties: in path order), the order `ranges` prefers
    them in: with committedOnly=false a stale copy's tail may differ from the fullest's, so it
    only fills in what the fullest lacks (ids retention dropped from it, say)."""
    assert replicas, "bounds needs at least one replica"
    found = [
        bound(r, committed_only=committed_only, high_water_mark=high_water_mark, session=session, unasked=unasked)
        for r in replicas
    ]
    return sorted(found, key=lambda b: -b.last)


_UNBOUNDED = 1 << 63


@dataclasses.dataclass(frozen=True)
class Pushed:
    """What a query's WHERE clause pushed down: the partitions it can match (a set, None: any,
    and ids `[partition_low, partition_high)`) and the transaction ids `[low, high)` it can
    match, the same in every partition. A scan reads only what they allow, so
    `WHERE partition = 0 AND transaction_id >= 1000` plans that range only."""

    partitions: frozenset[int] | None = None
    partition_low: int = 0
    partition_high: int = _UNBOUNDED
    low: int = 0
    high: int = _UNBOUNDED

    def wants(self, partition: int) -> bool:
        return (
            self.partitions is None or partition in self.partitions
        ) and self.partition_low <= partition < self.partition_high

    def clip(self, start: int, end: int) -> tuple[int, int]:
        """`[start, end)` within the pushed ids; empty (start == end) when they miss it."""
        a, b = max(start, self.low), min(end, self.high)
        return (a, b) if a < b else (start, start)

    def add(self, column: str, op: str, value: object) -> tuple[Pushed, bool]:
        """This and the condition `column op value` (op: = < <= > >= in; `in` takes a tuple),
        and whether the scan then applies the condition exactly. False: Spark must still apply
        it (another column; a value that is not an integer, such as a null; `in` over
        transaction ids, which narrows the scan to the range from the least to the greatest)."""
        column = column.lower()
        if column not in ("partition", "transaction_id"):
            return self, False
        values = tuple(value) if op == "in" and isinstance(value, (tuple, list)) else (value,)
        if op == "in" and not isinstance(value, (tuple, list)) or not values or not all(type(v) is int for v in values):
            return self, False
        ints: tuple[int, ...] = values
        low, high = _interval(op, ints)
        if column == "transaction_id":
            return dataclasses.replace(self, low=max(self.low, low), high=min(self.high, high)), op != "in" or len(
                ints
            ) == 1
        if op in ("=", "in"):
            allowed = frozenset(ints) if self.partitions is None else self.partitions & frozenset(ints)
            return dataclasses.replace(self, partitions=allowed), True
        return dataclasses.replace(
            self, partition_low=max(self.partition_low, low), partition_high=min(self.partition_high, high)
        ), True

    def __str__(self) -> str:
        shown = []
        if self.partitions is not None:
            shown.append("partition in (" + ", ".join(map(str, sorted(self.partitions))) + ")")
        for name, lo, hi in (
            ("partition", self.partition_low, self.partition_high),
            ("transaction_id", self.low, self.high),
        ):
            if lo > 0 or hi < _UNBOUNDED:
                shown.append(f"{name} in [{lo}, {'max' if hi >= _UNBOUNDED else hi})")
        return " and ".join(shown) or "no filter"


def _interval(op: str, values: tuple[int, ...]) -> tuple[int, int]:
    """The ids `[low, high)` satisfying `id op value` (for `in`: the hull of the values)."""
    v = values[0]
    bounds = {"=": (v, v + 1), "<": (0, v), "<=": (0, v + 1), ">": (v + 1, _UNBOUNDED), ">=": (v, _UNBOUNDED)}
    if op == "in":
        return min(values), max(values) + 1
    return bounds[op]


def ranges(
    held: Mapping[int, Sequence[Range]],
    starting: OffsetSpec,
    ending: OffsetSpec,
    *,
    fail_on_data_loss: bool = True,
    holder: str = "any directory",
    pushed: Pushed = Pushed(),
) -> list[Range]:
    """Per partition read (the keys), the range the offsets select, in pieces each read from
    one source. `held[p]` is what each source (a directory, or the cluster) can serve, in order
    of preference: the partition spans from the lowest first id to the highest last. `pushed`
    narrows that to what a query's filters can match (before gaps are looked for: ids the
    query excludes may be missing)."""
    check_partitions("startingOffsets", starting, held)
    check_partitions("endingOffsets", ending, held)
    out = []
    for p in sorted(held):
        if not pushed.wants(p):
            continue
        earliest, latest = _extent(held[p])
        start, end = select(starting, ending, p, earliest, latest, fail_on_data_loss=fail_on_data_loss, holder=holder)
        start, end = pushed.clip(start, end)
        out.extend(cover(p, start, end, held[p], fail_on_data_loss=fail_on_data_loss))
    return out


def _extent(held: Sequence[Range]) -> tuple[int, int]:
    """`[first, end)` of the union of what the sources hold (gaps inside are `cover`'s concern);
    when none holds anything, an empty range where the furthest left off."""
    full = [r for r in held if len(r)]
    if not full:
        end = max(r.end for r in held)
        return end, end
    return min(r.start for r in full), max(r.end for r in full)


def cover(
    partition: int, start: int, end: int, held: Sequence[Range], *, fail_on_data_loss: bool = True
) -> list[Range]:
    """`[start, end)` cut where the source changes: each id from the first in `held` holding
    it. Ids none holds are an error naming them (a silent gap would look like a complete read),
    unless `fail_on_data_loss` is false: then they are skipped with a warning naming them."""
    out, todo = [], [(start, end)] if start < end else []
    for h in held:
        rest = []
        for lo, hi in todo:
            a, b = max(lo, h.start), min(hi, h.end)
            if a >= b:
                rest.append((lo, hi))
                continue
            out.append(Range(partition, a, b, h.path))
            rest.extend((x, y) for x, y in ((lo, a), (b, hi)) if x < y)
        todo = rest
    if todo:
        serving = "; ".join(f"{h.path} {h.start}..{h.end - 1}" for h in sorted(held, key=lambda r: r.start) if len(h))
        gaps = ", ".join(f"{lo}..{hi - 1}" for lo, hi in sorted(todo))
        lost = (
            f"partition {partition}: transactions {gaps} are in none of the directories in path (each can serve: "
            f"{serving})"
        )
        if fail_on_data_loss:
            lo, hi = min(todo)
            raise DataLossError(
                f"{lost}: add a directory that holds them, read around them (startingOffsets {hi}, or endingOffsets "
                f"{lo}), "
                "or set failOnDataLoss=false to skip them"
            )
        log.warning("waltz: %s: skipping them (failOnDataLoss=false)", lost)
    return sorted(out, key=lambda r: r.start)


def split(parts: Iterable[Range], *, min_splits: int, max_per_split: int) -> list[Range]:
    """Cuts ranges so there are at least `min_splits` (one per transaction when there are fewer)
    and none longer than `max_per_split`: one huge partition still keeps every core busy."""
    parts = [r for r in parts if len(r)]
    total = sum(len(r) for r in parts)
    if not total:
        return []
    target = min(min_splits, total)
    # In proportion to length first (that leaves fewer than one piece per range to place),
    # then each further piece to the range whose pieces are longest.
    counts = [max(math.ceil(len(r) / max_per_split), len(r) * target // total) for r in parts]
    longest = [(-len(r) / n, i) for i, (r, n) in enumerate(zip(parts, counts, strict=True))]
    heapq.heapify(longest)
    for _ in range(target - sum(counts)):
        _, i = heapq.heappop(longest)
        counts[i] += 1
        heapq.heappush(longest, (-len(parts[i]) / counts[i], i))
    return [piece for r, n in zip(parts, counts, strict=True) for piece in _cut(r, n)]


def _cut(r: Range, n: int) -> list[Range]:
    """`r` in `n` pieces whose lengths differ by at most one."""
    size = len(r)
    return [Range(r.partition, r.start + i * size // n, r.start + (i + 1) * size // n, r.path) for i in range(n)]


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
