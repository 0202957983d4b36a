"""Batch scans: `spark.read.format("waltz")` over storage directories (native reader, Arrow)
and over a live cluster, committed-only bounds, offsets, splits, corrupt files, bad options."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import re
import signal
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from conftest import Live
from waltz._native import Storage
from waltz.storage.scan import iter_scan, scan_rows

pytestmark = pytest.mark.spark

COLUMNS = ["partition", "transaction_id", "header", "client_id", "generation", "sequence", "data"]


def by_partition(df: Any) -> dict[int, list[tuple[int, Any]]]:
    out: dict[int, list[tuple[int, Any]]] = defaultdict(list)
    for r in df.orderBy("partition", "transaction_id").collect():
        out[r.partition].append((r.transaction_id, json.loads(bytes(r.data))))
    return dict(out)


def full_rows(df: Any) -> list[tuple[Any, ...]]:
    return [(*r[:-1], bytes(r[-1])) for r in df.orderBy("partition", "transaction_id").collect()]


def native_rows(path: pathlib.Path, lasts: dict[int, int]) -> list[tuple[Any, ...]]:
    rows = []
    with Storage.open(path, read_only=True) as storage:
        for p in sorted(lasts):
            for chunk in iter_scan(storage.partition(p), 0, lasts[p]):
                rows.extend(scan_rows(chunk, p))
    return rows


def settled(live: Live, i: int) -> None:
    """Until storage-i holds every committed transaction (a replica outside the majority of an
    append may lag a moment)."""
    marks = {p: rows[-1][0] for p, rows in live.written().items()}
    deadline = time.monotonic() + 30
    while True:
        with Storage.open(live.storage_dir(i), read_only=True) as s:
            if all(s.partition(p).max_transaction_id >= m for p, m in marks.items()):
                return
        assert time.monotonic() < deadline, f"storage-{i} did not catch up"
        time.sleep(0.1)


def planted(tmp_path: pathlib.Path, n: int = 100, low_water_mark: int = 79) -> pathlib.Path:
    """A storage directory of 2 partitions holding `n` transactions each, of which only
    `0..low_water_mark` are known committed (the rest is an uncommitted tail)."""
    d = tmp_path / "replica"
    with Storage.create(d, uuid.uuid4(), 2) as s:
        for p in (0, 1):
            s.add_partition(p)
            s.partition(p).append(0, [((7, 1, p, i), i, b'{"n":%d}' % i) for i in range(n)])
            s.set_low_water_mark(p, 1, low_water_mark)
    return d


def test_scan_of_a_live_replica_equals_the_feed_and_the_native_reader(spark: Any, live: Live) -> None:
    live.write("batch", 400)
    settled(live, 0)
    df = (
        spark.read.format("waltz")
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .load(str(live.storage_dir(0)))
    )
    assert df.columns == COLUMNS
    assert [f.dataType.simpleString() for f in df.schema.fields] == [
        "int",
        "bigint",
        "int",
        "int",
        "int",
        "int",
        "binary",
    ]
    written = live.written()
    assert by_partition(df) == written
    lasts = {p: rows[-1][0] for p, rows in written.items()}
    assert full_rows(df) == native_rows(live.storage_dir(0), lasts)
    # The header, the request ids: what the client sent, nothing hidden.
    first = df.where("partition = 0 AND transaction_id = 0").collect()[0]
    assert first.header == 0 and first.client_id == live.client.client_id and first.sequence >= 0


def test_all_replicas_at_once_read_each_partition_once(spark: Any, live: Live) -> None:
    dirs = ",".join(str(live.storage_dir(i)) for i in range(3))
    df = spark.read.format("waltz").option("metadata", live.url).option("cluster", live.cluster.cluster).load(dirs)
    assert by_partition(df) == live.written()


def test_reading_the_cluster_without_files(spark: Any, live: Live) -> None:
    df = spark.read.format("waltz").option("metadata", live.url).option("cluster", live.cluster.cluster).load()
    assert by_partition(df) == live.written()
    sliced = (
        spark.read.format("waltz")
        .option("metadata", live.url)
        .option("cluster", live.cluster.cluster)
        .option("startingOffsets", '{"0": 5, "1": 190}')
        .option("endingOffsets", '{"0": 7}')
        .load()
    )
    assert [(r.partition, r.transaction_id) for r in sliced.orderBy("partition", "transaction_id").collect()] == [
        (0, 5),
        (0, 6),
        *((1, t) for t in range(190, 200)),
    ]


def test_without_the_cluster_a_live_replica_is_read_up_to_its_low_water_mark(spark: Any, live: Live) -> None:
    # A new store session (the server restarts) sets every replica's low-water mark to the
    # high-water mark at its start; what is written after is beyond it.
    live.cluster.kill("server-0")
    live.cluster.start_member("server-0")
    live.cluster.wait_served()
    live.cluster.wait_replicas()
    before = live.written()
    live.write("after-restart", 20)
    with Storage.open(live.storage_dir(1), read_only=True) as s:
        lwm = {p: s.partition_info(p).low_water_mark for p in (0, 1)}
    assert lwm == {p: rows[-1][0] for p, rows in before.items()}
    got = by_partition(spark.read.format("waltz").load(str(live.storage_dir(1))))
    assert got == before


def test_committed_only_excludes_an_uncommitted_tail(spark: Any, tmp_path: pathlib.Path) -> None:
    d = str(planted(tmp_path))
    assert spark.read.format("waltz").load(d).groupBy("partition").count().orderBy("partition").collect() == [
        (0, 80),
        (1, 80),
    ]
    everything = spark.read.format("waltz").option("committedOnly", "false").load(d)
    assert everything.groupBy("partition").count().orderBy("partition").collect() == [(0, 100), (1, 100)]


def test_offsets_partitions_and_splits(spark: Any, tmp_path: pathlib.Path) -> None:
    d = str(planted(tmp_path, 100, 99))

    def ids(**options: str) -> list[tuple[int, int]]:
        df = spark.read.format("waltz").options(**options).load(d)
        return [
            (r.partition, r.transaction_id)
            for r in df.select("partition", "transaction_id").orderBy("partition", "transaction_id").collect()
        ]

    assert ids(startingOffsets='{"0": 10}', endingOffsets='{"0": 20, "1": -1}') == [
        *((0, t) for t in range(10, 20)),
        *((1, t) for t in range(100)),
    ]
    assert ids(startingOffsets='{"0": -2, "1": 98}', endingOffsets="latest") == [
        *((0, t) for t in range(100)),
        (1, 98),
        (1, 99),
    ]
    assert ids(startingOffsets="latest") == []
    assert ids(startingOffsets='{"1": 500}') == [(0, t) for t in range(100)]  # past the end: nothing, not an error
    assert ids(partitions="1", endingOffsets='{"1": 3}') == [(1, 0), (1, 1), (1, 2)]
    split = spark.read.format("waltz").option("minPartitions", "8").load(d)
    assert split.rdd.getNumPartitions() == 8
    assert split.count() == 200 and split.select("partition", "transaction_id").distinct().count() == 200
    # Batches of one transaction each (the smallest a batch can be) read the same rows.
    assert ids(maxBytesPerBatch="1") == ids()


def test_a_corrupt_record_fails_the_task_naming_file_and_offset(spark: Any, tmp_path: pathlib.Path) -> None:
    d = planted(tmp_path, 100, 99)
    segment = d / "0" / "0000000000000000000.seg"
    raw = bytearray(segment.read_bytes())
    at = len(raw) // 2
    raw[at] ^= 0xFF
    segment.write_bytes(bytes(raw))
    with pytest.raises(Exception) as e:
        spark.read.format("waltz").load(str(d)).collect()
    assert str(segment) in str(e.value) and "offset" in str(e.value), str(e.value)[-2000:]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"startingOffsets": "{oops"}, "expected earliest, latest or JSON"),
        ({"endingOffsets": '{"0": "x"}'}, "must be a transaction id"),
        ({"colour": "blue"}, "unknown option 'colour'"),
        # Spark hands a source its option names in lower case: the nearest valid one is spelt right.
        (
            {"maxOffsetsPerTrigger": "5"},
            "unknown option 'maxoffsetspertrigger' (did you mean 'maxTransactionsPerTrigger'?)",
        ),
        ({"partitions": "7"}, "no directory in path holds partition 7"),
        ({"committedOnly": "maybe"}, "expected true or false"),
        ({"metadata": "http://x"}, "expected a metadata URL"),
    ],
)
def test_bad_options_are_clear_errors(
    spark: Any, tmp_path: pathlib.Path, options: dict[str, str], message: str
) -> None:
    d = str(planted(tmp_path))
    with pytest.raises(Exception) as e:
        spark.read.format("waltz").options(**options).load(d).collect()
    assert message in str(e.value), str(e.value)[-2000:]


def test_a_directory_that_is_not_storage_is_a_clear_error(spark: Any, tmp_path: pathlib.Path) -> None:
    with pytest.raises(Exception) as e:
        spark.read.format("waltz").load(str(tmp_path)).collect()
    assert "is not a readable Waltz storage directory" in str(e.value), str(e.value)[-2000:]


def test_committed_only_with_the_cluster_excludes_a_tail_planted_in_a_stopped_replica(spark: Any, live: Live) -> None:
    """Last in this module: it leaves storage-2 stopped with a dirty tail."""
    settled(live, 2)
    live.cluster.kill("storage-2", signal.SIGTERM)
    deadline = time.monotonic() + 30
    while live.cluster.pid("storage-2") is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    written = live.written()
    with Storage.open(live.storage_dir(2)) as s:
        for p in (0, 1):
            part = s.partition(p)
            nxt = part.max_transaction_id + 1
            part.append(nxt, [((9, 9, p, i), 0, b'{"id":"planted"}') for i in range(5)])
    reader = spark.read.format("waltz").option("metadata", live.url).option("cluster", live.cluster.cluster)
    assert by_partition(reader.load(str(live.storage_dir(2)))) == written
    everything = by_partition(reader.option("committedOnly", "false").load(str(live.storage_dir(2))))
    assert {p: rows[-5:] for p, rows in everything.items()} == {
        p: [(written[p][-1][0] + i, {"id": "planted"}) for i in range(1, 6)] for p in (0, 1)
    }


def test_a_range_the_files_no_longer_hold_fails_instead_of_coming_back_short(tmp_path: pathlib.Path) -> None:
    """Planned up to id 149 (say, before a directory was replaced), but the files end at 99."""
    from waltz import errors
    from waltz.spark.options import Options
    from waltz.spark.source import RangePartition, _read_range

    d = planted(tmp_path, 100, 99)
    opts = Options.parse({"path": str(d)})
    assert sum(b.num_rows for b in _read_range(opts, RangePartition(0, 20, 100, str(d)))) == 80
    with pytest.raises(errors.CorruptionError, match="ends at transaction 99, but the plan covers up to 149"):
        list(_read_range(opts, RangePartition(0, 20, 150, str(d))))


ONE_CLUSTER = uuid.UUID(int=9)  # directories of one cluster: two clusters' are refused together


def directory(path: pathlib.Path, n: int, low_water_mark: int, *, drop_before: int | None = None) -> tuple[str, int]:
    """Partition 0 of ONE_CLUSTER holding `n` transactions in small segments, retention dropping
    those before `drop_before`; returns the directory and its first id."""
    with Storage.create(path, ONE_CLUSTER, 1, segment_size=4096) as s:
        s.add_partition(0)
        part = s.partition(0)
        for i in range(0, n, 10):
            part.append(i, [((7, 1, 0, j), j, b'{"n":%d}' % j + b" " * 100) for j in range(i, min(n, i + 10))])
        s.set_low_water_mark(0, 1, low_water_mark)
        if drop_before is not None:
            part.drop_segments_before(drop_before)
        return str(path), part.first_transaction_id


def test_several_directories_are_read_as_their_union_and_lost_ids_fail_the_read(
    spark: Any, tmp_path: pathlib.Path
) -> None:
    dropped, first = directory(tmp_path / "a", 300, 299, drop_before=150)  # retention dropped 0..first-1
    older, _ = directory(tmp_path / "b", 201, 200)  # a copy from before
    assert 0 < first <= 150

    def ids(path: str, **options: str) -> list[int]:
        df = spark.read.format("waltz").options(minPartitions="3", **options).load(path)
        return [r.transaction_id for r in df.select("transaction_id").orderBy("transaction_id").collect()]

    assert ids(f"{dropped},{older}") == ids(f"{older},{dropped}") == list(range(300))
    with pytest.raises(Exception) as e:
        ids(dropped, startingOffsets='{"0": 0}')
    assert f"transactions 0..{first - 1} of partition 0 are no longer in any directory" in str(e.value), str(e.value)[
        -2000:
    ]
    assert ids(dropped, startingOffsets='{"0": 0}', failOnDataLoss="false") == list(range(first, 300))


def test_an_unreachable_cluster_bounds_a_batch_read_by_low_water_marks(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Planning only (the driver's log is this process's): a stream still needs the cluster."""
    from waltz.spark.options import Options
    from waltz.spark.source import RangePartition, WaltzReader, WaltzStreamReader

    d = str(planted(tmp_path))
    nowhere = f"embedded:{tmp_path}/nowhere/metadata.db"
    opts = Options.parse({"path": d, "metadata": nowhere, "timeout": "2", "minPartitions": "1"})
    with caplog.at_level(logging.INFO, logger="waltz.spark"):
        parts = WaltzReader(opts).partitions()
    assert [(p.partition, p.start, p.end) for p in parts if isinstance(p, RangePartition)] == [(0, 0, 80), (1, 0, 80)]
    assert f"cannot reach the cluster at {nowhere}" in caplog.text and "low-water marks" in caplog.text
    assert f"low-water mark 79: the cluster at {nowhere} was unreachable" in caplog.text
    with pytest.raises(ConnectionError):
        WaltzReader(Options.parse({"metadata": nowhere, "timeout": "2"})).partitions()
    with pytest.raises(ConnectionError):
        WaltzStreamReader(Options.parse({"metadata": nowhere, "timeout": "2"}, streaming=True)).initialOffset()


