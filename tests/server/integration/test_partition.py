"""The server's partition (append path, locks, feed) over a real store session on three real
storage nodes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from test_store_session import cluster  # noqa: F401  (fixture)
from waltz import errors
from waltz.server.lock_table import lock_hash
from waltz.server.partition import (
    COMING_AT_MOST,
    COMING_WITHIN,
    AppendRequest,
    Committed,
    Ignored,
    LockFailed,
    ServerPartition,
)
from waltz.server.store_session import StoreSession
from waltz.storage import ReqId

GEN = 1
ACCOUNT = [lock_hash("account", i) for i in range(10)]
CUSTOMER = lock_hash("customer", 1)


def req(
    client: int, seq: int, hwm: int, data: bytes = b"x", gen: int = GEN, header: int = 0, **locks: Any
) -> AppendRequest:
    return AppendRequest(ReqId(client, gen, 0, seq), hwm, header or seq, data, **locks)


def run(meta: Any, body: Callable[[ServerPartition], Awaitable[None]], **kw: Any) -> None:
    async def go() -> None:
        session = await StoreSession.open(meta, 0, generation=GEN)
        p = ServerPartition(0, GEN, session, **kw)
        await p.start()
        try:
            await body(p)
        finally:
            await p.close()

    asyncio.run(go())


def test_lock_semantics_end_to_end(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        # Write/write at the same high-water mark, submitted together: exactly one wins and the
        # loser learns the winner's id.
        a, b = await asyncio.gather(
            p.append(req(1, 1, -1, write_locks=[ACCOUNT[0]])), p.append(req(2, 1, -1, write_locks=[ACCOUNT[0]]))
        )
        assert isinstance(a, Committed) and b == LockFailed(a.transaction_id)
        # Read/read both succeed.
        r1, r2 = await asyncio.gather(
            p.append(req(1, 2, 0, read_locks=[ACCOUNT[1]])), p.append(req(2, 2, 0, read_locks=[ACCOUNT[1]]))
        )
        assert isinstance(r1, Committed) and isinstance(r2, Committed)
        # Write then read (reader computed before the write): the read fails.
        w = await p.append(req(1, 3, p.high_water_mark, write_locks=[ACCOUNT[2]]))
        assert isinstance(w, Committed)
        assert await p.append(req(2, 3, w.transaction_id - 1, read_locks=[ACCOUNT[2]])) == LockFailed(w.transaction_id)
        # Read then write: both succeed.
        hwm = p.high_water_mark
        assert isinstance(await p.append(req(1, 4, hwm, read_locks=[ACCOUNT[3]])), Committed)
        assert isinstance(await p.append(req(2, 4, hwm, write_locks=[ACCOUNT[3]])), Committed)
        # Children written concurrently under an append lock on the parent; a whole-parent reader
        # computed before them fails.
        hwm = p.high_water_mark
        c1, c2 = await asyncio.gather(
            p.append(req(1, 5, hwm, write_locks=[ACCOUNT[4]], append_locks=[CUSTOMER])),
            p.append(req(2, 5, hwm, write_locks=[ACCOUNT[5]], append_locks=[CUSTOMER])),
        )
        assert isinstance(c1, Committed) and isinstance(c2, Committed)
        assert isinstance(await p.append(req(3, 1, hwm, read_locks=[CUSTOMER])), LockFailed)
        # Several locks: one conflicting lock fails the whole transaction.
        hwm = p.high_water_mark
        assert isinstance(await p.append(req(1, 6, hwm - 1, write_locks=[ACCOUNT[6], ACCOUNT[5]])), LockFailed)
        assert isinstance(await p.append(req(1, 7, hwm, write_locks=[ACCOUNT[6], ACCOUNT[5]])), Committed)
        assert p.stats["lock_failures"] == 4

    run(meta, body)


@pytest.mark.parametrize(("turns", "clients", "batches"), [(6, 3, 1), (0, 3, 3), (6, 1, 3)])
def test_appends_arriving_over_a_few_loop_turns_share_a_store_batch(
    cluster, turns: int, clients: int, batches: int
) -> None:  # noqa: F811
    """Several clients' appends, one per loop turn, join one store batch; with gathering off, or
    with a single client (nobody else to wait for), each goes alone."""
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        for c in range(clients):  # every client has appended before, as in a closed loop
            assert isinstance(await p.append(req(c + 1, 1, -1)), Committed)
        before = sum(p.commit_seconds[0])  # one commit-latency sample per store batch

        async def after(n: int) -> Any:
            for _ in range(n):
                await asyncio.sleep(0)
            return await p.append(req(n % clients + 1, n + 2, -1))

        results = await asyncio.gather(*(after(n) for n in range(3)))
        assert sorted(r.transaction_id for r in results) == [clients, clients + 1, clients + 2]
        assert sum(p.commit_seconds[0]) - before == batches

    run(meta, body, gather_turns=turns)


def test_a_batch_does_not_wait_when_no_other_client_can_come(cluster) -> None:  # noqa: F811
    """Both recent appenders have queued: nobody else is on the way, so the batch is cut at once
    and a newcomer two turns later goes in a batch of its own (waiting turns for it would have
    delayed the other two)."""
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        for c in (1, 2):
            assert isinstance(await p.append(req(c, 1, -1)), Committed)
        before = sum(p.commit_seconds[0])

        async def after(client: int, turns: int) -> Any:
            for _ in range(turns):
                await asyncio.sleep(0)
            return await p.append(req(client, 2, -1))

        results = await asyncio.gather(after(1, 0), after(2, 0), after(3, 2))
        assert [r.transaction_id for r in results] == [2, 3, 4]
        assert sum(p.commit_seconds[0]) - before == 2

    run(meta, body, gather_turns=6)


class _Appenders:
    """Clients 1, 2 and 3 of one partition, each append taking the next sequence number."""

    def __init__(self, p: ServerPartition) -> None:
        self.p = p
        self._seq = iter(range(1, 1000))

    async def append(self, client: int, turns: int = 0) -> Any:
        for _ in range(turns):
            await asyncio.sleep(0)
        return await self.p.append(req(client, next(self._seq), -1))

    async def start(self) -> None:
        for c in (1, 2, 3):
            assert isinstance(await self.append(c), Committed)

    async def client_2_comes_back(self, after: float, then_quiet: float) -> None:
        """Client 2 appends again `after` seconds from now, then stays quiet for `then_quiet`."""
        await asyncio.sleep(after)
        assert isinstance(await self.append(2), Committed)
        await asyncio.sleep(then_quiet)

    async def store_batches(self) -> int:
        """Client 1 appends now and client 3 two turns later: the store batches they took (one
        commit-latency sample per batch)."""
        before = sum(self.p.commit_seconds[0])
        await asyncio.gather(self.append(1), self.append(3, 2))
        return sum(self.p.commit_seconds[0]) - before


def test_a_client_quiet_for_a_while_is_not_waited_for(cluster) -> None:  # noqa: F811
    """Clients answered a moment ago may be on their way, and a newcomer two turns behind joins
    their batch; once they have been quiet for longer than `COMING_WITHIN`, nobody is waited
    for: the batch is cut at once (on the old rule every client that appended in the last second
    held each batch of a lone client for `gather_turns` turns)."""
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        clients = _Appenders(p)
        await clients.start()
        assert await clients.store_batches() == 1  # client 2 answered a moment ago: it may come
        await asyncio.sleep(max(0.2, COMING_WITHIN * 3))
        assert await clients.store_batches() == 2  # clients 2 and 3 quiet for a while

    run(meta, body, gather_turns=6)


def test_a_client_that_takes_long_to_come_back_is_still_waited_for(cluster) -> None:  # noqa: F811
    """A far client comes back a long round trip after its answer: once it has shown that, it is
    waited for within twice that time, though longer than `COMING_WITHIN`, and a newcomer two
    turns behind joins the batch as before; past `COMING_AT_MOST` nobody is waited for."""
    meta, _ = cluster
    far = COMING_WITHIN * 4

    async def body(p: ServerPartition) -> None:
        clients = _Appenders(p)
        await clients.start()
        # Answered longer ago than COMING_WITHIN at the batch, within 2 x far.
        await clients.client_2_comes_back(after=far, then_quiet=COMING_WITHIN * 1.5)
        assert await clients.store_batches() == 1
        await asyncio.sleep(COMING_AT_MOST + 0.2)  # past any client's window
        assert await clients.store_batches() == 2

    run(meta, body, gather_turns=6)


def test_a_client_with_a_slow_rhythm_is_not_waited_for_all_its_quiet_time(cluster) -> None:  # noqa: F811
    """A client that appends every few hundred milliseconds (a heartbeat) counts as on its way
    for `COMING_AT_MOST` after its answer, not for twice its rhythm: the other clients' batches
    do not wait for it through its quiet time."""
    meta, _ = cluster
    rhythm = COMING_AT_MOST * 3

    async def body(p: ServerPartition) -> None:
        clients = _Appenders(p)
        await clients.start()
        # Its rhythm, then quiet within twice that but past COMING_AT_MOST at the batch.
        await clients.client_2_comes_back(after=rhythm, then_quiet=COMING_AT_MOST * 1.5)
        assert await clients.store_batches() == 2

    run(meta, body, gather_turns=6)


def test_a_stale_generation_is_never_committed(cluster) -> None:  # noqa: F811
    meta, nodes = cluster

    async def body(p: ServerPartition) -> None:
        assert isinstance(await p.append(req(1, 1, -1, b"good")), Committed)
        assert await p.append(req(1, 2, -1, b"stale", gen=GEN - 1)) == Ignored(
            f"generation {GEN - 1} is not the partition's {GEN}"
        )
        assert isinstance(await p.append(req(1, 3, -1, b"good2")), Committed)
        assert p.high_water_mark == 1

    run(meta, body)

    async def read(c: Any) -> list[bytes]:
        return [bytes(r.data) for r in await c.records(0, 50, 0, 10)]

    assert nodes[0].run(read) == [b"good", b"good2"]


def test_a_broken_commit_order_tells_its_appenders_the_outcome_is_unknown(cluster) -> None:  # noqa: F811
    """The commit-order invariant failing (forced here by skipping an id) ends the session; the
    batch may still be on a majority, so its appenders hear StoreSessionError (the client waits
    for a new mount and finds the outcome in the feed), never a rejection it would take as
    final and submit again."""
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        assert isinstance(await p.append(req(1, 1, -1, b"first")), Committed)
        p._next += 1  # the bug the invariant guards against: ids assigned out of step
        with pytest.raises(errors.StoreSessionError, match="does not follow high-water mark"):
            await p.append(req(1, 2, -1, b"second"))
        assert p.session.failed is not None

    run(meta, body)


def test_a_batch_that_fails_midway_ends_the_session(cluster) -> None:  # noqa: F811
    """A bug raising while a batch is handed to the replicas (here one replica's send) leaves the
    batch possibly sent to the others, to be committed by the next recovery. Its appenders hear
    "outcome unknown", and the session must end: a healthy session would answer the client's next
    mount READY, the client would submit again, and the transaction could commit twice."""
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        assert isinstance(await p.append(req(1, 1, -1, b"first")), Committed)

        def broken_send(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError("a bug in the storage client")

        p.session._replicas[-1].client.send_append = broken_send
        with pytest.raises(errors.StoreSessionError, match="a bug in the storage client"):
            await p.append(req(1, 2, -1, b"second"))
        assert p.session.failed is not None and "writing a batch failed" in str(p.session.failed)
        # Settled by the session's failure, the batch freed its in-flight slot once, not twice.
        assert p._in_flight._value == p._max_in_flight

    run(meta, body)


def test_an_assignment_change_during_a_session_switch_gets_a_switch_of_its_own(cluster) -> None:  # noqa: F811
    """A switch reads the replica assignment when it opens the new session; a change arriving
    after that read was dropped (the switch under way cleared the request), so the partition
    kept a session on the old replica set until something else replaced it."""
    meta, _ = cluster

    async def go() -> None:
        opened: list[int] = []
        p: ServerPartition | None = None

        async def open_session() -> StoreSession:
            opened.append(1)
            new = await StoreSession.open(meta, 0, generation=GEN)
            if len(opened) == 1:
                assert p is not None
                p.request_new_session("the assignment changed after the switch read it")
            return new

        session = await StoreSession.open(meta, 0, generation=GEN)
        p = ServerPartition(0, GEN, session, open_session=open_session)
        await p.start()
        try:
            assert isinstance(await p.append(req(1, 1, -1)), Committed)
            p.request_new_session("replicas changed")
            for _ in range(400):  # a liveness bound: the second switch needs no append to start
                if len(opened) == 2 and p.stats["store_sessions"] == 2:
                    break
                await asyncio.sleep(0.05)
            assert len(opened) == 2, "the change that came during the switch was dropped"
            assert isinstance(await p.append(req(1, 2, 0)), Committed)
        finally:
            await p.close()

    asyncio.run(go())


def test_closing_while_the_store_session_switches_answers_the_append_that_waited(cluster) -> None:  # noqa: F811
    """The append that found a new session due was taken off the queue before the switch: a
    close during the switch must answer it (before, it waited for ever)."""
    meta, _ = cluster

    async def go() -> None:
        switching = asyncio.Event()

        async def stuck() -> StoreSession:
            switching.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        session = await StoreSession.open(meta, 0, generation=GEN)
        p = ServerPartition(0, GEN, session, checkpoint_interval=1, open_session=stuck)
        await p.start()
        assert isinstance(await p.append(req(1, 1, -1)), Committed)
        waiting = asyncio.ensure_future(p.append(req(1, 2, -1)))
        await asyncio.wait_for(switching.wait(), 10)
        await p.close()
        with pytest.raises(errors.StoreSessionError, match="closed before this append was written"):
            await asyncio.wait_for(waiting, 10)

    asyncio.run(go())


def test_feed_order_equals_commit_order_for_every_reader(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        rng = random.Random(5)
        results: dict[tuple[int, int], Any] = {}

        async def client(cid: int) -> None:
            for seq in range(60):
                lock = ACCOUNT[rng.randrange(len(ACCOUNT))]
                results[(cid, seq)] = await p.append(
                    req(cid, seq, p.high_water_mark, f"{cid}:{seq}".encode(), write_locks=[lock])
                )

        async def reader(after: int, n: int) -> list[Any]:
            got: list[Any] = []
            async for entries in p.feed(after, max_entries=7):
                got.extend(entries)
                if len(got) >= n:
                    return got
            return got

        await asyncio.gather(*(client(c) for c in range(8)))
        committed = {r.transaction_id: k for k, r in results.items() if isinstance(r, Committed)}
        assert sorted(committed) == list(range(len(committed)))  # dense ids
        for after in (-1, 10):
            feed = await reader(after, len(committed) - after - 1)
            assert [e.transaction_id for e in feed] == list(range(after + 1, len(committed)))
            assert all((e.req_id.client_id, e.req_id.sequence) == committed[e.transaction_id] for e in feed)
        for txid in (0, len(committed) - 1):
            cid, seq = committed[txid]
            assert await p.transaction_data(txid) == f"{cid}:{seq}".encode()

    run(meta, body)


def test_a_pushed_feed_hands_over_every_commit_once_in_order(cluster, caplog) -> None:  # noqa: F811
    """A waiting reader with `push` takes commits in the commit's turn; whatever it declines or
    fails on, the iterator yields from there: together, every transaction once, in order."""
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        pushed: list[Any] = []
        got: list[Any] = []
        calls = {"push": 0, "declined": 0, "raised": 0}
        sizes: list[int] = []

        def push(entries: list[Any]) -> bool:
            calls["push"] += 1
            sizes.append(len(entries))
            if calls["push"] % 4 == 1:  # the first, fifth, ... decline: the iterator takes over
                calls["declined"] += 1
                return False
            if calls["push"] % 4 == 3:
                calls["raised"] += 1
                raise RuntimeError("a reader's push broke")
            pushed.extend(entries)
            got.extend(entries)
            return True

        total = 120

        async def reader() -> None:
            async for entries in p.feed(-1, max_entries=3, push=push):
                got.extend(entries)

        r = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # parked, waiting for the first commit

        async def client(cid: int) -> None:
            for seq in range(total // 4):
                assert isinstance(await p.append(req(cid, seq, p.high_water_mark)), Committed)

        await asyncio.gather(*(client(c) for c in range(4)))

        async def all_delivered() -> None:  # the last ones may have been pushed, or yielded
            while len(got) < total:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_delivered(), 10)
        r.cancel()
        await asyncio.gather(r, return_exceptions=True)
        assert [e.transaction_id for e in got] == list(range(total))
        assert pushed and len(pushed) < total  # both ways were taken
        assert max(sizes) <= 3
        assert calls["declined"] and calls["raised"]
        assert "handing commits to a feed reader failed" in caplog.text

    run(meta, body)


def test_readers_behind_the_cache_catch_up_from_storage(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        for i in range(50):
            await p.append(req(1, i, p.high_water_mark, b"d%d" % i))
        assert p.high_water_mark == 49
        entries: list[Any] = []
        async for batch in p.feed(-1, max_entries=8):
            entries.extend(batch)
            if len(entries) >= 50:
                break
        assert [e.transaction_id for e in entries] == list(range(50))
        assert await p.transaction_data(3) == b"d3"  # evicted from the 64-byte data cache: read from a replica

        async def late() -> list[Any]:
            async for batch in p.feed(49):
                return batch
            return []

        waiting = asyncio.ensure_future(late())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await p.append(req(1, 99, p.high_water_mark, b"new"))
        assert [e.transaction_id for e in await asyncio.wait_for(waiting, 10)] == [50]

    run(meta, body, feed_cache_bytes=10 * 200, data_cache_bytes=64)


def test_queue_limit_makes_appenders_wait(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(p: ServerPartition) -> None:
        # Hold the append loop: four appends fill the queue, the next ones wait to get in.
        assert p._task is not None
        p._task.cancel()
        await asyncio.gather(p._task, return_exceptions=True)
        waiting = [asyncio.ensure_future(p.append(req(1, i, -1, b"q"))) for i in range(6)]
        await asyncio.sleep(0.2)
        assert p._queue.full() and p._queue.qsize() == 4 and not any(w.done() for w in waiting)
        await p.start()
        results = await asyncio.wait_for(asyncio.gather(*waiting), 30)
        assert sorted(r.transaction_id for r in results if isinstance(r, Committed)) == list(range(6))

    run(meta, body, queue_limit=4, max_batch_records=3, max_batches_in_flight=2)


def test_new_store_sessions_every_checkpoint_interval_and_on_a_replica_change(cluster, tmp_path) -> None:  # noqa: F811
    """Appenders only wait while the partition moves to a new session: every 40 commits, and when a
    fourth replica is assigned (it is filled and joins); nothing is lost or reordered."""
    from support.daemons import Node

    meta, nodes = cluster
    extra = Node(tmp_path / "n3", meta.info().cluster_key)

    async def go() -> None:
        first = await StoreSession.open(meta, 0, generation=GEN)
        p = ServerPartition(
            0, GEN, first, checkpoint_interval=40, open_session=lambda: StoreSession.open(meta, 0, generation=GEN)
        )
        await p.start()
        try:
            results = []
            for chunk in range(15):  # the interval is checked between batches
                results += await asyncio.gather(
                    *(p.append(req(1, i, -1, f"t{i}".encode())) for i in range(chunk * 10, chunk * 10 + 10))
                )
            assert [r.transaction_id for r in results if isinstance(r, Committed)] == list(range(150))
            assert p.stats["store_sessions"] >= 3 and p.session.session_id > first.session_id + 2
            meta.add_storage_node(extra.address, extra.ports["admin_port"], 3)
            meta.assign_partition(extra.address, 0)
            await asyncio.to_thread(extra.admin, lambda c: c.assign(0))
            before = p.session.session_id
            p.request_new_session("a replica was added")
            # Idle, the partition still moves on at once (a replica waiting for a new session
            # should not wait for the next append).
            for _ in range(200):
                if p.session.session_id != before:
                    break
                await asyncio.sleep(0.05)
            assert p.session.session_id > before and extra.address in p.session.assigned_replicas
            assert isinstance(await p.append(req(1, 150, -1, b"t150")), Committed)
            for _ in range(200):
                if extra.address in p.session.replicas_in_write_path:
                    break
                await asyncio.sleep(0.05)
            assert isinstance(await p.append(req(1, 151, -1, b"t151")), Committed)
            for _ in range(100):  # committed on three of four; the fourth has it a moment later
                copies = [await asyncio.to_thread(n.admin_records) for n in [*nodes, extra]]
                if all(len(c) == 152 for c in copies):
                    break
                await asyncio.sleep(0.05)
        finally:
            await p.close()
        assert all(c == copies[0] for c in copies) and [bytes(r.data) for r in copies[0]] == [
            f"t{i}".encode() for i in range(152)
        ]

    try:
        asyncio.run(go())
    finally:
        from support.processes import stop

        stop(extra.proc)


# -- Regressions from an adversarial review of the server write path (Partition): each failed
#    on the code as first written. ------------------------------------------------------------------


LOCK = lock_hash("account", 1)


HANG = 5.0  # seconds after which an outcome that should be immediate counts as a hang


async def held_partition(meta: Any, **kw: Any) -> ServerPartition:
    """A started partition whose append loop is held (as test_partition's queue test does), so
    requests can be queued deterministically before the loop sees them."""
    p = ServerPartition(0, GEN, await StoreSession.open(meta, 0, generation=GEN, timeout=30.0), **kw)
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
        p = ServerPartition(0, GEN, session)
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
        p = ServerPartition(0, GEN, await StoreSession.open(meta, 0, generation=GEN))
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


def test_an_appender_that_gives_up_waiting_for_queue_room_does_not_hold_up_settled(cluster) -> None:  # noqa: F811
    """A connection that goes away while its append waits for room (the queue full): that append
    was never queued, and a Mount of the same client, which waits for `settled`, must not wait
    for it for ever (its future stayed unresolved until issue 33's `_settle`)."""
    meta, _ = cluster

    async def go() -> None:
        p = await held_partition(meta, queue_limit=1)
        queued = await p.enqueue(req(1, 1, -1))
        gave_up = asyncio.ensure_future(p.enqueue(req(1, 2, -1)))
        await asyncio.sleep(0.1)
        assert p._queue.full() and not gave_up.done()
        gave_up.cancel()
        await asyncio.gather(gave_up, return_exceptions=True)
        await p.start()  # the loop goes on: the queued one commits, and the client is settled
        assert isinstance(await asyncio.wait_for(queued, HANG), Committed)
        await asyncio.wait_for(p.settled(1), HANG)
        await p.close()

    asyncio.run(go())


def test_listeners_hear_each_outcome_exactly_once(cluster) -> None:  # noqa: F811
    """The connection's listener (it writes Lock Failures) is told of every outcome exactly once,
    its future already resolved, whatever the outcome: committed, lock failed, ignored."""
    meta, _ = cluster

    async def go() -> None:
        p = await held_partition(meta)
        heard: list[tuple[int, Any]] = []

        def listener(seq: int) -> Any:
            return lambda f: heard.append((seq, f.result()))

        futures = [
            await p.enqueue(req(1, 1, -1, write_locks=[ACCOUNT[0]]), listener(1)),
            await p.enqueue(req(2, 1, -1, write_locks=[ACCOUNT[0]]), listener(2)),
            await p.enqueue(req(3, 1, -1, gen=GEN + 1), listener(3)),
        ]
        await p.start()
        await asyncio.wait_for(asyncio.gather(*futures), HANG)
        outcomes = dict(heard)
        assert len(heard) == 3 and isinstance(outcomes[1], Committed) and isinstance(outcomes[3], Ignored)
        assert outcomes[2] == LockFailed(outcomes[1].transaction_id)
        await p.close()

    asyncio.run(go())


def test_close_answers_the_batch_waiting_for_an_in_flight_slot(cluster) -> None:  # noqa: F811
    meta, nodes = cluster

    async def go() -> None:
        p = ServerPartition(
            0, GEN, await StoreSession.open(meta, 0, generation=GEN, timeout=60.0), max_batches_in_flight=1
        )
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
