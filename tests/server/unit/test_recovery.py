"""The recovery's pure functions: preparation of a replica, the closing high-water-mark vote and
the partition metadata transitions (table-driven, plus an exhaustive check of the vote)."""

from __future__ import annotations

import itertools

import pytest
from waltz.cluster.metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.server.recovery import (
    Preparation,
    ReplicaReport,
    after_catch_up,
    after_recovery,
    electorate,
    last_session,
    prepare,
    vote,
)

L = 5  # the last session


def clean(top: int, lwm: int = -1) -> Preparation:
    """A replica clean in the last session (consistent, unresolved) holding up to `top`."""
    return prepare(ReplicaState(L, UNRESOLVED), ReplicaReport(L, lwm, top), L)


def voted(maxes: dict[str, int | None], *, electors: list[str] | None = None) -> int | None:
    """`None` in `maxes`: unreachable."""
    prepared = {a: clean(m) for a, m in maxes.items() if m is not None}
    return vote(electors or list(maxes), prepared).closing


# -- the vote -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("maxes", "closing"),
    [
        ({"a": 10, "b": 10, "c": 10}, 10),  # every replica votes, all equal
        ({"a": 130, "b": 120, "c": 110}, 120),  # every replica votes: the highest with a majority
        ({"a": 120, "b": 120, "c": 130, "d": 105, "e": 105}, 120),  # a dirty tail above the quorum
        ({"a": 50, "b": 50, "c": None}, 50),  # only a quorum votes, and agrees
        ({"a": 120, "b": 120, "c": 120, "d": None, "e": None}, 120),  # 5: a quorum at the top
        ({"a": 130, "b": None, "c": 110}, None),  # the spec's example: B unreachable, undecidable
        ({"a": 130, "b": 120, "c": 110}, 120),  # ... decided once B is back
        ({"a": 130, "b": None, "c": 130}, 130),  # ... or once C caught up with A
        ({"a": 120, "b": 120, "c": 130, "d": None, "e": None}, None),  # 5, two unreachable: 130 could have 3
        ({"a": 120, "b": 120, "c": 130, "d": 105, "e": None}, 120),  # one unreachable: 130 cannot reach 3
        ({"a": 130, "b": 130, "c": 130, "d": 105, "e": None}, 130),
        ({"a": 10, "b": None, "c": None}, None),  # fewer than a quorum reachable
        ({"a": -1, "b": -1, "c": -1}, -1),  # a new partition
        ({"a": -1, "b": -1, "c": None}, -1),
    ],
)
def test_vote_table(maxes: dict[str, int | None], closing: int | None) -> None:
    assert voted(maxes) == closing


def test_replicas_outside_the_electorate_do_not_vote() -> None:
    # Added replica d (empty) cannot make up the majority of the last session's write set.
    prepared = {"a": clean(10), "d": clean(10)}
    assert vote(["a", "b", "c"], prepared).closing is None
    prepared["b"] = clean(8)
    assert vote(["a", "b", "c"], prepared).closing is None  # 10 may be on a and c
    prepared["c"] = clean(8)
    assert vote(["a", "b", "c"], prepared).closing == 8


def test_a_removed_replica_still_votes_on_the_session_it_was_in() -> None:
    meta = PartitionMetadata(1, 6, {a: ReplicaState(L) for a in "abc"}, members=("a", "b", "c"))
    assert electorate(meta, ["a", "b"]) == ["a", "b", "c"]
    assert electorate(PartitionMetadata(), ["b", "a"]) == ["a", "b"]  # before any session: the assignment
    assert vote(electorate(meta, ["a", "b"]), {"a": clean(10), "b": clean(8)}).closing is None


def test_the_highest_low_water_mark_is_a_floor() -> None:
    # All inconsistent (truncated to their low-water marks): the highest low-water mark is committed.
    prepared = {a: prepare(None, ReplicaReport(3, lwm, lwm + 20), L) for a, lwm in (("a", 50), ("b", 40), ("c", 40))}
    assert [p.high_water_mark for p in prepared.values()] == [50, 40, 40]
    assert vote("abc", prepared).closing == 50


def exhaustive(n: int, values: range) -> None:
    """Every combination of holdings and reachability of `n` replicas all clean in the last
    session: the vote is None or at least the highest id a majority holds (what may have been
    committed), never above what a majority reachable holds, and decided when all are reachable."""
    q = n // 2 + 1
    names = [chr(97 + i) for i in range(n)]
    for holdings in itertools.product(values, repeat=n):
        may_be_committed = sorted(holdings, reverse=True)[q - 1]
        for reachable in itertools.product((True, False), repeat=n):
            prepared = {a: clean(h, lwm=-1) for a, h, up in zip(names, holdings, reachable) if up}
            got = vote(names, prepared).closing
            if all(reachable):
                assert got == may_be_committed, (holdings, reachable)
            if got is not None:
                assert got >= may_be_committed, (holdings, reachable, got)
                assert sum(1 for p in prepared.values() if p.high_water_mark >= got) >= q or got == -1, (
                    holdings,
                    reachable,
                    got,
                )


