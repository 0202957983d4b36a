"""`waltz-node server` as real processes with three real storage nodes and real metadata: a
client mounts, appends and reads its feed; the server is killed with SIGKILL and its partitions
move to another server under a new generation, with nothing acknowledged lost."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

from support.daemons import PARTITIONS, Cli, setup, start_server, wait_served  # noqa: F401  (setup is a fixture)
from support.processes import free_port, get
from test_server_connection import RawClient, feed_ids
from waltz import client_protocol as cp


async def mounted(endpoint: str, hwm: int, connection_seq: int) -> tuple[RawClient, cp.MountResponse, list[cp.Message]]:
    """Mounts partition 0, retrying while the server is still opening it."""
    port = int(endpoint.rsplit(":", 1)[1])
    for _ in range(300):
        c = await RawClient.connect(port)
        c.send(cp.Mount(1, 0, 42, hwm, connection_seq))
        got = await c.until(lambda m: isinstance(m, cp.MountResponse))
        resp = got[-1]
        assert isinstance(resp, cp.MountResponse)
        if resp.status == cp.MountStatus.READY:
            return c, resp, got
        c.close()
        await asyncio.sleep(0.2)
    raise AssertionError("never READY")


def test_failover_to_another_server_loses_nothing(setup, tmp_path: pathlib.Path) -> None:
    meta, nodes, url = setup
    http_port = free_port()
    first = start_server(tmp_path, url, "s1", http_port)
    second = None
    try:
        endpoint, gen = wait_served(meta, 0)

        async def phase1() -> None:
            c, resp, _ = await mounted(endpoint, -1, 1)
            assert resp.high_water_mark == -1
            for i in range(10):
                c.send(cp.Append((42, gen, 0, i), i - 1, i, b"tx%d" % i))
            got = await c.until(lambda m: isinstance(m, cp.FeedData) and m.entries[-1].transaction_id == 9)
            assert feed_ids(got) == list(range(10))
            c.close()

        asyncio.run(phase1())
        # The server's own view: healthy once its other partitions are open too (only partition 0
        # was waited for), and its metrics count what was committed.
        deadline = time.monotonic() + 30
        while (health := get(http_port, "/health"))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, body = health
        assert status == 200 and json.loads(body)["checks"]["partitions"]["0"] is True, body
        status, metrics = get(http_port, "/metrics")
        assert status == 200 and 'waltz_server_committed_total{partition="0"} 10.0' in metrics
        assert 'waltz_server_replicas_in_write_path{partition="0"} 3.0' in metrics
        assert 'waltz_server_commit_seconds_count{partition="0"}' in metrics
        old_server = next(s.server_id for s in meta.servers() if s.endpoint == endpoint)
        second = start_server(tmp_path, url, "s2", event_loop="asyncio")  # the standard loop serves as well
        first.send_signal(signal.SIGKILL)
        first.wait()
        endpoint2, gen2 = wait_served(meta, 0, not_by=old_server)
        assert gen2 > gen

        async def phase2() -> None:
            c, resp, got = await mounted(endpoint2, 9, 2)
            # Under load a further reassignment may have bumped the generation again: use the mount's.
            gen2 = resp.generation
            assert resp.high_water_mark == 9 and gen2 > gen
            c.send(cp.Append((42, gen, 0, 10), 9, 0, b"stale generation"))  # ignored
            c.send(cp.Append((42, gen2, 0, 11), 9, 0, b"tx10"))
            got = await c.until(lambda m: isinstance(m, cp.FeedData))
            (e,) = [e for m in got if isinstance(m, cp.FeedData) for e in m.entries]
            assert (e.transaction_id, e.req_id) == (10, (42, gen2, 0, 11))
            c.send(cp.TransactionDataRequest(5, 0, 3))
            assert (await c.until(lambda m: isinstance(m, cp.TransactionDataResponse)))[-1].data == b"tx3"  # type: ignore[attr-defined]
            c.close()

        asyncio.run(phase2())
        assert "event loop uvloop" in (tmp_path / "s1.log").read_text()
        assert "event loop asyncio" in (tmp_path / "s2.log").read_text()

        async def read(c: Any) -> list[bytes]:
            return [bytes(r.data) for r in await c.records(0, 0, 100)]  # admin read: no store session

        # A commit needs 2 of 3 replicas: the third may get the last record a moment later.
        expected = [b"tx%d" % i for i in range(11)]
        for n in nodes:
            deadline = time.monotonic() + 30
            while (got := n.admin(read)) != expected and time.monotonic() < deadline:
                assert got == expected[: len(got)], got  # a prefix, never anything else
                time.sleep(0.1)
            assert got == expected
        # Every partition ends up served and every replica in its current session.
        for p in range(PARTITIONS):
            wait_served(meta, p, not_by=old_server)
        deadline = time.monotonic() + 30
        while (
            not (report := Cli(url).json("--cluster", "e2e", "cluster", "verify", ok=None))["ok"]
            and time.monotonic() < deadline
        ):
            time.sleep(0.3)
        assert report["ok"], report
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_flood_of_large_appends_stays_within_the_memory_budget(setup, tmp_path: pathlib.Path) -> None:
    meta, _, url = setup
    config = tmp_path / "flood.toml"
    config.write_text(
        f'[server]\nmetadata = "{url}"\ncluster = "e2e"\nport = 0\nhttp_port = 0\nsession_timeout = 2.0\n\n'
        "[partition]\nqueue_limit = 16\nmax_batch_bytes = 4194304\nmax_batches_in_flight = 2\n"
        "data_cache_bytes = 8388608\nfeed_cache_bytes = 1048576\n"
    )
    # The budget these settings allow: queued appends, batches in flight, the data cache, and one
    # partly read 1 MiB frame per connection.
    connections, size = 4, 1 << 20
    budget_mib = (16 * size + 2 * (4 << 20) + (8 << 20) + connections * 2 * size) / (1 << 20)
    server = subprocess.Popen(
        [sys.executable, "-m", "waltz.cli.node", "server", "--config", str(config)],
        stderr=open(tmp_path / "flood.log", "a"),
        text=True,
    )
    try:
        endpoint, gen = wait_served(meta, 0)
        port = int(endpoint.rsplit(":", 1)[1])
        baseline = rss_mib(server.pid)
        peak = baseline

        async def flood() -> int:
            nonlocal peak
            payload = bytes(size)
            stop_at = time.monotonic() + 6.0

            async def one(cid: int) -> None:
                c = await RawClient.connect(port)
                c.send(cp.Mount(1, 0, cid, -1, 1))  # appends are taken only under the connection's mount, and frames
                # over 64 KiB only once a client has mounted
                await c.until(lambda m: isinstance(m, cp.MountResponse))
                seq = 0
                while time.monotonic() < stop_at:
                    c.send(cp.Append((cid, gen, 0, seq), -1, 0, payload))
                    seq += 1
                    await c.writer.drain()  # blocks once the server stops reading
                c.close()

            async def watch() -> None:
                nonlocal peak
                while time.monotonic() < stop_at + 1:
                    peak = max(peak, rss_mib(server.pid))
                    await asyncio.sleep(0.05)

            await asyncio.gather(*(one(100 + i) for i in range(connections)), watch())
            # Still answering, and it committed a good part of the flood.
            c = await RawClient.connect(port)
            c.send(cp.HighWaterMarkRequest(1, 0))
            hwm = (await c.until(lambda m: isinstance(m, cp.HighWaterMarkResponse)))[-1].high_water_mark  # type: ignore[attr-defined]
            c.close()
            return int(hwm)

        hwm = asyncio.run(flood())
        print(
            f"flood: committed {hwm + 1} x 1 MiB; RSS {baseline:.0f} -> peak {peak:.0f} MiB (budget {budget_mib:.0f} "
            "MiB)"
        )
        assert hwm >= 10
        overhead = 64.0
        assert peak - baseline < budget_mib + overhead, (
            f"RSS grew {peak - baseline:.0f} MiB (budget {budget_mib:.0f} MiB + {overhead:.0f})"
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
