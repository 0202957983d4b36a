"""The recovery of a partition when a store session starts: pure functions, no I/O.

`../shared/spec/server-and-recovery.txt` ("Recovery Procedure", "Quorum Checking in the Recovery
Process") in three steps, each a function the store session calls between its I/O:

1. `prepare`: what one reachable replica does before it votes. The metadata's replica state and
   the storage's last session info disagree: truncate to the storage's low-water mark. They agree
   and the closing high-water mark of that session is already set: truncate to it (or to the
   low-water mark if that is higher: never below a low-water mark). Otherwise the replica
   proposes its max transaction id as the closing high-water mark.
2. `vote`: the closing high-water mark of the last session. A replica holding up to X votes for
   every proposal <= X; the mark is the highest proposal with a majority of the electorate;
   undecidable (None) while votes + unreachable electors could still make a higher one a
   majority. Undecidable means wait and vote again when a replica comes, goes or catches up.
3. `after_recovery` / `after_catch_up`: the partition metadata once the new session's clean
   replicas are known (and later, each time a lagging replica becomes clean).

Why this is safe (the invariant the session keeps): a replica acknowledges writes in session S only
after the metadata records it clean in S (state (S, UNRESOLVED)). So every transaction a session
committed is held by a majority of the replicas recorded clean in it, and after `prepare` every
reachable replica holds a prefix of one sequence: the committed log up to the last session's
low-water mark followed by the last session's stream. A replica recorded clean in an older session
M holds M's stream above M's low-water mark, dirty above M's closing mark, so `after_recovery`
sets its closing mark (never to a later session's mark).

The electorate is the write set of the last session that recorded clean replicas (`members` in
the partition metadata): its majority is the one that committed. Replicas outside it (just
added) do not vote; their low-water marks still count, as every low-water mark is committed.

A replica that lost its files (a replaced disk, files deleted and the partition added again)
breaks that invariant: recorded clean in the last session, it may have acknowledged anything of
that session and holds none of it. Its storage betrays it: a replica is told a session (Set
Low-water Mark, durable) before the metadata records it clean in it, so storage session info
older than its clean state means it forgot (`Preparation.forgot`). Such a replica votes for every
candidate, including a higher one no reachable replica holds: what it acknowledged is then still
decided by the replicas that kept their copies, and undecidable while those may be unreachable.
A store session does not take it back in its own session either (`StoreSession` asks for a
successor, whose recovery counts it this way). `waltz storage recover-partition` keeps the
destination's session id for the same reason: it raises only the low-water mark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from waltz.cluster.metadata import UNRESOLVED, PartitionMetadata, ReplicaState


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """What a reachable replica says about the partition (Last Session Info, Max Transaction ID)."""

    last_session: int
    low_water_mark: int
    max_transaction_id: int


@dataclasses.dataclass(frozen=True)
class Preparation:
    """What one replica does before it votes, and what it then holds."""

    truncate_to: int | None
    """Truncate the replica's log after this id (None: keep everything)."""
    proposal: int | None
    """Its max transaction id, proposed as the closing high-water mark (None: no proposal)."""
    high_water_mark: int
    """What it holds once truncated: it votes for every proposal at or below this."""
    low_water_mark: int
    why: str
    forgot: bool = False
    """Clean in the last session by the metadata, its storage remembers only an older one: it lost
    its files and may have acknowledged anything of that session."""


def last_session(meta: PartitionMetadata) -> int | None:
    """The last session that recorded clean replicas: the one whose closing mark is voted on."""
    return max((s.session_id for s in meta.replicas.values() if s.closing_high_water_mark == UNRESOLVED), default=None)


def prepare(state: ReplicaState | None, report: ReplicaReport, last: int | None) -> Preparation:
    """`last`: `last_session(meta)`. An unresolved state older than it is treated as inconsistent
    (no correct update leaves one, and its tail may be another session's dirty data)."""
    lwm, top = report.low_water_mark, report.max_transaction_id
    stale = state is not None and state.closing_high_water_mark == UNRESOLVED and state.session_id != last
    if state is None or state.session_id != report.last_session or stale:
        # New, restored from a backup, or made clean by a session whose metadata update never
        # happened: only what it held at its last clean start is known to be committed.
        seen = (
            "no replica state"
            if state is None
            else f"replica state in session {state.session_id}{' (stale)' if stale else ''}"
        )
        why = (
            f"{seen}, storage last clean in session {report.last_session}: inconsistent, truncated to its low-water "
            f"mark {lwm}"
        )
        forgot = False
        if (
            state is not None
            and not stale
            and state.closing_high_water_mark == UNRESOLVED
            and report.last_session < state.session_id
        ):
            forgot = True
            why += f"; it lost what it held in session {state.session_id}, so it votes for every mark"
        return Preparation(lwm if top > lwm else None, None, min(top, lwm), lwm, why, forgot)
    if state.closing_high_water_mark != UNRESOLVED:
        # Never below its own low-water mark, which is committed: `waltz storage
        # recover-partition` raises it past the session's closing mark while keeping the session
        # id (a replica moved away, its files kept, and moved back). Found by `waltz torture
        # --seed 62`: the node refused the truncation and the replica stayed out of every session.
        c = max(state.closing_high_water_mark, lwm)
        why = f"session {state.session_id} closed at {state.closing_high_water_mark}" + (
            ": truncated to it" if c == state.closing_high_water_mark else f", refilled up to {lwm}: truncated to that"
        )
        return Preparation(c if top > c else None, None, min(top, c), lwm, why)
    if top > lwm:
        return Preparation(None, top, top, lwm, f"clean in session {state.session_id}: proposes {top}")
    return Preparation(
        None, None, top, lwm, f"clean in session {state.session_id}, nothing above its low-water mark {lwm}"
    )


