"""The client protocol served over a real partition (store session on three real storage nodes),
spoken by a raw protocol client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from support.processes import stop
from test_store_session import cluster  # noqa: F401  (fixture)
from waltz import client_protocol as cp
from waltz.server import connection
from waltz.server.connection import ClientConnection, Partitions
from waltz.server.lock_table import lock_hash
from waltz.server.partition import AppendRequest, Committed, LockFailed, ServerPartition
from waltz.server.store_session import StoreSession
from waltz.storage import ReqId

GEN = 1
LOCK = lock_hash("account", 1)


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.messages = cp.MessageReader()

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        c = cls(*await asyncio.open_connection("127.0.0.1", port))
        c.send(cp.Hello())
        assert await c.next() == cp.HelloOk(cp.VERSION)
        return c

    def send(self, msg: cp.Message) -> None:
        self.writer.write(msg.frame())

    async def next(self, timeout: float = 10.0) -> cp.Message | None:
        """The next message, or None when the server closed the connection."""
        while (m := self.messages.next_message()) is None:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                return None
            self.messages.feed(data)
        return m

    async def until(self, pred: Callable[[cp.Message], bool], timeout: float = 10.0) -> list[cp.Message]:
        got: list[cp.Message] = []
        while True:
            m = await self.next(timeout)
            assert m is not None, f"connection closed; got {got}"
            got.append(m)
            if pred(m):
                return got

    def close(self) -> None:
        self.writer.close()


def feed_ids(msgs: list[cp.Message]) -> list[int]:
    return [e.transaction_id for m in msgs if isinstance(m, cp.FeedData) for e in m.entries]


def append(client: int, seq: int, hwm: int, data: bytes = b"x", gen: int = GEN, **locks: Any) -> cp.Append:
    return cp.Append((client, gen, 0, seq), hwm, 0, data, **locks)


@contextlib.asynccontextmanager
async def serving(
    meta: Any, writers: list[asyncio.StreamWriter] | None = None
) -> AsyncIterator[tuple[int, ServerPartition, Partitions]]:
    """Partition 0 served on a port: (port, partition, the registry connections look it up in).
    The server's side of each connection goes into `writers`."""
    session = await StoreSession.open(meta, 0, generation=GEN)
    p = ServerPartition(0, GEN, session)
    await p.start()
    parts = Partitions()
    parts.by_id[0] = p

    def connected(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> Awaitable[None]:
        if writers is not None:
            writers.append(w)
        return ClientConnection(r, w, parts).run()

    server = await asyncio.start_server(connected, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], p, parts
    finally:
        server.close()
        await p.close()


def serve(meta: Any, body: Callable[[int, ServerPartition], Awaitable[None]]) -> None:
    async def go() -> None:
        async with serving(meta) as (port, p, _):
            await body(port, p)

    asyncio.run(go())


def test_mount_feed_append_and_lock_failure(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        for i in range(20):
            await p.append(AppendRequest(ReqId(9, GEN, 0, i), i - 1, 0, b"old"))
        c = await RawClient.connect(port)
        c.send(cp.Mount(1, 0, 5, -1, 1))
        got = await c.until(lambda m: isinstance(m, cp.MountResponse))
        assert feed_ids(got) == list(range(20))  # everything before READY
        assert got[-1] == cp.MountResponse(1, 0, cp.MountStatus.READY, 19, GEN)

        c.send(append(5, 1, 19, b"mine", write_locks=(LOCK,)))
        got = await c.until(lambda m: isinstance(m, cp.FeedData))
        (entry,) = got[-1].entries  # type: ignore[attr-defined]
        assert (entry.transaction_id, entry.req_id) == (20, (5, GEN, 0, 1))
        c.send(append(5, 2, 19, b"conflict", write_locks=(LOCK,)))  # computed before 20
        got = await c.until(lambda m: isinstance(m, cp.LockFailure))
        assert got[-1] == cp.LockFailure((5, GEN, 0, 2), 20)

        c.send(cp.TransactionDataRequest(7, 0, 20))
        got = await c.until(lambda m: isinstance(m, cp.TransactionDataResponse))
        assert got[-1] == cp.TransactionDataResponse(7, 0, 20, b"mine")
        c.send(cp.TransactionDataRequest(8, 0, 99))
        got = await c.until(lambda m: isinstance(m, cp.Failure))
        assert got[-1].kind == cp.FailureKind.NOT_COMMITTED  # type: ignore[attr-defined]
        c.send(cp.HighWaterMarkRequest(9, 0))
        assert (await c.until(lambda m: isinstance(m, cp.HighWaterMarkResponse)))[-1] == cp.HighWaterMarkResponse(
            9, 0, 20
        )
        c.send(cp.FeedRequest(10, 0, 15, 3))
        got = await c.until(lambda m: isinstance(m, cp.FeedData) and m.seq == 10)
        assert [e.transaction_id for e in got[-1].entries] == [16, 17, 18]  # type: ignore[attr-defined]
        c.close()

    serve(meta, body)


def test_mount_refusals(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        c = await RawClient.connect(port)
        c.send(cp.Mount(1, 0, 5, 100, 1))
        assert await c.next() == cp.MountResponse(1, 0, cp.MountStatus.CLIENT_AHEAD, -1, GEN)
        c.send(cp.Mount(2, 3, 5, -1, 1))
        assert await c.next() == cp.MountResponse(2, 3, cp.MountStatus.NOT_READY, -1, -1)
        c.send(append(5, 1, -1, gen=GEN + 7))  # another generation: ignored, never committed
        c.send(cp.Flush(3, 0))
        assert (await c.until(lambda m: isinstance(m, cp.FlushResponse)))[-1] == cp.FlushResponse(3, 0, -1)
        assert p.high_water_mark == -1
        c.close()

    serve(meta, body)


def test_an_older_connection_of_the_client_is_ignored(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        old = await RawClient.connect(port)
        old.send(cp.Mount(1, 0, 5, -1, 1))
        await old.until(lambda m: isinstance(m, cp.MountResponse))
        new = await RawClient.connect(port)
        new.send(cp.Mount(1, 0, 5, -1, 2))
        await new.until(lambda m: isinstance(m, cp.MountResponse))
        old.send(append(5, 1, -1, b"from the old connection"))
        new.send(append(5, 2, -1, b"from the new connection"))
        got = await new.until(lambda m: isinstance(m, cp.FeedData))
        assert [(e.transaction_id, e.req_id[3]) for m in got if isinstance(m, cp.FeedData) for e in m.entries] == [
            (0, 2)
        ]
        new.send(cp.Flush(2, 0))
        await new.until(lambda m: isinstance(m, cp.FlushResponse))
        assert p.high_water_mark == 0
        assert await p.transaction_data(0) == b"from the new connection"
        old.close()
        new.close()

    serve(meta, body)


def test_a_mount_under_a_held_client_id_needs_its_token(cluster) -> None:  # noqa: F811
    """Issue 34, finding 3: a client id mounted on a partition is bound to the token its Mount
    proved while a connection holds the mount; another token is refused (and cannot append under
    the id), the same token on a new connection takes over, and the binding ends with the last
    connection holding it."""
    meta, _ = cluster
    token, other = b"a" * cp.TOKEN_BYTES, b"b" * cp.TOKEN_BYTES

    async def body(port: int, p: ServerPartition) -> None:
        owner = await RawClient.connect(port)
        owner.send(cp.Mount(1, 0, 5, -1, 10, token))
        await owner.until(lambda m: isinstance(m, cp.MountResponse))
        spoof = await RawClient.connect(port)
        spoof.send(cp.Mount(1, 0, 5, -1, 11, other))
        refused = await spoof.next()
        assert isinstance(refused, cp.Failure) and refused.kind == cp.FailureKind.CLIENT_REFUSED, refused
        spoof.send(append(5, 1, -1, b"forged"))
        rejected = await spoof.next()
        assert isinstance(rejected, cp.Failure) and rejected.kind == cp.FailureKind.APPEND_REJECTED, rejected
        owner.send(append(5, 1, -1, b"mine"))
        assert feed_ids(await owner.until(lambda m: isinstance(m, cp.FeedData))) == [0]
        again = await RawClient.connect(port)  # the owner's new connection: same token, newer seq
        again.send(cp.Mount(1, 0, 5, 0, 12, token))
        ready = (await again.until(lambda m: isinstance(m, cp.MountResponse)))[-1]
        assert isinstance(ready, cp.MountResponse) and ready.status == cp.MountStatus.READY
        owner.close()
        again.close()
        await asyncio.sleep(0.2)  # the server sees both close
        spoof.send(cp.Mount(2, 0, 5, 0, 13, other))
        ready = (await spoof.until(lambda m: isinstance(m, cp.MountResponse)))[-1]
        assert isinstance(ready, cp.MountResponse) and ready.status == cp.MountStatus.READY
        assert await p.transaction_data(0) == b"mine" and p.high_water_mark == 0
        spoof.close()

    serve(meta, body)


def test_a_mount_far_ahead_of_the_clock_is_refused(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        c = await RawClient.connect(port)
        c.send(cp.Mount(1, 0, 5, -1, 2**62))
        refused = await c.next()
        assert isinstance(refused, cp.Failure) and refused.kind == cp.FailureKind.CLIENT_REFUSED, refused
        assert "ahead of this server's clock" in refused.message
        c.send(cp.Mount(2, 0, 5, -1, 1))  # not recorded as the newest: a sane seq mounts
        ready = (await c.until(lambda m: isinstance(m, cp.MountResponse)))[-1]
        assert isinstance(ready, cp.MountResponse) and ready.status == cp.MountStatus.READY
        c.close()

    serve(meta, body)


def test_a_client_of_an_older_protocol_version_is_told_why(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        c = RawClient(*await asyncio.open_connection("127.0.0.1", port))
        c.send(cp.Hello(1, 1))
        told = await c.next()
        assert isinstance(told, cp.Failure) and f"version {cp.VERSION}" in told.message, told
        assert await c.next() is None
        c.close()

    serve(meta, body)


def test_a_malformed_frame_closes_only_that_connection(cluster) -> None:  # noqa: F811
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        good = await RawClient.connect(port)
        bad = await RawClient.connect(port)
        frame = bytearray(append(5, 1, -1).frame())
        frame[-1] ^= 0xFF
        bad.writer.write(bytes(frame))
        assert await bad.next() is None  # closed
        good.send(cp.HighWaterMarkRequest(1, 0))
        assert await good.next() == cp.HighWaterMarkResponse(1, 0, -1)
        good.close()

    serve(meta, body)


def test_a_large_data_response_never_delays_the_feed(cluster) -> None:  # noqa: F811
    """Two connections, as a client keeps them: a large transaction-data response that the RPC
    connection does not even read must not hold back the feed on the stream connection."""
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        await p.append(AppendRequest(ReqId(9, GEN, 0, 0), -1, 0, bytes(8 << 20)))  # 8 MiB of data
        stream, rpc = await RawClient.connect(port), await RawClient.connect(port)
        stream.send(cp.Mount(1, 0, 5, 0, 1))
        await stream.until(lambda m: isinstance(m, cp.MountResponse))
        for i in range(5):
            rpc.send(cp.TransactionDataRequest(i, 0, 0))  # ~40 MiB of answers, never read
        await asyncio.sleep(0.2)
        for seq in range(1, 4):
            stream.send(append(5, seq, p.high_water_mark, b"small"))
            got = await stream.until(lambda m: isinstance(m, cp.FeedData), timeout=10)
            assert got[-1].entries[-1].req_id == (5, GEN, 0, seq)  # type: ignore[attr-defined]
        stream.close()
        rpc.close()

    serve(meta, body)


def test_a_feed_behind_a_full_socket_waits_and_loses_nothing(cluster) -> None:  # noqa: F811
    """Commits are written to a waiting feed in their own turn only while nothing is queued on
    the connection: behind answers the client has not read yet, they wait (the server buffers
    nothing more for that client) and then all arrive, in order."""
    meta, _ = cluster

    async def go() -> None:
        writers: list[asyncio.StreamWriter] = []
        async with serving(meta, writers) as (port, p, _):
            await p.append(AppendRequest(ReqId(9, GEN, 0, 0), -1, 0, bytes(8 << 20)))  # 8 MiB of data
            c = await RawClient.connect(port)
            c.send(cp.Mount(1, 0, 5, 0, 1))
            await c.until(lambda m: isinstance(m, cp.MountResponse))
            for i in range(3):
                c.send(cp.TransactionDataRequest(i, 0, 0))  # ~24 MiB of answers, not read yet
            await asyncio.sleep(0.2)
            buffered = writers[0].transport.get_write_buffer_size()
            assert buffered > 0
            for seq in range(20):
                await p.append(AppendRequest(ReqId(7, GEN, 0, seq), p.high_water_mark, 0, b"s"))
            assert writers[0].transport.get_write_buffer_size() == buffered
            got = await c.until(lambda m: isinstance(m, cp.FeedData) and m.entries[-1].transaction_id == 20, timeout=30)
            assert feed_ids(got) == list(range(1, 21))
            assert [m.seq for m in got if isinstance(m, cp.TransactionDataResponse)] == [0, 1, 2]
            c.close()

    asyncio.run(go())


def test_feed_frames_are_encoded_once_for_every_connection(cluster) -> None:  # noqa: F811
    meta, _ = cluster
    received: list[bytes] = []

    async def go() -> None:
        session = await StoreSession.open(meta, 0, generation=GEN)
        p = ServerPartition(0, GEN, session)
        await p.start()
        parts = Partitions()
        parts.by_id[0] = p
        encoded: list[bytes] = []
        original = parts.feed_frame

        def counting(partition: ServerPartition, entries: Any) -> bytes:
            frame = original(partition, entries)
            encoded.append(frame)
            return frame

        parts.feed_frame = counting  # type: ignore[method-assign]
        server = await asyncio.start_server(lambda r, w: ClientConnection(r, w, parts).run(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            clients = [await RawClient.connect(port) for _ in range(3)]
            for i, c in enumerate(clients):
                c.send(cp.Mount(1, 0, 10 + i, -1, 1))
                await c.until(lambda m: isinstance(m, cp.MountResponse))
            await p.append(AppendRequest(ReqId(9, GEN, 0, 0), -1, 0, b"shared"))
            for c in clients:
                got = await c.until(lambda m: isinstance(m, cp.FeedData))
                received.append(got[-1].frame())
            # Three connections were sent the same frame object: built once, then taken from the cache.
            assert len(encoded) == 3 and encoded[0] is encoded[1] is encoded[2]
            assert received[0] == received[1] == received[2] == encoded[0]
            for c in clients:
                c.close()
        finally:
            server.close()
            await p.close()

    asyncio.run(go())


async def mounted(port: int, client: int = 5, connection_seq: int = 1) -> RawClient:
    """A connection of `client` that mounted partition 0 from -1 (its answer read)."""
    c = await RawClient.connect(port)
    c.send(cp.Mount(1, 0, client, -1, connection_seq))
    await c.until(lambda m: isinstance(m, cp.MountResponse))
    return c


async def mounted_with_appends(port: int, client: int = 7, count: int = 3000) -> RawClient:
    """A connection of `client` that mounted partition 0 and sent `count` appends of 2 KB at
    once (more than one batch can commit before the next message is read)."""
    c = await mounted(port, client)
    for i in range(1, count + 1):
        c.send(append(client, i, -1, b"in flight %d " % i + bytes(2000)))
    return c


def test_a_mount_answers_ready_only_after_the_clients_earlier_appends_resolved(cluster) -> None:  # noqa: F811
    """The client fails every pending append once READY arrives: none of its appends from an
    older connection may commit after that."""
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        old = await mounted_with_appends(port)
        await asyncio.sleep(0.05)  # some read by the server and in flight, more queued
        new = await RawClient.connect(port)
        new.send(cp.Mount(2, 0, 7, -1, 2))
        got = await new.until(lambda m: isinstance(m, cp.MountResponse))
        ready = got[-1]
        assert isinstance(ready, cp.MountResponse) and ready.status == cp.MountStatus.READY
        before = feed_ids(got)
        await asyncio.sleep(1.0)
        committed_later = [
            e
            for e in (
                await p.feed(ready.high_water_mark, 1000).__anext__()
                if p.high_water_mark > ready.high_water_mark
                else []
            )
        ]
        assert committed_later == [], f"{len(committed_later)} appends of the old connection committed after READY"
        assert before == list(range(ready.high_water_mark + 1))
        assert ready.high_water_mark >= 0  # some did commit, and all of them before READY
        old.close()
        new.close()

    serve(meta, body)


def test_a_flush_never_vouches_for_appends_whose_store_session_ended(cluster) -> None:  # noqa: F811
    """A client runs again every append the feed has not shown by a FlushResponse's mark. An
    append whose store session ended has no outcome yet (the next session's recovery may still
    commit it), so the answer to a Flush is then STORE_UNAVAILABLE, on which clients mount
    again and let READY settle it; a mark here could commit one transaction twice."""
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        c = await mounted_with_appends(port)
        while p.high_water_mark < 0:  # the server is reading them; most are queued or in flight
            await asyncio.sleep(0.001)
        p.session._fail("ended by the test")
        c.send(cp.Flush(9000, 0))
        got = await c.until(lambda m: isinstance(m, (cp.Failure, cp.FlushResponse)) and m.seq == 9000)
        assert isinstance(got[-1], cp.Failure) and got[-1].kind == cp.FailureKind.STORE_UNAVAILABLE, got[-1]
        assert not any(isinstance(m, cp.FlushResponse) for m in got)
        c.close()

    serve(meta, body)


def test_a_mount_whose_partition_was_replaced_is_told_to_mount_again(cluster) -> None:  # noqa: F811
    """Found by `waltz torture`: the server stops a partition when its metadata session is
    suspended and serves it again (same generation, new store session) when it returns. A feed
    that saw commits of the replaced instance ended without a word, and its client waited for
    a feed that never moved again. It must get a Failure, on which clients mount again."""
    meta, _ = cluster

    async def go() -> None:
        async with serving(meta) as (port, p, parts):
            c = await mounted(port)
            del parts.by_id[0]  # taken out of the registry, as PartitionHost does when it stops one
            await p.append(AppendRequest(ReqId(9, GEN, 0, 1), -1, 0, b"committed as it stopped"))
            got = await c.until(lambda m: isinstance(m, cp.Failure))
            assert got[-1].kind == cp.FailureKind.STORE_UNAVAILABLE  # type: ignore[attr-defined]
            c.close()

    asyncio.run(go())


# -- Regressions from an adversarial review of the client port (connection.py, the partition's
#    admission): a client that never reads, storage failing under a feed request, malformed
#    marks, oversized lock lists, a client mark above the committed one. Each failed on the code
#    before its fix. ------------------------------------------------------------------------------


def _small_buffers(c: RawClient, server_writer: asyncio.StreamWriter) -> None:
    """64 KiB in the kernel on every side of the connection (autotuning lets it take megabytes),
    so what the server holds back itself shows."""
    for sock, option in (
        (c.writer.get_extra_info("socket"), socket.SO_RCVBUF),
        (c.writer.get_extra_info("socket"), socket.SO_SNDBUF),
        (server_writer.get_extra_info("socket"), socket.SO_RCVBUF),
        (server_writer.get_extra_info("socket"), socket.SO_SNDBUF),
    ):
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
            assert [(a.seq, len(a.data)) for a in answers if isinstance(a, cp.TransactionDataResponse)] == [
                (i, len(data)) for i in range(n)
            ]
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
            assert isinstance(
                await p.append(AppendRequest(ReqId(9, GEN, 0, 1), -1, 0, b"w", write_locks=(LOCK,))), Committed
            )
            c = await mounted(port, 5)  # appends are taken only under the connection's mount
            _small_buffers(c, writers[0])
            n = 60_000
            c.writer.write(append(5, 1, -1, b"", write_locks=(LOCK,)).frame() * n)  # each saw nothing: each fails
            await asyncio.sleep(3.0)
            held = writers[0].transport.get_write_buffer_size()
            assert held < 2 * connection.WRITE_BUFFER_LIMIT, f"{held} bytes of answers wait in the server"
            assert c.writer.transport.get_write_buffer_size() > 0, (
                "the server read every request of a client that reads nothing"
            )
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
            assert (
                isinstance(failed, cp.Failure) and failed.kind == cp.FailureKind.STORE_UNAVAILABLE and failed.seq == 3
            ), failed
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
            c = await mounted(port, 5)  # appends are taken only under the connection's mount
            assert p._task is not None
            p._task.cancel()  # the append loop stops: what is queued from now on waits
            await asyncio.gather(p._task, return_exceptions=True)
            c.send(append(5, 1, 0, b"stuck"))
            for i in range(connection.REQUESTS_IN_FLIGHT + 2):
                c.send(cp.Flush(100 + i, 0))
            c.send(cp.TransactionDataRequest(7, 0, 0))
            answer = await c.next(10)
            assert isinstance(answer, cp.TransactionDataResponse) and answer.data == b"committed", answer
            c.close()
            await p.start()  # let the stuck append and the Flushes finish before closing

    asyncio.run(go())


def test_client_ids_come_from_the_cluster_counter_and_are_bounded_per_connection(cluster) -> None:  # noqa: F811
    """Client Id Request (issue 34: clients no longer write the metadata): each answer is a new
    id from the cluster's counter, before any Mount; a connection gets at most
    MAX_CLIENT_IDS_PER_CONNECTION, then a Failure (client refused) and still works; a port that
    does not allocate says so."""
    meta, _ = cluster
    limit = connection.MAX_CLIENT_IDS_PER_CONNECTION

    async def go() -> None:
        def connected(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> Awaitable[None]:
            return ClientConnection(
                r, w, Partitions(), client_ids=lambda: asyncio.to_thread(meta.next_id, "client")
            ).run()

        server = await asyncio.start_server(connected, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            c = await RawClient.connect(port)
            ids = []
            for seq in range(1, limit + 1):
                c.send(cp.ClientIdRequest(seq))
                answer = await c.next()
                assert isinstance(answer, cp.ClientIdResponse) and answer.seq == seq, answer
                ids.append(answer.client_id)
            assert ids == list(range(ids[0], ids[0] + limit))
            c.send(cp.ClientIdRequest(99))
            refused = await c.next()
            assert isinstance(refused, cp.Failure) and refused.kind == cp.FailureKind.CLIENT_REFUSED, refused
            assert refused.seq == 99 and f"at most {limit} client ids" in refused.message
            c.send(cp.ClientIdRequest(100))  # the connection goes on
            assert isinstance(await c.next(), cp.Failure)
            other = await RawClient.connect(port)
            other.send(cp.ClientIdRequest(1))
            answer = await other.next()
            assert isinstance(answer, cp.ClientIdResponse) and answer.client_id == ids[-1] + 1, answer
            assert meta.next_id("client") == ids[-1] + 2  # the counter in the metadata moved with them
            c.close()
            other.close()
        finally:
            server.close()

    asyncio.run(go())

    async def unoffered(port: int, p: ServerPartition) -> None:
        c = await RawClient.connect(port)
        c.send(cp.ClientIdRequest(3))
        told = await c.next()
        assert isinstance(told, cp.Failure) and "does not allocate client ids" in told.message, told
        c.close()

    serve(meta, unoffered)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_mounted_stream_cut_anywhere_is_handled_in_order(cluster) -> None:  # noqa: F811
    """Once mounted, a connection's bytes go straight to its decoder and its Appends are queued
    as they arrive, the rest left to its loop (`_InlineReading`). Appends mixed with requests,
    lock failures and appends it may not make, sent in pieces of a few bytes so that frames
    arrive cut in two while the loop waits, are each handled once and in order: the good appends
    commit in the order sent, the answers of each kind come in the order of their requests."""
    meta, _ = cluster

    async def body(port: int, p: ServerPartition) -> None:
        assert isinstance(
            await p.append(AppendRequest(ReqId(9, GEN, 0, 1), -1, 0, b"w", write_locks=(LOCK,))), Committed
        )
        c = await RawClient.connect(port)
        c.send(cp.Mount(1, 0, 5, 0, 1))
        await c.until(lambda m: isinstance(m, cp.MountResponse))
        stream, seq, expected = b"", 0, []
        for i in range(60):
            seq += 1
            kind = i % 5
            if kind == 1:
                stream += cp.HighWaterMarkRequest(1000 + i, 0).frame()
                expected.append(("hwm", 1000 + i))
            elif kind == 2:
                stream += append(5, seq, -1, b"old", write_locks=(LOCK,)).frame()  # saw nothing: fails
                expected.append(("lock", seq))
            elif kind == 3:
                stream += cp.Append((5, GEN, 1, seq), -1, 0, b"no").frame()  # partition 1: not mounted
                expected.append(("refused", seq))
            else:
                stream += append(5, seq, 0, f"good {seq}".encode()).frame()
                expected.append(("commit", seq))
        for at in range(0, len(stream), 7):
            c.writer.write(stream[at : at + 7])
            await asyncio.sleep(0)  # the server reads the pieces as they come
        goods = [s for k, s in expected if k == "commit"]
        answers: list[tuple[str, int]] = []
        committed: list[int] = []
        while len(committed) < len(goods) or len(answers) < len(expected) - len(goods):
            m = await c.next(20)
            assert m is not None, "the connection closed"
            if isinstance(m, cp.FeedData):
                committed += [e.req_id[3] for e in m.entries if e.req_id[0] == 5]
            elif isinstance(m, cp.HighWaterMarkResponse):
                answers.append(("hwm", m.seq))
            elif isinstance(m, cp.LockFailure):
                answers.append(("lock", m.req_id[3]))
            else:
                assert isinstance(m, cp.Failure) and m.kind == cp.FailureKind.APPEND_REJECTED, m
                answers.append(("refused", m.seq))
        assert committed == goods
        for kind in ("hwm", "lock", "refused"):  # a lock failure is written with its batch, a turn later
            assert [s for k, s in answers if k == kind] == [s for k, s in expected if k == kind], kind
        assert p.high_water_mark == len(goods)
        c.close()

    serve(meta, body)
