"""A torture run (`waltz torture`): a local cluster behind fault-injecting proxies, client
processes appending and consuming while the nemesis strikes, then healing, draining every copy
of the log and checking the history against them (docs/torture.md).

The run's directory:
    cluster/            the LocalCluster (configs, data, member logs)
    zookeeper/          its ZooKeeper, with --zookeeper
    history/*.jsonl     one history per worker, plus the nemesis's (faults, observed marks)
    clients/            worker logs and the stop / done / final handshake files
    drains.jsonl        the cluster's feed and each replica's files, as drained at the end
    report.json         the checker's report, the faults injected and the run's problems
    error.txt           the traceback, when the run itself failed before judging
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from waltz import errors
from waltz.client import WaltzClient
from waltz.client.log_reader import LogReader
from waltz.cluster import retention as retention_policy
from waltz.cluster.manager import LIVE_MOVE
from waltz.local import LocalCluster
from waltz.local.cluster import REPLICAS
from waltz.local.zookeeper import ZooKeeperServer
from waltz.storage import Storage
from waltz.storage.client import StorageAdminClient
from waltz.torture import clock_faults, membership
from waltz.torture.checker import check
from waltz.torture.clock_faults import CLOCK_FAULTS
from waltz.torture.disk import DISK_FAULTS, DISK_SEGMENT_SIZE, mount_disks, unmount_disks
from waltz.torture.drain import Record, record_from_bytes, write_drains
from waltz.torture.feed import FeedRecorder
from waltz.torture.history import HistoryWriter, read_history
from waltz.torture.nemesis import FAULTS, Nemesis
from waltz.torture.proxy import FaultProxy, ProxyLoop
from waltz.torture.report import Report
from waltz.torture.workload import WorkloadSettings
from waltz.torture.workloads import check_workload, prepare


@dataclasses.dataclass
class TortureOptions:
    directory: pathlib.Path
    duration: float = 60.0
    """Seconds of faults; healing, draining and checking come after."""
    seed: int = 0
    clients: int = 3
    partitions: int = 2
    faults: tuple[str, ...] = FAULTS
    zookeeper: bool = False
    """Metadata in a real ZooKeeper started by the run (then kill-zookeeper applies)."""
    in_flight: int = 4
    """Operations each client keeps pending."""
    lock_pool: int = 6
    op_timeout: float = 10.0
    interval: float = 1.0
    """Seconds between nemesis steps."""
    hold: tuple[float, float] = (1.0, 6.0)
    """How long a fault lasts (uniform)."""
    heal_timeout: float = 180.0
    cover: bool = False
    """The nemesis picks among the kinds injected least so far (a short run covers every kind)."""
    retention_max_age: float | None = None
    """Seconds: a retention policy with this max age, 64 KiB segments and a checkpoint every 200
    transactions, so that replicas delete during the faults (None: keep everything)."""
    standstill: float | None = None
    """Seconds: the standstill check (`torture/progress.py`) with this limit; None: off (a loaded
    machine stalls a correct cluster for seconds now and then, so only runs that prove a mutant of
    the minority faults use it)."""
    workload: str = "log"
    """What the clients run (`waltz.torture.workload.WORKLOADS`)."""
    segment_size: int | None = None
    """Bytes per segment; None: 64 KiB with retention or disk faults (segments roll during the
    faults), the node's default otherwise."""
    min_faults: int = 0
    """Faults to inject at least: the schedule runs past `duration` (up to twice it) until this
    many started. A short run on a loaded machine otherwise spends its seconds in a few slow
    operator steps (remove-node took 10-26 s under CI's load) and proves little."""


def _keep_injecting(elapsed: float, started: int, o: TortureOptions) -> bool:
    """Whether the schedule goes on: for `duration`, then while fewer than `min_faults` started,
    up to twice the duration."""
    if elapsed < o.duration:
        return True
    return started < o.min_faults and elapsed < 2 * o.duration


@dataclasses.dataclass
class TortureResult:
    report: Report
    faults: dict[str, int]
    problems: list[str]
    transactions: int
    seconds: float
    locks: dict[str, int] = dataclasses.field(default_factory=dict)
    """The servers' lock failures at the end (counters restart with a partition's server)."""
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    """What the run did besides its faults: `live_server_moves` (partitions the cluster manager
    took from a live server, to balance a server that came back), `standstill_judged_seconds`
    (how long the standstill check judged the partitions' progress)."""

    @property
    def passed(self) -> bool:
        return self.report.ok and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "transactions": self.transactions,
            "seconds": round(self.seconds, 1),
            "faults": self.faults,
            "problems": self.problems,
            "locks": self.locks,
            "stats": self.stats,
            "report": json.loads(self.report.to_json()),
        }


