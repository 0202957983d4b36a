"""The storage node over TCP, black-box through the asyncio client (and raw sockets for bad input)."""

from __future__ import annotations

import asyncio
import pathlib
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
import zlib

import pytest
from support import script
from waltz import errors
from waltz._native import ResponseReader, encode_append, encode_request
from waltz.storage import RecordBatch, ReqId, Storage, StorageClient, StorageNode

NODE_PROCESS = script("node_process.py")


def batch(first: int, n: int, size: int = 100) -> RecordBatch:
    return RecordBatch([(ReqId(3, 1, 0, t), t, bytes([t % 251]) * size) for t in range(first, first + n)])


@pytest.fixture
def cluster(tmp_path):
    key = uuid.uuid4()
    path = tmp_path / "node"
    s = Storage.create(path, key, 4)
    s.add_partition(0)
    s.add_partition(1)
    node = StorageNode.start(s, max_list_count=50, max_list_bytes=2_000, idle_timeout=2.0)
    yield key, node, s, path
    node.stop()
    s.close()


def run(coro):
    return asyncio.run(coro)


def connect(key, node, **kw):
    host, port = node.address
    return StorageClient.connect(host, port, cluster_key=key, partition_count=4, **kw)


def test_every_request_and_its_answer(cluster):
    key, node, _, _ = cluster

    async def go():
        async with await connect(key, node) as c:
            assert await c.last_session_info(0, 1) == (-1, -1)
            assert await c.max_transaction_id(0, 1) == -1
            await c.set_low_water_mark(0, 1, -1)
            assert await c.last_session_info(0, 1) == (1, -1)
            # Pipelined: 20 appends in flight at once on one connection.
            await asyncio.gather(*(c.append(0, 1, i * 10, batch(i * 10, 10)) for i in range(20)))
            assert await c.max_transaction_id(0, 1) == 199
            r = await c.record(0, 1, 57)
            assert (r.txid, r.header, r.data, r.req_id.sequence) == (57, 57, bytes([57]) * 100, 57)
            h = await c.record_header(0, 1, 58)
            assert (h.txid, h.header) == (58, 58)
            assert await c.record(0, 1, 200) is None
            assert await c.record_header(0, 1, 200) is None
            assert [x.txid for x in await c.record_headers(0, 1, 10, 5)] == [10, 11, 12, 13, 14]
            # Lists are bounded by the node: 50 entries at most, 2,000 bytes of data at most.
            assert len(await c.record_headers(0, 1, 0, 10_000)) == 50
            assert len(await c.records(0, 1, 0, 10_000)) == 2_000 // 100
            await c.truncate(0, 1, 149)
            assert await c.max_transaction_id(0, 1) == 149
            await c.append(0, 1, 150, batch(150, 1))
            # Partitions are independent.
            assert await c.max_transaction_id(1, 1) == -1

    run(go())


def test_failures_are_answered_with_their_kind(cluster):
    key, node, _, _ = cluster

    async def go():
        async with await connect(key, node) as c:
            await c.append(0, 5, 0, batch(0, 3))
            with pytest.raises(errors.NonDenseAppendError, match="expected 3"):
                await c.append(0, 5, 7, batch(7, 1))
            with pytest.raises(errors.StaleSessionError, match="older than session 5"):
                await c.append(0, 4, 3, batch(3, 1))
            with pytest.raises(errors.StaleSessionError):
                await c.max_transaction_id(0, 4)
            with pytest.raises(errors.PartitionNotFoundError):
                await c.max_transaction_id(2, 5)
            with pytest.raises(errors.PartitionNotFoundError):
                await c.max_transaction_id(9, 5)
            with pytest.raises(errors.BelowLogStartError):
                await c.truncate(0, 5, -5)
            # The connection survives failures.
            assert await c.max_transaction_id(0, 6) == 2

        with pytest.raises(errors.ClusterKeyMismatch, match="does not match"):
            await StorageClient.connect(*node.address, cluster_key=uuid.uuid4(), partition_count=4)
        with pytest.raises(errors.PartitionCountMismatch):
            await StorageClient.connect(*node.address, cluster_key=key, partition_count=5)

    run(go())


