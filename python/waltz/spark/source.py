"""The `waltz` data source's reads: batch scans of storage directories through the native reader
and of a live cluster, and streaming reads of a live cluster (`waltz.spark.datasource` ties them
to the sink, `waltz.spark.sink`).

Planning runs in a Python worker on the driver and reading in executors' workers: everything an
input partition carries is plain (paths, ids), and native handles are opened inside `read`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from waltz._extras import require

require("pyspark", "spark", "The Spark data source")
require("pyarrow", "spark", "The Spark data source")

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    DataSourceStreamReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from waltz import errors
from waltz._native import Storage
from waltz.spark import plan
from waltz.spark.connection import log_reader
from waltz.spark.options import DataLossError, OptionError, Options, check_partitions, select
from waltz.storage.scan import iter_scan, records_to_arrow, scan_to_arrow

log = logging.getLogger("waltz.spark")


class RangePartition(InputPartition):
    """Transactions `start..end-1` of one partition, from a directory or (path None) the cluster."""

    def __init__(self, partition: int, start: int, end: int, path: str | None) -> None:
        super().__init__((partition, start, end, path))
        self.partition, self.start, self.end, self.path = partition, start, end, path

    def __repr__(self) -> str:
        return f"RangePartition(partition={self.partition}, [{self.start}, {self.end}), {self.path or 'cluster'})"


class _ClusterView:
    """What the driver asks the cluster once per plan: key, high-water marks, sessions, and
    (for reads without files) where each partition's log starts."""

    def __init__(self, opts: Options, *, firsts: bool) -> None:
        async def ask() -> None:
            async with log_reader(opts) as r:
                self.cluster_key = str(r.info.cluster_key)
                wanted = [p for p in range(r.info.partitions) if opts.wants(p)]
                missing = sorted(set(opts.partitions or ()) - set(wanted))
                if missing:
                    raise OptionError(
                        f"option partitions: the cluster has no partition {missing[0]} (it has {r.info.partitions})"
                    )
                self.high_water_marks = await r.high_water_marks(wanted)
                self.sessions = await r.sessions()
                self.firsts = await r.first_transaction_ids(wanted) if firsts else {}

        asyncio.run(ask())


def _view_or_low_water_marks(opts: Options) -> _ClusterView | None:
    """The cluster's view, or None when a batch read of files goes on without it: an unreachable
    cluster then bounds each directory by its low-water mark, committed for sure, only older.
    Each step of asking is bounded by option timeout. Reads without files need the cluster."""
    try:
        return _ClusterView(opts, firsts=not opts.paths)
    except (ConnectionError, TimeoutError) as e:
        if not opts.paths:
            raise
        log.warning(
            "waltz: cannot reach the cluster at %s (%s): bounding each partition by its directories' low-water marks, "
            "and checking only that the directories agree on a cluster key",
            opts.metadata,
            e,
        )
        return None


def _read_range(opts: Options, p: RangePartition) -> Iterator[pa.RecordBatch]:
    if p.start >= p.end:
        return
    if p.path is not None:
        # The driver already compared cluster keys; a corrupt record raises CorruptionError
        # naming the segment file and offset, which fails the task with that message.
        nxt = p.start
        with Storage.open(p.path, read_only=True) as storage:
            part = storage.partition(p.partition)
            for chunk in iter_scan(part, p.start, p.end - 1, chunk_bytes=opts.batch_bytes):
                assert chunk.first_txid == nxt and chunk.last_txid is not None, (chunk.first_txid, nxt)
                nxt = chunk.last_txid + 1
                yield scan_to_arrow(chunk, p.partition)
        if nxt < p.end:  # the files lost ids since planning (retention, a replaced directory)
            raise errors.CorruptionError(
                f"{p.path}: partition {p.partition} ends at transaction {nxt - 1}, but the plan covers up to "
                f"{p.end - 1}"
            )
        return
    yield from _read_cluster(opts, p.partition, p.start, p.end - 1)


def _read_cluster(opts: Options, partition: int, first: int, last: int) -> Iterator[pa.RecordBatch]:
    """Batches from a live cluster, one event loop per task driven from this generator."""
    loop = asyncio.new_event_loop()
    reader = log_reader(opts)
    try:
        loop.run_until_complete(reader.start())
        it = reader.read(partition, first, last, max_count=2000).__aiter__()
        nxt = first
        while True:
            try:
                records = loop.run_until_complete(it.__anext__())
            except StopAsyncIteration:
                break
            except errors.BelowLogStartError as e:
                # Planned (or checkpointed) before the replicas dropped these ids.
                held = loop.run_until_complete(reader.first_transaction_id(partition))
                if held <= nxt:
                    raise
                lost = (
                    f"transactions {nxt}..{min(held, last + 1) - 1} of partition {partition} are no longer in the "
                    "cluster's replicas"
                )
                if opts.fail_on_data_loss:
                    raise DataLossError(
                        f"{lost} (the first held is {held}): set failOnDataLoss=false to skip them"
                    ) from e
                log.warning("waltz: %s: going on from %d (failOnDataLoss=false)", lost, held)
                nxt = held
                it = reader.read(partition, nxt, last, max_count=2000).__aiter__()
                continue
            if records and records[0].txid != nxt:
                raise errors.ProtocolError(
                    f"partition {partition}: the cluster's replicas answered a read at {nxt} with transaction "
                    f"{records[0].txid}"
                )
            nxt = records[-1].txid + 1 if records else nxt
            yield records_to_arrow(records, partition)
        # The stream's offsets move past `last` once this batch is done: a short read must fail
        # the task, never pass for a complete one.
        if nxt <= last:
            raise errors.ClusterError(
                f"partition {partition}: the cluster's replicas returned transactions {first}..{nxt - 1} of "
                f"{first}..{last}"
            )
    finally:
        try:
            loop.run_until_complete(reader.close())
            # A read Spark stopped early (a LIMIT) leaves `it` suspended: close it on this loop.
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


