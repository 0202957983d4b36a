"""The exactly-once streaming sink (`df.writeStream.format("waltz")`, issue 36, item 1) with a
real SparkSession and a real local cluster: a task that commits its rows and then fails before
Spark hears of it, the query restarted from its checkpoint (the batch replayed under the same
query and batch ids), then further batches: every row is in the log once."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest
from conftest import Live

pytestmark = pytest.mark.spark


class _FailAfterCommit:
    """Mixed into the sink's writer (pickled by value into the workers): a task whose marker file
    does not exist yet creates it and fails after its rows are committed, as a task whose
    executor dies before reporting does."""

    markers: str = ""

    def write(self, iterator: Any) -> Any:
        from pyspark import TaskContext

        message = super().write(iterator)  # type: ignore[misc]
        task = TaskContext.get()
        marker = (
            pathlib.Path(self.markers)
            / f"batch-{task.getLocalProperty('streaming.sql.batchId')}-task-{task.partitionId()}"
        )
        if message.written and not marker.exists():
            marker.touch()
            raise RuntimeError("committed, then lost before reporting (test)")
        return message


def _flaky_source(markers: pathlib.Path) -> Any:
    from waltz.spark.datasource import WaltzDataSource
    from waltz.spark.stream_sink import WaltzStreamWriter

    class FlakyWriter(_FailAfterCommit, WaltzStreamWriter):
        pass

    FlakyWriter.markers = str(markers)

    class FlakyWaltz(WaltzDataSource):
        @classmethod
        def name(cls) -> str:
            return "flakywaltz"

        def streamWriter(self, schema: Any, overwrite: bool) -> Any:
            return FlakyWriter(self.options, schema)

    return FlakyWaltz


def _write_input(directory: pathlib.Path, name: str, tag: str, rows: range) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [json.dumps({"tag": tag, "row": i}).encode() for i in rows]
    table = pa.table(
        {
            "data": pa.array(data, pa.binary()),
            "partition": pa.array([i % 2 for i in rows], pa.int32()),
            "header": pa.array([i % 3 for i in rows], pa.int32()),  # rows that differ only by data
        }
    )
    pq.write_table(table, directory / f"{name}.parquet")


def _query(spark: Any, live: Live, source: pathlib.Path, checkpoint: pathlib.Path, fmt: str) -> Any:
    return (
        spark.readStream.schema("data binary, partition int, header int")
        .option("maxFilesPerTrigger", "1")
        .parquet(str(source))
        .writeStream.format(fmt)
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def _rows_of(live: Live, tag: str, expected: int) -> list[tuple[int, int]]:
    """(partition, row) of every committed transaction with this tag, once the client's feed has
    delivered at least `expected` of them (and a moment more, for duplicates)."""
    deadline = time.monotonic() + 60
    while True:
        got = [(p, d["row"]) for p, rows in live.written().items() for _, d in rows if d.get("tag") == tag]
        if len(got) >= expected or time.monotonic() > deadline:
            time.sleep(1.0)
            return [(p, d["row"]) for p, rows in live.written().items() for _, d in rows if d.get("tag") == tag]
        time.sleep(0.1)


def test_a_task_lost_after_committing_and_a_restarted_query_write_each_row_once(
    spark: Any, live: Live, tmp_path: pathlib.Path
) -> None:
    from pyspark import cloudpickle
    from pyspark.errors import StreamingQueryException

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module
    spark.dataSource.register(_flaky_source(tmp_path / "markers"))
    (tmp_path / "markers").mkdir()
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    source.mkdir()
    tag = uuid.uuid4().hex
    _write_input(source, "a", tag, range(0, 40))
    _write_input(source, "b", tag, range(40, 60))
    # Spark takes files in modification-time order; two written within one tick tie, and either
    # could be batch 0. Apart by a minute, "a" is batch 0 on every run.
    now = time.time()
    os.utime(source / "a.parquet", (now - 120, now - 120))
    os.utime(source / "b.parquet", (now - 60, now - 60))

    # Batch 0's tasks commit their rows and fail; with local[2] Spark does not retry a task, so
    # the query fails, and the batch is not in its commit log.
    failing = _query(spark, live, source, checkpoint, "flakywaltz")
    with pytest.raises(StreamingQueryException, match="committed, then lost before reporting"):
        failing.awaitTermination(180)
    lost = _rows_of(live, tag, 40)
    assert sorted(r for _, r in lost) == list(range(40)), "batch 0's rows were committed before the failure"

    # The query restarted from its checkpoint replays batch 0 under the same query and batch ids
    # (its tasks find their rows), then goes on with batch 1, whose first attempts fail after
    # committing too; the third start writes nothing of them again.
    for fmt in ("flakywaltz", "waltz"):
        restarted = _query(spark, live, source, checkpoint, fmt)
        try:
            restarted.awaitTermination(180)
        except StreamingQueryException as e:
            assert "committed, then lost before reporting" in str(e)
    final = _query(spark, live, source, checkpoint, "waltz")
    assert final.awaitTermination(180)
    assert final.exception() is None

    rows = _rows_of(live, tag, 60)
    assert sorted(r for _, r in rows) == list(range(60))  # each row once, none lost
    assert all(p == r % 2 for p, r in rows)
    failed = sorted(p.name for p in (tmp_path / "markers").iterdir())
    assert failed == ["batch-0-task-0", "batch-1-task-0"], "each batch's task failed after committing once"


def test_a_replayed_batch_with_repeated_rows_writes_as_many_as_it_has(
    spark: Any, live: Live, tmp_path: pathlib.Path
) -> None:
    """Rows equal in partition, header and data are counted, not merged: a replay writes the
    missing copies only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    source.mkdir()
    tag = uuid.uuid4().hex
    same = json.dumps({"tag": tag, "row": 7}).encode()
    pq.write_table(
        pa.table({"data": pa.array([same] * 5, pa.binary()), "partition": pa.array([1] * 5, pa.int32())}),
        source / "same.parquet",
    )
    markers = tmp_path / "markers"
    markers.mkdir()
    spark.dataSource.register(_flaky_source(markers))
    first = _query_two_columns(spark, live, source, checkpoint, "flakywaltz")
    with pytest.raises(Exception, match="committed, then lost before reporting"):
        first.awaitTermination(180)
    second = _query_two_columns(spark, live, source, checkpoint, "waltz")
    assert second.awaitTermination(180)
    assert _rows_of(live, tag, 5) == [(1, 7)] * 5