def test_data_and_fence_survive_a_restart(tmp_path):
    key = uuid.uuid4()
    path = tmp_path / "node"
    s = Storage.create(path, key, 1)
    s.add_partition(0)

    async def first(node):
        async with await connect_n(key, node, 1) as c:
            await c.set_low_water_mark(0, 7, -1)
            await c.append(0, 7, 0, batch(0, 30))

    async def second(node):
        async with await connect_n(key, node, 1) as c:
            assert await c.last_session_info(0, 8) == (7, -1)
            assert await c.max_transaction_id(0, 8) == 29
            assert (await c.record(0, 8, 29)).data == bytes([29]) * 100
        async with await connect_n(key, node, 1) as c:
            with pytest.raises(errors.StaleSessionError):
                await c.append(0, 6, 30, batch(30, 1))

    with StorageNode.start(s) as node:
        run(first(node))
    s.close()
    s = Storage.open(path)
    with StorageNode.start(s) as node:
        run(second(node))
    s.close()


def connect_n(key, node, partitions):
    return StorageClient.connect(*node.address, cluster_key=key, partition_count=partitions)


def frame(body: bytes, magic: int = 0x5753, msg_type: int = 0x01) -> bytes:
    """One frame around `body` (Hello unless `msg_type` says otherwise), CRC and all."""
    inner = struct.pack(">HBB", magic, 1, msg_type) + body
    crc = zlib.crc32(inner)
    return struct.pack(">I", len(inner) + 4) + inner + struct.pack(">I", crc)


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(3)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff\xff" + b"x" * 10,  # a length above the maximum frame
        b"\x00\x00\x00\x02ab",  # shorter than a frame header
        frame(b"\x01\x01", magic=0x1234),  # wrong magic
        frame(b"\x01\x01")[:-1] + b"\x00",  # wrong CRC
        frame(b"\x05\x09"),  # unsupported versions
        encode_request("max_transaction_id", 1, 1, 0),  # no Hello first
        encode_request("hello") + frame(b"\x00" * 20)[:7] + b"\x7f" + frame(b"\x00" * 20)[8:],  # unknown type
    ],
    ids=["oversized", "short", "magic", "crc", "version", "no-hello", "unknown-type"],
)
def test_bad_frames_close_only_their_connection(cluster, payload):
    key, node, _, _ = cluster

    async def healthy_client_keeps_working():
        async with await connect(key, node) as c:
            await c.append(0, 1, 0, batch(0, 5))
            bad = socket.create_connection(node.address)
            bad.sendall(payload)
            assert closed_by_peer(bad)
            bad.close()
            await c.append(0, 1, 5, batch(5, 5))
            assert await c.max_transaction_id(0, 1) == 9

    run(healthy_client_keeps_working())


def test_disconnect_mid_frame_and_idle_clients_are_dropped(cluster):
    key, node, _, _ = cluster
    half = socket.create_connection(node.address)
    half.sendall(encode_request("hello")[:5])
    half.close()
    idle = socket.create_connection(node.address)
    assert closed_by_peer(idle)  # idle_timeout is 2 s in this fixture

    async def still_serving():
        async with await connect(key, node) as c:
            assert await c.max_transaction_id(0, 1) == -1

    run(still_serving())


