"""A 3-server ZooKeeper ensemble on loopback (Debian's `zookeeper`, 3.8), each with its own ports
and data directory and the default durability (forceSync=yes: the transaction log is fsynced
before a proposal is acknowledged), and its client sessions for the load generator: kazoo's
async API (`create_async`, completed on kazoo's threads and handed to the asyncio loop), one
KazooClient (one ZooKeeper session, one connection) per session, each write a persistent
sequential znode with a 1 KiB value.

All sessions connect to the leader (writes through a follower are forwarded to it: one more
hop), so this is ZooKeeper's best case on this machine."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import shutil
import socket
from typing import Any

from .loadgen import PeerProcesses, ensure_installed, free_port, log

SERVERS = 3
JAR = "/usr/share/java/zookeeper.jar"
CONF = "/etc/zookeeper/conf"
DURABILITY = "ensemble of 3 (Zab), forceSync=yes: a create returns once a majority fsynced its transaction log"
FSYNC_PER_WRITE = True


def installed() -> bool:
    return os.path.exists(JAR) and shutil.which("java") is not None


def four_letter(port: int, word: str) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(word.encode())
            chunks = []
            while b := s.recv(4096):
                chunks.append(b)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


class ZooKeeperEnsemble(PeerProcesses):
    label = "ZooKeeper server"
    log_name = "zk{i}/zookeeper.log"

    def __init__(self, directory: pathlib.Path) -> None:
        super().__init__(directory)
        self.client_ports = [free_port() for _ in range(SERVERS)]
        self.quorum_ports = [(free_port(), free_port()) for _ in range(SERVERS)]
        self.leader_port = 0
        self.version = "?"

    @property
    def pids(self) -> dict[str, int]:
        return {f"zk{i}": p.pid for i, p in enumerate(self.procs)}

    def start(self, timeout: float = 90.0) -> None:
        ensure_installed("ZooKeeper", installed, ["zookeeper", "default-jre-headless"])
        servers = "".join(f"server.{i + 1}=127.0.0.1:{q}:{e}\n" for i, (q, e) in enumerate(self.quorum_ports))
        for i in range(SERVERS):
            d = self.directory / f"zk{i}"
            (d / "data").mkdir(parents=True)
            (d / "data" / "myid").write_text(f"{i + 1}\n")
            (d / "zoo.cfg").write_text(
                "tickTime=2000\ninitLimit=10\nsyncLimit=5\n"
                f"dataDir={d / 'data'}\nclientPort={self.client_ports[i]}\nclientPortAddress=127.0.0.1\n"
                "admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,stat\n"
                "maxClientCnxns=0\n" + servers
            )
            self.spawn(
                i,
                [
                    "java",
                    "-Xmx1g",
                    "-Dzookeeper.root.logger=WARN,CONSOLE",
                    "-cp",
                    f"{CONF}:{JAR}",
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                    str(d / "zoo.cfg"),
                ],
            )
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float) -> None:
        """Every server answers ruok → imok, and the ensemble has one leader and two followers."""

        def probe() -> str | None:
            oks = [four_letter(port, "ruok") for port in self.client_ports]
            srvr = [four_letter(port, "srvr") for port in self.client_ports]
            modes = [
                next((line.split(":", 1)[1].strip() for line in s.splitlines() if line.startswith("Mode:")), "")
                for s in srvr
            ]
            if not (all(o == "imok" for o in oks) and sorted(modes) == ["follower", "follower", "leader"]):
                return f"modes {modes}"
            self.leader_port = self.client_ports[modes.index("leader")]
            self.version = next(
                (
                    line.split(":", 1)[1].split("-")[0].strip()
                    for line in srvr[0].splitlines()
                    if line.startswith("Zookeeper version")
                ),
                "?",
            )
            log(f"ZooKeeper {self.version}: ensemble of 3 healthy, leader on :{self.leader_port}")
            return None

        self.poll_ready(timeout, "ZooKeeper ensemble", probe)


class ZooKeeperSession:
    def __init__(self, client: Any, path: str) -> None:
        self.client, self.path = client, path

    @classmethod
    async def open(cls, port: int, cid: int, parent: str = "/bench") -> ZooKeeperSession:
        from kazoo.client import KazooClient

        logging.getLogger("kazoo").setLevel(logging.ERROR)
        client = KazooClient(hosts=f"127.0.0.1:{port}", timeout=30)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: client.start(timeout=30))
        await loop.run_in_executor(None, lambda: client.ensure_path(f"{parent}/c{cid}"))
        return cls(client, f"{parent}/c{cid}/n-")

    async def op(self, payload: bytes) -> int:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:  # on the asyncio loop
            if fut.done():
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

        def done(result: Any) -> None:  # on a kazoo thread
            try:
                result.get()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine
                loop.call_soon_threadsafe(settle, e)
            else:
                loop.call_soon_threadsafe(settle, None)

        self.client.create_async(self.path, payload, sequence=True).rawlink(done)
        await fut
        return 0

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.client.stop)
        await loop.run_in_executor(None, self.client.close)
