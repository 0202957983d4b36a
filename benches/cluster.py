"""A Waltz cluster on loopback against etcd, ZooKeeper, RabbitMQ and NATS JetStream, same load generator, same run.

    python benches/cluster.py [--quick] [--json PATH] [--plot PATH] [--systems LIST] [--event-loop uvloop|asyncio]

Waltz: 1 server (`waltz-node server`) and 3 storage nodes as separate processes, embedded
metadata, 4 partitions, driven by closed-loop clients speaking the client protocol. Each client
has one connection, mounts one partition (client i writes partition i mod 4) and keeps one 1 KiB
transaction in flight: it sends an Append and waits until its ReqId comes back in the feed (the
commit), then sends the next. Variants: without locks; with one write lock per transaction
drawn from a pool of 1,000 ids (a Lock Failure waits for the feed to pass the winner, then
retries the same transaction: latency counts from the first submit); and 2 servers over the 4
partitions (each client connects to the server of its partition). Then the same cluster through
the client library: one `WaltzClient` in this process with 1, 8, 32 threads each keeping one
transaction in flight, then one `AsyncWaltzClient` with as many tasks and `async def` callbacks,
each reporting submit-to-applied latency and the ratio to the raw-protocol clients at the same
concurrency (what the library costs). Both mount from the partitions' tails, as a service that
is up to date does.

Peers, each 3 members on loopback with the strongest durability its Debian version offers,
installed with apt when missing (as root; a clear message otherwise): the coordination stores
etcd (Debian `etcd-server`, client `aetcd`, puts of 1 KiB values) and ZooKeeper (Debian
`zookeeper`, client kazoo, persistent sequential znodes of 1 KiB), and the message logs
RabbitMQ (Debian `rabbitmq-server`, a quorum queue, client `aio-pika`, persistent messages with
publisher confirms) and NATS JetStream (Debian `nats-server`, a stream of 3 file-backed replicas,
client `nats-py`, publishes waiting for the PubAck). All but JetStream fsync on a majority before
they acknowledge; nats-server 2.9 cannot, so its rows say so and no target is judged against it
(each peer's promise is in its module under `benches/peers/` and in the JSON's `durability`).

All systems run through one load generator (`benches/peers/loadgen.py`), on uvloop (as a
`WaltzClient` runs; grpc.aio under aetcd runs on it too, kazoo on threads of its own; the
standard loop with `--event-loop asyncio`), at 1, 8, 32 clients:
committed operations/s, MB/s, p50/p99/p999 submit-to-commit latency, CPU microseconds per
committed operation summed over every process of the system plus this one (the clients). In
the same run: the write + fdatasync p50 of a 1 KiB record on the same disk and a loopback TCP
round trip p50, for the 1-client latency target.

Knobs for investigation: WALTZ_SERVER_EXTRA (TOML appended to the server's configuration, e.g.
"[partition]\\nmax_batches_in_flight = 2"), WALTZ_PROFILE=PATH (the first server runs under
cProfile).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from peers import etcd, jetstream, loadgen, rabbitmq, zookeeper  # noqa: E402
from peers.etcd import EtcdCluster, EtcdSession  # noqa: E402
from peers.jetstream import JetStreamCluster, JetStreamSession  # noqa: E402
from peers.loadgen import PeerUnavailable, closed_loop, cpu_seconds, log, threaded_closed_loop  # noqa: E402
from peers.rabbitmq import RabbitMQCluster, RabbitMQSession  # noqa: E402
from peers.zookeeper import ZooKeeperEnsemble, ZooKeeperSession  # noqa: E402
from support.processes import free_port, wait_http, write_config  # noqa: E402
from waltz import client_protocol as cp  # noqa: E402
from waltz.client import (  # noqa: E402
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)
from waltz.cluster import open_store  # noqa: E402
from waltz.cluster.metadata import ClusterMetadata  # noqa: E402
from waltz.event_loop import EVENT_LOOPS, loop_factory  # noqa: E402
from waltz.storage import StorageAdminClient  # noqa: E402

PARTITIONS = 4
LOCK_POOL = 1000
CLIENTS = (1, 8, 32)
RESULTS = HERE / "results"


# ---- Waltz ----------------------------------------------------------------------------------


class WaltzCluster:
    """`servers` servers and 3 storage nodes as processes on loopback, embedded metadata."""

    def __init__(self, root: pathlib.Path, servers: int = 1, partitions: int = PARTITIONS) -> None:
        self.root, self.servers, self.partitions = root, servers, partitions
        self.url = f"embedded:{root / 'meta.db'}"
        self.store: Any = None
        self.nodes: list[subprocess.Popen[str]] = []
        self.server_procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []

    @property
    def pids(self) -> dict[str, int]:
        names = ["server"] if self.servers == 1 else [f"server{i + 1}" for i in range(self.servers)]
        return {
            **dict(zip(names, (p.pid for p in self.server_procs))),
            **{f"storage{i + 1}": p.pid for i, p in enumerate(self.nodes)},
        }

    def start(self) -> None:
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        self.store = open_store(self.url)
        self.store.start()
        self.meta = meta = ClusterMetadata(self.store, "/waltz/bench")
        info, _ = meta.create("bench", self.partitions, 3)
        for i in range(3):
            (root / f"n{i}").mkdir()
            config, ports = write_config(root / f"n{i}", info.cluster_key, partition_count=self.partitions)
            with open(root / f"n{i}" / "node.log", "w") as logf:
                proc = loadgen.track(
                    subprocess.Popen(
                        [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(config)],
                        stdin=subprocess.DEVNULL,
                        stderr=logf,
                        text=True,
                    )
                )
            self.nodes.append(proc)
            wait_http(ports["http_port"], proc)
            meta.add_storage_node(f"127.0.0.1:{ports['port']}", ports["admin_port"], i)
            meta.auto_assign(i)

            async def assign(p: dict[str, int] = ports) -> None:
                async with await StorageAdminClient.connect(
                    "127.0.0.1", p["admin_port"], cluster_key=info.cluster_key, partition_count=self.partitions
                ) as a:
                    for q in range(self.partitions):
                        await a.assign(q)

            asyncio.run(assign())
        for s in range(self.servers):
            port = free_port()
            self.ports.append(port)
            config = root / f"server{s}.toml"
            config.write_text(
                f'[server]\nmetadata = "{self.url}"\ncluster = "bench"\nhost = "127.0.0.1"\nport = {port}\n'
                f"http_port = 0\n" + os.environ.get("WALTZ_SERVER_EXTRA", "")
            )
            profile = (
                ["-m", "cProfile", "-o", os.environ["WALTZ_PROFILE"]]
                if os.environ.get("WALTZ_PROFILE") and s == 0
                else []
            )
            with open(root / f"server{s}.log", "w") as logf:
                self.server_procs.append(
                    loadgen.track(
                        subprocess.Popen(
                            [sys.executable, *profile, "-m", "waltz.cli.node", "server", "--config", str(config)],
                            stdin=subprocess.DEVNULL,
                            stderr=logf,
                        )
                    )
                )
        self.wait_balanced()

    def wait_balanced(self, timeout: float = 60.0) -> None:
        """Every server up and every partition served, spread evenly over the servers."""
        deadline = time.monotonic() + timeout
        share = self.partitions // self.servers
        while True:
            live = self.meta.servers()
            served = [set(s.serving) for s in live]
            if (
                len(live) == self.servers
                and set().union(*served) >= set(range(self.partitions))
                and all(len(s) == share for s in served)
            ):
                break
            for s, p in enumerate(self.server_procs):
                if p.poll() is not None:
                    raise RuntimeError(f"server {s} exited: {(self.root / f'server{s}.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"partitions not served evenly after {timeout:.0f} s: {[sorted(s) for s in served]}")
            time.sleep(0.1)
        time.sleep(0.5)
        self.partition_port = {p: s.port for s in self.meta.servers() for p in s.serving}
        log(f"Waltz: {self.servers} server(s), 3 storage nodes, {self.partitions} partitions served")

    def stop(self) -> None:
        """SIGTERM to the servers, then to the storage nodes; a member that exits non-zero is reported."""
        try:
            for group in (self.server_procs, self.nodes):
                for p in group:
                    if p.poll() is None:
                        p.terminate()
                for p in group:
                    loadgen.stop_process(p, timeout=30)
                    if p.returncode not in (0, -15):
                        log(f"Waltz process {p.pid} exited with {p.returncode} (logs were in {self.root})")
        finally:
            for p in self.server_procs + self.nodes:
                if p.poll() is None:
                    p.kill()
            if self.store is not None:
                self.store.close()
                self.store = None


_client_ids = iter(range(100_000, 1 << 30))


class WaltzSession:
    """One closed-loop protocol client: one connection, one partition, one transaction in flight."""

    def __init__(self, cid: int, partition: int, locks: bool) -> None:
        self.cid, self.partition, self.locks = cid, partition, locks
        self.messages = cp.MessageReader()
        self.rng = random.Random(cid)
        self.seq = self.gen = self.hwm = 0
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    @classmethod
    async def connect(cls, port: int, partition: int, locks: bool = False) -> WaltzSession:
        """Connected, handshaken, and `hwm` the partition's high-water mark; not mounted."""
        self = cls(next(_client_ids), partition, locks)
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(cp.Hello().frame())
        assert isinstance(await self.next(), cp.HelloOk)
        self.writer.write(cp.HighWaterMarkRequest(1, partition).frame())
        while not isinstance(m := await self.next(), cp.HighWaterMarkResponse):
            pass
        self.hwm = m.high_water_mark
        return self

    @classmethod
    async def open(cls, port: int, partition: int, locks: bool = False) -> WaltzSession:
        self = await cls.connect(port, partition, locks)
        self.writer.write(cp.Mount(2, partition, self.cid, self.hwm, 1).frame())
        while not isinstance(m := await self.next(), cp.MountResponse):
            pass
        assert m.status == cp.MountStatus.READY, m
        self.gen = m.generation
        return self

    async def next(self) -> cp.Message:
        while (m := self.messages.next_message()) is None:
            data = await self.reader.read(1 << 20)
            if not data:
                raise ConnectionError("server closed the connection")
            self.messages.feed(data)
        return m

    def _feed(self, m: cp.FeedData, req: tuple[int, int, int, int]) -> bool:
        done = False
        for e in m.entries:
            self.hwm = e.transaction_id
            done = done or e.req_id == req
        return done

    async def op(self, payload: bytes) -> int:
        locks = (cp.lock_hash("bench", self.rng.randrange(LOCK_POOL)),) if self.locks else ()
        retries = 0
        while True:
            self.seq += 1
            req = (self.cid, self.gen, self.partition, self.seq)
            self.writer.write(cp.Append(req, self.hwm, 0, payload, write_locks=locks).frame())
            while True:
                m = await self.next()
                if isinstance(m, cp.FeedData):
                    if self._feed(m, req):
                        return retries
                elif isinstance(m, cp.LockFailure) and m.req_id == req:
                    while self.hwm < m.transaction_id:  # apply the feed up to the winner, then retry
                        if isinstance(f := await self.next(), cp.FeedData):
                            self._feed(f, req)
                    retries += 1
                    break
                elif isinstance(m, cp.Failure):
                    raise RuntimeError(f"client {self.cid}: {m}")

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class BlockingWaltzSession(WaltzSession):
    """`WaltzSession` over a blocking socket, for one thread of its own (`threaded_closed_loop`):
    the reference for `WaltzClient`, whose callers are threads, as the asyncio clients are for
    `AsyncWaltzClient`. No locks."""

    sock: socket.socket

    @classmethod
    def open_blocking(cls, port: int, partition: int) -> BlockingWaltzSession:
        self = cls(next(_client_ids), partition, False)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(cp.Hello().frame())
        assert isinstance(self.next_blocking(), cp.HelloOk)
        self.sock.sendall(cp.HighWaterMarkRequest(1, partition).frame())
        while not isinstance(m := self.next_blocking(), cp.HighWaterMarkResponse):
            pass
        self.hwm = m.high_water_mark
        self.sock.sendall(cp.Mount(2, partition, self.cid, self.hwm, 1).frame())
        while not isinstance(m := self.next_blocking(), cp.MountResponse):
            pass
        assert m.status == cp.MountStatus.READY, m
        self.gen = m.generation
        return self

    def next_blocking(self) -> cp.Message:
        while (m := self.messages.next_message()) is None:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("server closed the connection")
            self.messages.feed(data)
        return m

    def op(self, payload: bytes) -> int:  # type: ignore[override]
        self.seq += 1
        req = (self.cid, self.gen, self.partition, self.seq)
        self.sock.sendall(cp.Append(req, self.hwm, 0, payload).frame())
        while True:
            m = self.next_blocking()
            if isinstance(m, cp.FeedData):
                if self._feed(m, req):
                    return 0
            elif isinstance(m, cp.Failure):
                raise RuntimeError(f"client {self.cid}: {m}")

    def close(self) -> None:  # type: ignore[override]
        self.sock.close()


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
    """Transaction `n` of the submitter that works on `partition`: the library's submitters are
    pinned as the raw rows' clients are (submitter i on partition i % 4), so that both carry the
    same load and the ratio measures the library. Until 2026-11-28 the transactions went round
    the partitions by `n`, a load the raw clients never make: at 8 and 32 in flight it cost the
    server and the nodes a third of the throughput (smaller batches), not the library."""

    def __init__(self, n: int, payload: bytes, partition: int) -> None:
        super().__init__()
        self.n, self.payload, self.partition = n, payload, partition

    def partition_id(self, num_partitions: int) -> int:
        return self.partition % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self.n)
        builder.set_data(self.payload)
        return True