def _query_two_columns(spark: Any, live: Live, source: pathlib.Path, checkpoint: pathlib.Path, fmt: str) -> Any:
    return (
        spark.readStream.schema("data binary, partition int")
        .parquet(str(source))
        .writeStream.format(fmt)
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def test_attempts_of_one_task_running_at_once_write_each_row_once(live: Live) -> None:
    """A zombie attempt and its retry (or speculative copies) writing at the same time: the write
    lock per row content keeps them from both committing a row, and whichever runs after them finds every
    row. No SparkSession: the attempts are the sink's own code, called as Spark's task would."""
    import concurrent.futures
    import threading

    import pyarrow as pa
    from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType
    from waltz.spark.stream_sink import WaltzStreamWriter

    tag = uuid.uuid4().hex
    n = 300  # 150 rows, each twice (equal partition and data): the copies must stay two
    batch = pa.record_batch(
        [
            pa.array([json.dumps({"tag": tag, "row": i % 150}).encode() for i in range(n)], pa.binary()),
            pa.array([i % 2 for i in range(n)], pa.int32()),
        ],
        names=["data", "partition"],
    )
    schema = StructType([StructField("data", BinaryType()), StructField("partition", IntegerType())])
    writer = WaltzStreamWriter({"metadata": live.url, "cluster": live.cluster.cluster}, schema)
    query = f"concurrent-{tag}"
    start = threading.Barrier(3)

    def attempt() -> Any:
        start.wait()
        return writer.attempt(query, 0, 0, [batch])

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda _: attempt(), range(3)))
    assert sum(o.written for o in outcomes) == n, [(o.written, o.found) for o in outcomes]
    late = writer.attempt(query, 0, 0, [batch])
    assert (late.written, late.found) == (0, n)
    rows = _rows_of(live, tag, n)
    assert sorted(r for _, r in rows) == sorted(i % 150 for i in range(n))