def test_vote_exhaustively_3_replicas() -> None:
    exhaustive(3, range(-1, 6))


def test_vote_exhaustively_5_replicas() -> None:
    exhaustive(5, range(-1, 4))


# -- replicas that lost their files -------------------------------------------------------------
def wiped(lwm: int = -1, top: int | None = None) -> Preparation:
    """Clean in the last session by the metadata; its storage was replaced (no session info), or
    refilled by recover-partition up to `lwm` (its own session id kept)."""
    return prepare(ReplicaState(L, UNRESOLVED), ReplicaReport(-1, lwm, lwm if top is None else top), L)


def test_a_replica_that_lost_its_files_is_known_by_its_older_storage_session() -> None:
    p = wiped()
    assert p.forgot and p.proposal is None and p.high_water_mark == -1 and "lost" in p.why
    assert wiped(lwm=40, top=60).truncate_to == 40
    # Not the same: restored from a backup of the same session, closed, stale, new, or ahead.
    assert not prepare(ReplicaState(L), ReplicaReport(L, 0, 10), L).forgot
    assert not prepare(ReplicaState(3, 50), ReplicaReport(1, 0, 10), L).forgot
    assert not prepare(ReplicaState(3), ReplicaReport(1, 0, 10), L).forgot
    assert not prepare(None, ReplicaReport(-1, -1, -1), L).forgot
    assert not prepare(ReplicaState(L), ReplicaReport(6, 100, 150), L).forgot


def test_the_torture_run_that_lost_200_transactions() -> None:
    """`waltz torture --duration 30m --seed 7`: storage-1 lost its files and was refilled up to a
    lagging storage-0's low-water mark; storage-2 alone held 43136..43335, acknowledged by
    storage-1 and storage-2. Counting storage-1 as holding only what it has decided 43135."""
    prepared = {"s0": clean(43135, lwm=40000), "s1": wiped(lwm=40000), "s2": clean(43335, lwm=40000)}
    assert vote(["s0", "s1", "s2"], prepared).closing == 43335
    # Storage-2 unreachable: what it holds may have had storage-1's vote; wait for it.
    del prepared["s2"]
    out = vote(["s0", "s1", "s2"], prepared)
    assert out.closing is None and "lost their files" in out.why


def test_a_majority_that_lost_its_files_is_never_decided() -> None:
    out = vote("abc", {"a": wiped(), "b": wiped(), "c": clean(10)})
    assert out.closing is None and "cannot be known" in out.why


def exhaustive_with_lost_files(n: int, values: range) -> None:
    """Every holding, reachability and loss of files (fewer than a majority lost, or no decision
    is possible): the vote is None or at least what may have been committed (with the copies
    since lost), and never above what a reachable replica that kept its files holds."""
    q = n // 2 + 1
    names = [chr(97 + i) for i in range(n)]
    for holdings in itertools.product(values, repeat=n):
        may_be_committed = sorted(holdings, reverse=True)[q - 1]
        for fate in itertools.product(("up", "down", "wiped"), repeat=n):
            prepared = {a: clean(h) if f == "up" else wiped() for a, h, f in zip(names, holdings, fate) if f != "down"}
            got = vote(names, prepared).closing
            lost = fate.count("wiped")
            if "down" not in fate and lost < q:
                assert got is not None, (holdings, fate)
            if got is not None:
                assert lost < q, (holdings, fate, got)
                assert got >= may_be_committed, (holdings, fate, got)
                kept = [h for h, f in zip(holdings, fate) if f == "up"]
                assert got <= max(kept, default=-1), (holdings, fate, got)


def test_vote_exhaustively_with_lost_files_3_replicas() -> None:
    exhaustive_with_lost_files(3, range(-1, 5))


def test_vote_exhaustively_with_lost_files_5_replicas() -> None:
    exhaustive_with_lost_files(5, range(-1, 3))


