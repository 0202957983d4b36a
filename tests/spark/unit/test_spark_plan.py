"""The `waltz` Spark source's planning and options: pure logic, no Spark needed."""

from __future__ import annotations

import logging
import re
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from waltz._native import Storage
from waltz.spark.options import (
    EARLIEST,
    LATEST,
    MAX_BATCH_BYTES,
    DataLossError,
    OffsetSpec,
    OptionError,
    Options,
    parse_offsets,
    resolve,
    select,
)
from waltz.spark.plan import Pushed, Range, Replica, bound, bounds, capped, ranges, split, survey


def replica(path: str, last: int, session: int, lwm: int, first: int = 0) -> Replica:
    return Replica(path, 0, first, last, session, lwm)


def test_the_cluster_mark_is_trusted_only_for_replicas_in_the_current_session() -> None:
    current, stale = replica("/a", 120, 5, 90), replica("/b", 150, 4, 80)
    b = bounds([stale, current], committed_only=True, high_water_mark=100, session=5)[0]
    assert (b.replica.path, b.last) == ("/a", 100) and "high-water mark 100" in b.why
    # The stale replica holds more, but above 80 it may be a dirty tail of session 4.
    b = bound(stale, committed_only=True, high_water_mark=100, session=5)
    assert b.last == 80 and "not in the current session 5" in b.why


def test_without_the_cluster_the_low_water_mark_bounds_and_says_why() -> None:
    b = bound(replica("/a", 120, 5, 90), committed_only=True, high_water_mark=None, session=None)
    assert b.last == 90 and "set option cluster" in b.why
    b = bound(replica("/a", 120, 5, 90), committed_only=True, high_water_mark=None, session=None, unasked="unreachable")
    assert b.last == 90 and b.why.endswith("unreachable")


def test_a_replica_behind_the_mark_is_read_to_its_end_and_the_fullest_comes_first() -> None:
    bs = bounds(
        [replica("/a", 70, 5, 10), replica("/b", 95, 5, 10)], committed_only=True, high_water_mark=100, session=5
    )
    assert [(b.replica.path, b.last) for b in bs] == [("/b", 95), ("/a", 70)]


def test_committed_only_false_reads_everything() -> None:
    assert bound(replica("/a", 120, 4, 90), committed_only=False, high_water_mark=100, session=5).last == 120


def test_ranges_resolve_offsets_as_kafka_does() -> None:
    held = {0: [Range(0, 0, 100, "/a")], 1: [Range(1, 10, 50, None)]}
    assert ranges(held, {0: 5}, {1: 20}) == [Range(0, 5, 100, "/a"), Range(1, 10, 20, None)]
    assert ranges({0: [Range(0, 0, 0)]}, "earliest", "latest") == []
    assert (
        ranges({0: [Range(0, 0, 0, "/new"), Range(0, 150, 150, "/old")]}, "earliest", "latest") == []
    )  # nothing held anywhere
    # start == end is the empty range: at latest, or both at one id.
    assert ranges({0: [Range(0, 0, 10)]}, "latest", "latest") == []
    assert ranges({0: [Range(0, 0, 10)]}, {0: 4}, {0: 4}) == []
    assert ranges({0: [Range(0, 0, 10)]}, {0: 500}, "latest") == []  # past the end: clamped, not an error


@pytest.mark.parametrize(
    ("starting", "ending", "message"),
    [
        ({0: 8}, {0: 3}, "startingOffsets 8 is after endingOffsets 3"),
        ({0: 500}, {0: 300}, "startingOffsets 500 is after endingOffsets 300"),
        ("latest", {0: 5}, r"startingOffsets latest \(10\) is after endingOffsets 5"),
        ({0: 5}, {0: EARLIEST}, r"startingOffsets 5 is after endingOffsets earliest \(0\)"),
    ],
)
def test_a_start_after_the_end_is_an_error(starting: OffsetSpec, ending: OffsetSpec, message: str) -> None:
    with pytest.raises(OptionError, match=f"partition 0: {message}"):
        ranges({0: [Range(0, 0, 10)]}, starting, ending)


