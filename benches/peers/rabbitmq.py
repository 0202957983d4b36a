"""A 3-node RabbitMQ cluster on loopback (Debian's `rabbitmq-server`, 3.10 on Erlang 25) with one
quorum queue of 3 members, and its client sessions for the load generator: `aio-pika` (asyncio
AMQP 0-9-1), one connection and one channel in confirm mode per session, each write a persistent
1 KiB message published to the queue through the default exchange, done when the broker's
publisher confirm (basic.ack) arrives.

What the confirm promises (3.10, Ra 2.2): the queue is a Raft group; the leader confirms a
message once the command carrying it is committed, i.e. written to the Ra write-ahead log of a
majority of members, and Ra's WAL notifies a write only after the batch holding it was
fdatasynced (`wal_sync_method`'s default, `datasync`). So a confirm means fsynced on 2 of 3 nodes.

Three nodes on one host: each its own node name, AMQP and distribution ports, Mnesia/Ra, log and
configuration files under the run's directory, no plugins; one Erlang cookie (in the `HOME` all
nodes share) and one `epmd` of the run's own on a free port (a node would otherwise start a
system-wide `epmd -daemon` on 4369 that outlives the run). Node 0 boots first; nodes 1 and 2 boot
with classic-config peer discovery naming node 0, which is `join_cluster` done at first boot
(each `rabbitmqctl` call starts an Elixir VM: tens of seconds on a loaded 2-core machine). The
membership is checked with `erl_call` (a C program, no VM).

The queue is declared through node 0, so its leader is there (3.10's default leader locator is
client-local); the harness asks the cluster where the leader is and connects all sessions to it:
a publish through another node is forwarded to the leader, one more hop, so this is RabbitMQ's
best case on this machine."""

from __future__ import annotations

import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import time
from typing import Any

from .loadgen import PeerProcesses, PeerUnavailable, ensure_installed, free_port, log, stop_process, track

NODES = 3
SCRIPTS = pathlib.Path("/usr/lib/rabbitmq/bin")  # Debian's /usr/sbin wrappers switch to the rabbitmq user
QUEUE = "waltz-bench"
DURABILITY = "quorum queue of 3 (Raft): publisher confirm once the message is in the fdatasynced Ra WAL of a majority"
FSYNC_PER_WRITE = True


def installed() -> bool:
    return (SCRIPTS / "rabbitmq-server").exists() and shutil.which("epmd") is not None and erl_call() is not None


def erl_call() -> str | None:
    return shutil.which("erl_call") or next(
        (str(p) for p in pathlib.Path("/usr/lib/erlang").glob("lib/erl_interface-*/bin/erl_call")), None
    )


