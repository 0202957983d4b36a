"""Real processes for tests: free ports, a ZooKeeper server, storage node daemons."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

# free_port: below the ephemeral range, so a port chosen for a daemon is not some outgoing
# connection's by the time the daemon listens (CI failed on "Address already in use").
from waltz.local.cluster import free_port, http_get  # noqa: F401  (tests import free_port from here)
from waltz.local.zookeeper import ZOOKEEPER_JAR, ZooKeeperServer, zookeeper_available  # noqa: F401  (tests import them from here)


def toml_sections(sections: Mapping[str, Mapping[str, Any]] | None) -> str:
    """TOML text of whole sections, e.g. {"tls": {"ca": path, ...}}; strings and paths quoted."""
    out = []
    for name, values in (sections or {}).items():
        out.append(f"\n[{name}]\n")
        for k, v in values.items():
            text = str(v).lower() if isinstance(v, bool) else v if isinstance(v, (int, float)) else json.dumps(str(v))
            out.append(f"{k} = {text}\n")
    return "".join(out)


def write_config(
    tmp_path: pathlib.Path,
    key: uuid.UUID,
    partition_count: int = 2,
    *,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    storage_keys: Mapping[str, Any] | None = None,
    node_keys: Mapping[str, Any] | None = None,
    **extra: str,
) -> tuple[pathlib.Path, dict[str, int]]:
    """A storage node's TOML file; `extra` are more [logging] keys, `sections` whole sections ([tls]),
    `storage_keys` and `node_keys` more [storage] and [node] keys."""
    more = {
        name: "".join(f"{k} = {v}\n" for k, v in (keys or {}).items())
        for name, keys in (("storage", storage_keys), ("node", node_keys))
    }
    ports = {"port": free_port(), "admin_port": free_port(), "http_port": free_port()}
    text = (
        f"""
[storage]
directory = "{tmp_path / "data"}"
cluster_key = "{key}"
partition_count = {partition_count}
checkpoint_interval = 100
{more["storage"]}
[node]
host = "127.0.0.1"
port = {ports["port"]}
admin_port = {ports["admin_port"]}
http_port = {ports["http_port"]}
{more["node"]}
[logging]
level = "info"
json = true
"""
        + "".join(f"{k} = {v}\n" for k, v in extra.items())
        + toml_sections(sections)
    )
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path, ports


def start(config: pathlib.Path) -> subprocess.Popen[str]:
    # -X faulthandler: a node that does not stop gets SIGABRT from `stop`, and every Python
    # thread's stack comes out on its stderr (a rare shutdown hang left no clue three times).
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "waltz.cli.node", "storage", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
    )


def get(port: int, path: str) -> tuple[int, str]:
    return http_get(port, path, timeout=5.0)


def wait_http(port: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"node exited: {proc.stderr.read() if proc.stderr else ''}"
        try:
            get(port, "/health")
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the node's HTTP endpoint never came up")


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # started by `start`: its threads' stacks on stderr
        _, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"process {proc.pid} did not exit within 30 s of SIGTERM; its stderr (a node's ends with "
            f"its threads' stacks):\n{err[-30000:]}"
        ) from None
    assert proc.returncode == 0, err
    return err


def postgres_bin(name: str) -> str | None:
    for d in sorted(pathlib.Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


class PostgresServer:
    """A real PostgreSQL (Debian package `postgresql`) in a temporary directory on 127.0.0.1 and
    a free port, trust authentication. PostgreSQL refuses to run as root: under root it runs as
    the `postgres` system user, in a directory that user owns."""

    def __init__(self) -> None:
        import tempfile

        initdb = postgres_bin("initdb")
        if initdb is None:
            raise RuntimeError("PostgreSQL is not installed: run scripts/setup.sh (apt package `postgresql`)")
        self.bin = pathlib.Path(initdb).parent
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="waltz-pg-"))
        self.port = free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, capture_output=True, text=True)

    def start(self) -> None:
        data = self.directory / "data"
        self._run(str(self.bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "waltz", "--no-sync")
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(self.directory / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://waltz@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.directory / "data"), "-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
