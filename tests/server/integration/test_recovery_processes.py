"""Recovery with real processes: under a steady append load, kill -9 a storage node, then the
server, then two of the three storage nodes; every acknowledged transaction is in the log
afterwards, the replicas hold identical bytes over the committed range, and appends resume after
each recovery. Prints the time from each kill to the first acknowledgement after it."""

from __future__ import annotations

import asyncio
import pathlib
import signal
import time
import zlib
from typing import Any

import pytest
from support.daemons import setup, start_server, wait_served  # noqa: F401  (fixture)
from support.processes import start, stop, wait_http
from test_server_daemon import mounted
from waltz import client_protocol as cp

CLIENT = 42


class Load:
    """One client appending one transaction at a time; acknowledged = seen in its feed."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta
        self.sent: dict[int, bytes] = {}
        self.acked: dict[int, bytes] = {}
        self.ack_times: list[float] = []
        self.stopped = False
        self.seq = 0

    def absorb(self, msgs: list[cp.Message]) -> None:
        for m in msgs:
            if isinstance(m, cp.FeedData):
                for e in m.entries:
                    if e.req_id[0] == CLIENT:
                        data = self.sent[e.req_id[3]]
                        if e.transaction_id not in self.acked:
                            self.ack_times.append(time.monotonic())
                        assert self.acked.setdefault(e.transaction_id, data) == data, (
                            f"transaction {e.transaction_id} changed"
                        )

    async def run(self) -> None:
        connection = 0
        while not self.stopped:
            c = None
            try:
                endpoint, _ = await asyncio.to_thread(wait_served, self.meta, 0)
                connection += 1
                hwm = max(self.acked, default=-1)
                c, resp, got = await mounted(endpoint, hwm, connection)
                self.absorb(got)  # the mount replays the feed: appends that committed meanwhile
                while not self.stopped:
                    self.seq += 1
                    seq = self.seq
                    self.sent[seq] = b"load-%d" % seq
                    c.send(cp.Append((CLIENT, resp.generation, 0, seq), max(self.acked, default=-1), 0, self.sent[seq]))
                    self.absorb(
                        await c.until(
                            lambda m, s=seq: isinstance(m, cp.FeedData) and any(e.req_id[3] == s for e in m.entries),
                            timeout=3.0,
                        )
                    )
            except (TimeoutError, AssertionError, OSError, ConnectionError) as e:
                if isinstance(e, AssertionError) and "changed" in str(e):
                    raise
                await asyncio.sleep(0.1)
            finally:
                if c is not None:
                    c.close()

    async def acks_after(self, since: float, count: int = 20, timeout: float = 90.0) -> float:
        """Waits for `count` acknowledgements after `since`; returns the seconds from `since` to the first."""
        deadline = time.monotonic() + timeout
        while sum(1 for t in self.ack_times if t > since) < count:
            assert time.monotonic() < deadline, (
                f"appends did not resume: {sum(1 for t in self.ack_times if t > since)} acknowledged"
            )
            await asyncio.sleep(0.02)
        return min(t for t in self.ack_times if t > since) - since


def replica_log(node: Any, upto: int) -> list[bytes]:
    return [bytes(r.data) for r in node.admin_records()[: upto + 1]]


def kill(proc: Any) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def restart(node: Any) -> None:
    node.proc = start(node.config)
    wait_http(node.ports["http_port"], node.proc)


def check_replicas(nodes: list[Any], load: Load) -> tuple[int, int]:
    """Every replica ends up with the committed range (one may still be catching up), byte for
    byte the same, with every acknowledged transaction; returns (last id, crc32)."""
    top = max(load.acked)
    deadline = time.monotonic() + 60
    while True:
        logs = [replica_log(n, top) for n in nodes]
        if all(len(lg) == top + 1 for lg in logs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    checksums = [zlib.crc32(b"\0".join(lg)) for lg in logs]
    assert [len(lg) for lg in logs] == [top + 1] * 3 and len(set(checksums)) == 1, (
        top,
        [len(lg) for lg in logs],
        checksums,
    )
    missing = {txid: data for txid, data in load.acked.items() if logs[0][txid] != data}
    assert not missing, f"acknowledged transactions lost or changed: {sorted(missing)[:10]}"
    return top, checksums[0]


def stop_all(servers: list[Any], nodes: list[Any]) -> None:
    for s in servers:
        if s.poll() is None:
            s.send_signal(signal.SIGTERM)
            s.wait(timeout=30)
    for n in nodes:
        if n.proc.poll() is None:
            stop(n.proc)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_kill_nine_a_node_the_server_and_a_majority_under_load(setup, tmp_path: pathlib.Path) -> None:  # noqa: F811
    meta, nodes, url = setup
    servers = [start_server(tmp_path, url, "s1")]
    figures: dict[str, float] = {}

    async def go() -> Load:
        load = Load(meta)
        task = asyncio.create_task(load.run())
        try:
            await load.acks_after(time.monotonic(), 50)
            # 1. one storage node: the other two keep committing (at most a short pause).
            await asyncio.to_thread(kill, nodes[0].proc)
            t = time.monotonic()  # dead from here (kill waited for it)
            figures["storage node killed: first ack after"] = await load.acks_after(t)
            await asyncio.to_thread(restart, nodes[0])
            await load.acks_after(time.monotonic(), 50)
            # 2. the server: a new one takes the partition and recovers it.
            servers.append(start_server(tmp_path, url, "s2"))
            await asyncio.to_thread(kill, servers[0])
            t = time.monotonic()
            figures["server killed: first ack after"] = await load.acks_after(t)
            # 3. two of three storage nodes: no majority, nothing is acknowledged; back, it resumes.
            t = time.monotonic()
            await asyncio.to_thread(kill, nodes[1].proc)
            await asyncio.to_thread(kill, nodes[2].proc)
            await asyncio.sleep(2.0)
            stalled = sum(1 for x in load.ack_times if x > t + 0.5)
            assert stalled <= 2, f"{stalled} acknowledged without a majority"  # at most what was in flight at the kill
            await asyncio.to_thread(restart, nodes[1])
            await asyncio.to_thread(restart, nodes[2])
            t2 = time.monotonic()
            figures["majority back: first ack after restart"] = await load.acks_after(t2)
            await load.acks_after(time.monotonic(), 50)
        finally:
            load.stopped = True
            await asyncio.wait_for(task, 30)
        return load

    try:
        load = asyncio.run(go())
        top, crc = check_replicas(nodes, load)
        assert len(load.acked) >= 200
        print(
            f"\n{len(load.acked)} acknowledged, committed range 0..{top} identical on 3 replicas (crc32 {crc:08x}); "
            + ", ".join(f"{k}: {v:.2f}s" for k, v in figures.items())
        )
    finally:
        stop_all(servers, nodes)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_replica_that_lost_its_files_keeps_nothing_from_being_lost(setup, tmp_path: pathlib.Path) -> None:  # noqa: F811
    """What `waltz torture` found: storage-0 lags (killed); storage-1 and storage-2 acknowledge
    more; storage-2 goes down and storage-1 loses its files (deleted and the partition added
    again, as an operator replacing a disk would). A recovery that took storage-1 at its word
    would decide storage-0's end with it and truncate storage-2 once back: what storage-1 and
    storage-2 acknowledged would be gone. It must wait for storage-2 instead, and then every
    replica, storage-1 included, ends with every acknowledged transaction."""
    meta, nodes, url = setup
    servers = [start_server(tmp_path, url, "s1")]

    async def wipe(c: Any) -> None:
        await c.set_availability(0, readable=True, writable=False)
        await c.unassign(0, delete_files=True)
        await c.assign(0)
        await c.set_availability(0, readable=True, writable=True)

    async def go() -> tuple[Load, int, int]:
        load = Load(meta)
        task = asyncio.create_task(load.run())
        try:
            await load.acks_after(time.monotonic(), 30)
            await asyncio.to_thread(kill, nodes[0].proc)
            await load.acks_after(time.monotonic(), 60)  # on storage-1 and storage-2 only
            await asyncio.to_thread(kill, nodes[2].proc)
            behind = max(load.acked)
            await asyncio.to_thread(nodes[1].admin, wipe)
            await asyncio.to_thread(restart, nodes[0])
            await asyncio.sleep(3.0)  # recoveries meet storage-0 and the empty storage-1 only
            during = len(load.acked)
            await asyncio.to_thread(restart, nodes[2])
            await load.acks_after(time.monotonic(), 30)
        finally:
            load.stopped = True
            await asyncio.wait_for(task, 30)
        return load, behind, during

    try:
        load, behind, during = asyncio.run(go())
        top, _ = check_replicas(nodes, load)
        assert top > behind
        log = (tmp_path / "s1.log").read_text()
        assert "lost what it held" in log, "no recovery met the replica that lost its files"
        print(
            f"\n{len(load.acked)} acknowledged ({during} before storage-2 was back), 0..{top} identical on 3 replicas"
        )
    finally:
        stop_all(servers, nodes)