async def high_water_marks(partition_port: dict[int, int]) -> dict[int, int]:
    """Each partition's high-water mark, asked of its server over the raw protocol."""
    marks = {}
    for partition, port in partition_port.items():
        s = await WaltzSession.connect(port, partition)
        marks[partition] = s.hwm
        await s.close()
    return marks


class _AsyncNoted(_Noted):
    """The same application in `async def` callbacks: run on the client's loop, no threads."""

    async def get_client_high_water_mark(self, partition: int) -> int:  # type: ignore[override]
        return super().get_client_high_water_mark(partition)

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        super().apply_transaction(transaction)


class _AsyncPut(_Put):
    async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
        return super().execute(builder)


class _LibraryCell:
    """What both client-library cells share: the application, mounted from the partitions'
    tails as a service that is up to date is (until 2026-11-25 the cells mounted from -1 and
    applied every earlier cell's transactions, hundreds of thousands, inside their own measured
    seconds), the payload, when each transaction was submitted, and the CPU of every process."""

    def __init__(self, app: _Noted, partition_port: dict[int, int], pids: dict[str, int]) -> None:
        app.marks = asyncio.run(high_water_marks(partition_port))
        self.app, self.pids = app, {"clients": os.getpid(), **pids}
        self.payload = os.urandom(1024)
        self.submitted: dict[int, float] = {}
        self.counter = iter(range(1, 1 << 31))

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each process: this one ("clients", as the raw rows name it) and the cluster's."""
        return {k: cpu_seconds(p) for k, p in self.pids.items()}

    def row(
        self, concurrency: int, elapsed: float, cpu0: dict[str, float], cpu1: dict[str, float]
    ) -> dict[str, object]:
        cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
        lat = sorted(self.app.applied_at[n] - t for n, t in self.submitted.items() if n in self.app.applied_at)
        per = max(len(lat), 1)
        return {
            "concurrency": concurrency,
            "committed": len(lat),
            "tx_per_s": len(lat) / elapsed,
            "p50_ms": loadgen.percentile(lat, 0.50) * 1e3,
            "p99_ms": loadgen.percentile(lat, 0.99) * 1e3,
            "cpu_us_per_tx": sum(cpu.values()) / per * 1e6,
            "cpu_us_per_tx_by_process": {k: round(v / per * 1e6) for k, v in cpu.items()},
        }


