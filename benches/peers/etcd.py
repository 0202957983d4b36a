"""A 3-member etcd cluster on loopback (Debian's `etcd-server`, etcd 3.4: the v3 gRPC API),
default durability (every Raft entry fsynced before it is acknowledged), and its client
sessions for the load generator: `aetcd` (asyncio, gRPC), one client (one channel) per
session, each put a 1 KiB value under its own new key.

All sessions talk to the leader: a put sent to a follower is forwarded to the leader, one more
loopback hop, so this is etcd's best case on this machine."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import urllib.request
from typing import Any

from .loadgen import PeerProcesses, PeerUnavailable, ensure_installed, free_port, log, stop_process

MEMBERS = 3
DURABILITY = "3 members (Raft): a put returns once a majority fsynced the entry to its WAL"
FSYNC_PER_WRITE = True


def installed() -> bool:
    return shutil.which("etcd") is not None


def version() -> str:
    try:
        out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "?"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("etcd Version")), "?")


def _post(port: int, path: str, body: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def _get(port: int, path: str, timeout: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


class EtcdCluster(PeerProcesses):
    label = "etcd member"
    log_name = "m{i}/etcd.log"

    def __init__(self, directory: pathlib.Path) -> None:
        super().__init__(directory)
        self.client_ports = [free_port() for _ in range(MEMBERS)]
        self.peer_ports = [free_port() for _ in range(MEMBERS)]
        self.leader_port = 0

    @property
    def pids(self) -> dict[str, int]:
        return {f"etcd{i}": p.pid for i, p in enumerate(self.procs)}

    def start(self, timeout: float = 60.0) -> None:
        ensure_installed("etcd", installed, ["etcd-server"])
        initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))
        for i in range(MEMBERS):
            d = self.directory / f"m{i}"
            d.mkdir(parents=True)
            self.spawn(
                i,
                [
                    "etcd",
                    "--name",
                    f"m{i}",
                    "--data-dir",
                    str(d / "data"),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{self.client_ports[i]}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{self.client_ports[i]}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{self.peer_ports[i]}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{self.peer_ports[i]}",
                    "--initial-cluster",
                    initial,
                    "--initial-cluster-token",
                    "waltz-bench",
                    "--initial-cluster-state",
                    "new",
                    "--logger",
                    "zap",
                    "--log-outputs",
                    "stderr",
                    "--log-level",
                    "warn",
                ],
            )
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float) -> None:
        """Every member answers /health with true, and all agree on one leader."""

        def probe() -> str | None:
            health = [_get(port, "/health") for port in self.client_ports]
            status = [_post(port, "/v3/maintenance/status", {}) for port in self.client_ports]
            leaders = {s.get("leader") for s in status}
            if not (all(h.get("health") == "true" for h in health) and len(leaders) == 1 and None not in leaders):
                return f"health {health}, leaders {leaders}"
            leader = leaders.pop()
            self.leader_port = next(
                port for port, s in zip(self.client_ports, status) if s["header"]["member_id"] == leader
            )
            log(f"etcd {version()}: 3 members healthy, leader on :{self.leader_port}")
            return None

        self.poll_ready(timeout, "etcd cluster", probe)

    def stop(self, timeout: float = 10.0) -> None:
        """One member at a time, leader first: a leader stopped together with its followers waits
        for a leadership transfer that cannot happen."""
        leader = [p for p, port in zip(self.procs, self.client_ports) if port == self.leader_port]
        for p in leader + [p for p in self.procs if p not in leader]:
            stop_process(p, timeout=timeout)


class EtcdSession:
    def __init__(self, client: Any, cid: int) -> None:
        self.client, self.prefix, self.seq = client, f"/bench/{cid}/".encode(), 0

    @classmethod
    async def open(cls, port: int, cid: int) -> EtcdSession:
        try:
            import aetcd
        except ImportError:
            raise PeerUnavailable(
                "the etcd client is missing: pip install --group bench (aetcd; scripts/setup.sh installs it)"
            ) from None
        client = aetcd.Client(host="127.0.0.1", port=port, timeout=30)
        await client.connect()
        return cls(client, cid)

    async def op(self, payload: bytes) -> int:
        self.seq += 1
        await self.client.put(self.prefix + str(self.seq).encode(), payload)
        return 0

    async def close(self) -> None:
        await self.client.close()