# -- preparing a replica -------------------------------------------------------------------------
def test_consistent_and_unresolved_proposes_its_max() -> None:
    p = prepare(ReplicaState(L), ReplicaReport(L, 100, 150), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (None, 150, 150)
    p = prepare(ReplicaState(L), ReplicaReport(L, 100, 100), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (None, None, 100)  # nothing above its low-water mark


def test_inconsistent_sessions_truncate_to_the_storage_low_water_mark() -> None:
    # Made clean by a session (6) whose metadata update never happened: an interrupted update.
    p = prepare(ReplicaState(L), ReplicaReport(6, 100, 150), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (100, None, 100)
    # Restored from an older backup (storage says 3, metadata 5).
    p = prepare(ReplicaState(L), ReplicaReport(3, 40, 90), L)
    assert (p.truncate_to, p.high_water_mark) == (40, 40)
    # New replica: no state.
    p = prepare(None, ReplicaReport(-1, -1, -1), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (None, None, -1)
    # An unresolved state older than the last session (no correct update leaves one).
    p = prepare(ReplicaState(3), ReplicaReport(3, 40, 90), L)
    assert (p.truncate_to, p.proposal) == (40, None) and "stale" in p.why


def test_a_set_closing_mark_truncates_the_dirty_tail() -> None:
    p = prepare(ReplicaState(3, 120), ReplicaReport(3, 80, 130), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (120, None, 120)
    p = prepare(ReplicaState(3, 120), ReplicaReport(3, 80, 110), L)  # behind its session's close
    assert (p.truncate_to, p.high_water_mark) == (None, 110)


def test_a_closed_session_never_truncates_below_the_low_water_mark() -> None:
    """`waltz torture --seed 62`: a replica moved away (its files kept, its state closed at 12534
    in session 6) and moved back, refilled by recover-partition up to 44014 under its own session
    id. Truncating it to 12534 would remove committed records (the node refuses), so it stayed
    out of every session."""
    p = prepare(ReplicaState(6, 12534), ReplicaReport(6, 44014, 44014), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (None, None, 44014)
    p = prepare(ReplicaState(6, 12534), ReplicaReport(6, 44014, 44100), L)
    assert (p.truncate_to, p.proposal, p.high_water_mark) == (44014, None, 44014) and "refilled" in p.why


def test_recovery_after_a_failed_recovery() -> None:
    # Session 6 decided 120 and set it as b's low-water mark, then died before its metadata update.
    states = {"a": ReplicaState(L), "b": ReplicaState(L), "c": ReplicaState(L)}
    reports = {"a": ReplicaReport(L, 0, 130), "b": ReplicaReport(6, 120, 130), "c": ReplicaReport(L, 0, 120)}
    prepared = {a: prepare(states[a], reports[a], L) for a in "abc"}
    assert prepared["b"].truncate_to == 120
    assert vote("abc", prepared).closing == 120
    del prepared["c"]
    assert vote("abc", prepared).closing is None  # 130 may be on a and c


# -- metadata transitions --------------------------------------------------------------------------
def test_after_recovery_follows_the_spec_rules() -> None:
    meta = PartitionMetadata(
        2,
        7,
        {
            "a": ReplicaState(L),
            "b": ReplicaState(L),
            "c": ReplicaState(L),
            "d": ReplicaState(3, 100),
            "e": ReplicaState(2),
        },
        members=("a", "b", "c"),
    )
    after = after_recovery(meta, 7, 120, ["a", "b", "f"], ["a", "b", "c", "f"])
    assert after.replicas == {
        "a": ReplicaState(7),  # clean: the new session, unresolved
        "b": ReplicaState(7),
        "f": ReplicaState(7),  # added, filled during the recovery
        "c": ReplicaState(L, 120),  # in the last session, not clean now: its closing mark
        "d": ReplicaState(3, 100),  # already resolved: unchanged
        # e (unresolved in an older session) is dropped: its next recovery truncates it to its low-water mark
    }
    assert after.members == ("a", "b", "c", "f") and after.generation == 2 and after.session_id == 7
    assert after_recovery(after, 7, 120, ["a", "b", "f"], ["a", "b", "c", "f"]) == after  # idempotent
    assert last_session(after) == 7
    caught = after_catch_up(after, 7, "c")
    assert caught.replicas["c"] == ReplicaState(7) and after_catch_up(caught, 7, "c") == caught


def test_an_interrupted_update_is_repaired_by_the_next_session() -> None:
    # Session 6 took its id, set b's low-water mark, and died before its metadata update; session 7
    # recovers from the same states and its update resolves session 5 for the replicas not clean.
    meta = PartitionMetadata(1, 6, {a: ReplicaState(L) for a in "abc"}, members=("a", "b", "c"))
    after = after_recovery(meta, 7, 120, ["a", "b"], ["a", "b", "c"])
    assert after.replicas == {"a": ReplicaState(7), "b": ReplicaState(7), "c": ReplicaState(L, 120)}


def test_metadata_round_trips_with_members() -> None:
    meta = PartitionMetadata(1, 6, {"a": ReplicaState(5, 3)}, members=("a", "b"))
    assert PartitionMetadata.from_json(meta.to_json()) == meta
    legacy = meta.to_json()
    del legacy["members"]
    assert PartitionMetadata.from_json(legacy).members == ()


def test_reads_fall_back_only_to_replicas_this_session_served() -> None:
    """A replica connected but never in this session's write path (reached after the vote, its
    preparation not done or failed) may hold an older session's dirty tail at ids this session
    committed differently: a read must not fall back to it."""
    from waltz.server.store_session import StoreSession, _Replica

    s = StoreSession.__new__(StoreSession)
    s._replicas = [
        _Replica("never-served", client=object()),
        _Replica("left", client=object(), served=True),
        _Replica("in", client=object(), in_write_path=True, served=True),
        _Replica("gone", served=True),
    ]
    assert [r.address for r in s._readers()] == ["in", "left"]