_COMPARISONS: dict[type[Filter], str] = {
    EqualTo: "=",
    LessThan: "<",
    LessThanOrEqual: "<=",
    GreaterThan: ">",
    GreaterThanOrEqual: ">=",
    In: "in",
}


class WaltzReader(DataSourceReader):
    """A batch scan. Without filter pushdown: Spark runs a source that defines `pushFilters`
    only when `spark.sql.python.filterPushdown.enabled` is true (and fails the read otherwise),
    so this class has none and `WaltzFilteringReader` adds it."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.pushed = plan.Pushed()

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        view = _view_or_low_water_marks(opts) if opts.metadata else None
        if opts.paths:
            held = _held_by_directories(opts, view)
            holder = "any directory"
        else:
            assert view is not None
            held = _held_by_cluster(view)
            holder = "the cluster's replicas"
        ranges = plan.ranges(
            held,
            opts.starting,
            opts.ending,
            fail_on_data_loss=opts.fail_on_data_loss,
            holder=holder,
            pushed=self.pushed,
        )
        splits = plan.split(ranges, min_splits=opts.min_partitions, max_per_split=opts.max_per_split)
        return [RangePartition(r.partition, r.start, r.end, r.path) for r in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RangePartition):  # Spark's stand-in when the plan is empty
            return iter(())
        return _read_range(self.opts, partition)


class WaltzFilteringReader(WaltzReader):
    """A batch scan that takes the query's conditions on `partition` and `transaction_id`."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        """Narrows the plan by each condition it can apply exactly and hands every other one
        back to Spark, which then applies it to the rows read (none is ever dropped)."""
        for f in filters:
            op = _COMPARISONS.get(type(f))
            attribute: tuple[str, ...] = getattr(f, "attribute", ())
            exact = False
            if op is not None and len(attribute) == 1:
                self.pushed, exact = self.pushed.add(attribute[0], op, getattr(f, "value", None))
            if not exact:
                yield f
        log.info("waltz: the scan reads only %s", self.pushed)


def _unasked(opts: Options, view: _ClusterView | None, partition: int) -> str:
    """Why a partition has no high-water mark to bound its directories by."""
    if opts.metadata is None:
        return plan.NOT_ASKED
    if view is None:
        return f"the cluster at {opts.metadata} was unreachable"
    return f"the cluster has no partition {partition}"


def _held_by_directories(opts: Options, view: _ClusterView | None) -> dict[int, list[plan.Range]]:
    """Partition → what each directory can serve of it, the fullest first."""
    found = plan.survey(opts.paths, view.cluster_key if view else None)
    missing = sorted(set(opts.partitions or ()) - set(found))
    if missing:
        raise OptionError(f"option partitions: no directory in path holds partition {missing[0]}")
    held = {}
    for pid, replicas in sorted(found.items()):
        if not opts.wants(pid):
            continue
        bounds = plan.bounds(
            replicas,
            committed_only=opts.committed_only,
            high_water_mark=view.high_water_marks.get(pid) if view else None,
            session=view.sessions.get(pid) if view else None,
            unasked=_unasked(opts, view, pid),
        )
        for b in bounds:
            log.info(
                "waltz: partition %d: %s serves transactions %d..%d: %s",
                pid,
                b.replica.path,
                b.replica.first,
                b.last,
                b.why,
            )
        held[pid] = [b.serves() for b in bounds]
    return held


def _held_by_cluster(view: _ClusterView) -> dict[int, list[plan.Range]]:
    held = {}
    for pid, hwm in view.high_water_marks.items():
        log.info("waltz: partition %d: reading the cluster up to its high-water mark %d", pid, hwm)
        first = view.firsts[pid]
        held[pid] = [plan.Range(pid, first, max(first, hwm + 1))]
    return held


class WaltzStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are `{"partition": next transaction id}`; a micro-batch reads `[start, end)` of
    each partition, which is committed (end - 1 is at most a high-water mark), so a restart from
    the checkpoint reads exactly the same transactions again."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self._target: dict[str, int] | None = None

    def _latest(self) -> dict[str, int]:
        view = _ClusterView(self.opts, firsts=False)
        return {str(p): hwm + 1 for p, hwm in view.high_water_marks.items()}

    def initialOffset(self) -> dict[str, int]:
        view = _ClusterView(self.opts, firsts=True)
        check_partitions("startingOffsets", self.opts.starting, view.high_water_marks)
        return {
            str(p): select(
                self.opts.starting,
                "latest",
                p,
                view.firsts[p],
                max(view.firsts[p], hwm + 1),
                fail_on_data_loss=self.opts.fail_on_data_loss,
                holder="the cluster's replicas",
            )[0]
            for p, hwm in view.high_water_marks.items()
        }

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        latest = self._target if self._target is not None else self._latest()
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return plan.capped(start, latest, budget)

    def reportLatestOffset(self) -> dict[str, int]:
        return self._latest()

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        ranges = [plan.Range(int(p), int(start.get(p, end[p])), int(end[p])) for p in sorted(end, key=int)]
        splits = plan.split(ranges, min_splits=1, max_per_split=self.opts.max_per_split)
        return [RangePartition(r.partition, r.start, r.end, None) for r in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RangePartition):  # Spark's stand-in when the plan is empty
            return iter(())
        return _read_range(self.opts, partition)

    def commit(self, end: dict[str, int]) -> None:
        pass  # nothing to release: the log keeps every committed transaction
