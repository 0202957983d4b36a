"""Recovery figures, three storage node daemons on loopback, in one run:

- the pause in commits when a storage node is killed (SIGKILL) under a closed-loop append load:
  time from the kill to the next commit, and the longest gap between commits around it;
- catch-up: a node misses SIZE of 1 KiB transactions (1 GiB; 100 MiB with --quick), comes back,
  and a new store session fills it in bounded batches while appends go on; MB/s of catch-up
  against the disk's raw sequential write rate (1 MiB writes then fdatasync, same directory,
  same size) measured in the same run.

    python benches/recovery.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))

from support.processes import start, stop, wait_http, write_config  # noqa: E402
from waltz.cluster import open_store  # noqa: E402
from waltz.cluster.metadata import ClusterMetadata  # noqa: E402
from waltz.server.store_session import StoreSession  # noqa: E402
from waltz.storage import RecordBatch, ReqId, StorageAdminClient  # noqa: E402

RECORD = 1024
BATCH = 1000


def raw_write_mb_per_s(directory: pathlib.Path, size: int) -> float:
    path = directory / "raw.bin"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size >> 20):
            os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - t0
    path.unlink()
    return size / took / 1e6


def batch(n: int = BATCH) -> RecordBatch:
    payload = os.urandom(RECORD)
    return RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(n)])


async def pump(
    session: StoreSession,
    b: RecordBatch,
    stop_at: float | None,
    window: int,
    stamps: list[float],
    limit: int | None = None,
) -> int:
    """Closed loop of `window` batches in flight until `stop_at` or `limit` transactions; returns how many committed."""
    committed = 0

    async def worker() -> None:
        nonlocal committed
        while (
            (stop_at is None or time.perf_counter() < stop_at)
            and (limit is None or committed < limit)
            and session.failed is None
        ):
            await session.append(b)
            committed += len(b)
            stamps.append(time.perf_counter())

    await asyncio.gather(*(worker() for _ in range(window)))
    return committed


async def run(args: argparse.Namespace, root: pathlib.Path) -> dict[str, object]:
    size = (100 if args.quick else 1024) << 20
    store = open_store(f"embedded:{root / 'meta.db'}")
    store.start()
    meta = ClusterMetadata(store, "/waltz/bench")
    info, _ = meta.create("bench", 1, 3)
    nodes = []
    for i in range(3):
        d = root / f"node{i}"
        d.mkdir()
        config, ports = write_config(d, info.cluster_key, partition_count=1)
        proc = start(config)
        wait_http(ports["http_port"], proc)
        nodes.append([config, ports, proc])
        meta.add_storage_node(f"127.0.0.1:{ports['port']}", ports["admin_port"], i)
        meta.assign_partition(f"127.0.0.1:{ports['port']}", 0)
        async with await StorageAdminClient.connect(
            "127.0.0.1", ports["admin_port"], cluster_key=info.cluster_key, partition_count=1
        ) as a:
            await a.assign(0)
    out: dict[str, object] = {}
    try:
        raw = raw_write_mb_per_s(root, size)
        # 1. Kill a node under load: the pause in commits.
        session = await StoreSession.open(meta, 0, generation=1)
        stamps: list[float] = []
        small = batch(10)
        load = asyncio.ensure_future(pump(session, small, time.perf_counter() + 3.0, 8, stamps))
        await asyncio.sleep(1.5)
        killed_at = time.perf_counter()
        nodes[2][2].send_signal(signal.SIGKILL)
        await load
        nodes[2][2].wait()
        after = [t for t in stamps if t > killed_at]
        around = sorted(t for t in stamps if killed_at - 0.5 < t < killed_at + 1.0)
        gaps = [b - a for a, b in zip(around, around[1:])]
        out["kill_to_next_commit_ms"] = (after[0] - killed_at) * 1e3 if after else None
        out["longest_commit_gap_around_kill_ms"] = max(gaps) * 1e3 if gaps else None
        out["commits_in_the_second_after_kill"] = sum(1 for t in after if t < killed_at + 1.0) * 10
        # 2. The dead node misses `size` of transactions.
        big = batch()
        t0 = time.perf_counter()
        missed = await pump(session, big, None, 8, [], limit=size // RECORD)
        fill_s = time.perf_counter() - t0
        await session.close()
        # 3. Back: a new session's recovery leaves it behind; its replica task fills it while appends go on.
        nodes[2][2] = start(nodes[2][0])
        wait_http(nodes[2][1]["http_port"], nodes[2][2])
        address = f"127.0.0.1:{nodes[2][1]['port']}"
        session = await StoreSession.open(meta, 0, generation=1)
        t0 = time.perf_counter()
        stamps = []
        during = asyncio.ensure_future(pump(session, batch(10), None, 1, stamps, limit=1 << 62))
        while address not in session.replicas_in_write_path:
            if session.failed is not None:
                raise RuntimeError(str(session.failed))
            await asyncio.sleep(0.05)
        catch_up_s = time.perf_counter() - t0
        await session.close()
        await asyncio.gather(during, return_exceptions=True)
        caught = (missed + len(stamps) * 10) * (
            RECORD + 44
        )  # record bytes on disk: data + 44 bytes of header and checksums
        out.update(
            {
                "size_mb": size / 1e6,
                "raw_sequential_write_mb_per_s": raw,
                "fill_two_replicas_mb_per_s": missed * RECORD / fill_s / 1e6,
                "catch_up_seconds": catch_up_s,
                "catch_up_mb_per_s": caught / catch_up_s / 1e6,
                "appends_committed_during_catch_up": len(stamps) * 10,
            }
        )
        out["ratios"] = {"catch_up_over_raw_write": out["catch_up_mb_per_s"] / raw}  # type: ignore[operator]
    finally:
        for _, _, proc in nodes:
            if proc.poll() is None:
                stop(proc)
        store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        out = asyncio.run(run(args, pathlib.Path(d)))
    print("| figure | value |\n|---|---|")
    for k, v in out.items():
        if k != "ratios":
            print(f"| {k} | {v:,.1f} |" if isinstance(v, float) else f"| {k} | {v} |")
    for k, v in out["ratios"].items():  # type: ignore[attr-defined]
        print(f"{k}: {v:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