def measure_async_client(
    url: str, partition_port: dict[int, int], concurrency: int, seconds: float, pids: dict[str, int], event_loop: str
) -> dict[str, object]:
    """One AsyncWaltzClient on this process's loop, `concurrency` tasks each keeping one
    transaction in flight, every callback `async def`: the library without thread crossings."""
    cell = _LibraryCell(_AsyncNoted(), partition_port, pids)

    async def run() -> tuple[float, dict[str, float], dict[str, float]]:
        async with AsyncWaltzClient(cell.app, ClientConfig(metadata=url, cluster="bench", max_pending=1024)) as client:
            c0, t0 = cell.cpu(), time.perf_counter()
            deadline = t0 + seconds

            async def one(i: int) -> None:
                while time.perf_counter() < deadline:
                    n = next(cell.counter)
                    cell.submitted[n] = time.perf_counter()
                    await (await client.submit(_AsyncPut(n, cell.payload, i)))

            await asyncio.gather(*(one(i) for i in range(concurrency)))
            await client.flush()
            return time.perf_counter() - t0, c0, cell.cpu()

    with asyncio.Runner(loop_factory=loop_factory(event_loop, "--event-loop")) as runner:
        elapsed, c0, c1 = runner.run(run())
    return cell.row(concurrency, elapsed, c0, c1)


