"""Does a peer fsync before it acknowledges? Counts the fsync-family system calls of every process
of each peer while one client makes N acknowledged 1 KiB writes, one at a time.

    python benches/peer_fsync.py [--systems rabbitmq,jetstream,etcd,zookeeper] [--writes 300]

The peers start as `benches/cluster.py` starts them (3 members on loopback, apt when missing);
`strace -f` (Debian `strace`) attaches to each member for the writes only. A peer that fsyncs on
a majority before each acknowledgement shows about one sync call per write on at least two
members (fewer only where writes share a sync); one that acknowledges first shows none, or a
handful from a timer. What each harness's docstring claims is checked here, not assumed
(issue 39: nats-server 2.9 made none at all).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from peers import loadgen  # noqa: E402
from peers.etcd import EtcdCluster, EtcdSession  # noqa: E402
from peers.jetstream import JetStreamCluster, JetStreamSession  # noqa: E402
from peers.loadgen import PeerUnavailable, ensure_installed, log  # noqa: E402
from peers.rabbitmq import RabbitMQCluster, RabbitMQSession  # noqa: E402
from peers.zookeeper import ZooKeeperEnsemble, ZooKeeperSession  # noqa: E402

SYNC_CALLS = "fsync,fdatasync,sync_file_range,msync,syncfs"


async def _prepare(name: str, cluster: Any) -> Callable[[], Awaitable[Any]]:
    """What the peer needs before its first write, and how to open one client session."""
    if name == "rabbitmq":
        await RabbitMQSession.declare(cluster.leader_port)
        cluster.locate_queue()
        return lambda: RabbitMQSession.open(cluster.leader_port)
    if name == "jetstream":
        await cluster.create_stream()
        return lambda: JetStreamSession.open(cluster.leader_port, 1)
    if name == "etcd":
        return lambda: EtcdSession.open(cluster.leader_port, 1)
    return lambda: ZooKeeperSession.open(cluster.leader_port, 1)


CLUSTERS: dict[str, Callable[[pathlib.Path], Any]] = {
    "rabbitmq": RabbitMQCluster,
    "jetstream": JetStreamCluster,
    "etcd": EtcdCluster,
    "zookeeper": ZooKeeperEnsemble,
}


def count_syncs(trace: pathlib.Path) -> dict[str, int]:
    """Completed sync calls per kind in an `strace -f -o` file (resumed halves count once)."""
    kinds: collections.Counter[str] = collections.Counter()
    for line in trace.read_text(errors="replace").splitlines():
        if "resumed>" in line:
            continue
        for kind in SYNC_CALLS.split(","):
            if f" {kind}(" in line or line.startswith(f"{kind}("):
                kinds[kind] += 1
    return dict(kinds)


def audit(name: str, directory: pathlib.Path, writes: int) -> dict[str, Any]:
    cluster = CLUSTERS[name](directory / name)
    try:
        cluster.start()

        async def run() -> float:
            open_session = await _prepare(name, cluster)
            session = await open_session()
            payload = os.urandom(1024)
            await session.op(payload)  # the session's first write (its own set-up) is not counted
            tracers = {
                member: subprocess.Popen(
                    [
                        "strace",
                        "-f",
                        "-qq",
                        "-e",
                        f"trace={SYNC_CALLS}",
                        "-o",
                        str(directory / f"{name}-{member}.trace"),
                    ]
                    + ["-p", str(pid)],
                    stdin=subprocess.DEVNULL,
                )
                for member, pid in cluster.pids.items()
            }
            try:
                await asyncio.sleep(2.0)  # strace attaches to every thread
                t0 = time.perf_counter()
                for _ in range(writes):
                    await session.op(payload)
                elapsed = time.perf_counter() - t0
            finally:
                for t in tracers.values():
                    t.send_signal(signal.SIGINT)
                for t in tracers.values():
                    t.wait(timeout=30)
                await session.close()
            return elapsed

        elapsed = asyncio.run(run())
        members = {m: count_syncs(directory / f"{name}-{m}.trace") for m in cluster.pids}
        return {"writes": writes, "seconds": round(elapsed, 2), "sync_calls_by_member": members}
    finally:
        cluster.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="rabbitmq,jetstream", help=f"comma-separated subset of {','.join(CLUSTERS)}")
    ap.add_argument("--writes", type=int, default=300)
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    if bad := set(systems) - set(CLUSTERS):
        ap.error(f"unknown systems {sorted(bad)}")
    ensure_installed("strace", lambda: shutil.which("strace") is not None, ["strace"])
    with loadgen.scratch_dir("waltz-peer-fsync-") as root:
        try:
            for name in systems:
                try:
                    r = audit(name, root, args.writes)
                except PeerUnavailable as err:
                    print(f"{name}: NOT MEASURED: {err}")
                    continue
                print(f"{name}: {r['writes']} acknowledged writes in {r['seconds']} s, one client")
                for member, kinds in r["sync_calls_by_member"].items():
                    total = sum(kinds.values())
                    print(f"  {member}: {total} sync calls ({total / r['writes']:.2f} per write) {kinds}")
        except KeyboardInterrupt:
            log("interrupted: processes stopped, temporary files removed")
            return 130
        finally:
            loadgen.kill_leftovers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
