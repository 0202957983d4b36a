"""`df.write.format("waltz")`: every row appended as one transaction through the client.

Delivery: at least once. Within one task attempt no row is appended twice (the client retries
a lost append under the same request id, which the server recognises), and the task succeeds
only once every row of it is committed. But a task that fails midway, or a job that is
aborted, leaves the rows it already committed in the log (a log is never rolled back), and
Spark's retry of the task appends them again. That includes a bad row (null data, a partition
out of range): each attempt appends the rows of the Arrow batches before its own (a batch is
checked whole before any of its rows goes out), then fails. Readers that need exactly
once put an id in the data and drop duplicates downstream, or write with the streaming sink
(`waltz.spark.stream_sink`), which is exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from waltz._extras import require

require("pyspark", "spark", "The Spark data source")
require("pyarrow", "spark", "The Spark data source")

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, IntegerType, StructType

from waltz.client import Transaction, TransactionBuilder, TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.spark.connection import client_config, log_reader
from waltz.spark.options import NAMES, OptionError, Options, check_names

log = logging.getLogger("waltz.spark")

_IN_FLIGHT = 10_000
"""Rows of a task submitted and not yet known committed (the client's `max_pending` per
partition paces the submits themselves)."""


@dataclasses.dataclass
class Appended(WriterCommitMessage):
    rows: int


class _Append(TransactionContext):
    def __init__(self, partition: int, header: int, data: bytes) -> None:
        super().__init__()
        self._partition, self._header, self._data = partition, header, data

    def partition_id(self, num_partitions: int) -> int:
        return self._partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self._header)
        builder.set_data(self._data)
        return True


class _WriteOnly(WaltzClientCallbacks):
    """Starts the feed at the high-water marks read before, so nothing old is replayed."""

    def __init__(self, marks: Mapping[int, int]) -> None:
        self._marks = dict(marks)

    def get_client_high_water_mark(self, partition: int) -> int:
        return self._marks.get(partition, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self._marks[transaction.partition] = transaction.transaction_id


def check_schema(schema: StructType) -> None:
    fields = {f.name: f.dataType for f in schema.fields}
    if not isinstance(fields.get("data"), BinaryType):
        raise OptionError(
            "writing to waltz needs a binary column `data` (and optionally int `partition` and `header`); got "
            f"{schema.simpleString()}"
        )
    for name in ("partition", "header"):
        if name in fields and not isinstance(fields[name], IntegerType):
            raise OptionError(f"column `{name}` must be int, not {fields[name].simpleString()}")
    extra = sorted(set(fields) - {"data", "partition", "header"})
    if extra:
        raise OptionError(f"writing to waltz takes columns data, partition and header only; drop {', '.join(extra)}")


WRITE_OPTIONS = ("metadata", "zookeeper", "cluster", "tlsCa", "tlsCert", "tlsKey", "timeout")


def write_options(options: Mapping[str, str]) -> Options:
    """A write's options: where the cluster is and how to reach it. Read options would be
    silently meaningless here (which partitions, offsets), so they are refused."""
    given = {k.lower(): v for k, v in options.items()}
    if given.get("path"):
        raise OptionError(
            f"a write goes to a live cluster, not to files: drop the path {given['path']!r} (save() takes none)"
        )
    for_reads = {n.lower(): n for n in NAMES if n not in WRITE_OPTIONS and n != "path"}
    reads_only = sorted(for_reads[k.lower()] for k in options if k.lower() in for_reads)
    if reads_only:
        raise OptionError(
            f"option(s) {', '.join(reads_only)} do not apply to writes (those take {', '.join(WRITE_OPTIONS)})"
        )
    check_names({k: v for k, v in options.items() if k.lower() != "path"}, WRITE_OPTIONS)
    return Options.parse({k: v for k, v in given.items() if k != "path"}, streaming=True)


class WaltzWriter(DataSourceArrowWriter):
    """Spark hands each task its rows as Arrow record batches: a batch is checked column by
    column, and its rows go to the client straight from the columns, no `Row` per row."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.opts = write_options(options)
        check_schema(schema)
        self.has_partition = "partition" in schema.fieldNames()
        self.has_header = "header" in schema.fieldNames()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Appended:
        from pyspark import TaskContext

        opts = self.opts
        assert opts.metadata is not None
        batches = (b for b in iterator if b.num_rows)
        first = next(batches, None)
        if first is None:  # an empty task needs no connection (nor a reachable cluster)
            return Appended(0)

        async def marks() -> dict[int, int]:
            async with log_reader(opts) as r:
                return await r.high_water_marks()

        config = client_config(opts)
        task = TaskContext.get()
        spread = itertools.count(task.partitionId() if task is not None else 0)
        futures: collections.deque[concurrent.futures.Future[bool]] = collections.deque()
        appended = 0

        def settle(keep: int) -> None:
            nonlocal appended
            while len(futures) > keep:
                if futures.popleft().result() is not True:
                    raise RuntimeError("an append was declined")  # _Append never declines: a client bug
                appended += 1

        with WaltzClient(_WriteOnly(asyncio.run(marks())), config) as client:
            n = client.partitions
            for batch in itertools.chain((first,), batches):
                data, partitions, headers = self._columns(batch, n, spread)
                for partition, header, payload in zip(partitions, headers, data, strict=True):
                    futures.append(client.submit(_Append(partition, header, payload)))
                    settle(keep=_IN_FLIGHT)  # memory stays bounded however many rows a task has
            settle(keep=0)
            client.flush()
        return Appended(appended)

    def _columns(
        self, batch: pa.RecordBatch, n: int, spread: Iterator[int]
    ) -> tuple[list[bytes], list[int], list[int]]:
        """The batch's data, partition and header of each row, checked before any row of the
        batch is appended."""
        data = batch.column("data")
        if data.null_count:
            raise OptionError("column `data` is null in a row: every transaction needs data")
        rows = batch.num_rows
        if self.has_partition:
            column = batch.column("partition")
            low, high = pc.min_max(column).values()
            if column.null_count or low.as_py() < 0 or high.as_py() >= n:
                bad = None if column.null_count else (low.as_py() if low.as_py() < 0 else high.as_py())
                raise OptionError(f"column `partition` is {bad!r}: the cluster has partitions 0..{n - 1}")
            partitions: list[int] = column.to_pylist()
        else:
            partitions = [next(spread) % n for _ in range(rows)]
        if self.has_header:
            column = batch.column("header")
            if column.null_count:
                raise OptionError("column `header` is null in a row: fill it, or leave the column out for 0")
            headers: list[int] = column.to_pylist()
        else:
            headers = [0] * rows
        return data.to_pylist(), partitions, headers

    def commit(self, messages: list[Any]) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, Appended))
        log.info("waltz: appended %d rows as transactions", rows)

    def abort(self, messages: list[Any]) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, Appended))
        log.warning(
            "waltz: write aborted; %d rows of the tasks that finished are committed and stay in the log, and so do the "
            "rows "
            "failed task attempts committed before they failed (how many is not known; each retry appends its rows "
            "again)",
            rows,
        )