def measure_client(
    url: str, partition_port: dict[int, int], concurrency: int, seconds: float, pids: dict[str, int]
) -> dict[str, object]:
    """One WaltzClient in this process, `concurrency` threads each keeping one transaction in
    flight (submit, wait for the commit): what the library costs over the raw protocol."""
    cell = _LibraryCell(_Noted(), partition_port, pids)
    with WaltzClient(cell.app, ClientConfig(metadata=url, cluster="bench", max_pending=1024)) as client:
        c0, t0 = cell.cpu(), time.perf_counter()
        deadline = t0 + seconds

        def loop(i: int) -> None:
            while time.perf_counter() < deadline:
                n = next(cell.counter)
                cell.submitted[n] = time.perf_counter()
                client.submit(_Put(n, cell.payload, i)).result()

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        client.flush()
        elapsed, c1 = time.perf_counter() - t0, cell.cpu()
    return cell.row(concurrency, elapsed, c0, c1)


# ---- the run --------------------------------------------------------------------------------

SYSTEMS = (
    "waltz",
    "waltz-locks",
    "client-library",
    "waltz-2servers",
    "waltz-wide",
    "etcd",
    "zookeeper",
    "rabbitmq",
    "jetstream",
)
OURS = ("waltz", "waltz-locks", "waltz-2servers", "waltz-wide")
# Many connections (issue 33): 2 servers, 16 partitions, 128 clients, against the 32-client figure.
WIDE_SERVERS, WIDE_PARTITIONS, WIDE_CLIENTS = 2, 16, 128
PEER_MODULES = {"etcd": etcd, "zookeeper": zookeeper, "rabbitmq": rabbitmq, "jetstream": jetstream}
PEERS = tuple(PEER_MODULES)
# What each peer's acknowledgement promises, and whether it fsyncs on a majority before it: the
# targets compare Waltz only with the peers that do.
DURABILITY = {name: {"promise": m.DURABILITY, "fsync_per_write": m.FSYNC_PER_WRITE} for name, m in PEER_MODULES.items()}
LABELS = {
    "waltz": "Waltz (1 server, no locks)",
    "waltz-locks": "Waltz (1 server, write lock of 1,000)",
    "waltz-2servers": "Waltz (2 servers, no locks)",
    "waltz-wide": "Waltz (2 servers, 16 partitions, no locks)",
    "server-cpu": "The server's CPU",
    "client-library": "The client library",
    "etcd": "etcd",
    "zookeeper": "ZooKeeper",
    "rabbitmq": "RabbitMQ (quorum queue)",
    "jetstream": "NATS JetStream (no fsync before ack)",
}


def durable_peers() -> tuple[str, ...]:
    return tuple(p for p in PEERS if DURABILITY[p]["fsync_per_write"])


class Timing:
    def __init__(self, quick: bool, event_loop: str = "uvloop") -> None:
        self.seconds = 2.0 if quick else 10.0  # measured window per cell
        self.warmup = 0.5 if quick else 1.0  # per cell, not measured
        self.system_warmup = 1.5 if quick else 5.0  # 8 clients once per system (JIT, caches), not measured
        self.event_loop = event_loop
        self.loop_factory = loop_factory(event_loop, "--event-loop")

    def run(self, coro: Any) -> Any:
        """Runs one cell's clients on the load generator's event loop (every system the same)."""
        with asyncio.Runner(loop_factory=self.loop_factory) as runner:
            return runner.run(coro)