class _Worker:
    def __init__(
        self, run_dir: pathlib.Path, index: int, spec: dict[str, Any], env: dict[str, str] | None = None
    ) -> None:
        self.index = index
        self.log_path = run_dir / "clients" / f"worker-{index}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "waltz.torture.worker", str(run_dir), str(index), json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                # Past this many MiB a worker dumps its stacks and exits: a growing client is a
                # finding, never a reason for the kernel to kill the machine's other processes.
                env={
                    **os.environ,
                    "WALTZ_TORTURE_MEMORY": os.environ.get("WALTZ_TORTURE_MEMORY", "2048"),
                    **(env or {}),
                },
            )

    def failure(self) -> str | None:
        code = self.proc.poll()
        if code is None or code == 0:
            return None
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return f"worker {self.index} exited with {code}: {lines[-1] if lines else '(no output)'}"

    def dump_stacks(self) -> None:
        """A worker that is still running when it should have finished: its threads' stacks go
        to its log (faulthandler), which is what a hang needs to be understood."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _MarkObserver:
    """Asks the partitions' servers for their high-water marks once a second and records each
    answer with the time it was asked (the checker's hwm-decrease and hwm-beyond-log)."""

    def __init__(
        self, cluster: LocalCluster, history: HistoryWriter, say: Callable[[str], None] = lambda _: None
    ) -> None:
        self._cluster, self._history, self._say = cluster, history, say
        self.latest: dict[int, int] = {}
        """The newest mark observed per partition: ids at or below it are committed."""
        self._stop = threading.Event()
        self.started = threading.Event()
        """Set once the observer reads the metadata (it may be down when the run begins)."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="mark-observer", daemon=True)
        self._thread.start()

    async def _start(self) -> LogReader | None:
        """A started reader, or None once the run ends first. The metadata may be down when the
        observer starts (a schedule can open with kill-zookeeper): it is asked again each second,
        as the marks are; giving up left the run without its observer (seeds 78 and 82)."""
        said = ""
        while not self._stop.is_set():
            reader = LogReader(self._cluster.metadata_url, self._cluster.cluster, timeout=2.0)
            try:
                await reader.start()
                if said:
                    self._say("  mark observer: started")
                return reader
            except (errors.WaltzError, OSError, TimeoutError) as e:
                if str(e) != said:  # a lasting cause (a wrong cluster name) is said, once
                    said = str(e)
                    self._say(f"  mark observer: cannot start yet ({e}); trying again each second")
                with contextlib.suppress(Exception):
                    await reader.close()
                await asyncio.sleep(1.0)
        return None

    async def _run(self) -> None:
        reader = await self._start()
        if reader is None:
            return
        self.started.set()
        try:
            while not self._stop.is_set():
                for p in range(self._cluster.partitions):
                    asked = time.monotonic_ns()
                    try:
                        value = await reader.high_water_mark(p)
                    except (errors.WaltzError, OSError, TimeoutError):
                        continue  # unavailable under a fault: nothing observed
                    self._history.hwm(p, value, invoked=asked)
                    self.latest[p] = max(value, self.latest.get(p, -1))
                await asyncio.sleep(1.0)
        finally:
            await reader.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def run_torture(o: TortureOptions, say: Callable[[str], None] = print) -> TortureResult:
    started = time.monotonic()
    d = o.directory.resolve()
    if d.exists() and any(d.iterdir()):
        raise errors.WaltzError(f"{d} is not empty: a torture run needs a directory of its own")
    for sub in ("history", "clients"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    rng = random.Random(o.seed)
    zookeeper = ZooKeeperServer(d / "zookeeper") if o.zookeeper else None
    loop = ProxyLoop()
    proxies: dict[str, FaultProxy] = {}
    workers: list[_Worker] = []
    observer: _MarkObserver | None = None
    cluster: LocalCluster | None = None
    disks: dict[str, Any] = {}
    nemesis_log = HistoryWriter(d / "history" / "nemesis.jsonl", "nemesis")
    problems: list[str] = []
    metadata_proxy: FaultProxy | None = None
    try:
        metadata = None
        if zookeeper is not None:
            say(f"starting ZooKeeper on {zookeeper.hosts}")
            zookeeper.start()
            # Every process reaches ZooKeeper through a proxy: the zombie fault cuts one server from it.
            metadata_proxy = FaultProxy(loop, "zookeeper", zookeeper.port)
            metadata = f"zk://127.0.0.1:{metadata_proxy.port}/torture-{uuid.uuid4().hex[:8]}"
        retention = o.retention_max_age is not None
        workload = WorkloadSettings.named(o.workload)
        partition_keys = {"checkpoint_interval": 200} if retention else {}
        if workload.lock_budget_bytes is not None:
            partition_keys["lock_budget_bytes"] = workload.lock_budget_bytes
        segment_size = o.segment_size or (DISK_SEGMENT_SIZE if retention or set(o.faults) & set(DISK_FAULTS) else None)
        cluster = LocalCluster.create(
            d / "cluster",
            metadata=metadata,
            partitions=o.partitions,
            cluster="torture",
            storage_nodes=REPLICAS
            + (membership.SPARE_NODES if set(membership.MEMBERSHIP_FAULTS) & set(o.faults) else 0),
            storage_keys={"segment_size": segment_size} if segment_size else None,
            partition_keys=partition_keys or None,
        )
        disks = mount_disks(cluster, o.faults)
        clocks = bool(set(o.faults) & set(CLOCK_FAULTS))
        if clocks:  # each process reads a clock file of its own, which the clock faults write
            cluster.member_env = {m.name: clock_faults.environment(cluster.directory, m.name) for m in cluster.members}
        for m in cluster.members:
            proxies[m.name] = FaultProxy(loop, m.name, m.port)
            cluster.advertise(m.name, proxies[m.name].port)
        cluster.start(step=say)
        if o.retention_max_age is not None:
            with cluster.metadata() as meta:
                retention_policy.set_policy(meta, None, max_age_ms=int(o.retention_max_age * 1000))
            say(f"retention: transactions older than {o.retention_max_age:g} s are deleted during the run")
        say(f"cluster up: {', '.join(f'{m.name}@{cluster.dialed_address(m)}' for m in cluster.members)}")
        spec = {
            "seed": o.seed,
            "in_flight": o.in_flight,
            "lock_pool": o.lock_pool,
            "sizes": [64, 700, 3000],
            "op_timeout": o.op_timeout,
            "drain_timeout": o.heal_timeout,
            "client": cluster.client_settings(mount_timeout=o.op_timeout, transaction_timeout=o.op_timeout),
            "workload": workload.to_json(),
        }
        prepare(workload, d, o.partitions)
        say(f"workload: {o.workload}")
        clients = tuple(f"worker-{i}" for i in range(o.clients))
        workers = [
            _Worker(d, i, spec, clock_faults.environment(cluster.directory, name) if clocks else None)
            for i, name in enumerate(clients)
        ]
        _wait(
            lambda: all((d / "clients" / f"worker-{w.index}.ready").exists() for w in workers),
            workers,
            o.op_timeout + 60,
            "the clients did not mount their partitions",
        )
        observer = _MarkObserver(cluster, nemesis_log, say)
        nemesis = Nemesis(
            cluster,
            proxies,
            rng,
            o.faults,
            nemesis_log.write,
            say,
            zookeeper=zookeeper,
            hold=o.hold,
            committed=lambda: dict(observer.latest) if observer else {},
            metadata_proxy=metadata_proxy,
            cover=o.cover,
            disks=disks,
            clients=clients if clocks else (),
            client_pids=lambda: {f"worker-{w.index}": w.proc.pid for w in workers},
            standstill=None if retention else o.standstill,
        )
        say(f"faults for {o.duration:.0f} s (seed {o.seed}): {', '.join(nemesis.kinds)}")
        start = time.monotonic()
        while _keep_injecting(time.monotonic() - start, sum(nemesis.counts.values()), o):
            nemesis.step()
            _check_workers(workers)
            time.sleep(o.interval)
        say("healing every fault")
        nemesis.heal_all()
        problems += nemesis.problems
        for p in [*proxies.values(), *([metadata_proxy] if metadata_proxy else [])]:
            p.set_mode("pass")
        cluster.start()  # whatever a failed heal left down
        cluster.wait_served(o.heal_timeout)
        (d / "clients" / "stop").write_text("")
        say("clients finish what they have pending")
        _wait(
            lambda: all((d / "clients" / f"worker-{w.index}.done").exists() for w in workers),
            workers,
            o.op_timeout + 120,
            "the clients did not complete their operations",
        )
        cluster.wait_replicas(o.heal_timeout)
        starts: dict[int, int] = {}
        if o.retention_max_age is not None:
            starts = _stop_retention(cluster, say)
        targets = _marks(cluster)
        locks = {
            k: int(sum(cluster.server_metric(f"waltz_server_{k}_total").values()))
            for k in ("lock_failures", "lock_fallback_failures")
        }
        say(f"lock failures counted by the servers now serving: {locks}")
        (d / "clients" / "final.json").write_text(json.dumps(targets))
        say(f"committed high-water marks {targets}; draining")
        drains = {"cluster": _drain_feed(cluster, targets, o.heal_timeout, starts)}
        # Each worker records a read per transaction its feed delivers: growing histories are progress.
        _wait(
            lambda: all(w.proc.poll() is not None for w in workers),
            workers,
            o.heal_timeout,
            "the clients did not consume the log",
            progress=lambda: sum(f.stat().st_size for f in (d / "history").glob("*.jsonl")),
        )
        observer.close()
        observer = None
        # Every member stopped before the files are read: a running node holds both files of
        # every segment open through the same LazyFS, whose descriptors an hour of 64 KiB
        # segments used up (torture seeds 68 and 69: "Too many open files" on runs whose
        # history was OK). Stopped nodes hold nothing; the committed prefix is synced.
        killed = cluster.stop()
        if killed:
            say(f"members that did not stop on SIGTERM within 30 s, killed: {killed}")
        lagging: list[tuple[str, int]] = []
        held = membership.holders(cluster)  # replicas moved by move-replica are not where they began
        for m in cluster.members:
            if m.role == "storage":
                mine = {p: t for p, t in targets.items() if m.name in held.get(p, ())}
                drains[m.name] = _drain_files(cluster.directory / "data" / m.name, mine, m.name, lagging, problems)
        write_drains(d / "drains.jsonl", drains)
        nemesis_log.close()
        history = read_history(sorted((d / "history").glob("*.jsonl")))
        report = check(history, drains, reference="cluster", lagging=lagging, first_id=None if starts else 0)
        report.anomalies += check_workload(workload, d, drains["cluster"])
        transactions = sum(t + 1 for t in targets.values())
        stats: dict[str, float] = {"live_server_moves": _live_server_moves(cluster)}
        if nemesis.progress is not None:
            stats["standstill_judged_seconds"] = round(nemesis.progress.judged_seconds, 1)
        say(f"partition moves between live servers: {stats['live_server_moves']}")
        result = TortureResult(
            report,
            dict(sorted(nemesis.counts.items())),
            problems,
            transactions,
            time.monotonic() - started,
            locks,
            stats,
        )
        (d / "report.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
        return result
    except BaseException:
        (d / "error.txt").write_text(traceback.format_exc())  # the run's own failure, kept with its logs
        raise
    finally:
        if observer is not None:
            observer.close()
        for w in workers:
            w.dump_stacks()
            w.stop()
        if zookeeper is not None and zookeeper.proc is not None and zookeeper.proc.poll() is not None:
            with contextlib.suppress(Exception):
                zookeeper.start()  # killed by the nemesis when the run stopped: members deregister through it
        if cluster is not None:
            for name in list(proxies):
                with contextlib.suppress(errors.WaltzError, OSError):
                    cluster.kill(name, signal.SIGCONT)  # a paused member cannot stop
            try:
                cluster.stop()
            except Exception as e:  # noqa: BLE001 - the run's own error, if any, is what matters
                say(f"stopping the cluster failed: {type(e).__name__}: {e}")
        unmount_disks(disks)
        for p in proxies.values():
            p.close()
        if metadata_proxy is not None:
            metadata_proxy.close()
        loop.close()
        if zookeeper is not None:
            zookeeper.stop()


def _check_workers(workers: list[_Worker]) -> None:
    for w in workers:
        failure = w.failure()
        if failure:
            raise errors.WaltzError(failure)


def _wait(
    done: Callable[[], bool],
    workers: list[_Worker],
    timeout: float,
    what: str,
    progress: Callable[[], object] | None = None,
) -> None:
    """Until `done()`; fails after `timeout` s, counted from the last change of `progress()` when given."""
    deadline = time.monotonic() + timeout
    seen = progress() if progress is not None else None
    while not done():
        _check_workers(workers)
        if progress is not None and (now := progress()) != seen:
            seen, deadline = now, time.monotonic() + timeout
        if time.monotonic() > deadline:
            raise errors.WaltzError(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


def _live_server_moves(cluster: LocalCluster) -> int:
    """Partitions the cluster manager took from a live server (its leaders' log lines, every
    incarnation of every server: the logs are appended to across restarts)."""
    moves = 0
    for m in cluster.members:
        if m.role == "server":
            with contextlib.suppress(OSError):
                moves += cluster.log_path(m.name).read_text(errors="replace").count(f"{LIVE_MOVE} ")
    return moves


def _marks(cluster: LocalCluster) -> dict[int, int]:
    async def ask() -> dict[int, int]:
        async with LogReader(cluster.metadata_url, cluster.cluster, timeout=60.0) as r:
            return await r.high_water_marks()

    return asyncio.run(ask())


def _stop_retention(cluster: LocalCluster, say: Callable[[str], None]) -> dict[int, int]:
    """Sets the policy back to keep everything, waits until the replicas' first ids stop moving
    (the servers push the change within 5 s), and returns where each partition's log now starts:
    the ids below were deleted everywhere and may legitimately be missing."""
    with cluster.metadata() as meta:
        retention_policy.set_policy(meta, None, max_age_ms=None)
        nodes = meta.storage_nodes()
        info = meta.info()

        def firsts() -> dict[int, int]:
            out: dict[int, int] = {}
            for node in nodes:
                for row in asyncio.run(_status(node, info)):
                    if row["first_transaction_id"] >= 0:
                        p = row["partition"]
                        out[p] = min(out.get(p, row["first_transaction_id"]), row["first_transaction_id"])
            return out

        time.sleep(7.0)
        before = firsts()
        while (now := firsts()) != before:
            before = now
            time.sleep(2.0)
    say(f"retention stopped; the logs start at {now}")
    return now


async def _status(node: Any, info: Any) -> list[dict[str, Any]]:
    async with await StorageAdminClient.connect(
        node.host, node.admin_port, cluster_key=info.cluster_key, partition_count=info.partitions, timeout=10.0
    ) as c:
        status: list[dict[str, Any]] = await c.status()
        return status


def _drain_feed(
    cluster: LocalCluster, targets: dict[int, int], timeout: float, starts: dict[int, int] | None = None
) -> dict[int, list[Record]]:
    """The log as a new client receives it: the cluster's own serving path (from where each
    partition's log starts, when retention deleted its head)."""
    feed = FeedRecorder(keep=True)
    for p, first in (starts or {}).items():
        feed.marks[p] = first - 1
    with WaltzClient(feed, cluster.client_config()):
        behind = feed.wait_for(targets, timeout)
    if behind:
        raise errors.WaltzError(
            f"a new client's feed of partitions {behind} stopped short of {targets} (at {dict(feed.marks)}; nothing "
            f"for {timeout:.0f} s)"
        )
    return {p: [r for r in feed.records[p] if r.txid <= targets[p]] for p in targets}


def _drain_files(
    data_dir: pathlib.Path,
    targets: dict[int, int],
    name: str,
    lagging: list[tuple[str, int]],
    problems: list[str],
) -> dict[int, list[Record]]:
    """A replica's committed prefix as its files hold it (above the mark is an uncommitted tail
    a later recovery may cut: not part of the promise)."""
    out: dict[int, list[Record]] = {}
    with Storage.open(data_dir, read_only=True) as storage:
        for p, target in targets.items():
            records: list[Record] = []
            out[p] = records
            try:
                if _read_partition(storage, p, target, records) > 0:
                    lagging.append((name, p))  # a head dropped by retention: the rest must agree
            except errors.WaltzError as e:
                problems.append(f"{name} partition {p}: {type(e).__name__}: {e}")
                lagging.append((name, p))
            finally:
                # One partition's files open at a time: an open partition holds every segment's
                # files (torture seed 68: 10,866 files on one node after an hour of 64 KiB
                # segments). A close that fails is a problem of this replica, not of the run.
                try:
                    storage.close_partition(p)
                except errors.WaltzError as e:
                    problems.append(f"{name} partition {p}: closing after the read: {type(e).__name__}: {e}")
    return out


def _read_partition(storage: Storage, p: int, target: int, records: list[Record]) -> int:
    """Appends partition `p`'s records up to `target` to `records`; returns where its log starts.
    The partition object dies with this call, so closing it afterwards closes its files."""
    part = storage.partition(p)
    first = t = part.first_transaction_id
    while t <= target:
        chunk = part.read_records(t, max_count=1000, max_bytes=8 << 20)
        if not chunk:
            break
        for r in chunk:
            if r.txid > target:
                break
            records.append(record_from_bytes(r.txid, bytes(r.data), r.header))
        t = chunk[-1].txid + 1
    return first
