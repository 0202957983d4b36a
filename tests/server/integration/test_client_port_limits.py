"""The server's client port against hostile peers (issue 34, finding 4), on a real server
daemon with three real storage nodes: frames refused on their length before a Mount, a flood of
idle connections that does not lock a client out, idle unmounted connections closed (mounted
ones never), and an Append with millions of locks refused before they are decoded. Every
refusal is logged and counted in `waltz_server_limit_refusals_total`."""

from __future__ import annotations

import asyncio
import pathlib
import resource
import signal
import struct
import subprocess
import zlib

import pytest
from support.daemons import setup, start_server, wait_served  # noqa: F401  (setup is a fixture)
from support.processes import free_port, get
from test_server_connection import RawClient
from test_server_daemon import mounted, rss_mib
from waltz import client_protocol as cp
from waltz._native import encode_frame

pytestmark = pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)


def refusals(http_port: int) -> dict[str, float]:
    _, text = get(http_port, "/metrics")
    return {
        line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("waltz_server_limit_refusals_total{")
    }


def stop_server(server: subprocess.Popen[str]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def frame_head(length: int) -> bytes:
    """The start of a frame declaring `length` bytes after its length field (an Append)."""
    return struct.pack(">IHBB", length, cp.MAGIC, cp.VERSION, cp.Append.TYPE)


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bool:
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def test_unfinished_large_frames_before_mount_are_refused_on_their_length(setup, tmp_path: pathlib.Path) -> None:
    """8 connections with unfinished 60 MiB frames took the server from 37 to 519 MiB: each
    frame was buffered whole before anything looked at it. Before a Mount a frame is refused as
    soon as its length arrives (64 KiB at most by default), a 2 GiB one included."""
    meta, _, url = setup
    http_port = free_port()
    server = start_server(tmp_path, url, "frames", http_port=http_port)
    try:
        wait_served(meta, 0)
        port = int(wait_served(meta, 0)[0].rsplit(":", 1)[1])
        baseline = rss_mib(server.pid)
        peak = baseline
        sent_per_connection = 40 << 20

        async def one(length: int) -> bool:
            c = await RawClient.connect(port)
            c.writer.write(frame_head(length))
            chunk = bytes(1 << 20)
            try:
                for _ in range(sent_per_connection // len(chunk)):
                    c.writer.write(chunk)
                    await asyncio.wait_for(c.writer.drain(), 10)
            except (TimeoutError, ConnectionError):
                pass
            closed = await closed_by_server(c.reader, 5.0)
            c.close()
            return closed

        async def flood() -> list[bool]:
            nonlocal peak
            done = asyncio.ensure_future(asyncio.gather(*(one(60 << 20) for _ in range(8))))
            while not done.done():
                peak = max(peak, rss_mib(server.pid))
                await asyncio.sleep(0.05)
            return await done

        closed = asyncio.run(flood())
        print(f"unfinished frames: RSS {baseline:.0f} -> peak {peak:.0f} MiB")
        margin = 64.0  # of 8 x 40 MiB sent: a server buffering them grows by 320 MiB
        assert peak - baseline < margin, f"RSS grew {peak - baseline:.0f} MiB for frames that were never finished"
        assert all(closed), closed

        async def declared(length: int) -> bool:
            c = await RawClient.connect(port)
            c.writer.write(frame_head(length))  # the length alone, nothing after it
            closed = await closed_by_server(c.reader, 5.0)
            c.close()
            return closed

        assert asyncio.run(declared(2 << 30)), "a 2 GiB frame must be refused at once"
        assert asyncio.run(declared(1 << 20)), "a 1 MiB frame before a Mount must be refused on its length"
        assert refusals(http_port).get("frame_too_large", 0) >= 10
    finally:
        stop_server(server)
    log = (tmp_path / "frames.log").read_text()
    assert "refused (frame_too_large)" in log and "max_frame_before_mount" in log


def test_a_flood_of_idle_connections_does_not_lock_a_client_out(setup, tmp_path: pathlib.Path) -> None:
    """1,100 idle connections exhausted the server's file descriptors: new clients got a
    misleading TLS hint, store sessions could not reconnect (EMFILE), and nothing was logged.
    With a descriptor limit of 512 (the connection cap fitted to it: 256), 600 connections that
    say Hello and nothing else leave room for a client that mounts and appends."""
    meta, _, url = setup
    flood_size = 600
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = flood_size + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"this test opens {want} descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    http_port = free_port()
    server = start_server(tmp_path, url, "flood", http_port=http_port, file_limit=512)
    try:
        endpoint, gen = wait_served(meta, 0)
        port = int(endpoint.rsplit(":", 1)[1])

        async def go() -> None:
            idle = []
            for _ in range(flood_size):
                try:  # a server that no longer accepts leaves connects waiting in its backlog
                    _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
                except (TimeoutError, OSError):
                    break
                w.write(cp.Hello().frame())
                idle.append(w)
            await asyncio.sleep(1.0)
            c, ready, _ = await asyncio.wait_for(mounted(endpoint, -1, 1), 60)
            c.send(cp.Append((42, gen, 0, 1), ready.high_water_mark, 0, b"through the flood"))
            fed = await c.until(lambda m: isinstance(m, cp.FeedData) and len(m.entries) > 0, timeout=30)
            assert fed[-1].entries[-1].req_id == (42, gen, 0, 1)  # type: ignore[attr-defined]
            c.close()
            for w in idle:
                w.close()

        asyncio.run(go())
        refused = refusals(http_port)
        assert refused.get("evicted", 0) >= flood_size - 256, refused
        _, health = get(http_port, "/health")
        assert '"status": "ok"' in health, health  # the store sessions kept their connections
    finally:
        stop_server(server)
    log = (tmp_path / "flood.log").read_text()
    assert "refused (evicted)" in log and "max_connections" in log
    assert "EMFILE" not in log and "Too many open files" not in log


def test_an_idle_connection_that_never_mounts_is_closed_and_a_mounted_one_never(setup, tmp_path: pathlib.Path) -> None:
    meta, _, url = setup
    http_port = free_port()
    server = start_server(tmp_path, url, "idle", http_port=http_port, server={"mount_timeout": 1.0})
    try:
        endpoint, _ = wait_served(meta, 0)
        port = int(endpoint.rsplit(":", 1)[1])

        async def go() -> None:
            client, ready, _ = await mounted(endpoint, -1, 1)
            idle = await RawClient.connect(port)
            assert await closed_by_server(idle.reader, 10.0), "an unmounted idle connection must be closed"
            await asyncio.sleep(2.0)  # the mounted client, as quiet as the other: still served
            client.send(cp.HighWaterMarkRequest(7, 0))
            got = await client.until(lambda m: isinstance(m, cp.HighWaterMarkResponse))
            assert got[-1].seq == 7  # type: ignore[attr-defined]
            client.close()

        asyncio.run(go())
        assert refusals(http_port).get("mount_timeout", 0) >= 1
    finally:
        stop_server(server)
    assert "refused (mount_timeout)" in (tmp_path / "idle.log").read_text()


def append_with_locks(req_id: tuple[int, int, int, int], hwm: int, write_locks: int, data: bytes) -> bytes:
    """An Append frame declaring `write_locks` write locks (all zero), built without a tuple of them."""
    payload = b"".join(
        (
            struct.pack(">iiii", *req_id),
            struct.pack(">q", hwm),
            struct.pack(">i", write_locks),
            bytes(8 * write_locks),
            struct.pack(">ii", 0, 0),
            struct.pack(">i", 0),
            struct.pack(">i", len(data)),
            data,
            struct.pack(">I", zlib.crc32(data)),
        )
    )
    return encode_frame(cp.MAGIC, cp.Append.TYPE, payload)


def test_an_append_with_millions_of_locks_is_refused_while_decoding(setup, tmp_path: pathlib.Path) -> None:
    """One Append carrying 8 M locks held the event loop 0.85 s: they were all decoded before
    the partition's max_transaction_locks refused it. The decoder refuses the declared count now;
    the client gets APPEND_REJECTED as before, and the refusal is logged and counted."""
    meta, _, url = setup
    http_port = free_port()
    server = start_server(tmp_path, url, "locks", http_port=http_port)
    try:
        endpoint, gen = wait_served(meta, 0)

        async def go() -> None:
            c, ready, _ = await mounted(endpoint, -1, 1)
            other = await RawClient.connect(int(endpoint.rsplit(":", 1)[1]))
            c.writer.write(append_with_locks((42, gen, 0, 1), ready.high_water_mark, 8_000_000, b"greedy"))
            got = await c.until(lambda m: isinstance(m, cp.Failure), timeout=30)
            failure = got[-1]
            assert isinstance(failure, cp.Failure)
            assert failure.kind == cp.FailureKind.APPEND_REJECTED and failure.seq == 1, failure
            assert "max_transaction_locks" in failure.message
            # The same connection and another one go on appending.
            c.send(cp.Append((42, gen, 0, 2), ready.high_water_mark, 0, b"modest", write_locks=(1, 2)))
            fed = await c.until(lambda m: isinstance(m, cp.FeedData) and len(m.entries) > 0, timeout=30)
            assert fed[-1].entries[-1].req_id == (42, gen, 0, 2)  # type: ignore[attr-defined]
            other.send(cp.HighWaterMarkRequest(3, 0))
            assert (await other.until(lambda m: isinstance(m, cp.HighWaterMarkResponse)))[-1].seq == 3  # type: ignore[attr-defined]
            c.close()
            other.close()

        asyncio.run(go())
        assert refusals(http_port).get("too_many_locks", 0) == 1
    finally:
        stop_server(server)
    assert "refused (too_many_locks)" in (tmp_path / "locks.log").read_text()