def run_cells(
    name: str, open_session: Callable[[int, int], Any], pids: dict[str, int], t: Timing, clients: tuple[int, ...]
) -> list[dict[str, Any]]:
    """The warm-up pass, then one cell per client count."""
    log(f"{name}: warming up (8 clients, {t.system_warmup:.1f} s)")
    t.run(closed_loop(lambda i: open_session(8, i), 8, t.system_warmup, pids, warmup=0.0))
    rows = []
    for n in clients:
        r = t.run(closed_loop(lambda i, n=n: open_session(n, i), n, t.seconds, pids, warmup=t.warmup))
        r["load_average_1min"] = round(os.getloadavg()[0], 2)  # other work on the machine shows here
        log(
            f"{name} {n:>2} clients: {r['tx_per_s']:,.0f}/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms "
            f"CPU {r['cpu_us_per_tx']:.0f} us/op (clients {r['cpu_us_per_tx_by_process']['clients']})"
            + (f", {r['retries']} lock retries" if r["retries"] else "")
        )
        rows.append(r)
    return rows


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM (and SIGHUP) unwind like Ctrl-C, so every cluster is stopped and every dir removed."""

    def raise_interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def measure_all(
    root: pathlib.Path, systems: list[str], clients: tuple[int, ...], t: Timing, quick: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"systems": {}, "errors": {}, "versions": {}}
    out["durability"] = {p: DURABILITY[p] for p in PEERS if p in systems}
    calls = 2000 if quick else 5000
    log("references: write + fdatasync of 1 KiB, loopback round trip")
    out["references_before"] = {
        "fdatasync": loadgen.fdatasync_p50_us(root / "raw0", calls),
        "fdatasync_3_writers": loadgen.fdatasync_majority_p50_us(root / "raw0m", calls),
        "loopback_rtt": loadgen.loopback_rtt_p50_us(calls),
        "loopback_rtt_placed": loadgen.loopback_rtt_placed_us(calls),
    }

    if {"waltz", "waltz-locks", "client-library"} & set(systems):
        c = WaltzCluster(root / "waltz1", servers=1)
        try:
            c.start()
            port = c.ports[0]
            if "waltz" in systems:
                out["systems"]["waltz"] = run_cells(
                    "waltz", lambda n, i: WaltzSession.open(port, i % PARTITIONS), c.pids, t, clients
                )
            if "waltz-locks" in systems:
                out["systems"]["waltz-locks"] = run_cells(
                    "waltz-locks", lambda n, i: WaltzSession.open(port, i % PARTITIONS, locks=True), c.pids, t, clients
                )
            if "client-library" in systems:
                pids = c.pids
                # What threads alone cost: the raw protocol from blocking threads, no library.
                out["raw_threads"] = []
                for n in clients:
                    r = threaded_closed_loop(
                        lambda i: BlockingWaltzSession.open_blocking(port, i % PARTITIONS),
                        n,
                        t.seconds,
                        c.pids,
                        warmup=t.warmup,
                    )
                    log(f"raw protocol from {n:>2} blocking threads: {r['tx_per_s']:,.0f}/s p50 {r['p50_ms']:.2f} ms")
                    out["raw_threads"].append(r)
                out["client_library"] = []
                for n in clients:
                    r = measure_client(c.url, c.partition_port, n, t.seconds, pids)
                    log(
                        f"client library {n:>2} in flight: {r['tx_per_s']:,.0f}/s p50 {r['p50_ms']:.2f} ms, "
                        f"clients' CPU {r['cpu_us_per_tx_by_process']['clients']} us/tx"
                    )
                    out["client_library"].append(r)
                out["client_library_async"] = []
                for n in clients:
                    r = measure_async_client(c.url, c.partition_port, n, t.seconds, pids, t.event_loop)
                    log(
                        f"async client library {n:>2} in flight: {r['tx_per_s']:,.0f}/s p50 {r['p50_ms']:.2f} ms, "
                        f"clients' CPU {r['cpu_us_per_tx_by_process']['clients']} us/tx"
                    )
                    out["client_library_async"].append(r)
        finally:
            c.stop()
    if "waltz-2servers" in systems:
        c = WaltzCluster(root / "waltz2", servers=2)
        try:
            c.start()
            pp = c.partition_port
            out["systems"]["waltz-2servers"] = run_cells(
                "waltz-2servers", lambda n, i: WaltzSession.open(pp[i % PARTITIONS], i % PARTITIONS), c.pids, t, clients
            )
        finally:
            c.stop()
    if "waltz-wide" in systems:
        c = WaltzCluster(root / "waltz-wide", servers=WIDE_SERVERS, partitions=WIDE_PARTITIONS)
        try:
            c.start()
            pp = c.partition_port
            out["systems"]["waltz-wide"] = run_cells(
                "waltz-wide",
                lambda n, i: WaltzSession.open(pp[i % WIDE_PARTITIONS], i % WIDE_PARTITIONS),
                c.pids,
                t,
                (WIDE_CLIENTS,),
            )
        finally:
            c.stop()
    if "etcd" in systems:
        e = EtcdCluster(root / "etcd")
        try:
            e.start()
            from peers.etcd import version

            out["versions"]["etcd"] = version()
            out["systems"]["etcd"] = run_cells(
                "etcd", lambda n, i: EtcdSession.open(e.leader_port, next(_client_ids)), e.pids, t, clients
            )
        except PeerUnavailable as err:
            log(f"etcd skipped: {err}")
            out["errors"]["etcd"] = str(err)
        finally:
            e.stop()
    if "zookeeper" in systems:
        z = ZooKeeperEnsemble(root / "zookeeper")
        try:
            z.start()
            out["versions"]["zookeeper"] = z.version
            out["systems"]["zookeeper"] = run_cells(
                "zookeeper", lambda n, i: ZooKeeperSession.open(z.leader_port, next(_client_ids)), z.pids, t, clients
            )
        except PeerUnavailable as err:
            log(f"ZooKeeper skipped: {err}")
            out["errors"]["zookeeper"] = str(err)
        finally:
            z.stop()
    if "rabbitmq" in systems:
        rmq = RabbitMQCluster(root / "rabbitmq")
        try:
            rmq.start()
            out["versions"]["rabbitmq"] = rmq.version
            t.run(RabbitMQSession.declare(rmq.leader_port))
            rmq.locate_queue()
            out["systems"]["rabbitmq"] = run_cells(
                "rabbitmq", lambda n, i: RabbitMQSession.open(rmq.leader_port), rmq.pids, t, clients
            )
        except PeerUnavailable as err:
            log(f"RabbitMQ skipped: {err}")
            out["errors"]["rabbitmq"] = str(err)
        finally:
            rmq.stop()
    if "jetstream" in systems:
        j = JetStreamCluster(root / "jetstream")
        try:
            j.start()
            out["versions"]["jetstream"] = j.version
            t.run(j.create_stream())
            out["systems"]["jetstream"] = run_cells(
                "jetstream", lambda n, i: JetStreamSession.open(j.leader_port, next(_client_ids)), j.pids, t, clients
            )
        except PeerUnavailable as err:
            log(f"JetStream skipped: {err}")
            out["errors"]["jetstream"] = str(err)
        finally:
            j.stop()
    out["references_after"] = {
        "fdatasync": loadgen.fdatasync_p50_us(root / "raw1", calls),
        "fdatasync_3_writers": loadgen.fdatasync_majority_p50_us(root / "raw1m", calls),
        "loopback_rtt": loadgen.loopback_rtt_p50_us(calls),
        "loopback_rtt_placed": loadgen.loopback_rtt_placed_us(calls),
    }
    return out


def cell(rows: list[dict[str, Any]] | None, clients: int) -> dict[str, Any] | None:
    return next((r for r in rows or [] if r["clients"] == clients), None)


def strongest_durable_peer(sysres: dict[str, Any], clients: tuple[int, ...]) -> dict[str, Any]:
    """Per client count, the durable peer with the most committed operations/s in this run (what
    every throughput target is also stated against)."""
    out = {}
    for n in clients:
        rows = [(c["tx_per_s"], p) for p in durable_peers() if (c := cell(sysres.get(p), n))]
        if rows:
            tx, peer = max(rows)
            out[str(n)] = {"peer": peer, "tx_per_s": tx}
    return out


THROUGHPUT_X = 4.0
"""Issue 33: throughput at 8 and 32 clients at least this many times each durable peer's."""
P99_X = 0.5
"""Issue 33: p99 at most this fraction of etcd's at the same client count."""
SERVER_CPU_X = 2.0
"""Issue 33: the server's CPU per committed transaction at 32 clients, at most this many times one
storage node's in the same cell."""
LIBRARY_X = 0.9
"""Issue 33: the client library's throughput at least this fraction of the raw protocol's."""