@dataclasses.dataclass(frozen=True)
class Outcome:
    closing: int | None
    """The closing high-water mark, or None: undecidable for now."""
    why: str


def vote(electorate: Iterable[str], prepared: Mapping[str, Preparation]) -> Outcome:
    """`electorate`: every replica of the last session's write set; `prepared`: the reachable
    replicas (voters are those in the electorate; the others only add their low-water marks)."""
    electors = sorted(set(electorate))
    quorum = len(electors) // 2 + 1
    voters = {a: p for a, p in prepared.items() if a in electors}
    unreachable = len(electors) - len(voters)
    forgot = sum(1 for p in voters.values() if p.forgot)
    if forgot:
        # Replicas that lost their files may have acknowledged more than any reachable replica
        # holds; with the unreachable ones they may have been a majority.
        if forgot >= quorum:
            return Outcome(
                None,
                f"{forgot} of {len(electors)} replicas lost their files: what the last session committed "
                "cannot be known (restore a replica's files from a backup)",
            )
        if forgot + unreachable >= quorum:
            return Outcome(
                None,
                f"{forgot} of {len(electors)} replicas lost their files and {unreachable} are unreachable: "
                "a mark above every reachable replica may have had a majority: undecidable",
            )
    # Every low-water mark is committed (set only after a closing mark was decided), so the mark
    # is never below the highest one.
    floor = max((p.low_water_mark for p in prepared.values()), default=-1)
    proposals = {p.proposal for p in voters.values() if p.proposal is not None and p.proposal > floor}
    for candidate in sorted(proposals | {floor}, reverse=True):
        votes = sum(1 for p in voters.values() if p.forgot or p.high_water_mark >= candidate)
        if votes >= quorum:
            return Outcome(candidate, f"{candidate} has {votes} of {len(electors)} votes")
        if votes + unreachable >= quorum:
            return Outcome(
                None,
                f"{candidate} has {votes} of {len(electors)} votes and {unreachable} replicas are unreachable: "
                "undecidable",
            )
    # The floor is committed and no higher mark can have had a majority.
    return Outcome(floor, f"the highest low-water mark {floor}: no higher proposal can have a majority")


def electorate(meta: PartitionMetadata, assigned: Iterable[str]) -> list[str]:
    """The last session's write set, or the assigned replicas before any session recorded one."""
    return sorted(meta.members) if meta.members else sorted(set(assigned))


def after_recovery(
    meta: PartitionMetadata, session: int, closing: int, clean: Iterable[str], members: Iterable[str]
) -> PartitionMetadata:
    """The spec's "Update Partition Metadata": clean replicas join `session`; a replica still in
    the last session gets that session's closing mark; the others keep their state. A replica
    left unresolved in an even older session (no correct update leaves one) loses its state, so
    its next recovery truncates it to its own low-water mark instead of trusting a dirty tail."""
    clean = set(clean)
    last = last_session(meta)
    replicas: dict[str, ReplicaState] = {}
    for address, st in meta.replicas.items():
        if address in clean:
            continue
        if st.closing_high_water_mark != UNRESOLVED:
            replicas[address] = st
        elif st.session_id == last and st.session_id != session:
            replicas[address] = ReplicaState(st.session_id, closing)
        elif st.session_id == session:
            replicas[address] = st  # already clean in this session (a repeated update)
    for address in clean:
        replicas[address] = ReplicaState(session, UNRESOLVED)
    return dataclasses.replace(meta, session_id=session, replicas=replicas, members=tuple(sorted(set(members))))


def after_catch_up(meta: PartitionMetadata, session: int, address: str) -> PartitionMetadata:
    """A replica that caught up with `session` is clean in it (recorded before it acknowledges)."""
    replicas = dict(meta.replicas)
    replicas[address] = ReplicaState(session, UNRESOLVED)
    return dataclasses.replace(meta, replicas=replicas)


__all__ = [
    "Outcome",
    "Preparation",
    "ReplicaReport",
    "after_catch_up",
    "after_recovery",
    "electorate",
    "last_session",
    "prepare",
    "vote",
]
