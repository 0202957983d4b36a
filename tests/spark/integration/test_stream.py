"""Streaming reads of a live cluster (`spark.readStream.format("waltz")`) and the sink
(`df.write.format("waltz")`)."""

from __future__ import annotations

import json
import pathlib
import threading
import time
from typing import Any

import pytest
from conftest import Live
from test_batch import by_partition

pytestmark = pytest.mark.spark

LIMIT = 30


def stream(spark: Any, live: Live, out: pathlib.Path, checkpoint: pathlib.Path, **trigger: Any) -> Any:
    return (
        spark.readStream.format("waltz")
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .option("startingOffsets", "earliest")
        .option("maxTransactionsPerTrigger", str(LIMIT))
        .load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(**trigger)
        .start()
    )


def batches_with_rows(query: Any) -> list[int]:
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def test_a_stopped_query_resumes_from_its_checkpoint_without_gap_or_duplicate(
    spark: Any, live: Live, tmp_path: pathlib.Path
) -> None:
    live.write("s0", 100)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    first = stream(spark, live, out, checkpoint, processingTime="100 milliseconds")
    writer = threading.Thread(target=live.write, args=("s1", 200))
    writer.start()
    deadline = time.monotonic() + 120
    while len(batches_with_rows(first)) < 3:  # mid-stream: some batches done, more to come
        assert first.exception() is None, first.exception()
        assert time.monotonic() < deadline, first.recentProgress
        time.sleep(0.05)
    first.stop()
    writer.join()
    sizes = batches_with_rows(first)
    live.write("s2", 50)

    second = stream(spark, live, out, checkpoint, availableNow=True)
    assert second.awaitTermination(180)
    assert second.exception() is None
    sizes += batches_with_rows(second)

    got = by_partition(spark.read.parquet(str(out)))
    assert got == live.written()  # every committed transaction, once, in id order per partition
    assert sum(len(v) for v in got.values()) == 350
    assert max(sizes) <= LIMIT and len(sizes) >= 350 // LIMIT