@pytest.mark.parametrize("option", ["startingOffsets", "endingOffsets"])
def test_an_offset_for_a_partition_not_read_is_an_error(option: str) -> None:
    offsets: dict[str, tuple[OffsetSpec, OffsetSpec]] = {
        "startingOffsets": ({5: 10}, "latest"),
        "endingOffsets": ("earliest", {1: 3}),
    }
    starting, ending = offsets[option]
    with pytest.raises(OptionError, match=rf"option {option}: partition \d is not among the partitions read \(0\)"):
        ranges({0: [Range(0, 0, 10)]}, starting, ending)


def test_several_directories_are_read_as_their_union_each_id_from_the_fullest_holding_it() -> None:
    # A: retention dropped 0..149; B: an older copy holding 0..200.
    a, b = Range(0, 150, 300, "/a"), Range(0, 0, 201, "/b")
    assert ranges({0: [a, b]}, "earliest", "latest") == [Range(0, 0, 150, "/b"), Range(0, 150, 300, "/a")]
    assert ranges({0: [a, b]}, {0: 160}, "latest") == [Range(0, 160, 300, "/a")]
    assert ranges({0: [a, b]}, "earliest", {0: 100}) == [Range(0, 0, 100, "/b")]
    # Splits are cut where the directory changes, so each is read from one that holds it all.
    parts = split(ranges({0: [a, b]}, "earliest", "latest"), min_splits=2, max_per_split=1000)
    assert all(r.path == "/b" and r.end <= 201 or r.path == "/a" and r.start >= 150 for r in parts)
    assert sorted(t for r in parts for t in range(r.start, r.end)) == list(range(300))


def test_a_gap_between_directories_is_an_error_naming_it_unless_the_offsets_skip_it() -> None:
    held = {0: [Range(0, 250, 300, "/a"), Range(0, 0, 201, "/b")]}
    with pytest.raises(
        OptionError,
        match=r"partition 0: transactions 201..249 are in none of the directories in path "
        r"\(each can serve: /b 0..200; /a 250..299\)",
    ):
        ranges(held, "earliest", "latest")
    assert ranges(held, {0: 250}, "latest") == [Range(0, 250, 300, "/a")]
    assert ranges(held, "earliest", {0: 201}) == [Range(0, 0, 201, "/b")]


def test_with_fail_on_data_loss_false_gaps_between_directories_are_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = {0: [Range(0, 250, 300, "/a"), Range(0, 100, 201, "/b"), Range(0, 0, 50, "/c")]}
    with pytest.raises(DataLossError, match=r"transactions 50..99, 201..249 are in none .* failOnDataLoss=false"):
        ranges(held, "earliest", "latest")
    with caplog.at_level(logging.WARNING, logger="waltz.spark"):
        got = ranges(held, "earliest", "latest", fail_on_data_loss=False)
    assert got == [Range(0, 0, 50, "/c"), Range(0, 100, 201, "/b"), Range(0, 250, 300, "/a")]
    assert "partition 0: transactions 50..99, 201..249 are in none of the directories in path" in caplog.text
    assert "skipping them (failOnDataLoss=false)" in caplog.text


def test_bounds_serve_what_each_directory_holds_committed() -> None:
    dropped = replica("/a", 299, 5, 299, first=150)
    older = replica("/b", 250, 4, 200)  # above 200 a dirty tail of session 4, maybe
    assert [b.serves() for b in bounds([dropped, older], committed_only=True, high_water_mark=299, session=5)] == [
        Range(0, 150, 300, "/a"),
        Range(0, 0, 201, "/b"),
    ]
    assert bound(replica("/e", -1, -1, -1), committed_only=True, high_water_mark=None, session=None).serves() == Range(
        0, 0, 0, "/e"
    )


