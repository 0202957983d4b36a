"""Regression tests from an adversarial review of the server's client port (connection.py,
the partition's admission): a client that never reads, storage failing under a feed request,
malformed marks, oversized lock lists, a client mark above the committed one. Each failed on the
code before its fix. Real storage nodes and metadata; the server's connection in this process."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from waltz import client_protocol as cp
from waltz.server import connection
from waltz.server.lock_table import lock_hash
from waltz.server.partition import AppendRequest, Committed, LockFailed
from waltz.storage import ReqId

from support.processes import stop
from test_server_connection import GEN, RawClient, append, mounted, serving
from test_store_session import cluster  # noqa: F401  (fixture)

LOCK = lock_hash("account", 1)


def _small_buffers(c: RawClient, server_writer: asyncio.StreamWriter) -> None:
    """64 KiB in the kernel on every side of the connection (autotuning lets it take megabytes),
    so what the server holds back itself shows."""
    for sock, option in ((c.writer.get_extra_info("socket"), socket.SO_RCVBUF), (c.writer.get_extra_info("socket"), socket.SO_SNDBUF),
                         (server_writer.get_extra_info("socket"), socket.SO_RCVBUF), (server_writer.get_extra_info("socket"), socket.SO_SNDBUF)):
        sock.setsockopt(socket.SOL_SOCKET, option, 64 << 10)


def _data_tasks() -> int:
    return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ClientConnection._data")  # type: ignore[union-attr]


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_client_that_never_reads_holds_a_bounded_number_of_answers(cluster) -> None:  # noqa: F811
    """200 requests for a 4 MiB transaction's data, none read: each became a task holding its
    answer (816 MiB of server memory for 6 KB of requests). Now at most REQUESTS_IN_FLIGHT are
    answered at once and the connection stops reading; once the client reads, every one arrives."""
    meta, _ = cluster

    async def go() -> None:
        writers: list[asyncio.StreamWriter] = []
        async with serving(meta, writers) as (port, p, _):
            data = b"y" * (4 << 20)
            assert isinstance(await p.append(AppendRequest(ReqId(9, GEN, 0, 1), -1, 0, data)), Committed)
            c = await RawClient.connect(port)
            n = 30
            for i in range(n):
                c.send(cp.TransactionDataRequest(i, 0, 0))
            await asyncio.sleep(1.0)  # the server answers what it takes in, and then waits
            assert _data_tasks() <= connection.REQUESTS_IN_FLIGHT
            answers = [await c.next(30) for _ in range(n)]
            assert [(a.seq, len(a.data)) for a in answers if isinstance(a, cp.TransactionDataResponse)] == [(i, len(data)) for i in range(n)]
            c.close()

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_lock_failures_for_a_client_that_never_reads_stop_its_reading(cluster) -> None:  # noqa: F811
    """Appends that lose their lock are answered without waiting for the socket: a client that
    sends them and reads nothing grew the server's write buffer without limit (3 MB for 13.6 MB
    sent). Now the connection stops reading once about WRITE_BUFFER_LIMIT waits, and nothing is
    lost when the client reads."""
    meta, _ = cluster

    async def go() -> None:
        writers: list[asyncio.StreamWriter] = []
        async with serving(meta, writers) as (port, p, _):
            assert isinstance(await p.append(AppendRequest(ReqId(9, GEN, 0, 1), -1, 0, b"w", write_locks=(LOCK,))), Committed)
            c = await RawClient.connect(port)
            _small_buffers(c, writers[0])
            n = 60_000
            c.writer.write(append(5, 1, -1, b"", write_locks=(LOCK,)).frame() * n)  # each saw nothing: each fails
            await asyncio.sleep(3.0)
            held = writers[0].transport.get_write_buffer_size()
            assert held < 2 * connection.WRITE_BUFFER_LIMIT, f"{held} bytes of answers wait in the server"
            assert c.writer.transport.get_write_buffer_size() > 0, "the server read every request of a client that reads nothing"
            failures = 0
            while failures < n:
                m = await c.next(30)
                assert isinstance(m, cp.LockFailure), m
                failures += 1
            assert p.high_water_mark == 0
            c.close()

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_feed_request_is_answered_when_storage_fails_and_bad_marks_are_refused(cluster) -> None:  # noqa: F811
    """A feed request whose headers must come from storage got no answer when that read failed
    (the task died unseen); a feed request or mount below -1 was answered as a storage failure,
    which a client retries for ever."""
    meta, nodes = cluster

    async def go() -> None:
        async with serving(meta) as (port, p, _):
            for i in range(5):
                await p.append(AppendRequest(ReqId(9, GEN, 0, i + 1), i - 1, 0, b"x"))
            c = await RawClient.connect(port)
            c.send(cp.FeedRequest(1, 0, -5, 10))
            bad = await c.next()
            assert isinstance(bad, cp.Failure) and bad.kind == cp.FailureKind.BAD_REQUEST and bad.seq == 1, bad
            c.send(cp.Mount(2, 0, 5, -5, 1))
            bad = await c.next()
            assert isinstance(bad, cp.Failure) and bad.kind == cp.FailureKind.BAD_REQUEST and bad.seq == 2, bad
            p._feed.clear()  # as once the cache has moved on: the headers come from storage
            for node in nodes:
                await asyncio.to_thread(stop, node.proc)
            c.send(cp.FeedRequest(3, 0, -1, 10))
            failed = await c.next(60)
            assert isinstance(failed, cp.Failure) and failed.kind == cp.FailureKind.STORE_UNAVAILABLE and failed.seq == 3, failed
            c.close()

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_an_append_with_too_many_locks_is_rejected(cluster) -> None:  # noqa: F811
    """A million write locks in one append held the server's event loop for 6 s (every client
    waited) and pushed every other client's locks out of the table."""
    meta, _ = cluster

    async def go() -> None:
        async with serving(meta) as (port, p, _):
            c = await mounted(port)
            many = tuple(range(p.max_transaction_locks + 1))
            c.send(append(5, 7, -1, write_locks=many))
            rejected = await c.until(lambda m: isinstance(m, cp.Failure))
            assert rejected[-1].kind == cp.FailureKind.APPEND_REJECTED and rejected[-1].seq == 7
            assert "max_transaction_locks" in rejected[-1].message
            c.send(append(5, 8, -1, write_locks=many[:-1]))  # at the limit: accepted
            fed = await c.until(lambda m: isinstance(m, cp.FeedData) and len(m.entries) > 0)
            assert fed[-1].entries[-1].req_id == (5, GEN, 0, 8)
            c.close()

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_client_mark_above_the_committed_one_does_not_pass_over_the_batch(cluster) -> None:  # noqa: F811
    """A client claims to have seen transactions that are not committed (a mark far ahead): the
    lock check counted as seen the transactions ahead of it in the same batch, and it committed
    over one it cannot have seen. The mark is taken as at most the committed high-water mark."""
    meta, _ = cluster

    async def go() -> None:
        async with serving(meta) as (_, p, _):
            first = await p.enqueue(AppendRequest(ReqId(1, GEN, 0, 1), -1, 0, b"a", write_locks=(LOCK,)))
            liar = await p.enqueue(AppendRequest(ReqId(2, GEN, 0, 1), 2**63 - 1, 0, b"b", write_locks=(LOCK,)))
            assert isinstance(await first, Committed)
            assert isinstance(await liar, LockFailed)

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_the_newest_mount_of_a_client_is_forgotten_with_its_last_connection(cluster) -> None:  # noqa: F811
    """The newest connection seq of every (client id, partition) ever mounted was kept for the
    server's life: a client crash-looping under a new id each start grew it without end. It goes
    once no connection that mounted it is open; while an older one is, the older stays refused."""
    meta, _ = cluster

    async def go() -> None:
        async with serving(meta) as (port, p, parts):
            old = await mounted(port, 5, connection_seq=1)
            new = await mounted(port, 5, connection_seq=2)
            new.close()
            await _until(lambda: parts._mounted_by[(5, 0)] == 1)
            assert parts.newest_mount == {(5, 0): 2}
            old.send(append(5, 1, -1, b"from the old connection"))  # still older than the newest: dropped
            old.send(cp.Flush(2, 0))
            await old.until(lambda m: isinstance(m, cp.FlushResponse))
            assert p.high_water_mark == -1
            old.close()
            await _until(lambda: not parts.newest_mount)

    asyncio.run(go())


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_flushes_waiting_on_stuck_appends_do_not_hold_up_other_requests(cluster) -> None:  # noqa: F811
    """Flushes wait for their partition's appends; with every slot of the connection's requests
    taken by Flushes stuck behind slow storage, the connection read nothing more (a review of
    the request slots found it). Flushes have slots of their own."""
    meta, _ = cluster

    async def go() -> None:
        async with serving(meta) as (port, p, _):
            assert isinstance(await p.append(AppendRequest(ReqId(9, GEN, 0, 1), -1, 0, b"committed")), Committed)
            assert p._task is not None
            p._task.cancel()  # the append loop stops: what is queued from now on waits
            await asyncio.gather(p._task, return_exceptions=True)
            c = await RawClient.connect(port)
            c.send(append(5, 1, 0, b"stuck"))
            for i in range(connection.REQUESTS_IN_FLIGHT + 2):
                c.send(cp.Flush(100 + i, 0))
            c.send(cp.TransactionDataRequest(7, 0, 0))
            answer = await c.next(10)
            assert isinstance(answer, cp.TransactionDataResponse) and answer.data == b"committed", answer
            c.close()
            await p.start()  # let the stuck append and the Flushes finish before closing

    asyncio.run(go())