def test_a_stream_started_at_latest_sees_only_new_transactions(spark: Any, live: Live, tmp_path: pathlib.Path) -> None:
    before = {p: rows[-1][0] for p, rows in live.written().items()}
    query = (
        spark.readStream.format("waltz")
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .load()
        .writeStream.format("memory")
        .queryName("latest_only")
        .trigger(processingTime="100 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 60
        while not query.recentProgress:  # the first batch fixes the start
            assert time.monotonic() < deadline
            time.sleep(0.05)
        live.write("new", 10)
        while spark.table("latest_only").count() < 10:
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        rows = spark.table("latest_only").collect()
        assert sorted(json.loads(bytes(r.data))["id"] for r in rows) == sorted(f"new-{i}" for i in range(10))
        assert all(r.transaction_id > before[r.partition] for r in rows)
    finally:
        query.stop()


def test_the_sink_appends_every_row_as_a_transaction(spark: Any, live: Live) -> None:
    before = {p: rows[-1][0] for p, rows in live.written().items()}
    rows = [(i % 2, i, json.dumps({"id": f"sink-{i}"}).encode()) for i in range(60)]
    df = spark.createDataFrame(rows, "partition int, header int, data binary").repartition(3)
    df.write.format("waltz").option("metadata", live.url).option("cluster", live.cluster.cluster).mode("append").save()
    # Round robin over partitions when the rows name none.
    spark.createDataFrame([(json.dumps({"id": f"rr-{i}"}).encode(),) for i in range(10)], "data binary").write.format(
        "waltz"
    ).option("metadata", live.url).option("cluster", live.cluster.cluster).mode("append").save()

    after = (
        spark.read.format("waltz")
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .option("startingOffsets", json.dumps({str(p): m + 1 for p, m in before.items()}))
        .load()
        .collect()
    )
    got = {json.loads(bytes(r.data))["id"]: (r.partition, r.header) for r in after}
    assert {k: v for k, v in got.items() if k.startswith("sink-")} == {f"sink-{i}": (i % 2, i) for i in range(60)}
    assert sorted(k for k in got if k.startswith("rr-")) == sorted(f"rr-{i}" for i in range(10))
    assert {v[0] for k, v in got.items() if k.startswith("rr-")} == {0, 1}
    assert len(after) == 70


@pytest.mark.parametrize(
    ("schema", "rows", "mode", "message"),
    [
        ("data binary", [(b"{}",)], "overwrite", "append-only"),
        ("data string", [("x",)], "append", "needs a binary column `data`"),
        ("data binary, partition int", [(b"{}", 9)], "append", "column `partition` is 9"),
        ("data binary, extra int", [(b"{}", 1)], "append", "drop extra"),
        ("data binary, header int", [(b"{}", None)], "append", "column `header` is null in a row"),
        ("data binary", [(None,)], "append", "column `data` is null in a row"),
        ("data binary, partition int", [(b"{}", None)], "append", "column `partition` is None"),
        ("data binary, partition int", [(b"{}", 0), (b"{}", -1)], "append", "column `partition` is -1"),
    ],
)
def test_the_sink_refuses_bad_rows_clearly(
    spark: Any, live: Live, schema: str, rows: list[Any], mode: str, message: str
) -> None:
    df = spark.createDataFrame(rows, schema)
    with pytest.raises(Exception) as e:
        df.write.format("waltz").option("metadata", live.url).option("cluster", live.cluster.cluster).mode(mode).save()
    assert message in str(e.value), str(e.value)[-2000:]


def test_a_bad_row_fails_its_batch_before_any_row_of_it_is_appended(spark: Any, live: Live) -> None:
    """issue 36, item 2: the sink takes Arrow batches, and checks a batch's columns whole."""
    before = live.written()
    rows = [(json.dumps({"id": f"whole-{i}"}).encode(), i % 2 if i != 7 else 5) for i in range(10)]
    with pytest.raises(Exception, match="column `partition` is 5"):
        (
            spark.createDataFrame(rows, "data binary, partition int")
            .coalesce(1)
            .write.format("waltz")
            .option("metadata", live.url)
            .option("cluster", live.cluster.cluster)
            .mode("append")
            .save()
        )
    after = (
        spark.read.format("waltz")
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .option("startingOffsets", json.dumps({str(p): (r[-1][0] + 1 if r else 0) for p, r in before.items()}))
        .load()
    )
    assert [r for r in after.collect() if b"whole-" in bytes(r.data)] == []


def test_a_write_refuses_read_options_and_a_path_and_an_empty_one_connects_to_nothing(
    spark: Any, live: Live, tmp_path: pathlib.Path
) -> None:
    df = spark.createDataFrame([(b"{}",)], "data binary")

    def write(frame: Any, cluster: str, *path: str, **options: str) -> None:
        frame.write.format("waltz").option("metadata", cluster).option("cluster", live.cluster.cluster).options(
            **options
        ).mode("append").save(*path)

    for options, message in (
        ({"partitions": "1"}, "option(s) partitions do not apply to writes"),
        ({"startingOffsets": "earliest"}, "option(s) startingOffsets do not apply to writes"),
    ):
        with pytest.raises(Exception) as e:
            write(df, live.url, **options)
        assert message in str(e.value), str(e.value)[-2000:]
    with pytest.raises(Exception) as e:
        write(df, live.url, str(tmp_path / "x"))
    assert "a write goes to a live cluster, not to files" in str(e.value), str(e.value)[-2000:]
    # No rows, no connection: a cluster that does not exist is never asked.
    write(
        spark.createDataFrame([], "data binary").repartition(2), f"embedded:{tmp_path}/nowhere/metadata.db", timeout="2"
    )


def test_a_stream_needs_a_cluster(spark: Any, tmp_path: pathlib.Path) -> None:
    with pytest.raises(Exception) as e:
        spark.readStream.format("waltz").load(str(tmp_path)).writeStream.format("memory").queryName(
            "x"
        ).start().awaitTermination(30)
    assert "streams and writes need a live cluster" in str(e.value), str(e.value)[-2000:]


def test_a_stream_rejects_path_instead_of_ignoring_it(spark: Any, tmp_path: pathlib.Path) -> None:
    reader = spark.readStream.format("waltz").option("metadata", f"embedded:{tmp_path}/metadata.db")
    with pytest.raises(Exception) as e:
        reader.load(str(tmp_path / "storage")).writeStream.format("noop").start().awaitTermination(60)
    assert "applies to batch reads only" in str(e.value), str(e.value)[-2000:]


class _ShortReader:
    """A log reader whose replicas end the range early (what a future early return would do)."""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def read(self, partition: int, start: int, end: int, *, max_count: int) -> Any:
        from types import SimpleNamespace

        from waltz.storage import ReqId

        yield [
            SimpleNamespace(txid=t, req_id=ReqId(1, 1, partition, t), header=0, data=b"x")
            for t in range(start, start + 3)
        ]


def test_a_micro_batch_the_cluster_answers_short_fails_instead_of_skipping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream's offsets pass the batch's end once it is read: a range the replicas returned
    only in part must fail the task (its files' reads had that check, the cluster's did not)."""
    from waltz import errors
    from waltz.spark import source
    from waltz.spark.options import Options

    monkeypatch.setattr(source, "log_reader", lambda opts: _ShortReader())
    opts = Options.parse({"metadata": "embedded:/nowhere"}, streaming=True)
    got = []
    with pytest.raises(errors.ClusterError, match="returned transactions 10..12 of 10..19"):
        for batch in source._read_cluster(opts, 0, 10, 19):
            got.extend(batch.column("transaction_id").to_pylist())
    assert got == [10, 11, 12]


def test_ids_the_replicas_dropped_fail_a_cluster_read_at_once_or_are_skipped_with_fail_on_data_loss_false(
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream restarted from a checkpoint below what the replicas still hold (their folders
    replaced by pruned copies, say): every replica answers "below the log's start", which no
    retry can change. Before, the read retried until its timeout and ended in a
    RequestTimeoutError that did not say why."""
    import asyncio
    import logging

    from support.client_app import MemoryApp, Write
    from waltz import errors
    from waltz._native import Storage
    from waltz.client import WaltzClient
    from waltz.client.log_reader import LogReader
    from waltz.local import LocalCluster
    from waltz.spark import source
    from waltz.spark.options import DataLossError, Options

    cluster = LocalCluster.create(tmp_path / "c", partitions=1, storage_nodes=3, servers=1)
    nodes = [m.name for m in cluster.members if m.role == "storage"]
    for name in nodes:  # small segments, so that dropping the oldest drops ids
        toml = cluster.config_path(name).read_text()
        cluster.config_path(name).write_text(toml.replace("[storage]\n", "[storage]\nsegment_size = 4096\n", 1))
    cluster.start()
    try:
        client = WaltzClient(MemoryApp(), cluster.client_config())
        try:
            for i in range(300):  # one at a time: batches small enough for segments to roll often
                assert client.submit(Write(f"w-{i}", partition=0, header=i)).result(timeout=60)
            client.flush()
        finally:
            client.close()
        cluster.stop()
        firsts = set()
        for name in nodes:
            with Storage.open(cluster.directory / "data" / name, cluster.cluster_key) as s:
                firsts.add(s.partition(0).drop_segments_before(150))
        assert len(firsts) == 1
        first = firsts.pop()
        assert 0 < first <= 150
        cluster.start()
        cluster.wait_served()

        async def read(start: int) -> list[int]:
            async with LogReader(cluster.metadata_url, cluster.cluster, timeout=60) as r:
                return [rec.txid async for recs in r.read(0, start, 299) for rec in recs]

        assert asyncio.run(read(first)) == list(range(first, 300))
        with pytest.raises(
            errors.BelowLogStartError,
            match=rf"partition 0: transactions 10\.\.{first - 1} are held by no replica any more",
        ):
            asyncio.run(read(10))

        def ids(**options: str) -> list[int]:
            opts = Options.parse(
                {"metadata": cluster.metadata_url, "cluster": cluster.cluster, **options}, streaming=True
            )
            return [
                t
                for batch in source._read_cluster(opts, 0, 10, 299)
                for t in batch.column("transaction_id").to_pylist()
            ]

        with pytest.raises(
            DataLossError,
            match=f"transactions 10..{first - 1} of partition 0 are no longer in the cluster's replicas "
            f"\\(the first held is {first}\\): set failOnDataLoss=false",
        ):
            ids()
        with caplog.at_level(logging.WARNING, logger="waltz.spark"):
            assert ids(failOnDataLoss="false") == list(range(first, 300))
        assert f"going on from {first} (failOnDataLoss=false)" in caplog.text
    finally:
        cluster.stop()


def test_a_closed_log_reader_leaves_no_task_of_its_links_behind(live: Live) -> None:
    """issue 36, item 7: `Task was destroyed but it is pending! ... Link._read` in streaming
    logs. High-water marks of several partitions asked at once each opened a link to the same
    server and kept the last: the others, never closed, outlived the reader, and a loop closed
    after it (as `_read_cluster`'s is) destroyed their tasks pending. The `no_leaked_tasks`
    fixture fails any test after which asyncio reports such a task."""
    import asyncio

    from waltz.spark.connection import log_reader
    from waltz.spark.options import Options

    opts = Options.parse({"metadata": live.url, "cluster": live.cluster.cluster}, streaming=True)
    loop = asyncio.new_event_loop()
    try:
        reader = log_reader(opts)
        loop.run_until_complete(reader.start())
        for _ in range(3):
            assert set(loop.run_until_complete(reader.high_water_marks())) == {0, 1}  # both partitions at once
        loop.run_until_complete(reader.close())
        assert [t.get_name() for t in asyncio.all_tasks(loop)] == []
    finally:
        loop.close()
