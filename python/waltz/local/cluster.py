"""A cluster on one machine: storage nodes and servers of `waltz-node` as real processes on
127.0.0.1, with their configuration, data, logs and pid files in one directory.

    DIR/cluster.json          what the cluster is (members, ports, metadata URL); written once
    DIR/metadata.db           the embedded metadata store (unless ZooKeeper was given)
    DIR/config/NAME.toml      each member's configuration, as an operator would write it
    DIR/data/NAME/            each storage node's directory
    DIR/logs/NAME.log         each member's log (JSON lines)
    DIR/run/NAME.pid          the pid of each running member
    DIR/tls/                  certificates, when created with tls=True

Members run in their own sessions, so a cluster started by `waltz dev up` outlives the
command and a Ctrl-C in the terminal reaches only the command, which then stops them in order.
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
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from waltz import errors
from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.metadata import ClusterMetadata
from waltz.private_files import private_dir, write_private
from waltz.tls import DevCertificates, generate_dev_certificates

STATE_FILE = "cluster.json"
REPLICAS = 3


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    role: str  # "storage" or "server"
    port: int
    http_port: int
    admin_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclasses.dataclass(frozen=True)
class MemberStatus:
    name: str
    role: str
    pid: int | None
    address: str
    http: str
    health: str  # "ok", "failing: ...", "down", "no answer"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_handed_out: set[int] = set()
"""Ports `free_port` returned in this process: a member's ports are chosen one after another
before any listens, so a port still free could be handed out twice (CI saw a storage node fail
with "Address already in use" on its own second port)."""


def free_port() -> int:
    """A port nothing listens on now and not returned before by this process, chosen below the
    kernel's ephemeral range: a port from bind(0) is one outgoing connections also draw from, so
    one chosen when the cluster is created could be some connection's own port by the time its
    member listens on it."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    if len(_handed_out) > (low - first) // 2:
        _handed_out.clear()  # a long-lived process: the oldest members are long gone
    for _ in range(200):
        port = random.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # a crowded low range: fall back to any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a member's HTTP endpoint; OSError when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


