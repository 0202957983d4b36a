"""`df.writeStream.format("waltz")`: the exactly-once streaming sink (docs/spark.md).

Each row is still one transaction, as in the batch sink. What makes a retried task, or a batch
replayed after a driver restart, write nothing twice:

- The task's key is (query id, batch id, task partition): the query id is kept in the
  checkpoint, so a restarted query replays a batch under the same key. Under
  `<cluster root>/sink/<query>/<batch>/<task>` in the metadata store, the first attempt creates
  (create-if-absent) the high-water marks it saw before writing; every attempt reads them back
  and starts its feed there, so it sees every transaction any attempt of the task committed.
- Each attempt registers its client id under that entry before it writes. A transaction whose
  ReqId carries one of those ids is the task's own (client ids are never reused); it counts
  under its (partition, header, data digest). The n-th row of the task with a given key is
  written only while the log holds no more than n rows with that key from the task's attempts
  (equal rows are counted, not merged); an attempt writes the rows of one key in order.
- Every append of a key carries one write lock per (task, key): an append commits only if no
  other row with the key committed after the mark its decision was made at, so two live attempts
  (a zombie and its retry, or speculative copies) cannot both add the same row. A lock failure
  proves nothing by itself (hashed locks fail falsely at times): the row is executed again, and
  only the feed's count decides.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from waltz import errors
from waltz.client import (
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz.cluster import open_store
from waltz.cluster.layout import Paths, cluster_root
from waltz.spark.connection import client_config, log_reader
from waltz.spark.sink import _IN_FLIGHT, WaltzWriter

log = logging.getLogger("waltz.spark")

QUERY_ID = "sql.streaming.queryId"
BATCH_ID = "streaming.sql.batchId"
"""Local properties Spark sets on every job of a micro-batch (StreamExecution)."""

RowKey = tuple[int, int, bytes]
"""(Waltz partition, header, digest of the data)."""


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class StreamAppended(WriterCommitMessage):
    def __init__(self, written: int, found: int) -> None:
        self.written, self.found = written, found


class TaskLedger(WaltzClientCallbacks):
    """How many transactions of each row key the task's attempts (this one included) have
    committed since the first attempt's marks, counted from the feed; thread-safe (the feed is
    applied in callback threads while rows are executed in others)."""

    def __init__(self, marks: Mapping[int, int], registered: Any) -> None:
        self._marks = dict(marks)
        self._lock = threading.Lock()
        self._registered = registered
        """Returns the client ids of the task's attempts registered now."""
        self.own = -1
        """This attempt's client id."""
        self._attempts: set[int] = set()
        self._foreign: set[int] = set()
        self.counts: collections.Counter[RowKey] = collections.Counter()
        self._unknown: dict[int, list[Transaction]] = collections.defaultdict(list)
        """Transactions of client ids not yet looked up, by client id."""
        self._own: list[Transaction] = []
        """This attempt's commits, not yet counted: only a row's second or later occurrence needs
        them (an attempt writes the occurrences of a key one after the other, and the first is
        executed again only if it did not commit), so a task of distinct rows never fetches back
        the data it wrote."""

    def get_client_high_water_mark(self, partition: int) -> int:
        with self._lock:
            return self._marks.get(partition, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        client_id = transaction.req_id[0]
        with self._lock:
            ours = client_id in self._attempts
        key = (transaction.partition, transaction.header, digest(transaction.data())) if ours else None
        with self._lock:
            if key is not None:
                self.counts[key] += 1
            elif client_id == self.own:
                self._own.append(transaction)
            elif client_id not in self._foreign:
                self._unknown[client_id].append(transaction)
            self._marks[transaction.partition] = transaction.transaction_id

    def look_up(self) -> None:
        """Sorts the client ids seen in the feed into the task's other attempts and others. An
        attempt registers before it writes, so an id seen in the feed and not registered is not
        one."""
        with self._lock:
            unknown = set(self._unknown)
        registered = set(self._registered()) - {self.own}
        self._count({c: t for c in unknown & registered for t in [self._unknown.get(c, [])]})
        with self._lock:
            self._attempts |= registered
            self._foreign |= unknown - registered
            for c in unknown:
                self._unknown.pop(c, None)

    def _count(self, transactions: Mapping[int, list[Transaction]]) -> None:
        found = [(t.partition, t.header, digest(t.data())) for ts in transactions.values() for t in ts]
        with self._lock:
            self.counts.update(found)

    def committed(self, key: RowKey, occurrence: int) -> int:
        """How many rows with this key the log holds from the task's attempts, as far as the feed
        has been applied (at least: a commit not applied yet fails the row's lock)."""
        if occurrence > 0:
            with self._lock:
                own, self._own = self._own, []
            self._count({self.own: own})
        with self._lock:
            if self.counts[key] > occurrence or not self._unknown:
                return self.counts[key]
        self.look_up()
        with self._lock:
            return self.counts[key]


class _Row(TransactionContext):
    """The `occurrence`-th row (from 0) of the task with this key. It is written while the log
    holds no more than `occurrence` rows with the key from the task's attempts: an attempt
    writes the occurrences of a key in order, one finished before the next starts, so after
    occurrence n the log holds at least n + 1; and every append of the key carries the same
    write lock, so an append commits only if no other row with the key committed since the
    mark its decision was made at, which keeps the total at the number of rows."""

    def __init__(self, ledger: TaskLedger, task: str, key: RowKey, occurrence: int, data: bytes) -> None:
        super().__init__()
        self._ledger, self._key, self._occurrence, self._data = ledger, key, occurrence, data
        lock_id = int.from_bytes(digest(b"%s\x00%d\x00%s" % (key[2], key[1], task.encode()))[:8])
        self._lock = PartitionLocalLock("waltz.spark.sink", lock_id - (1 << 63))

    def partition_id(self, num_partitions: int) -> int:
        return self._key[0]

    def execute(self, builder: TransactionBuilder) -> bool:
        if self._ledger.committed(self._key, self._occurrence) > self._occurrence:
            return False  # an attempt of this task committed it
        builder.set_header(self._key[1])
        builder.set_data(self._data)
        builder.add_write_locks(self._lock)
        return True


class TaskEntry:
    """The task's entry in the metadata store: the first attempt's marks, the attempts' ids."""

    def __init__(self, metadata: str, cluster: str, query: str, batch: int, task: int) -> None:
        self.store = open_store(metadata)
        self.store.start()
        self.query_path = f"{Paths(cluster_root(cluster)).sink}/{query}"
        self.path = f"{self.query_path}/{batch}/{task}"
        self.batch = batch

    def marks(self, seen: Mapping[int, int]) -> dict[int, int]:
        """The marks stored by the task's first attempt (`seen` if this is it)."""
        try:
            self.store.create(self.path, json.dumps({str(p): m for p, m in seen.items()}).encode(), make_parents=True)
            return dict(seen)
        except errors.MetadataExistsError:
            data, _ = self.store.get(self.path)
            return {int(p): m for p, m in json.loads(data).items()}

    def register(self, client_id: int) -> None:
        try:
            self.store.create(f"{self.path}/attempts/{client_id}", make_parents=True)
        except errors.MetadataExistsError:
            pass

    def attempts(self) -> list[int]:
        try:
            return [int(c) for c in self.store.children(f"{self.path}/attempts")]
        except errors.MetadataNotFoundError:
            return []

    def forget_old_batches(self) -> None:
        """Batches before the previous one are in Spark's commit log and never replayed."""
        try:
            batches = self.store.children(self.query_path)
        except errors.MetadataNotFoundError:
            return
        for b in batches:
            if b.isdigit() and int(b) < self.batch - 1:
                try:
                    self.store.delete(f"{self.query_path}/{b}", recursive=True)
                except errors.MetadataNotFoundError:
                    pass

    def close(self) -> None:
        self.store.close()


class WaltzStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        # checkpointLocation is Spark's own (the sink keeps its state in the metadata store)
        ours = {k: v for k, v in options.items() if k.lower() != "checkpointlocation"}
        self.rows = WaltzWriter(ours, schema)  # the options, the schema, the column checks
        self.opts = self.rows.opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StreamAppended:
        from pyspark import TaskContext

        task = TaskContext.get()
        query, batch = (task.getLocalProperty(QUERY_ID), task.getLocalProperty(BATCH_ID)) if task else (None, None)
        if task is None or query is None or batch is None:
            raise RuntimeError(f"the waltz streaming sink runs in a streaming query's task (no {QUERY_ID})")
        if task.partitionId() == 0 and task.attemptNumber() == 0:
            self._forget_before(query, int(batch))
        return self.attempt(query, int(batch), task.partitionId(), iterator)

    def attempt(self, query: str, batch: int, task: int, batches: Iterable[pa.RecordBatch]) -> StreamAppended:
        """One attempt of task `task` of micro-batch `batch` of query `query`: writes those of its
        rows that no attempt of the same task has committed."""
        import asyncio

        opts = self.opts
        assert opts.metadata is not None
        rows = (b for b in batches if b.num_rows)
        first = next(rows, None)
        if first is None:  # an empty task needs no connection
            return StreamAppended(0, 0)

        async def marks() -> dict[int, int]:
            async with log_reader(opts) as r:
                return await r.high_water_marks()

        entry = TaskEntry(opts.metadata, opts.cluster, query, batch, task)
        try:
            ledger = TaskLedger(entry.marks(asyncio.run(marks())), entry.attempts)
            ledger.look_up()
            with WaltzClient(ledger, client_config(opts)) as client:
                ledger.own = client.client_id
                entry.register(client.client_id)  # before any write of this attempt
                return self._write(client, ledger, f"{query}/{batch}/{task}", itertools.chain((first,), rows))
        finally:
            entry.close()

    def _forget_before(self, query: str, batch: int) -> None:
        assert self.opts.metadata is not None
        entry = TaskEntry(self.opts.metadata, self.opts.cluster, query, batch, 0)
        try:
            entry.forget_old_batches()
        finally:
            entry.close()

    def _write(
        self, client: WaltzClient, ledger: TaskLedger, task: str, batches: Iterable[pa.RecordBatch]
    ) -> StreamAppended:
        n = client.partitions
        spread = itertools.count(0)  # the same spread on every attempt: rows map to the same partitions
        occurrences: collections.Counter[RowKey] = collections.Counter()
        previous: dict[RowKey, concurrent.futures.Future[bool]] = {}
        futures: collections.deque[concurrent.futures.Future[bool]] = collections.deque()
        written = found = 0

        def settle(keep: int) -> None:
            nonlocal written, found
            while len(futures) > keep:
                if futures.popleft().result():
                    written += 1
                else:
                    found += 1

        for b in batches:
            data, partitions, headers = self.rows._columns(b, n, spread)
            for partition, header, payload in zip(partitions, headers, data, strict=True):
                key = (partition, header, digest(payload))
                if occurrences[key]:
                    previous[key].result()  # equal rows one after the other (see _Row)
                future = client.submit(_Row(ledger, task, key, occurrences[key], payload))
                futures.append(future)
                previous[key] = future
                occurrences[key] += 1
                settle(keep=_IN_FLIGHT)
        settle(keep=0)
        client.flush()
        return StreamAppended(written, found)

    def commit(self, messages: list[Any], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, StreamAppended)]
        log.info(
            "waltz: batch %d: %d rows appended, %d found already committed by an earlier attempt",
            batchId,
            sum(m.written for m in done),
            sum(m.found for m in done),
        )

    def abort(self, messages: list[Any], batchId: int) -> None:
        log.warning(
            "waltz: batch %d aborted; the rows its tasks committed stay in the log, and the batch's replay writes "
            "only the others",
            batchId,
        )
