"""The server's write path without the network to clients: a store session replicating to 3
storage node daemons on loopback, against one node's append rate through the same client, in
one run; then the partition's append path (locks, ids, batching) with concurrent appenders.

    python benches/store_session.py [--quick] [--json PATH]

Closed loop: W batches of B x 1 KiB kept in flight; each commits when 2 of 3 replicas have
fsynced it. Reports committed transactions/s, MB/s, p50/p99 commit latency, and CPU
microseconds per committed transaction summed over this process and the three nodes (from
/proc). The reference is the same load against one node without replication (`StorageClient`
pipelined appends), so the ratio says what replication by quorum costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))

from support.processes import start, stop, wait_http, write_config  # noqa: E402
from waltz.cluster import open_store  # noqa: E402
from waltz.cluster.metadata import ClusterMetadata  # noqa: E402
from waltz.server.partition import AppendRequest, Committed, ServerPartition  # noqa: E402
from waltz.server.store_session import StoreSession  # noqa: E402
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


def make_batch(n: int) -> RecordBatch:
    payload = os.urandom(1024)
    return RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(n)])


async def closed_loop(submit, batch: RecordBatch, window: int, seconds: float) -> tuple[int, list[float]]:  # type: ignore[no-untyped-def]
    latencies: list[float] = []
    committed = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal committed
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await submit(batch)
            latencies.append(time.perf_counter() - t0)
            committed += len(batch)

    await asyncio.gather(*(worker() for _ in range(window)))
    return committed, latencies


def summarise(name: str, committed: int, lat: list[float], seconds: float, cpu: float) -> dict[str, object]:
    q = statistics.quantiles(lat, n=100)
    return {
        "name": name,
        "tx_per_s": committed / seconds,
        "mb_per_s": committed * 1024 / seconds / 1e6,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "cpu_us_per_tx": cpu / committed * 1e6,
    }


CONFIGS = ((1, 1), (1, 32), (100, 8))  # (records per batch, batches in flight)
APPENDERS = (1, 32, 256)  # single-transaction appenders through the ServerPartition (server batching)


async def run(args: argparse.Namespace, root: pathlib.Path) -> dict[str, object]:
    # Per config: partition 2k replicated on all three nodes, partition 2k+1 on node 0 alone.
    partitions = 2 * len(CONFIGS) + len(APPENDERS)
    store = open_store(f"embedded:{root / 'meta.db'}")
    store.start()
    meta = ClusterMetadata(store, "/waltz/bench")
    info, _ = meta.create("bench", partitions, 3)
    procs, ports = [], []
    for i in range(3):
        d = root / f"node{i}"
        d.mkdir()
        config, p = write_config(d, info.cluster_key, partition_count=partitions)
        proc = start(config)
        wait_http(p["http_port"], proc)
        procs.append(proc)
        ports.append(p)
        address = f"127.0.0.1:{p['port']}"
        meta.add_storage_node(address, p["admin_port"], i)
        mine = [q for q in range(partitions) if q % 2 == 0 or i == 0 or q >= 2 * len(CONFIGS)]
        for q in mine:
            meta.assign_partition(address, q)
        async with await StorageAdminClient.connect(
            "127.0.0.1", p["admin_port"], cluster_key=info.cluster_key, partition_count=partitions
        ) as a:
            for q in mine:
                await a.assign(q)
    pids = [os.getpid()] + [p.pid for p in procs]
    seconds = 3.0 if args.quick else 10.0
    rows, ratios = [], {}
    try:
        for k, (b, window) in enumerate(CONFIGS):
            batch = make_batch(b)
            session = await StoreSession.open(meta, 2 * k, generation=1)
            c0, t0 = cpu_seconds(pids), time.perf_counter()
            committed, lat = await closed_loop(session.append, batch, window, seconds)
            elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
            await session.close()
            quorum = summarise(f"quorum 2 of 3, batch {b}, {window} in flight", committed, lat, elapsed, cpu)

            client = await StorageClient.connect(
                "127.0.0.1", ports[0]["port"], cluster_key=info.cluster_key, partition_count=partitions
            )
            nxt = 0

            async def one(x: RecordBatch, q: int = 2 * k + 1) -> None:
                nonlocal nxt
                first, nxt = nxt, nxt + len(x)
                await client.send_append(q, 1, first, x)

            c0, t0 = cpu_seconds(pids[:2]), time.perf_counter()
            committed, lat = await closed_loop(one, batch, window, seconds)
            elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids[:2]) - c0
            await client.close()
            single = summarise(f"one node, batch {b}, {window} in flight", committed, lat, elapsed, cpu)
            rows += [quorum, single]
            ratios[f"tx_per_s_quorum_over_one_node_b{b}_w{window}"] = quorum["tx_per_s"] / single["tx_per_s"]
        # The partition's append path: lock check, id, batching of concurrent appenders, quorum.
        payload = os.urandom(1024)
        for j, n in enumerate(APPENDERS):
            q = 2 * len(CONFIGS) + j
            part = ServerPartition(q, 1, await StoreSession.open(meta, q, generation=1))
            await part.start()
            seq = iter(range(1 << 40))

            async def submit(_: object, part: ServerPartition = part) -> None:
                s = next(seq)
                r = await part.append(
                    AppendRequest(
                        ReqId(1, 1, part.partition_id, s), part.high_water_mark, 0, payload, write_locks=[s % 1000]
                    )
                )
                assert isinstance(r, Committed), r

            c0, t0 = cpu_seconds(pids), time.perf_counter()
            committed, lat = await closed_loop(submit, make_batch(1), n, seconds)
            elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
            await part.close()
            rows.append(
                summarise(f"partition, {n} appenders of single transactions, write locks", committed, lat, elapsed, cpu)
            )
    finally:
        for p in procs:
            stop(p)
        store.close()
    return {"rows": rows, "ratios": ratios, "seconds_per_run": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        out = asyncio.run(run(args, pathlib.Path(d)))
    print("| run | tx/s | MB/s | p50 ms | p99 ms | CPU us/tx |\n|---|---|---|---|---|---|")
    for r in out["rows"]:  # type: ignore[attr-defined]
        print(
            f"| {r['name']} | {r['tx_per_s']:,.0f} | {r['mb_per_s']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['cpu_us_per_tx']:.0f} |"
        )
    for k, v in out["ratios"].items():  # type: ignore[attr-defined]
        print(f"{k}: {v:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
