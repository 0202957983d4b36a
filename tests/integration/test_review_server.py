"""Regression tests from an adversarial review of the server write path (StoreSession,
Partition): each failed on the code as first written; all use real storage node daemons and
real metadata (both stores)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
from typing import Any

import pytest

from waltz import errors
from waltz.server.lock_table import lock_hash
from waltz.server.partition import AppendRequest, Committed, LockFailed, Partition
from waltz.server.store_session import StoreSession
from waltz.storage import ReqId

from support.processes import start, stop, wait_http
from test_cli import Node
from test_store_session import batch, cluster, read_all  # noqa: F401  (fixture)

GEN = 1
LOCK = lock_hash("account", 1)
HANG = 5.0  # seconds after which an outcome that should be immediate counts as a hang


def req(client: int, seq: int, hwm: int, data: bytes = b"x", gen: int = GEN, header: int = 0, **locks: Any) -> AppendRequest:
    return AppendRequest(ReqId(client, gen, 0, seq), hwm, header or seq, data, **locks)


async def held_partition(meta: Any, **kw: Any) -> Partition:
    """A started partition whose append loop is held (as test_partition's queue test does), so
    requests can be queued deterministically before the loop sees them."""
    p = Partition(0, GEN, await StoreSession.open(meta, 0, generation=GEN, timeout=30.0), **kw)
    await p.start()
    assert p._task is not None
    p._task.cancel()
    await asyncio.gather(p._task, return_exceptions=True)
    return p


# 1. An appender that gave up (cancelled) while its request was queued kills the append loop when
#    its request is refused (LockFailed / Ignored): set_result on a cancelled future raises
#    InvalidStateError out of _write, the loop task dies, and every other append hangs forever.
def test_a_cancelled_appender_does_not_kill_the_append_loop(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def go() -> None:
        p = await held_partition(meta)
        try:
            winner = asyncio.ensure_future(p.append(req(1, 1, -1, write_locks=[LOCK])))
            loser = asyncio.ensure_future(p.append(req(2, 1, -1, write_locks=[LOCK])))  # will LockFail
            await asyncio.sleep(0.1)
            loser.cancel()  # e.g. the client's connection closed, or a wait_for timeout
            await p.start()
            await asyncio.sleep(0.3)
            assert not p._task.done(), f"append loop died: {p._task.exception()!r}"
            assert isinstance(await asyncio.wait_for(winner, HANG), Committed)
            assert isinstance(await asyncio.wait_for(p.append(req(3, 1, -1)), HANG), Committed)
        finally:
            await p.close()

    asyncio.run(go())


# 2. Same loop death from a request the batch cannot encode (header outside i32): RecordBatch.add
#    raises OverflowError in the middle of _write. The accepted requests before it are never
#    answered (their locks already moved), and every later append hangs.
def test_a_bad_request_fails_alone_and_the_loop_survives(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def go() -> None:
        p = await held_partition(meta)
        try:
            good = asyncio.ensure_future(p.append(req(1, 1, -1, b"good")))
            bad = asyncio.ensure_future(p.append(req(2, 1, -1, b"bad", header=2**31)))
            await asyncio.sleep(0.1)
            await p.start()
            await asyncio.sleep(0.3)
            assert not p._task.done(), f"append loop died: {p._task.exception()!r}"
            assert isinstance(await asyncio.wait_for(good, HANG), Committed)
            with pytest.raises(Exception) as e:
                await asyncio.wait_for(bad, HANG)
            assert not isinstance(e.value, asyncio.TimeoutError), "the bad request was never answered"
            assert isinstance(await asyncio.wait_for(p.append(req(3, 1, -1)), HANG), Committed)
        finally:
            await p.close()

    asyncio.run(go())


# 3. Feed readers waiting for the next commit are never woken when the store session ends
#    (fenced, lost quorum, or close()): _on_commit's failure path returns before _notify, and
#    close() never notifies. The feed promises to raise the session's error; it hangs instead.
def test_a_waiting_feed_reader_learns_that_the_session_ended(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def go() -> None:
        session = await StoreSession.open(meta, 0, generation=GEN)
        p = Partition(0, GEN, session)
        await p.start()
        try:
            assert isinstance(await p.append(req(1, 1, -1)), Committed)

            async def next_entries() -> Any:
                async for entries in p.feed(p.high_water_mark):
                    return entries

            reader = asyncio.ensure_future(next_entries())
            await asyncio.sleep(0.1)
            newer = await StoreSession.open(meta, 0, generation=GEN + 1)  # another server took over
            with pytest.raises(errors.StoreSessionError, match="fenced"):
                await p.append(req(1, 2, 0))
            assert p.session.failed is not None
            with pytest.raises(errors.StoreSessionError):
                await asyncio.wait_for(reader, HANG)  # bug: asyncio.TimeoutError (hangs)
            await newer.close()
        finally:
            await p.close()

    asyncio.run(go())


def test_close_wakes_waiting_feed_readers(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def go() -> None:
        p = Partition(0, GEN, await StoreSession.open(meta, 0, generation=GEN))
        await p.start()

        async def next_entries() -> Any:
            async for entries in p.feed(p.high_water_mark):
                return entries

        reader = asyncio.ensure_future(next_entries())
        await asyncio.sleep(0.1)
        await p.close()
        with pytest.raises(errors.StoreSessionError):
            await asyncio.wait_for(reader, HANG)  # bug: hangs

    asyncio.run(go())


# 4. close() strands appenders: (a) those blocked on a full queue (back pressure) are woken by
#    close()'s draining and put their request in after it; (b) the batch the append loop holds
#    while waiting for an in-flight slot is dropped when the loop is cancelled. Neither ever gets
#    an answer.
def test_close_answers_appenders_waiting_for_queue_room(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def go() -> None:
        p = await held_partition(meta, queue_limit=2)
        waiting = [asyncio.ensure_future(p.append(req(1, i, -1))) for i in range(4)]
        await asyncio.sleep(0.1)
        assert p._queue.full()
        await p.close()
        done, pending = await asyncio.wait(waiting, timeout=HANG)
        assert not pending, f"{len(pending)} appenders never answered after close()"
        assert all(isinstance(w.exception(), errors.StoreSessionError) for w in done)

    asyncio.run(go())


def test_close_answers_the_batch_waiting_for_an_in_flight_slot(cluster) -> None:  # noqa: F811
    meta, nodes = cluster

    async def go() -> None:
        p = Partition(0, GEN, await StoreSession.open(meta, 0, generation=GEN, timeout=60.0), max_batches_in_flight=1)
        await p.start()
        for n in nodes[:2]:
            os.kill(n.proc.pid, signal.SIGSTOP)  # no quorum: the one in-flight batch stays in flight
        try:
            first = asyncio.ensure_future(p.append(req(1, 1, -1)))
            await asyncio.sleep(0.2)
            later = [asyncio.ensure_future(p.append(req(1, i, -1))) for i in range(2, 5)]
            await asyncio.sleep(0.2)
            assert p._queue.empty()  # the loop took them and waits for the slot
            await p.close()
            done, pending = await asyncio.wait([first, *later], timeout=HANG)
            assert not pending, f"{len(pending)} appenders never answered after close()"
        finally:
            for n in nodes[:2]:
                os.kill(n.proc.pid, signal.SIGCONT)

    asyncio.run(go())


# 5. (Fixed by the recovery vote.) settle() ignored the partition metadata's replica states, so replicas that never held the
#    committed transactions can "agree". Documented procedure (docs/operations.md, "Adding or
#    replacing a storage node", filling is optional): replace n1 by a new, empty n3 while n2 lags
#    (it left the write path; catch-up is not built) and n0 is briefly down. n2 and n3 are a
#    reachable majority of {n0, n2, n3} and agree on an empty log: the new session starts at -1,
#    the acknowledged transactions 0..2 are lost and new ones are committed at the same ids.
def test_replicas_that_never_held_the_commits_cannot_settle_the_start(cluster, tmp_path: pathlib.Path) -> None:  # noqa: F811
    meta, nodes = cluster
    n0, n1, n2 = nodes

    async def first_session() -> int:
        s = await StoreSession.open(meta, 0, generation=GEN, timeout=5.0)
        await asyncio.to_thread(stop, n2.proc)  # n2 is out of the write path of this session
        assert await s.append(batch("acked")) == (0, 2)  # acknowledged: on n0 and n1
        assert n2.address not in s.replicas_in_write_path
        await s.close()
        return s.session_id

    asyncio.run(first_session())
    n2.proc = start(n2.config)
    wait_http(n2.ports["http_port"], n2.proc)
    info = meta.info()
    n3 = Node(tmp_path / "n3", info.cluster_key)
    try:
        meta.add_storage_node(n3.address, n3.ports["admin_port"], 3)
        meta.assign_partition(n3.address, 0)
        n3.admin(lambda c: c.assign(0))
        meta.unassign_partition(n1.address, 0)  # n1 replaced by n3
        stop(n0.proc)  # n0 restarting

        async def second_session() -> None:
            # The electorate is the last session's write set {n0, n1, n2}: n1 (unassigned, still
            # reachable) holds 0..2, n2 was clean in it but holds nothing, n0 is down. Undecidable
            # until n2 is filled from n1; then 2 is decided and the new write set {n2, n3} holds it.
            s = await StoreSession.open(meta, 0, generation=GEN, timeout=2.0)
            assert s.high_water_mark == 2
            assert await s.append(batch("other")) == (3, 5)
            await s.close()
            for n in (n2, n3):
                held = await asyncio.to_thread(read_all, n, 99)
                assert [bytes(r.data) for r in held] == [b"acked-0", b"acked-1", b"acked-2", b"other-0", b"other-1", b"other-2"]

        asyncio.run(second_session())
    finally:
        if n3.proc.poll() is None:
            stop(n3.proc)