def test_register_points_at_the_worker_transport_only_when_it_is_tcp(
    spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from waltz.spark import UNIX_SOCKETS, register

    with caplog.at_level(logging.INFO, logger="waltz.spark"):
        register(spark)  # the test session keeps Spark's default transport
    assert [r for r in caplog.records if UNIX_SOCKETS in r.getMessage()]

    class UnixSession:  # what register reads of a session started with the setting on
        class conf:
            @staticmethod
            def get(key: str, default: str) -> str:
                return "true" if key == UNIX_SOCKETS else default

        dataSource = spark.dataSource

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="waltz.spark"):
        register(UnixSession())
    assert not [r for r in caplog.records if UNIX_SOCKETS in r.getMessage()]


# issue 36, item 3: WHERE conditions on partition and transaction_id narrow the scan.
def test_filters_on_partition_and_transaction_id_narrow_the_plan_and_read_the_same_rows(
    spark: Any,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d = str(planted(tmp_path, 100, 99))
    conditions = [
        "partition = 0 AND transaction_id >= 90",
        "partition IN (1) AND transaction_id < 3",
        "transaction_id > 40 AND transaction_id <= 42 AND partition >= 0",
        "transaction_id IN (5, 50, 7)",  # the scan reads 5..50, Spark keeps the three
        "transaction_id = 3 OR header = 99",  # no pushdown: Spark alone
        "header = 7 AND partition < 1",
    ]

    def scan(where: str) -> Any:
        return spark.read.format("waltz").options(minPartitions="1", maxTransactionsPerSplit="10").load(d).where(where)

    def rows(df: Any) -> list[tuple[int, int, int]]:
        return [(r.partition, r.transaction_id, r.header) for r in df.orderBy("partition", "transaction_id").collect()]

    assert spark.conf.get("spark.sql.python.filterPushdown.enabled") == "true"  # register() turned it on
    pushed = {c: (rows(scan(c)), scan(c).rdd.getNumPartitions()) for c in conditions}
    capsys.readouterr()
    scan("partition = 0 AND transaction_id >= 90").explain("formatted")
    explained = capsys.readouterr().out
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
    try:
        unpushed = {c: (rows(scan(c)), scan(c).rdd.getNumPartitions()) for c in conditions}
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    for c in conditions:
        assert pushed[c][0] == unpushed[c][0], c  # the same rows either way
    assert pushed["partition = 0 AND transaction_id >= 90"][0] == [(0, t, t) for t in range(90, 100)]
    assert pushed["transaction_id IN (5, 50, 7)"][0] == [(p, t, t) for p in (0, 1) for t in (5, 7, 50)]
    assert pushed["header = 7 AND partition < 1"][0] == [(0, 7, 7)]
    # Splits of at most 10 ids: 20 without pushdown, one for 90..99 of partition 0 with it.
    assert [unpushed[c][1] for c in conditions] == [20] * len(conditions)
    assert [pushed[c][1] for c in conditions] == [1, 1, 2, 10, 20, 10]
    assert re.search(
        r"PushedFilters: \[.*EqualTo\(partition,0\).*GreaterThanOrEqual\(transaction_id,90\)", explained
    ), explained


def test_earliest_after_a_retention_policy_deleted_the_head_reads_from_the_first_id_held(
    spark: Any, tmp_path: pathlib.Path
) -> None:
    """A real policy (issue 35): the servers hand it to the replicas, which delete their heads
    below their low-water marks; `startingOffsets` earliest then reads exactly the retained
    range, and a start below it fails naming what is gone."""
    import time

    from support.client_app import MemoryApp, Write
    from waltz.client import WaltzClient
    from waltz.client.log_reader import LogReader
    from waltz.cluster import retention
    from waltz.local import LocalCluster

    cluster = LocalCluster.create(
        tmp_path / "c",
        partitions=1,
        storage_nodes=3,
        servers=1,
        storage_keys={"segment_size": 4096},
        partition_keys={"checkpoint_interval": 50},
    )
    cluster.start()
    try:
        client = WaltzClient(MemoryApp(), cluster.client_config())
        try:
            for i in range(300):  # one at a time: batches small enough for segments to roll often
                assert client.submit(Write(f"w-{i}", partition=0, header=i)).result(timeout=60)
            with cluster.metadata() as meta:
                retention.set_policy(meta, None, max_bytes=4096)
            client.submit(Write("after", partition=0, header=300)).result(timeout=60)  # a new checkpoint
            client.flush()
        finally:
            client.close()

        async def first_held() -> int:
            async with LogReader(cluster.metadata_url, cluster.cluster, timeout=60) as r:
                return await r.first_transaction_id(0)

        deadline, first, last = time.monotonic() + 60, 0, -1
        while first == 0 or first != last:  # deleted, and no longer moving
            assert time.monotonic() < deadline, "the replicas never deleted their heads"
            time.sleep(1.5)
            first, last = asyncio.run(first_held()), first
        df = (
            spark.read.format("waltz")
            .option("metadata", cluster.metadata_url)
            .option("cluster", cluster.cluster)
            .option("startingOffsets", "earliest")
            .load()
        )
        assert [r.transaction_id for r in df.orderBy("transaction_id").collect()] == list(range(first, 301))
        below = (
            spark.read.format("waltz")
            .option("metadata", cluster.metadata_url)
            .option("cluster", cluster.cluster)
            .option("startingOffsets", '{"0": 3}')
            .load()
        )
        with pytest.raises(Exception, match=rf"transactions 3\.\.{first - 1}"):
            below.collect()
    finally:
        cluster.stop()