def design_targets(res: dict[str, Any], sysres: dict[str, Any]) -> dict[str, Any]:
    """Issue 33's targets beyond the peer ratios: the server's CPU against a storage node's, the
    client library against the raw protocol, and many connections against the 32-client cell."""
    out: dict[str, Any] = {}
    one = cell(sysres.get("waltz"), 32)
    if one:
        by = one["cpu_us_per_tx_by_process"]
        nodes = [v for k, v in by.items() if k.startswith("storage")]
        if "server" in by and nodes:
            node = max(nodes)  # the busiest node: the ratio is the server's cost over a replica's
            out["server-cpu"] = {
                f"server CPU/tx <= {SERVER_CPU_X:g}x one storage node's at 32 clients": {
                    "value": round(by["server"] / node, 3),
                    "met": by["server"] <= SERVER_CPU_X * node,
                    "detail": f"server {by['server']} us, busiest storage node {node} us",
                }
            }
    lib: dict[str, Any] = {}
    for key, name in (("client_library", "WaltzClient"), ("client_library_async", "AsyncWaltzClient")):
        for r in res.get(key, []):
            raw = cell(sysres.get("waltz"), r["concurrency"])
            if raw:
                x = r["tx_per_s"] / raw["tx_per_s"]
                lib[f"{name} >= {LIBRARY_X:g}x raw protocol at {r['concurrency']} in flight"] = {
                    "value": round(x, 3),
                    "met": x >= LIBRARY_X,
                }
    if lib:
        out["client-library"] = lib
    wide = cell(sysres.get("waltz-wide"), WIDE_CLIENTS)
    base = cell(sysres.get("waltz-2servers"), 32) or cell(sysres.get("waltz"), 32)
    if wide and base:
        out["waltz-wide"] = {
            f"{WIDE_CLIENTS} clients >= the 32-client throughput": {
                "value": round(wide["tx_per_s"] / base["tx_per_s"], 3),
                "met": wide["tx_per_s"] >= base["tx_per_s"],
                "detail": f"{wide['tx_per_s']:,.0f} against {base['tx_per_s']:,.0f} tx/s, p99 {wide['p99_ms']:.2f} ms",
            }
        }
    return out


def analyse(res: dict[str, Any], clients: tuple[int, ...]) -> None:
    """Adds ratios (ours ÷ peer, same client count) and the targets to `res`."""
    sysres = res["systems"]
    ratios: dict[str, Any] = {}
    for ours in OURS:
        for peer in PEERS:
            for n in clients:
                a, b = cell(sysres.get(ours), n), cell(sysres.get(peer), n)
                if a and b:
                    ratios[f"{ours}/{peer}/{n}"] = {
                        "tx_per_s": a["tx_per_s"] / b["tx_per_s"],
                        "p50": a["p50_ms"] / b["p50_ms"],
                        "p99": a["p99_ms"] / b["p99_ms"],
                        "cpu_per_tx": a["cpu_us_per_tx"] / b["cpu_us_per_tx"],
                    }
    res["peer_ratios"] = ratios
    res["strongest_durable_peer"] = strongest_durable_peer(sysres, clients)
    refs = [res["references_before"], res["references_after"]]
    # The lower of the two measurements: other work on the machine only ever adds to either.
    fsync = min(r["fdatasync"]["p50_us"] for r in refs)
    rtt = min(r["loopback_rtt"]["p50_us"] for r in refs)
    bound_us = 1.5 * (fsync + 2 * rtt)
    targets: dict[str, Any] = {}
    for ours in OURS:
        verdicts = {}
        for peer in durable_peers():  # a peer that acknowledges before its fsync is no yardstick
            for n in (8, 32):
                r = ratios.get(f"{ours}/{peer}/{n}")
                if r is None:
                    continue
                verdicts[f"throughput >= {THROUGHPUT_X:g}x {peer} at {n}"] = {
                    "value": round(r["tx_per_s"], 3),
                    "met": r["tx_per_s"] >= THROUGHPUT_X,
                }
                if peer == "etcd":
                    verdicts[f"p99 <= {P99_X:g}x etcd at {n}"] = {"value": round(r["p99"], 3), "met": r["p99"] <= P99_X}
        one = cell(sysres.get(ours), 1)
        if one:
            verdicts["p50 at 1 client <= 1.5 x (fdatasync p50 + 2 loopback RTT p50)"] = {
                "value_us": round(one["p50_ms"] * 1e3),
                "bound_us": round(bound_us),
                "met": one["p50_ms"] * 1e3 <= bound_us,
            }
        if verdicts:
            targets[ours] = verdicts
    targets.update(design_targets(res, sysres))
    res["latency_floor"] = {"fdatasync_p50_us": fsync, "loopback_rtt_p50_us": rtt, "bound_us": bound_us}
    if all("fdatasync_3_writers" in r for r in refs):
        # Informative: the same formula with the fsync a majority of three replicas on this one
        # disk actually waits for (three syncing at once).
        fsync3 = min(r["fdatasync_3_writers"]["p50_us"] for r in refs)
        res["latency_floor"].update(fdatasync_3_writers_p50_us=fsync3, bound_3_writers_us=1.5 * (fsync3 + 2 * rtt))
    res["targets"] = targets
    # The figures issue 5 and 7 reported, under their old keys.
    res["rows"] = sysres.get("waltz", [])
    res["ratios"] = {}
    for key in ("client_library", "client_library_async"):
        for r in res.get(key, []):
            raw = cell(sysres.get("waltz"), r["concurrency"])
            if raw:
                res["ratios"][f"{key}_vs_raw_protocol_{r['concurrency']}"] = round(r["tx_per_s"] / raw["tx_per_s"], 3)
    # Informative: the raw protocol from blocking threads against the asyncio clients (what
    # threads alone cost), and WaltzClient, whose callers are threads, against it.
    for r in res.get("raw_threads", []):
        raw = cell(sysres.get("waltz"), r["clients"])
        if raw:
            res["ratios"][f"raw_threads_vs_raw_protocol_{r['clients']}"] = round(r["tx_per_s"] / raw["tx_per_s"], 3)
        lib = [x for x in res.get("client_library", []) if x["concurrency"] == r["clients"]]
        if lib:
            res["ratios"][f"client_library_vs_raw_threads_{r['clients']}"] = round(
                lib[0]["tx_per_s"] / r["tx_per_s"], 3
            )


