"""A 3-server NATS cluster with JetStream on loopback (Debian's `nats-server`, 2.9) and one stream
of 3 replicas on file storage, and its client sessions for the load generator: `nats-py`, one
connection per session, each write a JetStream publish of 1 KiB to the stream's subject, done when
the stream's PubAck arrives.

What the PubAck promises (2.9): the stream is a Raft group; its leader acknowledges once a
majority of the replicas has the message in its Raft log, written to the file but NOT fsynced:
2.9 has no way to fsync before an acknowledgement (`sync_interval`, with `always`, came in 2.10;
2.9 refuses the field as unknown) and syncs its files on a timer of its own. So an
acknowledged write survives the loss of a process on a minority, not the loss of power on a
majority of machines. Its rows are marked as such, and no Waltz target is judged against it.

All sessions connect to the stream's leader (a publish through another server is routed to the
leader: one more hop), so this is JetStream's best case on this machine."""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import subprocess
import time
import urllib.request
from typing import Any

from .loadgen import PeerProcesses, PeerUnavailable, ensure_installed, free_port, log

SERVERS = 3
STREAM = "WALTZBENCH"
SUBJECT = "waltzbench"
DURABILITY = (
    "stream of 3 replicas (Raft), file storage: PubAck once a majority wrote the message, "
    "NOT fsynced (nats-server 2.9 cannot fsync before an ack)"
)
FSYNC_PER_WRITE = False


def installed() -> bool:
    return shutil.which("nats-server") is not None


def version() -> str:
    try:
        out = subprocess.run(["nats-server", "--version"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "?"
    return out.strip().rsplit("v", 1)[-1] or "?"


def server_name(i: int) -> str:
    return f"waltzbench{i}"


def server_config(i: int, directory: pathlib.Path, client_port: int, http_port: int, route_ports: list[int]) -> str:
    """nats-server.conf of server i: its own ports and store, routes to all three (itself included,
    which the server skips), JetStream on with no sync setting (2.9 has none)."""
    routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in route_ports)
    return (
        f'server_name: "{server_name(i)}"\n'
        f'listen: "127.0.0.1:{client_port}"\n'
        f'http: "127.0.0.1:{http_port}"\n'
        "jetstream {\n"
        f'  store_dir: "{directory / "store"}"\n'
        "  max_memory_store: 64MB\n"
        "  max_file_store: 4GB\n"
        "}\n"
        "cluster {\n"
        '  name: "waltzbench"\n'
        f'  listen: "127.0.0.1:{route_ports[i]}"\n'
        f"  routes: [{routes}]\n"
        "}\n"
    )


def _get(port: int, path: str, timeout: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


class JetStreamCluster(PeerProcesses):
    label = "nats-server"
    log_name = "n{i}/nats-server.log"

    def __init__(self, directory: pathlib.Path) -> None:
        super().__init__(directory)
        self.client_ports = [free_port() for _ in range(SERVERS)]
        self.http_ports = [free_port() for _ in range(SERVERS)]
        self.route_ports = [free_port() for _ in range(SERVERS)]
        self.leader_port = 0
        self.version = "?"

    @property
    def pids(self) -> dict[str, int]:
        return {f"nats{i}": p.pid for i, p in enumerate(self.procs)}

    def start(self, timeout: float = 90.0) -> None:
        ensure_installed("NATS", installed, ["nats-server"])
        self.version = version()
        for i in range(SERVERS):
            d = self.directory / f"n{i}"
            d.mkdir(parents=True)
            conf = d / "nats-server.conf"
            conf.write_text(server_config(i, d, self.client_ports[i], self.http_ports[i], self.route_ports))
            self.spawn(i, ["nats-server", "-c", str(conf)])
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float) -> None:
        """Every server's /healthz is ok (JetStream up) and the three agree on a meta leader."""

        def probe() -> str | None:
            health = [_get(port, "/healthz") for port in self.http_ports]
            jsz = [_get(port, "/jsz") for port in self.http_ports]
            leaders = {(j.get("meta_cluster") or {}).get("leader") for j in jsz}
            if all(h.get("status") == "ok" for h in health) and len(leaders) == 1 and None not in leaders:
                return None
            return f"health {health}, meta leaders {leaders}"

        self.poll_ready(timeout, "NATS cluster", probe)

    async def create_stream(self, timeout: float = 60.0) -> None:
        """The stream (3 replicas, file storage), then its leader's client port for the sessions."""
        import nats
        from nats.js.api import StorageType, StreamConfig

        nc = await nats.connect(f"nats://127.0.0.1:{self.client_ports[0]}", connect_timeout=10)
        try:
            js = nc.jetstream(timeout=10)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    await js.add_stream(
                        StreamConfig(name=STREAM, subjects=[f"{SUBJECT}.>"], storage=StorageType.FILE, num_replicas=3)
                    )
                    info = await js.stream_info(STREAM)
                    cluster = info.cluster
                    current = (
                        cluster is not None
                        and cluster.leader
                        and all(r.current and not r.offline for r in cluster.replicas or [])
                    )
                    if current and cluster is not None and len(cluster.replicas or []) == SERVERS - 1:
                        leader = cluster.leader
                        break
                    err: Exception | str = f"replicas not current: {cluster}"
                except Exception as e:  # noqa: BLE001 - the meta group may still be electing: retried
                    err = e
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"JetStream stream not ready after {timeout:.0f} s: {err}")
                await asyncio.sleep(0.5)
        finally:
            await nc.close()
        self.leader_port = next(p for i, p in enumerate(self.client_ports) if server_name(i) == leader)
        log(f"NATS {self.version}: 3 servers, stream of 3 replicas led by {leader} (:{self.leader_port})")


class JetStreamSession:
    def __init__(self, nc: Any, subject: str) -> None:
        self.nc, self.js, self.subject = nc, nc.jetstream(timeout=30), subject

    @classmethod
    async def open(cls, port: int, cid: int) -> JetStreamSession:
        try:
            import nats
        except ImportError:
            raise PeerUnavailable(
                "the NATS client is missing: pip install --group bench (nats-py; scripts/setup.sh installs it)"
            ) from None
        nc = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=30, max_reconnect_attempts=0)
        return cls(nc, f"{SUBJECT}.{cid}")

    async def op(self, payload: bytes) -> int:
        await self.js.publish(self.subject, payload)  # returns the PubAck; an error reply raises
        return 0

    async def close(self) -> None:
        await self.nc.close()