def test_an_opened_connection_outlives_idle_timeout_and_one_not_opened_does_not(cluster):
    """A quiet partition must not cost a store session its replica connections; a peer that never
    opens is closed by the Open deadline (idle_timeout, 2 s here, being shorter than 10 s) even
    while it keeps sending, and the answer to a wrong cluster key does not tell the node's key."""
    key, node, _, _ = cluster

    async def go():
        async with await connect(key, node) as c:
            await c.append(0, 1, 0, batch(0, 2))
            await asyncio.sleep(3)
            await c.append(0, 1, 2, batch(2, 2))
            assert await c.max_transaction_id(0, 1) == 3

    chatty = socket.create_connection(node.address)
    other = uuid.uuid4()
    chatty.sendall(encode_request("hello") + encode_request("open", -1, 0, -1, cluster_key=other, partition_count=4))
    reader = ResponseReader()
    chatty.settimeout(3)
    answers: list[tuple] = []
    while len(answers) < 2:
        reader.feed(chatty.recv(65536))
        while (a := reader.next_response()) is not None:
            answers.append(a)
    assert answers[1][0] == "failure" and str(key) not in answers[1][4][1] and str(other) in answers[1][4][1]
    start = time.monotonic()
    with pytest.raises(OSError):
        while time.monotonic() - start < 8:
            chatty.sendall(encode_request("last_session_info", 1, 1, 0))
            if not chatty.recv(65536):
                raise ConnectionResetError("closed")
            time.sleep(0.2)
    assert time.monotonic() - start < 8
    run(go())


def test_max_connections_closes_the_connections_over_it(tmp_path):
    s = Storage.create(tmp_path / "node", uuid.uuid4(), 1)
    with pytest.raises(errors.InvalidArgumentError):
        StorageNode.start(s, max_connections=0)
    node = StorageNode.start(s, max_connections=1)
    try:
        kept = socket.create_connection(node.address)
        over = socket.create_connection(node.address)
        assert closed_by_peer(over)
        assert node.stats()["refused_connections"] == 1
        kept.sendall(encode_request("hello"))
        kept.settimeout(3)
        assert kept.recv(65536)
    finally:
        node.stop()
        s.close()


def test_response_reader_takes_a_large_buffer_of_small_frames():
    body = b"".join(frame(struct.pack(">qqi", 1, seq, 0), msg_type=0x80) for seq in range(100_000))
    r = ResponseReader()
    r.feed(body[:-5])
    seqs = []
    while (a := r.next_response()) is not None:
        seqs.append(a[1])
    r.feed(body[-5:])
    while (a := r.next_response()) is not None:
        seqs.append(a[1])
    assert seqs == list(range(100_000))


def test_100k_random_and_mutated_frames_never_disturb_the_node(cluster):
    """100,000 frames over 2,000 connections: each opens a valid session, then sends valid
    requests mixed with mutated and random frames. The node closes the connections it must,
    never crashes, and still serves exactly the data it had."""
    key, node, _, _ = cluster
    rng = random.Random(5)

    async def go():
        async with await connect(key, node) as c:
            await c.append(0, 1, 0, batch(0, 20))
        opening = encode_request("hello") + encode_request("open", -1, 0, -1, cluster_key=key, partition_count=4)
        valid = [
            encode_request("max_transaction_id", 1, 2, 0),
            encode_request("record", 1, 3, 0, txid=5),
            encode_request("record_list", 1, 4, 0, txid=0, max_count=3),
            encode_request("record_header_list", 1, 5, 1, txid=0, max_count=3),
            encode_request("last_session_info", 1, 6, 3),
            frame(b"\x01\x01"),
        ]
        sent = 0
        for _ in range(2_000):
            frames = []
            for _ in range(50):
                b = bytearray(rng.choice(valid))
                roll = rng.random()
                if roll < 0.3:
                    for _ in range(rng.randrange(1, 4)):
                        b[rng.randrange(len(b))] = rng.randrange(256)
                elif roll < 0.4:
                    b = bytearray(rng.randbytes(rng.randrange(1, 80)))
                elif roll < 0.5:
                    b = b[: rng.randrange(len(b))]
                frames.append(bytes(b))
            sent += len(frames)
            with socket.create_connection(node.address) as sock:
                try:
                    sock.sendall(opening + b"".join(frames))
                    sock.shutdown(socket.SHUT_WR)
                    sock.settimeout(5)
                    while sock.recv(65536):
                        pass
                except OSError:
                    pass
        assert sent >= 100_000
        async with await connect(key, node) as c:
            assert await c.max_transaction_id(0, 1) == 19
            assert [r.data for r in await c.records(0, 1, 0, 20)] == [bytes([t]) * 100 for t in range(20)]
        stats = node.stats()
        assert stats["closed_bad_frames"] > 1_000
        assert stats["connections"] >= 2_000

    run(go())