def report(res: dict[str, Any]) -> None:
    sysres = res["systems"]
    rows = sysres.get("waltz")
    if rows:
        print("Waltz, 1 server and 3 storage nodes, raw-protocol clients, no locks\n")
        print("| clients | tx/s | MB/s | p50 ms | p99 ms | p999 ms | CPU us/tx |\n|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['clients']} | {r['tx_per_s']:,.0f} | {r['mb_per_s']:.2f} | {r['p50_ms']:.2f} | "
                f"{r['p99_ms']:.2f} "
                f"| {r['p999_ms']:.2f} | {r['cpu_us_per_tx']:.0f} |"
            )
        for r in rows:
            print(r["cpu_us_per_tx_by_process"], file=sys.stderr)
    if res.get("raw_threads"):
        print(
            "\nThe raw protocol from blocking threads (a socket and a thread per client, no event loop, no "
            "library: what threads that each wait for their own write cost)\n"
        )
        print(
            "| threads | tx/s | p50 ms | p99 ms | CPU us/tx (all processes) | tx/s vs asyncio raw clients | "
            "WaltzClient tx/s vs it |\n|---|---|---|---|---|---|---|"
        )
        for r in res["raw_threads"]:
            n = r["clients"]
            vs_raw, lib = (
                res["ratios"].get(f"{k}_{n}") for k in ("raw_threads_vs_raw_protocol", "client_library_vs_raw_threads")
            )
            print(
                f"| {n} | {r['tx_per_s']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['cpu_us_per_tx']:.0f} | "
                + (f"{vs_raw:.2f}x | " if vs_raw is not None else "- | ")
                + (f"{lib:.2f}x |" if lib is not None else "- |")
            )
    for key, title in (
        (
            "client_library",
            "one WaltzClient, N threads each with one transaction in flight, thread i on partition i % 4",
        ),
        (
            "client_library_async",
            "one AsyncWaltzClient, N tasks each with one transaction in flight, task i on partition i % 4, async",
        ),
    ):
        if not res.get(key):
            continue
        print(f"\nThe client library ({title}; latency submit -> applied)\n")
        print(
            "| in flight | tx/s | p50 ms | p99 ms | CPU us/tx (all processes) | tx/s vs raw protocol "
            "|\n|---|---|---|---|---|---|"
        )
        for r in res[key]:
            ratio = res["ratios"].get(f"{key}_vs_raw_protocol_{r['concurrency']}")
            print(
                f"| {r['concurrency']} | {r['tx_per_s']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{r['cpu_us_per_tx']:.0f} | " + (f"{ratio:.2f}x |" if ratio is not None else "- |")
            )
    print(
        "\nAll systems, the same load generator (1 KiB writes, one in flight per client; latency submit -> commit; "
        "CPU summed over the system's processes and the clients)\n"
    )
    print(
        "| system | clients | ops/s | MB/s | p50 ms | p99 ms | p999 ms | CPU us/op | lock retries "
        "|\n|---|---|---|---|---|---|---|---|---|"
    )
    for name, rs in sysres.items():
        for r in rs:
            print(
                f"| {LABELS.get(name, name)} | {r['clients']} | {r['tx_per_s']:,.0f} | {r['mb_per_s']:.2f} | "
                f"{r['p50_ms']:.2f} "
                f"| {r['p99_ms']:.2f} | {r['p999_ms']:.2f} | {r['cpu_us_per_tx']:,.0f} | {r['retries']} |"
            )
    if res["peer_ratios"]:
        print(
            "\nRatios, ours / peer at the same client count (throughput: higher is better; p99 and CPU: lower is "
            "better)\n"
        )
        for line in ratio_table(res):
            print(line)
    if res.get("durability"):
        print("\nWhat each peer's acknowledgement promises (targets only against those that fsync first)\n")
        for name, d in res["durability"].items():
            print(f"- {LABELS.get(name, name)}: {d['promise']}" + ("" if d["fsync_per_write"] else " [not durable]"))
    lf = res["latency_floor"]
    rb, ra = res["references_before"], res["references_after"]
    print(
        f"\nReferences (before / after the systems): write + fdatasync of 1 KiB p50 {rb['fdatasync']['p50_us']:.0f} / "
        f"{ra['fdatasync']['p50_us']:.0f} us; loopback TCP round trip (1 KiB) p50 {rb['loopback_rtt']['p50_us']:.0f} / "
        f"{ra['loopback_rtt']['p50_us']:.0f} us; 1-client bound 1.5 x ({lf['fdatasync_p50_us']:.0f} + 2 x "
        f"{lf['loopback_rtt_p50_us']:.0f}) = {lf['bound_us']:.0f} us"
    )
    if "fdatasync_3_writers_p50_us" in lf:
        print(
            f"Three writers syncing at once (three replicas on this one disk, as every commit has them): write + "
            f"fdatasync p50 {rb['fdatasync_3_writers']['p50_us']:.0f} / {ra['fdatasync_3_writers']['p50_us']:.0f} us; "
            f"the same bound with it: 1.5 x ({lf['fdatasync_3_writers_p50_us']:.0f} + 2 x "
            f"{lf['loopback_rtt_p50_us']:.0f}) "
            f"= {lf['bound_3_writers_us']:.0f} us (informative; the target keeps the issue's formula)"
        )
    if rb.get("loopback_rtt_placed") and ra.get("loopback_rtt_placed"):
        placed = "; ".join(
            f"{r['loopback_rtt_placed']['one_core_p50_us']:.0f} / {r['loopback_rtt_placed']['two_cores_p50_us']:.0f}"
            for r in (rb, ra)
        )
        print(
            f"Loopback round trip with both ends pinned to one core / to two (before; after): {placed} us "
            "(informative: the unpinned reference is one or the other, as the scheduler places its echo)"
        )
    if strongest := res.get("strongest_durable_peer"):
        print(
            "\nStrongest durable peer per client count: "
            + "; ".join(f"{n}: {LABELS[s['peer']]} {s['tx_per_s']:,.0f}/s" for n, s in strongest.items())
        )
    for name, err in res["errors"].items():
        print(f"\n{name}: NOT MEASURED: {err}")
    print("\nTargets")
    for ours, verdicts in res["targets"].items():
        print(f"\n{LABELS[ours]}:")
        for what, v in verdicts.items():
            val = f"{v['value_us']} us (bound {v['bound_us']} us)" if "value_us" in v else f"{v['value']:.2f}"
            detail = f" ({v['detail']})" if "detail" in v else ""
            print(f"- {what}: {val}{detail}: {'MET' if v['met'] else 'MISSED'}")


