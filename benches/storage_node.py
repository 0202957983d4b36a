"""Storage node over loopback against the engine in-process, same batches, same run.

    python benches/storage_node.py [--quick] [--json PATH]

Targets (issue 3): pipelined appends at batch 100 x 1 KiB >= 0.8x the in-process rate; the
single-record durable append round trip p50 within 150 us of the raw fdatasync p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid

from waltz._native import ResponseReader, encode_append, encode_request, raw_append_loop
from waltz.storage import RecordBatch, ReqId, Storage, StorageClient, StorageNode

RECORD_OVERHEAD = 40


def make_batch(n: int, size: int) -> RecordBatch:
    payload = os.urandom(size)
    return RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(n)])


def in_process(path: pathlib.Path, batch: RecordBatch, seconds: float) -> float:
    s = Storage.create(path, uuid.uuid4(), 1)
    s.add_partition(0)
    p = s.partition(0)
    nxt, done, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        nxt = p.append(nxt, batch) + 1
        done += len(batch)
    rate = done / (time.perf_counter() - t0)
    s.close()
    return rate


async def over_node(
    path: pathlib.Path, batch: RecordBatch, seconds: float, in_flight: int
) -> tuple[float, list[float]]:
    key = uuid.uuid4()
    s = Storage.create(path, key, 1)
    s.add_partition(0)
    node = StorageNode.start(s)
    try:
        c = await StorageClient.connect(*node.address, cluster_key=key, partition_count=1)
        n = len(batch)
        nxt, done, latencies = 0, 0, []
        sem = asyncio.Semaphore(in_flight)

        async def one(first: int) -> None:
            nonlocal done
            t = time.perf_counter()
            try:
                await c.append(0, 1, first, batch)
            finally:
                sem.release()
            latencies.append(time.perf_counter() - t)
            done += n

        tasks = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await sem.acquire()
            tasks.append(asyncio.create_task(one(nxt)))
            nxt += n
        await asyncio.gather(*tasks)
        rate = done / (time.perf_counter() - t0)
        await c.close()
        return rate, latencies
    finally:
        node.stop()
        s.close()


def thin_client_round_trips(path: pathlib.Path, calls: int) -> tuple[list[float], list[float]]:
    """Single-record appends and a no-fsync request from a blocking socket using the native
    codec: the node's own latency, without an asyncio event loop in the measurement."""
    key = uuid.uuid4()
    s = Storage.create(path, key, 1)
    s.add_partition(0)
    node = StorageNode.start(s)
    sock = socket.create_connection(node.address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = ResponseReader()

    def call(frame: bytes) -> tuple:
        sock.sendall(frame)
        while (resp := reader.next_response()) is None:
            reader.feed(sock.recv(65536))
        return resp

    try:
        call(encode_request("hello"))
        call(encode_request("open", -1, 1, -1, cluster_key=key, partition_count=1))
        batch = make_batch(1, 1024)
        appends, reads = [], []
        for i in range(calls):
            t = time.perf_counter()
            assert call(encode_append(1, 10 + i, 0, i, batch))[0] == "success"
            appends.append(time.perf_counter() - t)
        for i in range(calls):
            t = time.perf_counter()
            call(encode_request("max_transaction_id", 1, 10 + calls + i, 0))
            reads.append(time.perf_counter() - t)
        return appends, reads
    finally:
        sock.close()
        node.stop()
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args(argv)
    seconds = 2.0 if args.quick else 6.0
    base = pathlib.Path(tempfile.mkdtemp(prefix="waltz-node-bench-", dir=args.dir))
    results: dict = {"cells": []}
    try:
        for n, size, in_flight in (
            [(100, 1024, 8), (1, 1024, 1), (1, 1024, 16)]
            if args.quick
            else [(100, 1024, 8), (100, 1024, 32), (10, 1024, 16), (1, 1024, 1), (1, 1024, 16)]
        ):
            batch = make_batch(n, size)
            local = in_process(base / f"local-{n}-{in_flight}", batch, seconds)
            remote, lat = asyncio.run(over_node(base / f"node-{n}-{in_flight}", batch, seconds, in_flight))
            results["cells"].append(
                {
                    "batch": n,
                    "record": size,
                    "in_flight": in_flight,
                    "in_process_rec_s": local,
                    "node_rec_s": remote,
                    "ratio": remote / local,
                    "p50_us": statistics.median(lat) * 1e6,
                    "p99_us": sorted(lat)[int(len(lat) * 0.99)] * 1e6,
                }
            )
        raw = raw_append_loop(str(base / "raw"), os.urandom(RECORD_OVERHEAD + 1024), 2000 if args.quick else 5000)
        raw_p50 = statistics.median(raw) / 1000
        thin_appends, thin_reads = thin_client_round_trips(base / "thin", 1500 if args.quick else 5000)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    single = next(c for c in results["cells"] if c["batch"] == 1 and c["in_flight"] == 1)
    main_cell = next(c for c in results["cells"] if c["batch"] == 100 and c["in_flight"] == 8)
    thin_p50 = statistics.median(thin_appends) * 1e6
    results["raw_fdatasync_p50_us"] = raw_p50
    results["thin_client_append_p50_us"] = thin_p50
    results["thin_client_no_fsync_request_p50_us"] = statistics.median(thin_reads) * 1e6
    results["ratios"] = {
        "node_over_in_process_b100_1KiB": main_cell["ratio"],
        "round_trip_p50_minus_raw_fsync_p50_us": thin_p50 - raw_p50,
        "asyncio_client_round_trip_p50_minus_raw_fsync_p50_us": single["p50_us"] - raw_p50,
    }
    print("| batch | record | in flight | in-process rec/s | node rec/s | ÷ in-process | p50 µs | p99 µs |")
    print("|---|---|---|---|---|---|---|---|")
    for c in results["cells"]:
        print(
            f"| {c['batch']} | {c['record']} | {c['in_flight']} | {c['in_process_rec_s']:,.0f} | "
            f"{c['node_rec_s']:,.0f} | {c['ratio']:.2f} | {c['p50_us']:,.0f} | {c['p99_us']:,.0f} |"
        )
    print()
    gap = thin_p50 - raw_p50
    print(f"raw write+fdatasync p50 (1 KiB): {raw_p50:.0f} µs")
    print(
        f"single-record durable append round trip p50, thin blocking client: {thin_p50:.0f} µs "
        f"(+{gap:.0f} µs, target <= 150): {'MET' if gap <= 150 else 'MISSED'}; "
        f"a no-fsync request: {results['thin_client_no_fsync_request_p50_us']:.0f} µs"
    )
    print(
        f"the same through the asyncio StorageClient: {single['p50_us']:.0f} µs (+{single['p50_us'] - raw_p50:.0f} µs)"
    )
    print(
        f"node / in-process at batch 100 x 1 KiB: {main_cell['ratio']:.2f} (target >= 0.8): "
        f"{'MET' if main_cell['ratio'] >= 0.8 else 'MISSED'}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