def test_a_start_below_the_first_id_held_fails_or_with_fail_on_data_loss_false_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = {0: [Range(0, 150, 300, "/a")]}
    with pytest.raises(
        DataLossError,
        match=r"option startingOffsets: transactions 0..149 of partition 0 are no longer in any directory",
    ):
        ranges(held, {0: 0}, "latest")
    with pytest.raises(
        DataLossError, match=r"transactions 10..19 of partition 0 are no longer in the cluster's replicas"
    ):
        select({0: 10}, {0: 20}, 0, 150, 300, fail_on_data_loss=True, holder="the cluster's replicas")
    with caplog.at_level(logging.WARNING, logger="waltz.spark"):
        assert ranges(held, {0: 0}, "latest", fail_on_data_loss=False) == [Range(0, 150, 300, "/a")]
    assert "transactions 0..149 of partition 0 are no longer in any directory: starting at 150" in caplog.text
    # Nothing asked below the first id is lost: earliest, and an empty range.
    assert select("earliest", "latest", 0, 150, 300, fail_on_data_loss=True) == (150, 300)
    assert select({0: 7}, {0: 7}, 0, 150, 300, fail_on_data_loss=True) == (150, 150)


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
    assert len(split([Range(0, 0, 10)], min_splits=6, max_per_split=1000)) == 6
    assert len(split([Range(0, 5, 33)], min_splits=9, max_per_split=24)) == 9


ranges_to_split = st.lists(
    st.builds(
        lambda p, s, n, path: Range(p, s, s + n, path),
        st.integers(0, 3),
        st.integers(0, 50),
        st.integers(0, 60),
        st.sampled_from([None, "/a"]),
    ),
    max_size=5,
)


@given(ranges_to_split, st.integers(1, 40), st.integers(1, 40))
def test_split_honours_min_splits_and_max_per_split_and_covers_each_id_once(
    parts: list[Range], min_splits: int, max_per_split: int
) -> None:
    def ids(rs: list[Range]) -> list[tuple[int, str, int]]:
        return sorted((r.partition, r.path or "", t) for r in rs for t in range(r.start, r.end))

    out = split(parts, min_splits=min_splits, max_per_split=max_per_split)
    assert ids(out) == ids(parts)
    assert len(out) >= min(min_splits, len(ids(parts)))
    assert all(1 <= len(r) <= max_per_split for r in out)


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
        ({"path": "/x", "metadata": "embedded:/m", "zookeeper": "h:1"}, "give only one of"),
        ({"path": "/x", "tlsCa": "ca.pem"}, "needs all of tlsCa"),
        ({"path": "/x", "minPartitions": "0"}, "expected a positive integer"),
        ({"path": "/x", "maxBytesPerBatch": "1M"}, "maxBytesPerBatch='1M': expected a positive integer"),
        (
            {"path": "/x", "maxBytesPerBatch": str(3 << 30)},
            "maxBytesPerBatch='3221225472': at most 2147483647 (Arrow's 32-bit offsets)",
        ),
        ({"path": "/x", "failOnDataLoss": "sometimes"}, "failOnDataLoss='sometimes': expected true or false"),
        ({"path": "/x", "partitions": "a,b"}, "comma-separated"),
        ({"path": "/x", "startingOffsets": "[1]"}, "must be an object"),
        ({"path": "/x", "startingOffsets": '{"0": -3}'}, "must be a transaction id"),
    ],
)
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(OptionError, match=re.escape(message)):
        Options.parse(options)


def test_stream_options() -> None:
    o = Options.parse({"zookeeper": "127.0.0.1:2181/waltz", "maxTransactionsPerTrigger": "5"}, streaming=True)
    assert (o.metadata, o.max_per_trigger, o.starting) == ("zk://127.0.0.1:2181/waltz", 5, "latest")
    with pytest.raises(OptionError, match="need a live cluster"):
        Options.parse({"path": "/x"}, streaming=True)
    with pytest.raises(OptionError, match="batch reads only"):
        Options.parse({"metadata": "embedded:/m", "endingOffsets": "latest"}, streaming=True)
    with pytest.raises(OptionError, match="option path='/x' applies to batch reads only"):
        Options.parse({"metadata": "embedded:/m", "path": "/x"}, streaming=True)
    assert Options.parse({"paths": '["/a", "/b"]'}).paths == ("/a", "/b")
    assert Options.parse({"path": "/x", "maxBytesPerBatch": str(MAX_BATCH_BYTES)}).batch_bytes == MAX_BATCH_BYTES
    assert (
        Options.parse({"path": "/x"}).fail_on_data_loss
        and not Options.parse({"path": "/x", "failOnDataLoss": "false"}).fail_on_data_loss
    )
    assert parse_offsets("x", '{"3": -2}') == {3: EARLIEST}