def test_kill9_during_pipelined_appends_loses_nothing_acknowledged(tmp_path):
    key = uuid.uuid4()
    path = tmp_path / "node"
    s = Storage.create(path, key, 1)
    s.add_partition(0)
    s.close()
    rng = random.Random(11)
    acked_total = 0
    for round_no in range(5):
        proc = subprocess.Popen([sys.executable, str(NODE_PROCESS), str(path)], stdout=subprocess.PIPE, text=True)
        port = int(proc.stdout.readline())
        acked: list[int] = []

        async def pump():
            c = await StorageClient.connect("127.0.0.1", port, cluster_key=key, partition_count=1, timeout=5)
            nxt = await c.max_transaction_id(0, 1) + 1

            async def one(first, n):
                await c.append(0, 1, first, batch(first, n))
                acked.append(first + n - 1)

            try:
                while True:
                    tasks = []
                    for _ in range(8):  # eight batches in flight at a time
                        n = rng.choice([1, 5, 20])
                        tasks.append(asyncio.create_task(one(nxt, n)))
                        nxt += n
                    await asyncio.gather(*tasks)
            except errors.WaltzError:
                return

        async def killer():
            await asyncio.sleep(rng.uniform(0.3, 0.8))
            proc.send_signal(signal.SIGKILL)

        async def both():
            await asyncio.gather(pump(), killer())

        run(both())
        proc.wait()
        assert acked, "nothing was acknowledged before the kill"
        p = Storage.open(path).partition(0)
        assert p.max_transaction_id >= max(acked), "acknowledged appends lost"
        for r in p.read_records(0, max_count=10**6, max_bytes=1 << 30):
            assert r.data == bytes([r.txid % 251]) * 100
        acked_total += len(acked)
    assert acked_total > 20


def test_admin_port_assigns_toggles_and_reports(tmp_path):
    from waltz.storage import StorageAdminClient

    key = uuid.uuid4()
    s = Storage.create(tmp_path / "node", key, 3)
    with StorageNode.start(s, admin_port=0) as node:
        admin_addr = node.admin_address
        assert admin_addr is not None

        async def go():
            async with await StorageAdminClient.connect(*admin_addr, cluster_key=key, partition_count=3) as admin:
                assert await admin.status() == []
                await admin.assign(1)
                await admin.assign(1)  # idempotent
                c = await StorageClient.connect(*node.address, cluster_key=key, partition_count=3)
                await c.append(1, 2, 0, batch(0, 4))
                [st] = await admin.status()
                assert (st["partition"], st["max_transaction_id"], st["newest_session"], st["failure"]) == (
                    1,
                    3,
                    2,
                    None,
                )
                assert (st["readable"], st["writable"]) == (True, True)

                await admin.set_availability(1, readable=True, writable=False)
                with pytest.raises(errors.StorageRequestError, match="not writable") as e:
                    await c.append(1, 2, 4, batch(4, 1))
                assert e.value.kind == "partition_not_writable"
                assert await c.max_transaction_id(1, 2) == 3  # reads still allowed
                await admin.set_availability(1, readable=False, writable=False)
                with pytest.raises(errors.StorageRequestError, match="not readable"):
                    await c.record(1, 2, 0)
                await admin.set_availability(1, readable=True, writable=True)
                await c.append(1, 2, 4, batch(4, 1))

                with pytest.raises(errors.PartitionNotFoundError):
                    await admin.set_availability(7, readable=True, writable=True)
                await admin.unassign(1, delete_files=True)
                assert await admin.status() == []
                with pytest.raises(errors.PartitionNotFoundError):
                    await c.max_transaction_id(1, 2)
                await c.close()

            with pytest.raises(errors.ClusterKeyMismatch):
                await StorageAdminClient.connect(*admin_addr, cluster_key=uuid.uuid4(), partition_count=3)

        run(go())
    s.close()