SHORT = {"etcd": "etcd", "zookeeper": "ZooKeeper", "rabbitmq": "RabbitMQ", "jetstream": "JetStream (no fsync)"}


def ratio_table(res: dict[str, Any]) -> list[str]:
    """Markdown rows: per Waltz variant and client count, tx/s, p99 and CPU/op ÷ each peer measured."""
    peers = [p for p in PEERS if p in res["systems"]]
    metrics = (("tx_per_s", "tx/s"), ("p99", "p99"), ("cpu_per_tx", "CPU/op"))
    head = [f"{what} ÷ {SHORT[p]}" for _, what in metrics for p in peers]
    lines = ["| Waltz variant | clients | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for ours in OURS:
        for n in sorted({r["clients"] for r in res["systems"].get(ours, [])}):
            cells = []
            for key, _ in metrics:
                for p in peers:
                    d = res["peer_ratios"].get(f"{ours}/{p}/{n}")
                    cells.append(f"{d[key]:.2f}" if d else "-")
            lines.append(f"| {LABELS[ours]} | {n} | " + " | ".join(cells) + " |")
    return lines


def plot(res: dict[str, Any], path: pathlib.Path, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "waltz": ("tab:blue", "o", "-"),
        "waltz-locks": ("tab:cyan", "s", "--"),
        "waltz-2servers": ("tab:purple", "^", ":"),
        "waltz-wide": ("tab:brown", "*", ":"),
        "etcd": ("tab:green", "D", "-"),
        "zookeeper": ("tab:red", "v", "-"),
        "rabbitmq": ("tab:orange", "P", "-"),
        "jetstream": ("tab:olive", "X", "--"),  # dashed: acknowledged before any fsync
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharex=True)
    for ax, key, what in ((axes[0], "p99_ms", "p99"), (axes[1], "p50_ms", "p50")):
        for name, rows in res["systems"].items():
            color, marker, ls = styles.get(name, ("gray", "x", "-"))
            xs, ys = [r["tx_per_s"] for r in rows], [r[key] for r in rows]
            ax.plot(xs, ys, color=color, marker=marker, linestyle=ls, label=LABELS.get(name, name))
            for r, x, y in zip(rows, xs, ys):
                ax.annotate(
                    f"{r['clients']}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8, color=color
                )
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else "")
        )
        ax.set_xlabel("committed 1 KiB writes/s")
        ax.set_ylabel(f"{what} submit-to-commit latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"throughput vs {what} latency (labels: clients)")
    if "latency_floor" in res:
        axes[1].axhline(
            res["latency_floor"]["bound_us"] / 1e3,
            color="gray",
            linestyle="--",
            linewidth=1,
            label="1.5 x (fdatasync + 2 RTT)",
        )
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s per cell instead of 10 s")
    ap.add_argument("--json", type=pathlib.Path, help="results (default benches/results/cluster[-quick].json)")
    ap.add_argument("--plot", type=pathlib.Path, help="PNG (default benches/results/cluster-peers[-quick].png)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="client counts (default 1,8,32)")
    ap.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="uvloop",
        help="the load generator's loop, for every system's clients (default uvloop, as WaltzClient's)",
    )
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    if bad := set(systems) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(bad)}")
    clients = tuple(int(c) for c in args.clients.split(","))
    suffix = "-quick" if args.quick else ""
    json_path = args.json or RESULTS / f"cluster{suffix}.json"
    plot_path = args.plot or RESULTS / f"cluster-peers{suffix}.png"
    t = Timing(args.quick, args.event_loop)
    load = os.getloadavg()
    log(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    started = time.time()
    with terminate_on_sigterm(), loadgen.scratch_dir("waltz-cluster-bench-") as root:
        try:
            res = measure_all(root, systems, clients, t, args.quick)
        except KeyboardInterrupt:
            log("interrupted: processes stopped, temporary files removed")
            return 130
        finally:
            if n := loadgen.kill_leftovers():
                log(f"killed {n} leftover process(es)")
    res["run"] = {
        "command": " ".join(["python", "benches/cluster.py", *sys.argv[1:]]),
        "quick": args.quick,
        "event_loop": t.event_loop,
        "seconds_per_cell": t.seconds,
        "warmup_per_cell": t.warmup,
        "system_warmup": t.system_warmup,
        "load_average_before": load,
        "load_average_after": os.getloadavg(),
        "wall_seconds": round(time.time() - started, 1),
        "cpus": os.cpu_count(),
    }
    res["seconds_per_run"] = t.seconds
    analyse(res, clients)
    report(res)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=2))
    versions = ", ".join(f"{k} {v}" for k, v in res["versions"].items())
    plot(
        res,
        plot_path,
        f"1 KiB writes, 3 replicas, fsync on a majority before the ack (except where marked), loopback, "
        f"{os.cpu_count()} cores;\n{versions}; {t.seconds:.0f} s per point; load avg before {load[0]:.1f}",
    )
    log(f"wrote {json_path} and {plot_path} ({res['run']['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