def version() -> str:
    """The broker's version from its installed application directory (rabbitmq_server-X.Y.Z)."""
    dirs = sorted(pathlib.Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*"))
    return dirs[-1].name.split("-", 1)[1] if dirs else "?"


def node_name(i: int) -> str:
    return f"waltzbench{i}@localhost"


def node_config(i: int, seed: str) -> str:
    """rabbitmq.conf of node i: nodes after the first discover the first and join its cluster at boot."""
    lines = [
        "disk_free_limit.absolute = 50MB",  # the default, made explicit: below it the broker blocks publishers
    ]
    if i > 0:
        lines += [
            "cluster_formation.peer_discovery_backend = classic_config",
            f"cluster_formation.classic_config.nodes.1 = {seed}",
        ]
    return "\n".join(lines) + "\n"


def node_env(
    directory: pathlib.Path, home: pathlib.Path, i: int, amqp_port: int, dist_port: int, epmd_port: int
) -> dict[str, str]:
    """Everything that keeps node i apart from the other two and from a system-wide RabbitMQ."""
    d = directory / f"node{i}"
    return {
        "HOME": str(home),  # its .erlang.cookie is the cluster's shared cookie
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_CRASH_DUMP": str(d / "erl_crash.dump"),
        "RABBITMQ_NODENAME": node_name(i),
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(amqp_port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
        "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
        "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
        "RABBITMQ_MNESIA_DIR": str(d / "mnesia" / node_name(i)),
        "RABBITMQ_PLUGINS_EXPAND_DIR": str(d / "plugins-expand"),
        "RABBITMQ_LOG_BASE": str(d / "log"),
        "RABBITMQ_LOGS": "-",
        "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
    }


def members_in(erl_term: str) -> set[str]:
    """The node names in an Erlang term printed by erl_call (a list of atoms, or queue infos)."""
    return set(re.findall(r"'?(waltzbench\d+@localhost)'?", erl_term))


def leader_in(erl_term: str) -> str | None:
    """The `{leader, Node}` of a queue's infos printed by erl_call."""
    m = re.search(r"\{leader,\s*'?(waltzbench\d+@localhost)'?\s*\}", erl_term)
    return m.group(1) if m else None


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class RabbitMQCluster(PeerProcesses):
    label = "RabbitMQ node"
    log_name = "node{i}/rabbitmq.log"

    def __init__(self, directory: pathlib.Path) -> None:
        super().__init__(directory)
        self.home = directory / "home"
        self.amqp_ports = [free_port() for _ in range(NODES)]
        self.dist_ports = [free_port() for _ in range(NODES)]
        self.epmd_port = free_port()
        self.cookie = secrets.token_hex(16)
        self.epmd: subprocess.Popen[bytes] | None = None
        self.beam: dict[int, int] = {}  # node index -> pid of its Erlang VM (the script's child)
        self.leader_port = self.amqp_ports[0]
        self.version = version()

    @property
    def pids(self) -> dict[str, int]:
        return {f"rabbit{i}": pid for i, pid in self.beam.items()}

    def env(self, i: int) -> dict[str, str]:
        return {
            **os.environ,
            **node_env(self.directory, self.home, i, self.amqp_ports[i], self.dist_ports[i], self.epmd_port),
        }

    def start(self, timeout: float = 240.0) -> None:
        ensure_installed("RabbitMQ", installed, ["rabbitmq-server"])
        self.home.mkdir(parents=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(self.cookie)
        cookie.chmod(0o400)
        self.epmd = track(
            subprocess.Popen(
                ["epmd", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + timeout
        while not _port_open(self.epmd_port):
            if self.epmd.poll() is not None or time.monotonic() > deadline:
                raise PeerUnavailable(f"epmd did not start on :{self.epmd_port}")
            time.sleep(0.05)
        self._boot(0)
        self.wait_started([0], deadline)
        self._boot(1)
        self._boot(2)
        self.wait_started([1, 2], deadline)
        self.wait_clustered(deadline)
        log(f"RabbitMQ {self.version}: 3 nodes in one cluster")

    def _boot(self, i: int) -> None:
        d = self.directory / f"node{i}"
        (d / "log").mkdir(parents=True)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq.conf").write_text(node_config(i, node_name(0)))
        self.spawn(i, [str(SCRIPTS / "rabbitmq-server")], cwd=d, env=self.env(i))

    def wait_started(self, nodes: list[int], deadline: float) -> None:
        """Each node logged that its startup completed and accepts AMQP connections."""
        pending = set(nodes)
        while pending:
            self.check_alive(pending)
            for i in sorted(pending):
                if "Server startup complete" in self.log_text(i) and _port_open(self.amqp_ports[i]):
                    if not (beams := _children(self.procs[i].pid)):
                        raise PeerUnavailable(f"RabbitMQ node {i}: no Erlang VM under {self.procs[i].pid}")
                    self.beam[i] = beams[0]
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                raise PeerUnavailable(
                    f"RabbitMQ nodes {sorted(pending)} not started in time: {self.log_tail(min(pending))}"
                )
            time.sleep(0.2)

    def rpc(self, expression: str) -> str:
        """Evaluates an Erlang expression on node 0 over Erlang distribution; returns the printed result."""
        exe = erl_call()
        assert exe is not None
        r = subprocess.run(
            [exe, "-n", node_name(0), "-c", self.cookie, "-e"],
            input=expression + "\n",
            env=self.env(0),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode != 0 or not r.stdout.startswith("{ok,"):
            raise PeerUnavailable(f"erl_call `{expression}` failed: {(r.stderr or r.stdout)[-500:]}")
        return r.stdout

    def wait_clustered(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            last = self.rpc("rabbit_nodes:all_running().")
            if members_in(last) == {node_name(i) for i in range(NODES)}:
                return
            time.sleep(0.5)
        raise PeerUnavailable(f"RabbitMQ nodes did not form one cluster: running {last.strip()}")

    def locate_queue(self) -> None:
        """Checks that the declared quorum queue has a member on every node and points the
        sessions at its leader (node 0 unless the declare went elsewhere)."""
        infos = self.rpc('rabbit_amqqueue:info_all(<<"/">>, [name, leader, members]).')
        members, leader = members_in(infos), leader_in(infos)
        if members != {node_name(i) for i in range(NODES)} or leader is None:
            raise PeerUnavailable(f"the quorum queue is not on all {NODES} nodes with a leader: {infos.strip()}")
        self.leader_port = self.amqp_ports[int(leader.split("@")[0].removeprefix("waltzbench"))]
        log(f"RabbitMQ: quorum queue {QUEUE!r} on 3 nodes, leader {leader} (:{self.leader_port})")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to each node's script, which stops its VM cleanly and waits for it; then epmd."""
        super().stop(timeout)
        if self.epmd is not None:
            stop_process(self.epmd)


class RabbitMQSession:
    def __init__(self, connection: Any, channel: Any) -> None:
        self.connection, self.channel = connection, channel
        self.exchange = channel.default_exchange

    @classmethod
    async def open(cls, port: int) -> RabbitMQSession:
        try:
            import aio_pika
        except ImportError:
            raise PeerUnavailable(
                "the RabbitMQ client is missing: pip install --group bench (aio-pika; scripts/setup.sh installs it)"
            ) from None
        connection = await aio_pika.connect(host="127.0.0.1", port=port, login="guest", password="guest", timeout=60)
        channel = await connection.channel(publisher_confirms=True)
        return cls(connection, channel)

    @staticmethod
    async def declare(port: int) -> None:
        """The quorum queue, 3 members (declared through node 0, so led by node 0)."""
        s = await RabbitMQSession.open(port)
        try:
            await s.channel.declare_queue(
                QUEUE, durable=True, arguments={"x-queue-type": "quorum", "x-quorum-initial-group-size": NODES}
            )
        finally:
            await s.close()

    async def op(self, payload: bytes) -> int:
        import aio_pika

        # Returns once the broker's basic.ack (the publisher confirm) arrived; a nack or a
        # returned (unroutable) message raises.
        await self.exchange.publish(
            aio_pika.Message(payload, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=QUEUE, mandatory=True
        )
        return 0

    async def close(self) -> None:
        await self.connection.close()
