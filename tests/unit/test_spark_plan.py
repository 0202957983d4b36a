"""The `waltz` Spark source's planning and options: pure logic, no Spark needed."""

from __future__ import annotations

import pytest

from waltz.spark.options import EARLIEST, LATEST, OptionError, Options, parse_offsets, resolve
from waltz.spark.plan import Range, Replica, bound, capped, ranges, split


def replica(path: str, last: int, session: int, lwm: int) -> Replica:
    return Replica(path, 0, 0, last, session, lwm)


def test_the_cluster_mark_is_trusted_only_for_replicas_in_the_current_session() -> None:
    current, stale = replica("/a", 120, 5, 90), replica("/b", 150, 4, 80)
    b = bound([stale, current], committed_only=True, high_water_mark=100, session=5)
    assert (b.replica.path, b.last) == ("/a", 100) and "high-water mark 100" in b.why
    # The stale replica holds more, but above 80 it may be a dirty tail of session 4.
    b = bound([stale], committed_only=True, high_water_mark=100, session=5)
    assert b.last == 80 and "not in the current session 5" in b.why


def test_without_the_cluster_the_low_water_mark_bounds_and_says_why() -> None:
    b = bound([replica("/a", 120, 5, 90)], committed_only=True, high_water_mark=None, session=None)
    assert b.last == 90 and "set option cluster" in b.why


def test_a_replica_behind_the_mark_is_read_to_its_end_and_the_fullest_wins() -> None:
    b = bound([replica("/a", 70, 5, 10), replica("/b", 95, 5, 10)], committed_only=True, high_water_mark=100, session=5)
    assert (b.replica.path, b.last) == ("/b", 95)


def test_committed_only_false_reads_everything() -> None:
    assert bound([replica("/a", 120, 4, 90)], committed_only=False, high_water_mark=100, session=5).last == 120


def test_ranges_resolve_offsets_as_kafka_does() -> None:
    rs = ranges({0: 0, 1: 10}, {0: 99, 1: 49}, {0: 5}, {1: 20}, {0: "/a", 1: None})
    assert rs == [Range(0, 5, 100, "/a"), Range(1, 10, 20, None)]
    assert [len(r) for r in ranges({0: 0}, {0: -1}, "earliest", "latest", {0: None})] == [0]
    assert ranges({0: 0}, {0: 9}, {0: 8}, {0: 3}, {0: None}) == [Range(0, 8, 8, None)]  # end before start: empty


def test_resolve_clamps_and_fills_missing_partitions() -> None:
    assert resolve({0: EARLIEST}, 0, 3, 10, missing=LATEST) == 3
    assert resolve({0: LATEST}, 0, 3, 10, missing=EARLIEST) == 10
    assert resolve({0: 1}, 0, 3, 10, missing=LATEST) == 3
    assert resolve({0: 99}, 0, 3, 10, missing=LATEST) == 10
    assert resolve({}, 1, 3, 10, missing=EARLIEST) == 3


def test_split_keeps_every_core_busy_and_covers_each_id_once() -> None:
    parts = split([Range(0, 0, 1000), Range(1, 0, 10), Range(2, 5, 5)], min_splits=8, max_per_split=10_000)
    assert len(parts) >= 8
    covered = sorted((r.partition, t) for r in parts for t in range(r.start, r.end))
    assert covered == [(0, t) for t in range(1000)] + [(1, t) for t in range(10)]
    assert all(len(r) <= 10 for r in split([Range(0, 0, 95)], min_splits=1, max_per_split=10))
    assert split([Range(0, 4, 4)], min_splits=4, max_per_split=10) == []


def test_capped_shares_the_budget_by_backlog() -> None:
    assert capped({"0": 0, "1": 0}, {"0": 100, "1": 10}, None) == {"0": 100, "1": 10}
    got = capped({"0": 0, "1": 0}, {"0": 100, "1": 10}, 22)
    assert sum(got.values()) == 22 and got["1"] >= 2
    assert capped({"0": 50}, {"0": 50}, 5) == {"0": 50}
    assert capped({}, {"0": 7}, 100) == {"0": 7}  # a partition missing from the start begins at its latest
    assert capped({"0": 5, "1": 9}, {"0": 8, "1": 9}, 2) == {"0": 7, "1": 9}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "set path"),
        ({"path": "/x", "cluster": "embedded:/m", "zookeeper": "h:1"}, "give only one of"),
        ({"path": "/x", "tlsCa": "ca.pem"}, "needs all of tlsCa"),
        ({"path": "/x", "minPartitions": "0"}, "expected a positive integer"),
        ({"path": "/x", "maxBytesPerBatch": "1M"}, "maxBytesPerBatch='1M': expected a positive integer"),
        ({"path": "/x", "partitions": "a,b"}, "comma-separated"),
        ({"path": "/x", "startingOffsets": "[1]"}, "must be an object"),
        ({"path": "/x", "startingOffsets": '{"0": -3}'}, "must be a transaction id"),
    ],
)
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(OptionError, match=message.replace("(", r"\(")):
        Options.parse(options)


def test_stream_options() -> None:
    o = Options.parse({"zookeeper": "127.0.0.1:2181/waltz", "maxTransactionsPerTrigger": "5"}, streaming=True)
    assert (o.metadata, o.max_per_trigger, o.starting) == ("zk://127.0.0.1:2181/waltz", 5, "latest")
    with pytest.raises(OptionError, match="need a live cluster"):
        Options.parse({"path": "/x"}, streaming=True)
    with pytest.raises(OptionError, match="batch reads only"):
        Options.parse({"cluster": "embedded:/m", "endingOffsets": "latest"}, streaming=True)
    assert Options.parse({"paths": '["/a", "/b"]'}).paths == ("/a", "/b")
    assert parse_offsets("x", '{"3": -2}') == {3: EARLIEST}