RETRYING_SESSION = textwrap.dedent(
    """
    import json, os, pathlib, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark import TaskContext
    from pyspark.sql import SparkSession
    from waltz.spark.datasource import WaltzDataSource
    from waltz.spark.stream_sink import WaltzStreamWriter

    metadata, cluster, source, checkpoint, markers = sys.argv[1:]

    class FailsFirstAttempt(WaltzStreamWriter):
        def write(self, iterator):
            message = super().write(iterator)
            task = TaskContext.get()
            if task.attemptNumber() == 0 and message.written:
                batch = task.getLocalProperty("streaming.sql.batchId")
                pathlib.Path(markers, f"batch-{batch}-task-{task.partitionId()}").touch()
                raise RuntimeError("committed, then lost before reporting (test)")
            return message

    class Flaky(WaltzDataSource):
        @classmethod
        def name(cls):
            return "flakywaltz"

        def streamWriter(self, schema, overwrite):
            return FailsFirstAttempt(self.options, schema)

    # local[2,3]: a failed task is attempted again, up to 3 times, as on a cluster
    spark = (SparkSession.builder.master("local[2,3]").config("spark.ui.enabled", "false")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(Flaky)
    query = (spark.readStream.schema("data binary, partition int, header int").option("maxFilesPerTrigger", "1")
             .parquet(source).writeStream.format("flakywaltz").option("metadata", metadata)
             .option("cluster", cluster).option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination(240)
    print(json.dumps({"exception": str(query.exception()) if query.exception() else None}))
    spark.stop()
    """
)


def test_spark_retrying_a_task_that_failed_after_committing_writes_each_row_once(
    live: Live, tmp_path: pathlib.Path
) -> None:
    """Spark's own task retry (local[2,3], a session in a subprocess): each batch's first attempt
    commits its rows and fails, the second attempt finds them, and the query succeeds."""
    source, markers = tmp_path / "in", tmp_path / "markers"
    source.mkdir()
    markers.mkdir()
    tag = uuid.uuid4().hex
    _write_input(source, "a", tag, range(0, 30))
    _write_input(source, "b", tag, range(30, 50))
    script = tmp_path / "session.py"
    script.write_text(RETRYING_SESSION)
    args = [live.url, live.cluster.cluster, str(source), str(tmp_path / "checkpoint"), str(markers)]
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"exception": None}
    assert sorted(p.name for p in markers.iterdir()) == ["batch-0-task-0", "batch-1-task-0"]
    rows = _rows_of(live, tag, 50)
    assert sorted(r for _, r in rows) == list(range(50))


def test_an_attempt_cut_off_midway_is_completed_by_the_next(live: Live) -> None:
    """The first attempt's input fails after two of its three Arrow batches (rows committed, some
    still in flight when its client closes); the retry writes exactly the rows still missing."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, IntegerType, StructField, StructType
    from waltz.spark.stream_sink import WaltzStreamWriter

    tag = uuid.uuid4().hex
    batches = [
        pa.record_batch(
            [
                pa.array([json.dumps({"tag": tag, "row": i}).encode() for i in rows], pa.binary()),
                pa.array([i % 2 for i in rows], pa.int32()),
            ],
            names=["data", "partition"],
        )
        for rows in (range(0, 100), range(100, 200), range(200, 300))
    ]
    schema = StructType([StructField("data", BinaryType()), StructField("partition", IntegerType())])
    writer = WaltzStreamWriter({"metadata": live.url, "cluster": live.cluster.cluster}, schema)
    query = f"cut-{tag}"

    def cut_off() -> Any:
        yield from batches[:2]
        raise OSError("executor lost (test)")

    with pytest.raises(OSError, match="executor lost"):
        writer.attempt(query, 3, 1, cut_off())
    retry = writer.attempt(query, 3, 1, batches)
    rows = _rows_of(live, tag, 300)
    assert sorted(r for _, r in rows) == list(range(300))
    assert retry.written + retry.found == 300 and retry.found > 0, (retry.written, retry.found)
