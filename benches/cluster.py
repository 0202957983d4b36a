"""A Waltz cluster on loopback: 1 server (`waltz-node server`) and 3 storage nodes as separate
processes, embedded metadata, driven by closed-loop clients speaking the client protocol.

    python benches/cluster.py [--quick] [--json PATH]

Each client has one connection, mounts one partition (client i writes partition i mod 4) and
keeps one 1 KiB transaction in flight: it sends an Append and waits until its ReqId comes back
in the feed (the commit), then sends the next. Reported per client count (1, 8, 32): committed
transactions/s, MB/s, p50/p99 submit-to-commit latency, and CPU microseconds per committed
transaction summed over every process (server, storage nodes, and this one, which runs the
clients). Then the same through the client library: one `WaltzClient` in this process with
1, 8, 32 threads each keeping one transaction in flight, reporting transactions/s, p50/p99
submit-to-applied latency and the ratio to the raw-protocol clients at the same concurrency
(what the library costs). Comparisons with etcd and ZooKeeper are issue 10's extension.

Knobs for investigation: WALTZ_SERVER_EXTRA (TOML appended to the server's configuration, e.g.
"[partition]\nmax_batches_in_flight = 2"), WALTZ_PROFILE=PATH (the server runs under cProfile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests" / "integration"))

from processes import free_port, start, stop, wait_http, write_config  # noqa: E402

from waltz import client_protocol as cp  # noqa: E402
from waltz.client import (  # noqa: E402
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz.cluster import open_store  # noqa: E402
from waltz.cluster.metadata import ClusterMetadata  # noqa: E402
from waltz.storage import StorageAdminClient  # noqa: E402

PARTITIONS = 4
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


class Client:
    """One closed-loop client: one connection, one partition, one transaction in flight."""

    def __init__(self, cid: int, partition: int) -> None:
        self.cid, self.partition = cid, partition
        self.messages = cp.MessageReader()
        self.latencies: list[float] = []
        self.committed = 0

    async def next(self) -> cp.Message:
        while (m := self.messages.next_message()) is None:
            data = await self.reader.read(1 << 20)
            if not data:
                raise ConnectionError("server closed the connection")
            self.messages.feed(data)
        return m

    async def run(self, port: int, seconds: float, payload: bytes) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(cp.Hello().frame())
        assert isinstance(await self.next(), cp.HelloOk)
        self.writer.write(cp.HighWaterMarkRequest(1, self.partition).frame())
        while not isinstance(m := await self.next(), cp.HighWaterMarkResponse):
            pass
        hwm = m.high_water_mark
        self.writer.write(cp.Mount(2, self.partition, self.cid, hwm, 1).frame())
        while not (isinstance(m := await self.next(), cp.MountResponse)):
            pass
        assert m.status == cp.MountStatus.READY, m
        gen = m.generation
        seq = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            seq += 1
            req = (self.cid, gen, self.partition, seq)
            t0 = time.perf_counter()
            self.writer.write(cp.Append(req, hwm, 0, payload).frame())
            done = False
            while not done:
                m = await self.next()
                if isinstance(m, cp.FeedData):
                    for e in m.entries:
                        hwm = e.transaction_id
                        done = done or e.req_id == req
                elif isinstance(m, (cp.LockFailure, cp.Failure)):
                    raise RuntimeError(f"client {self.cid}: {m}")
            self.latencies.append(time.perf_counter() - t0)
            self.committed += 1
        self.writer.close()


async def measure(port: int, clients: int, seconds: float, pids: list[int]) -> dict[str, object]:
    payload = os.urandom(1024)
    cs = [Client(100_000 + clients * 1000 + i, i % PARTITIONS) for i in range(clients)]
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    each0 = [cpu_seconds([p]) for p in pids]
    await asyncio.gather(*(c.run(port, seconds, payload) for c in cs))
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
    each = [cpu_seconds([p]) - e for p, e in zip(pids, each0)]
    committed = sum(c.committed for c in cs)
    lat = sorted(x for c in cs for x in c.latencies)
    q = statistics.quantiles(lat, n=1000)
    return {
        "clients": clients,
        "committed": committed,
        "tx_per_s": committed / elapsed,
        "mb_per_s": committed * 1024 / elapsed / 1e6,
        "p50_ms": q[499] * 1e3,
        "p99_ms": q[989] * 1e3,
        "p999_ms": q[998] * 1e3,
        "cpu_us_per_tx": cpu / committed * 1e6,
        "cpu_us_per_tx_by_process": dict(zip(["clients", "server", "storage1", "storage2", "storage3"], (round(e / committed * 1e6) for e in each))),
    }


class _Noted(WaltzClientCallbacks):
    """Applies nothing; notes when each transaction (by header) reached apply_transaction."""

    def __init__(self) -> None:
        self.marks: dict[int, int] = {}
        self.applied_at: dict[int, float] = {}

    def get_client_high_water_mark(self, partition: int) -> int:
        return self.marks.get(partition, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self.applied_at[transaction.header] = time.perf_counter()
        self.marks[transaction.partition] = transaction.transaction_id


class _Put(TransactionContext):
    def __init__(self, n: int, payload: bytes) -> None:
        super().__init__()
        self.n, self.payload = n, payload

    def partition_id(self, num_partitions: int) -> int:
        return self.n % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.n)
        builder.set_data(self.payload)
        return True


def measure_client(url: str, concurrency: int, seconds: float, pids: list[int]) -> dict[str, object]:
    """One WaltzClient in this process, `concurrency` threads each keeping one transaction in
    flight (submit, wait for the commit): what the library costs over the raw protocol."""
    app = _Noted()
    payload = os.urandom(1024)
    submitted: dict[int, float] = {}
    counter = iter(range(1, 1 << 31))
    with WaltzClient(app, ClientConfig(metadata=url, cluster="bench", max_pending=1024)) as client:
        app.marks = {p: client.high_water_mark(p) for p in range(client.partitions)}  # start at the tail
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        deadline = t0 + seconds

        def loop() -> None:
            while time.perf_counter() < deadline:
                n = next(counter)
                submitted[n] = time.perf_counter()
                client.submit(_Put(n, payload)).result()

        threads = [threading.Thread(target=loop) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        client.flush()
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
        own_cpu = cpu_seconds([os.getpid()])
    lat = sorted(app.applied_at[n] - t for n, t in submitted.items() if n in app.applied_at)
    q = statistics.quantiles(lat, n=100)
    return {
        "concurrency": concurrency,
        "committed": len(lat),
        "tx_per_s": len(lat) / elapsed,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "cpu_us_per_tx": cpu / len(lat) * 1e6,
        "client_process_cpu_s": own_cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    seconds = 3.0 if args.quick else 10.0
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        root = pathlib.Path(d)
        url = f"embedded:{root / 'meta.db'}"
        store = open_store(url)
        store.start()
        meta = ClusterMetadata(store, "/waltz/bench")
        info, _ = meta.create("bench", PARTITIONS, 3)
        nodes, procs = [], []
        for i in range(3):
            (root / f"n{i}").mkdir()
            config, ports = write_config(root / f"n{i}", info.cluster_key, partition_count=PARTITIONS)
            proc = start(config)
            wait_http(ports["http_port"], proc)
            nodes.append(ports)
            procs.append(proc)
            meta.add_storage_node(f"127.0.0.1:{ports['port']}", ports["admin_port"], i)
            meta.auto_assign(i)

            async def assign(p: dict[str, int] = ports) -> None:
                async with await StorageAdminClient.connect("127.0.0.1", p["admin_port"], cluster_key=info.cluster_key,
                                                            partition_count=PARTITIONS) as a:
                    for q in range(PARTITIONS):
                        await a.assign(q)

            asyncio.run(assign())
        port = free_port()
        (root / "server.toml").write_text(f'[server]\nmetadata = "{url}"\ncluster = "bench"\nport = {port}\nhttp_port = 0\n' + os.environ.get("WALTZ_SERVER_EXTRA", ""))
        profile = ["-m", "cProfile", "-o", os.environ["WALTZ_PROFILE"]] if os.environ.get("WALTZ_PROFILE") else []
        server = subprocess.Popen([sys.executable, *profile, "-m", "waltz.cli.node", "server", "--config", str(root / "server.toml")],
                                  stderr=open(root / "server.log", "w"))
        try:
            deadline = time.monotonic() + 60
            while not all(s.serving.keys() >= set(range(PARTITIONS)) for s in meta.servers()) or not meta.servers():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not serve every partition: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(0.1)
            time.sleep(0.5)
            pids = [os.getpid(), server.pid] + [p.pid for p in procs]
            rows = [asyncio.run(measure(port, n, seconds, pids)) for n in (1, 8, 32)]
            client_rows = [measure_client(url, n, seconds, pids) for n in (1, 8, 32)]
        finally:
            server.terminate()
            server.wait(timeout=30)
            for p in procs:
                stop(p)
            store.close()
    print("| clients | tx/s | MB/s | p50 ms | p99 ms | p999 ms | CPU us/tx |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(r["cpu_us_per_tx_by_process"], file=sys.stderr)
    for r in rows:
        print(f"| {r['clients']} | {r['tx_per_s']:,.0f} | {r['mb_per_s']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p999_ms']:.2f} | {r['cpu_us_per_tx']:.0f} |")
    print("\nThe client library (one WaltzClient, N threads each with one transaction in flight; latency submit -> applied)\n")
    print("| in flight | tx/s | p50 ms | p99 ms | CPU us/tx (all processes) | tx/s vs raw protocol |\n|---|---|---|---|---|---|")
    ratios = {}
    for r, raw in zip(client_rows, rows):
        ratio = r["tx_per_s"] / raw["tx_per_s"]  # type: ignore[operator]
        ratios[f"client_library_vs_raw_protocol_{r['concurrency']}"] = round(ratio, 3)
        print(f"| {r['concurrency']} | {r['tx_per_s']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_us_per_tx']:.0f} | {ratio:.2f}x |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"seconds_per_run": seconds, "rows": rows, "client_library": client_rows, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