class LocalCluster:
    """Create one with `LocalCluster.create(directory, ...)`, find it again with
    `LocalCluster.open(directory)`; `start()` brings every member up (and the cluster's metadata
    on the first start), `stop()` takes them down, servers first."""

    def __init__(self, directory: pathlib.Path, state: dict[str, Any]) -> None:
        self.directory = directory.resolve()
        self.state = state
        self.members = [Member(**m) for m in state["members"]]
        self.metadata_url: str = state["metadata"]
        self.cluster: str = state["cluster"]
        self.partitions: int = state["partitions"]
        self.tls: bool = state.get("tls", False)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        # Variables a member starts with besides this process's environment, by member name
        # (the torture run's clock files).
        self.member_env: dict[str, dict[str, str]] = {}

    # ---- creating and finding -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        directory: str | pathlib.Path,
        *,
        metadata: str | None = None,
        cluster: str = "local",
        partitions: int = 4,
        storage_nodes: int = 3,
        servers: int = 2,
        tls: bool = False,
        server_session_timeout: float = 3.0,
        storage_keys: dict[str, int] | None = None,
        partition_keys: dict[str, int] | None = None,
    ) -> LocalCluster:
        """Writes the cluster's directory: configuration files, certificates and the cluster in
        the metadata store (embedded in the directory unless `metadata` names a store)."""
        directory = pathlib.Path(directory).resolve()
        if (directory / STATE_FILE).exists():
            raise errors.ClusterError(
                f"{directory} already holds a local cluster: start it, or remove the directory first"
            )
        if storage_nodes < REPLICAS:
            raise errors.ClusterError(f"a local cluster needs at least {REPLICAS} storage nodes (one per replica)")
        if servers < 1 or partitions < 1:
            raise errors.ClusterError("a local cluster needs at least one server and one partition")
        private_dir(directory)
        for sub in ("config", "data", "logs", "run"):
            private_dir(directory / sub)
        members = [
            Member(f"storage-{i}", "storage", free_port(), free_port(), free_port()) for i in range(storage_nodes)
        ] + [Member(f"server-{i}", "server", free_port(), free_port()) for i in range(servers)]
        state = {
            "metadata": metadata or f"embedded:{directory / 'metadata.db'}",
            "cluster": cluster,
            "partitions": partitions,
            "tls": tls,
            "server_session_timeout": server_session_timeout,
            "storage_keys": dict(storage_keys or {}),
            "partition_keys": dict(partition_keys or {}),
            "members": [dataclasses.asdict(m) for m in members],
            "initialized": False,
        }
        self = cls(directory, state)
        with self.metadata() as meta:
            info, created = meta.create(cluster, partitions, REPLICAS)
            if not created and info.partitions != partitions:
                raise errors.ClusterError(
                    f"cluster {cluster!r} already exists in {self.metadata_url} with {info.partitions} partitions"
                )
        self.state["cluster_key"] = str(info.cluster_key)
        if tls:
            generate_dev_certificates(directory / "tls")
        for m in members:
            write_private(
                self.config_path(m.name), self._storage_toml(m) if m.role == "storage" else self._server_toml(m)
            )
        self._save()
        return self

    @classmethod
    def open(cls, directory: str | pathlib.Path) -> LocalCluster:
        directory = pathlib.Path(directory)
        try:
            state = json.loads((directory / STATE_FILE).read_text())
        except FileNotFoundError:
            raise errors.ClusterError(f"no local cluster in {directory} (create one with `waltz dev up`)") from None
        except (OSError, ValueError) as e:
            raise errors.ClusterError(f"{directory / STATE_FILE}: unreadable ({e})") from None
        try:
            return cls(directory, state)
        except (KeyError, TypeError, AttributeError) as e:
            raise errors.ClusterError(f"{directory / STATE_FILE}: unreadable (missing or bad {e})") from None

    def _save(self) -> None:
        tmp = self.directory / (STATE_FILE + ".tmp")
        write_private(tmp, json.dumps(self.state, indent=2) + "\n")  # it holds the cluster key
        os.replace(tmp, self.directory / STATE_FILE)

    # ---- files -----------------------------------------------------------------------------

    def config_path(self, name: str) -> pathlib.Path:
        return self.directory / "config" / f"{name}.toml"

    def log_path(self, name: str) -> pathlib.Path:
        return self.directory / "logs" / f"{name}.log"

    def _pid_path(self, name: str) -> pathlib.Path:
        return self.directory / "run" / f"{name}.pid"

    def _tls_toml(self, role: str) -> str:
        if not self.tls:
            return ""
        t = self._certificates().tls(role)
        return f'\n[tls]\nca = "{t.ca}"\ncert = "{t.cert}"\nkey = "{t.key}"\n'

    def _certificates(self) -> DevCertificates:
        return DevCertificates.at(self.directory / "tls")

    def _storage_toml(self, m: Member) -> str:
        return (
            f'[storage]\ndirectory = "{self.directory / "data" / m.name}"\ncluster_key = '
            f'"{self.state["cluster_key"]}"\n'
            f"partition_count = {self.partitions}\n"
            + "".join(f"{k} = {v}\n" for k, v in self.state.get("storage_keys", {}).items())
            + "\n"
            + f'[node]\nhost = "127.0.0.1"\nport = {m.port}\nadmin_port = {m.admin_port}\nhttp_port = {m.http_port}\n\n'
            '[logging]\nlevel = "info"\njson = true\n' + self._tls_toml("storage")
        )

    def _server_toml(self, m: Member) -> str:
        advertised = f'advertised_address = "{self.dialed_address(m)}"\n' if m.name in self._advertised else ""
        return (
            f'[server]\nmetadata = "{self.metadata_url}"\ncluster = "{self.cluster}"\nhost = "127.0.0.1"\n'
            f"port = {m.port}\nhttp_port = {m.http_port}\nsession_timeout = {self.state['server_session_timeout']}\n"
            f"{advertised}\n"
            + _section("partition", self.state.get("partition_keys", {}))
            + '[logging]\nlevel = "info"\njson = true\n'
            + self._tls_toml("server")
        )

    @property
    def _advertised(self) -> dict[str, int]:
        return self.state.setdefault("advertised", {})  # type: ignore[no-any-return]

    def advertise(self, name: str, port: int) -> None:
        """Makes the others dial member `name` at 127.0.0.1:`port` (a proxy in front of it, as the
        torture test puts there): servers reach a storage node there, clients a server. Before
        the first start, since storage nodes are registered in the metadata then."""
        m = self.member(name)
        if self.state["initialized"]:
            raise errors.ClusterError("advertise members before the cluster's first start")
        self._advertised[name] = port
        if m.role == "server":
            write_private(self.config_path(name), self._server_toml(m))
        self._save()

    def dialed_address(self, m: Member) -> str:
        """Where the other processes reach `m`: its own port, or the one advertised for it."""
        return f"127.0.0.1:{self._advertised.get(m.name, m.port)}"

    def client_tls(self, role: str = "client") -> dict[str, str]:
        """TLS settings (keys of `ClientConfig`) with the certificate of `role`, empty without TLS."""
        if not self.tls:
            return {}
        t = self._certificates().tls(role)
        return {"tls_ca": str(t.ca), "tls_cert": str(t.cert), "tls_key": str(t.key)}

    def environment(self) -> dict[str, str]:
        """What `waltz` commands need to administer this cluster: the admin certificate, which
        the storage nodes' admin ports and the servers' client ports both admit."""
        env = {"WALTZ_METADATA": self.metadata_url, "WALTZ_CLUSTER": self.cluster}
        env.update({f"WALTZ_{k.upper()}": v for k, v in self.client_tls("admin").items()})
        return env

    @contextlib.contextmanager
    def metadata(self) -> Iterator[ClusterMetadata]:
        store = open_store(self.metadata_url)
        store.start(timeout=30.0)
        try:
            yield ClusterMetadata(store, cluster_root(self.cluster))
        finally:
            store.close()

    # ---- processes -------------------------------------------------------------------------

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise errors.ClusterError(f"no member {name!r} (members: {', '.join(m.name for m in self.members)})")

    def pid(self, name: str) -> int | None:
        """The member's pid while it runs (a pid file whose process is another program is stale)."""
        proc = self._procs.get(name)
        if proc is not None:
            return proc.pid if proc.poll() is None else None
        try:
            pid = int(self._pid_path(name).read_text())
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            return None
        return pid if str(self.config_path(name)).encode() in cmdline and state != "Z" else None

    def start_member(self, name: str) -> None:
        m = self.member(name)
        if self.pid(name) is not None:
            return
        with open(self.log_path(name), "ab", opener=lambda path, flags: os.open(path, flags, 0o600)) as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "waltz.cli.node", m.role, "--config", str(self.config_path(name))],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env={**os.environ, **self.member_env[name]} if name in self.member_env else None,
            )
        self._procs[name] = proc
        write_private(self._pid_path(name), f"{proc.pid}\n")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = self.pid(name)
        if pid is not None:
            os.kill(pid, sig)
            if sig == signal.SIGKILL:
                self._wait_gone(name, 10.0)

    def _wait_gone(self, name: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.pid(name) is not None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def wait_member(self, name: str, timeout: float = 60.0) -> None:
        """Until the member's HTTP endpoint answers (its ports are open)."""
        m = self.member(name)
        deadline = time.monotonic() + timeout
        while True:
            if self.pid(name) is None:
                raise errors.ClusterError(f"{name} exited at start: {self._log_tail(name)}")
            try:
                http_get(m.http_port, "/health")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise errors.ClusterError(
                        f"{name} did not open its ports within {timeout:.0f} s; see {self.log_path(name)}"
                    ) from None
                time.sleep(0.1)

    def _log_tail(self, name: str) -> str:
        try:
            lines = self.log_path(name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def start(self, step: Callable[[str], None] = lambda _: None, timeout: float = 120.0) -> None:
        """Starts every member that is not running and waits until every partition is served;
        on the first start, registers the storage nodes and their replicas in the metadata."""
        storage = [m for m in self.members if m.role == "storage"]
        for m in storage:
            step(f"starting {m.name} on {m.address}")
            self.start_member(m.name)
        for m in storage:
            self.wait_member(m.name)
        if not self.state["initialized"]:
            step("registering storage nodes and replicas")
            self._register(storage)
            self.state["initialized"] = True
            self._save()
        servers = [m for m in self.members if m.role == "server"]
        for m in servers:
            step(f"starting {m.name} on {m.address}")
            self.start_member(m.name)
        deadline = time.monotonic() + timeout
        for m in servers:
            self.wait_member(m.name)
        step("waiting until every partition is served")
        self.wait_served(max(1.0, deadline - time.monotonic()))
        # A server that joined late may still be taking its share of the partitions (a rebalance):
        # what the caller prints next should be the settled state, not that moment.
        while any(s.health != "ok" for s in self.status()) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _register(self, storage: list[Member]) -> None:
        with self.metadata() as meta:
            for group, m in enumerate(storage[:REPLICAS]):
                meta.add_storage_node(self.dialed_address(m), m.admin_port, group)
                meta.auto_assign(group)
            for m in storage[REPLICAS:]:  # spares: registered, holding nothing yet
                meta.add_storage_node(self.dialed_address(m), m.admin_port, REPLICAS)
        for m in storage[:REPLICAS]:
            self.admin(m.name, self._assign_all)

    async def _assign_all(self, client: Any) -> None:
        for p in range(self.partitions):
            await client.assign(p)

    def admin(self, name: str, call: Callable[[Any], Any]) -> Any:
        """Runs `call(StorageAdminClient)` against a storage node's admin port."""
        from waltz.storage.client import StorageAdminClient

        m = self.member(name)
        ssl = self._admin_ssl()

        async def run() -> Any:
            extra = {"ssl": ssl} if ssl is not None else {}
            async with await StorageAdminClient.connect(
                "127.0.0.1",
                m.admin_port,
                cluster_key=self.state["cluster_key"],
                partition_count=self.partitions,
                **extra,
            ) as client:
                return await call(client)

        return asyncio.run(run())

    def _admin_ssl(self) -> Any:
        # The storage nodes' admin ports admit only servers and operators.
        return self._certificates().tls("admin").client_context() if self.tls else None

    def stop(self, timeout: float = 30.0) -> list[str]:
        """SIGTERM to the servers, then to the storage nodes (servers finish their writes
        first); SIGKILL to whatever is still running after `timeout`. Returns what was killed."""
        killed = []
        for role in ("server", "storage"):
            names = [m.name for m in self.members if m.role == role and self.pid(m.name) is not None]
            for name in names:
                self.kill(name, signal.SIGTERM)
            for name in names:
                if not self._wait_gone(name, timeout):
                    self.kill(name, signal.SIGKILL)
                    killed.append(name)
                self._pid_path(name).unlink(missing_ok=True)
        return killed

    # ---- state -----------------------------------------------------------------------------

    def status(self) -> list[MemberStatus]:
        out = []
        for m in self.members:
            pid = self.pid(m.name)
            health = "down"
            if pid is not None:
                try:
                    code, body = http_get(m.http_port, "/health")
                    health = "ok" if code == 200 else f"failing: {_failing(body)}"
                except OSError:
                    health = "no answer"
            out.append(MemberStatus(m.name, m.role, pid, m.address, f"127.0.0.1:{m.http_port}", health))
        return out

    def wait_served(self, timeout: float = 120.0) -> None:
        """Until every partition is served by a live server under its current generation."""
        deadline = time.monotonic() + timeout
        with self.metadata() as meta:
            while True:
                assignment, _ = meta.assignment()
                live = {s.server_id: s for s in meta.servers()}
                missing = [
                    p
                    for p in range(self.partitions)
                    if (a := assignment.get(p)) is None
                    or a.server not in live
                    or live[a.server].serving.get(p) != a.generation
                ]
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise errors.ClusterError(
                        f"partitions {missing} are not served after {timeout:.0f} s; see {self.directory / 'logs'}"
                    )
                time.sleep(0.1)

    def server_metric(self, name: str) -> dict[int, float]:
        """A per-partition gauge or counter, as the live servers report it (each partition from
        the server that serves it)."""
        values: dict[int, float] = {}
        for m in self.members:
            if m.role != "server" or self.pid(m.name) is None:
                continue
            try:
                code, body = http_get(m.http_port, "/metrics")
            except OSError:
                continue
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    if sample.name == name and "partition" in sample.labels:
                        values[int(sample.labels["partition"])] = sample.value
        return values

    def wait_replicas(self, timeout: float = 120.0) -> None:
        """Until every partition writes to all its replicas (returning replicas caught up)."""
        deadline = time.monotonic() + timeout
        while True:
            in_path = self.server_metric("waltz_server_replicas_in_write_path")
            lagging = [p for p in range(self.partitions) if in_path.get(p, 0) < REPLICAS]
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise errors.ClusterError(
                    f"partitions {lagging} still write to fewer than {REPLICAS} replicas after {timeout:.0f} s"
                )
            time.sleep(0.2)

    def client_config(self, **overrides: Any) -> Any:
        from waltz.client import ClientConfig

        return ClientConfig(metadata=self.metadata_url, cluster=self.cluster, **{**self.client_tls(), **overrides})

    def client_settings(self, **overrides: Any) -> dict[str, Any]:
        """`client_config` as JSON-ready keyword arguments, for client processes."""
        config = dataclasses.asdict(self.client_config(**overrides))
        return {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in config.items()}

    @property
    def cluster_key(self) -> uuid.UUID:
        return uuid.UUID(self.state["cluster_key"])


def _section(name: str, keys: dict[str, Any]) -> str:
    """A TOML section of plain numbers (empty when there are none)."""
    return f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) + "\n" if keys else ""


def _failing(body: str) -> str:
    try:
        checks = json.loads(body).get("checks", {})
    except ValueError:
        return body[:80]
    bad = [k for k, v in _flatten(checks) if v is not True]
    return ", ".join(bad) or "unhealthy"


def _flatten(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