def test_a_damaged_record_below_the_directorys_durable_mark_fails_the_survey(tmp_path) -> None:
    """A bit flip in the last record: the read-only open takes it for a torn tail and stops before
    it, and the read returned one row fewer without a word, though the directory had vouched for
    it (its local low-water mark)."""
    d = tmp_path / "d"
    with Storage.create(d, uuid.UUID(int=7), 1) as s:
        s.add_partition(0)
        s.partition(0).append(0, [((7, 1, 0, j), j, b"x" * 100) for j in range(10)])
        s.set_low_water_mark(0, 1, 9)
    assert [r.last for r in survey([str(d)])[0]] == [9]
    seg = d / "0" / "0000000000000000000.seg"
    raw = bytearray(seg.read_bytes())
    raw[max(i for i, b in enumerate(raw) if b) - 5] ^= 0xFF  # inside the last record's data
    seg.write_bytes(bytes(raw))
    with pytest.raises(OptionError, match="only up to 8, below 9"):
        survey([str(d)])


def test_directories_of_two_clusters_are_refused_even_without_the_clusters_key(tmp_path) -> None:
    """With the cluster unreachable there is no key to check against; a union of two clusters'
    logs of one partition would still pass for one log."""
    for name, key in (("a", 7), ("b", 7), ("c", 8)):
        with Storage.create(tmp_path / name, uuid.UUID(int=key), 1) as s:
            s.add_partition(0)
            s.partition(0).append(0, [((7, 1, 0, 0), 0, b"x")])
    assert len(survey([str(tmp_path / "a"), str(tmp_path / "b")])[0]) == 2
    with pytest.raises(OptionError, match=rf"path {tmp_path / 'c'} belongs to another cluster than {tmp_path / 'a'}"):
        survey([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")])


# issue 36, item 3: filters on partition and transaction_id narrow the plan.
def test_pushed_filters_narrow_the_ranges_planned_and_say_what_spark_must_still_apply() -> None:
    held = {p: [Range(p, 0, 5000)] for p in range(4)}
    pushed, exact = Pushed().add("partition", "=", 0)
    assert exact
    pushed, exact = pushed.add("transaction_id", ">=", 1000)
    assert exact
    assert ranges(held, "earliest", "latest", pushed=pushed) == [Range(0, 1000, 5000)]
    # Conditions AND together; partition ranges and IN sets intersect.
    p2 = Pushed()
    for column, op, value in [
        ("partition", "in", (1, 2, 3)),
        ("partition", "<", 3),
        ("transaction_id", ">", 10),
        ("transaction_id", "<=", 20),
        ("TRANSACTION_ID", "<", 15),
    ]:
        p2, exact = p2.add(column, op, value)
        assert exact
    assert ranges(held, "earliest", "latest", pushed=p2) == [Range(1, 11, 15), Range(2, 11, 15)]
    assert str(p2) == "partition in (1, 2, 3) and partition in [0, 3) and transaction_id in [11, 15)"
    # IN over ids narrows to its hull but Spark must still drop the ids between.
    p3, exact = Pushed().add("transaction_id", "in", (7, 3, 40))
    assert not exact and (p3.low, p3.high) == (3, 41)
    assert Pushed().add("transaction_id", "in", (7,))[1]
    # Anything else goes back to Spark unchanged: other columns, nulls, non-integers, booleans.
    for column, op, value in [
        ("header", "=", 1),
        ("partition", "=", None),
        ("transaction_id", ">", 1.5),
        ("partition", "=", True),
        ("partition", "in", ()),
    ]:
        same, exact = Pushed().add(column, op, value)
        assert not exact and same == Pushed()
    # Contradictions and ranges past the data plan nothing, without an error.
    none, _ = Pushed().add("transaction_id", "<", 0)
    assert ranges(held, "earliest", "latest", pushed=none) == []
    past, _ = Pushed().add("transaction_id", "=", 9999)
    assert ranges(held, "earliest", "latest", pushed=past) == []
    # Offsets and filters both apply: the intersection is read.
    pushed, _ = Pushed().add("transaction_id", "<", 100)
    assert ranges(held, {0: 50}, "latest", pushed=pushed)[0] == Range(0, 50, 100)


def test_ids_a_filter_excludes_may_be_missing_from_every_directory() -> None:
    held = {0: [Range(0, 0, 100, "/a"), Range(0, 200, 300, "/b")]}
    with pytest.raises(DataLossError):
        ranges(held, "earliest", "latest")
    pushed, _ = Pushed().add("transaction_id", ">=", 200)
    assert ranges(held, "earliest", "latest", pushed=pushed) == [Range(0, 200, 300, "/b")]


# issue 36, item 5: one meaning of `cluster` everywhere, old spellings warned about.
def test_metadata_is_the_url_and_cluster_the_name_as_in_client_config() -> None:
    o = Options.parse({"metadata": "embedded:/m", "cluster": "payments"}, streaming=True)
    assert (o.metadata, o.cluster) == ("embedded:/m", "payments")
    assert Options.parse({"path": "/x", "cluster": "payments"}).cluster == "payments"
    assert Options.parse({"zookeeper": "h:1/w"}, streaming=True).cluster == "default"


def test_the_old_spellings_still_work_with_a_deprecation_warning(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.warns(DeprecationWarning) as w:
        o = Options.parse({"cluster": "zk://h:1/w", "clusterName": "payments"}, streaming=True)
    assert (o.metadata, o.cluster) == ("zk://h:1/w", "payments")
    assert [str(m.message).split(":")[0] for m in w] == [
        "option cluster as the metadata URL is deprecated",
        "option clusterName is deprecated",
    ]
    assert "deprecated" in caplog.text  # Spark's workers do not show warnings: the driver's log does
    with pytest.raises(OptionError, match="give only one of cluster and"):
        Options.parse({"path": "/x", "cluster": "a", "clusterName": "b"})
    with pytest.raises(OptionError, match="cluster is the cluster's name"):
        Options.parse({"metadata": "embedded:/m", "cluster": "embedded:/n"}, streaming=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"path": "/x", "maxOffsetsPerTrigger": "5"},
            "unknown option 'maxOffsetsPerTrigger' (did you mean 'maxTransactionsPerTrigger'?)",
        ),
        (
            {"path": "/x", "startingoffset": "earliest"},
            "unknown option 'startingoffset' (did you mean 'startingOffsets'?)",
        ),
        (
            {"path": "/x", "kafka.bootstrap.servers": "h:1"},
            "unknown option 'kafka.bootstrap.servers' (did you mean 'metadata'?)",
        ),
        (
            {"path": "/x", "Frobnicate": "1"},
            "unknown option 'Frobnicate' of the waltz source; it takes path, paths, metadata",
        ),
    ],
)
def test_an_unknown_option_is_echoed_as_given_with_the_nearest_name(options: dict[str, str], message: str) -> None:
    with pytest.raises(OptionError) as e:
        Options.parse(options)
    assert message in str(e.value)


def test_a_write_names_the_nearest_write_option() -> None:
    pytest.importorskip("pyspark")
    from waltz.spark.sink import write_options

    with pytest.raises(OptionError, match=re.escape("unknown option 'metdata' (did you mean 'metadata'?)")):
        write_options({"metdata": "embedded:/m"})
    with pytest.raises(OptionError, match="option\\(s\\) startingOffsets do not apply to writes"):
        write_options({"metadata": "embedded:/m", "startingoffsets": "earliest"})
    assert write_options({"metadata": "embedded:/m", "cluster": "c"}).cluster == "c"