def test_the_fence_survives_a_restart_even_before_any_low_water_mark(tmp_path):
    """Session 6 only read (no Set Low-water Mark yet) when the node restarted: session 5 must
    still be refused afterwards, or an old server could write behind a new one's recovery."""
    key = uuid.uuid4()
    path = tmp_path / "node"
    s = Storage.create(path, key, 1)
    s.add_partition(0)

    async def before(node):
        async with await connect_n(key, node, 1) as c:
            await c.set_low_water_mark(0, 5, -1)
            await c.append(0, 5, 0, batch(0, 3))
            assert await c.max_transaction_id(0, 6) == 2  # session 6 seen: the fence moves

    async def after(node):
        async with await connect_n(key, node, 1) as c:
            assert await c.last_session_info(0, 6) == (5, -1)  # still the last session that set a mark
            with pytest.raises(errors.StaleSessionError, match="older than session 6"):
                await c.append(0, 5, 3, batch(3, 1))
            await c.append(0, 6, 3, batch(3, 1))

    with StorageNode.start(s) as node:
        run(before(node))
    s.close()
    s = Storage.open(path)
    with StorageNode.start(s) as node:
        run(after(node))
    s.close()


def test_requests_time_out_when_the_node_stops_answering(tmp_path):
    key = uuid.uuid4()
    path = tmp_path / "node"
    s = Storage.create(path, key, 1)
    s.add_partition(0)
    s.close()
    proc = subprocess.Popen([sys.executable, str(NODE_PROCESS), str(path)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def go():
            c = await StorageClient.connect("127.0.0.1", port, cluster_key=key, partition_count=1, timeout=1.0)
            assert await c.max_transaction_id(0, 1) == -1
            # Pipelined: a plain future with its own timer. It acknowledges once durable, fails
            # with the node's answer, and times out like any other request.
            await c.send_append(0, 2, 0, batch(0, 1))
            with pytest.raises(errors.StaleSessionError):
                await c.send_append(0, 1, 1, batch(1, 1))
            proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(errors.StorageTimeoutError, match="did not answer"):
                    await c.append(0, 2, 1, batch(1, 1))
                with pytest.raises(errors.StorageTimeoutError, match="did not answer"):
                    await asyncio.wait_for(c.send_append(0, 2, 1, batch(1, 1)), 10)
                assert not c._pending  # a timed-out request leaves nothing behind
                # Appends in flight share one deadline timer: each still fails at its own
                # deadline, and the later one no sooner than its own.
                first = c.send_append(0, 2, 1, batch(1, 1))
                await asyncio.sleep(0.5)
                second = c.send_append(0, 2, 2, batch(2, 1))
                with pytest.raises(errors.StorageTimeoutError, match="did not answer"):
                    await asyncio.wait_for(first, 10)
                assert not second.done()
                with pytest.raises(errors.StorageTimeoutError, match="did not answer"):
                    await asyncio.wait_for(second, 10)
                assert not c._pending
            finally:
                proc.send_signal(signal.SIGCONT)
            # The node answers again, and an append sent now is acknowledged, not left to a timer
            # that nobody armed.
            last = await c.max_transaction_id(0, 2)
            await asyncio.wait_for(c.send_append(0, 2, last + 1, batch(last + 1, 1)), 10)
            await c.close()

        run(go())
    finally:
        proc.kill()
        proc.wait()


def test_an_append_listener_runs_in_the_turn_that_read_the_answer(cluster):
    """The server's commit path hangs on `send_append`'s listener: it must run as soon as the
    answer is read (before any done callback, which waits for the next turn), see the future
    settled, hear failures too, and a listener that raises must not stop the connection."""
    key, node, _, _ = cluster

    async def go():
        loop = asyncio.get_running_loop()
        errors_seen = []
        loop.set_exception_handler(lambda _loop, ctx: errors_seen.append(ctx))
        async with await connect(key, node) as c:
            await c.last_session_info(0, 2)
            order = []

            def listener(f):
                # In the transport's callback that read the answer: no task, not a later turn.
                assert asyncio.current_task() is None
                order.append(("listener", f.done(), None if f.exception() is None else type(f.exception())))

            acked = c.send_append(0, 2, 0, batch(0, 3), listener)
            acked.add_done_callback(lambda f: order.append(("done callback",)))
            await acked
            await asyncio.sleep(0)
            assert order == [("listener", True, None), ("done callback",)]

            failed = []
            with pytest.raises(errors.StaleSessionError):
                await c.send_append(0, 1, 3, batch(3, 1), lambda f: failed.append(type(f.exception())))
            assert failed == [errors.StaleSessionError]

            def broken(f):
                raise RuntimeError("listener bug")

            await c.send_append(0, 2, 3, batch(3, 1), broken)
            assert await c.max_transaction_id(0, 2) == 3  # reading went on
            assert [type(ctx["exception"]) for ctx in errors_seen] == [RuntimeError]
            assert "listener" in errors_seen[0]["message"]

    run(go())


def read_answers(sock: socket.socket, n: int) -> list[tuple]:
    reader, got = ResponseReader(), []
    sock.settimeout(10)
    while len(got) < n:
        data = sock.recv(1 << 16)
        assert data, f"the node closed the connection after {len(got)} of {n} answers"
        reader.feed(data)
        while (r := reader.next_response()) is not None:
            got.append(r)
    return got


def test_appends_that_arrive_together_share_a_sync_and_are_answered_in_order(cluster):
    """One write carrying 40 appends and then a read: the node queues the appends, makes them
    durable with far fewer fdatasyncs than appends (its connection thread waits once for all),
    answers in request order, and the read after them sees every one."""
    key, node, storage, _ = cluster
    syncs_before = storage.partition(0).stats()["syncs"]
    with socket.create_connection(node.address) as sock:
        sock.sendall(encode_request("hello") + encode_request("open", -1, 1, -1, cluster_key=key, partition_count=4))
        assert [a[0] for a in read_answers(sock, 2)] == ["hello_ok", "success"]
        requests = b"".join(encode_append(1, 10 + t, 0, t, batch(t, 1)) for t in range(40))
        sock.sendall(requests + encode_request("max_transaction_id", 1, 50, 0))
        answers = read_answers(sock, 41)
    assert [a[1] for a in answers] == [10 + t for t in range(40)] + [50]
    assert all(a[0] == "success" for a in answers[:40]), answers[:3]
    assert answers[40][0] == "max_transaction_id" and answers[40][4] == 39
    assert storage.partition(0).max_transaction_id == 39
    syncs = storage.partition(0).stats()["syncs"] - syncs_before
    assert 1 <= syncs < 40, f"{syncs} fdatasyncs for 40 appends sent together"


def test_a_failed_append_among_queued_ones_is_answered_in_its_place(cluster):
    """An append that cannot be queued (not dense) between good ones: its failure comes back
    between their successes, in request order, and the good ones are durable."""
    key, node, storage, _ = cluster
    with socket.create_connection(node.address) as sock:
        sock.sendall(encode_request("hello") + encode_request("open", -1, 1, -1, cluster_key=key, partition_count=4))
        read_answers(sock, 2)
        sock.sendall(
            encode_append(1, 10, 1, 0, batch(0, 2))
            + encode_append(1, 11, 1, 7, batch(7, 1))
            + encode_append(1, 12, 1, 2, batch(2, 2))
        )
        answers = read_answers(sock, 3)
    assert [(a[0], a[1]) for a in answers] == [("success", 10), ("failure", 11), ("success", 12)]
    assert answers[1][4][0] == "non_dense_append"
    assert storage.partition(1).max_transaction_id == 3


def connection_threads() -> int:
    """Threads of this process named as the node names its connection threads."""
    count = 0
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "waltz-conn"
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that exited meanwhile
    return count


def settles_at(count, expected: int) -> int:
    """`count()` once it equals `expected` or after 10 s: a thread that ended its work may
    take a moment more to leave the process."""
    deadline = time.monotonic() + 10
    while (n := count()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def test_stopping_the_node_ends_its_connections(tmp_path):
    """Every connection has a thread of its own; stop ends them all, idle or not, before it
    returns, and closes their sockets."""
    key = uuid.uuid4()
    s = Storage.create(tmp_path / "node", key, 1)
    s.add_partition(0)
    node = StorageNode.start(s)
    before = connection_threads()
    socks = [socket.create_connection(node.address) for _ in range(5)]
    socks[0].sendall(
        encode_request("hello")
        + encode_request("open", -1, 1, -1, cluster_key=key, partition_count=1)
        + encode_append(1, 2, 0, 0, batch(0, 3))
    )
    assert [a[0] for a in read_answers(socks[0], 3)] == ["hello_ok", "success", "success"]
    assert settles_at(connection_threads, before + 5) == before + 5
    node.stop()
    assert settles_at(connection_threads, before) == before
    for sock in socks:
        assert closed_by_peer(sock)
        sock.close()
    s.close()


def test_a_client_that_never_reads_its_answers_is_dropped_and_others_are_served(tmp_path):
    key = uuid.uuid4()
    s = Storage.create(tmp_path / "node", key, 1)
    s.add_partition(0)
    node = StorageNode.start(s, max_list_bytes=1 << 20, idle_timeout=2.0)
    try:

        async def fill():
            async with await connect_n(key, node, 1) as c:
                big = RecordBatch([(ReqId(1, 1, 0, t), 0, bytes([t]) * 100_000) for t in range(10)])
                await c.append(0, 1, 0, big)

        run(fill())
        hog = socket.create_connection(node.address)
        hog.sendall(
            encode_request("hello")
            + encode_request("open", -1, 0, -1, cluster_key=key, partition_count=1)
            + b"".join(encode_request("record_list", 1, 10 + i, 0, txid=0, max_count=10) for i in range(200))
        )

        async def others_are_served():
            async with await connect_n(key, node, 1) as c:
                assert len(await c.records(0, 1, 0, 10)) == 10

        run(others_are_served())
        time.sleep(3.5)  # the hog reads nothing for longer than the node's idle timeout
        # It was disconnected: draining what the kernel already buffered ends in EOF or a reset,
        # not in 200 MB of answers.
        hog.settimeout(15)
        received = 0
        try:
            while chunk := hog.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        hog.close()
        assert received < 40 << 20, f"{received} bytes: the node kept answering a client that never read"
        run(others_are_served())
    finally:
        node.stop()
        s.close()


def test_a_failed_partition_will_not_say_what_it_holds_nor_take_a_session_until_reopened(tmp_path):
    """What `waltz torture` found: a node whose fsync failed reported its durable end as its max,
    took a new session's low-water mark, and after a restart held the unconfirmed record past
    that end again (it was written, only never confirmed durable): a record another session had
    committed differently at that id came back. A failed partition now refuses Max Transaction
    Id and Set Low-water Mark until it is reopened; reopened, it shows the tail, which recovery
    then truncates like any dirty tail."""
    strace = shutil.which("strace")
    assert strace, "strace is required (installed by the project's setup)"
    key = uuid.uuid4()
    path = tmp_path / "node"
    s = Storage.create(path, key, 1)
    s.add_partition(0)
    s.close()

    def start():
        proc = subprocess.Popen([sys.executable, str(NODE_PROCESS), str(path)], stdout=subprocess.PIPE, text=True)
        return proc, int(proc.stdout.readline())

    proc, port = start()
    tracer = None
    try:

        async def before(c):
            await c.set_low_water_mark(0, 5, -1)
            await c.append(0, 5, 0, batch(0, 10))

        failed_at = []

        async def fail(c):
            # Appends until the injected EIO strikes (the attach is seen, but whether strace
            # already rewrites the node's next fsync is not), at most a handful of batches.
            nxt = 10
            for _ in range(20):
                try:
                    await c.append(0, 5, nxt, batch(nxt, 3))
                except errors.StorageError as e:
                    assert "Input/output error" in str(e), e
                    break
                nxt += 3
            else:
                pytest.fail("no fsync failed although strace injects EIO into every one")
            failed_at.append(nxt)
            # Session 5 itself: a newer one would be refused already, its fence not being durable.
            for request in (lambda: c.max_transaction_id(0, 5), lambda: c.set_low_water_mark(0, 5, nxt - 1)):
                with pytest.raises(errors.PartitionFailedError, match="unknown until the node reopens it"):
                    await request()
            assert await c.last_session_info(0, 5) == (5, -1)  # no mark was taken

        def client(fn):
            async def go():
                async with await StorageClient.connect(
                    "127.0.0.1", port, cluster_key=key, partition_count=1, timeout=10
                ) as c:
                    await fn(c)

            run(go())

        client(before)
        tracer = subprocess.Popen(
            [
                strace,
                "-f",
                "-o",
                "/dev/null",
                "-p",
                str(proc.pid),
                "-e",
                "trace=fdatasync,fsync",
                "-e",
                "inject=fdatasync,fsync:error=EIO:when=1+",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        attached = tracer.stderr.readline()
        assert "attached" in attached, attached
        client(fail)
    finally:
        if tracer is not None:
            tracer.terminate()
            tracer.wait(timeout=10)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    proc, port = start()
    try:

        async def after(c):
            (unconfirmed,) = failed_at
            # The unconfirmed batch is back: a dirty tail.
            assert await c.max_transaction_id(0, 6) == unconfirmed + 2
            await c.truncate(0, 6, unconfirmed - 1)
            await c.set_low_water_mark(0, 6, unconfirmed - 1)
            assert await c.max_transaction_id(0, 6) == unconfirmed - 1

        async def go():
            async with await StorageClient.connect(
                "127.0.0.1", port, cluster_key=key, partition_count=1, timeout=10
            ) as c:
                await after(c)

        run(go())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_tls_peer_that_reads_nothing_gives_its_connection_place_back(tmp_path):
    """A TLS peer pipelines reads and never takes the answers. The node drops it after its idle
    timeout, and the close does not wait on the peer (TLS's close flushes what it holds): the
    thread and the max_connections place come back, and a healthy peer gets in."""
    from waltz.tls import generate_dev_certificates

    certs = generate_dev_certificates(tmp_path / "certs")
    key = uuid.uuid4()
    s = Storage.create(tmp_path / "node", key, 1)
    s.add_partition(0)
    node = StorageNode.start(
        s, idle_timeout=1.0, max_connections=1, tls_ca=certs.ca, tls_cert=certs.storage_cert, tls_key=certs.storage_key
    )
    ctx = certs.tls("server").client_context()
    host, port = node.address
    try:

        async def fill():
            async with await StorageClient.connect(
                host, port, cluster_key=key, partition_count=1, ssl=ctx, timeout=10
            ) as c:
                await c.set_low_water_mark(0, 1, -1)
                await c.append(0, 1, 0, RecordBatch([(ReqId(1, 1, 0, i), 0, b"x" * (4 << 20)) for i in range(4)]))

        run(fill())
        before = connection_threads()
        raw = socket.create_connection((host, port))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        stuck.settimeout(5)
        stuck.sendall(encode_request("hello"))
        assert stuck.recv(100)
        stuck.sendall(encode_request("open", -1, 1, -1, cluster_key=key, partition_count=1))
        assert stuck.recv(100)
        for seq in range(20):  # 16 MiB answers each, never read
            stuck.sendall(encode_request("record_list", 1, 10 + seq, 0, txid=0, max_count=1000))
        assert settles_at(connection_threads, before) == before

        async def healthy():
            async with await StorageClient.connect(
                host, port, cluster_key=key, partition_count=1, ssl=ctx, timeout=10
            ) as c:
                return await c.max_transaction_id(0, 1)

        assert run(healthy()) == 3
        assert node.stats()["refused_connections"] == 0
        stuck.close()
    finally:
        node.stop()
        s.close()
