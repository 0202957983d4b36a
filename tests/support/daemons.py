"""Real daemons for integration tests: storage node daemons (`Node`), server daemons
(`start_server`, `wait_served`), the `waltz` command run in process (`Cli`), and the `setup`
fixture: metadata with a cluster of PARTITIONS partitions on three storage nodes."""

from __future__ import annotations

import asyncio
import json
import pathlib
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner, Result
from waltz.cli.main import main
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata
from waltz.storage import StorageAdminClient, StorageClient

from support.processes import start, stop, toml_sections, wait_http, write_config

PARTITIONS = 4


class Cli:
    def __init__(self, metadata_url: str) -> None:
        self.env = {"WALTZ_METADATA": metadata_url, "WALTZ_CLUSTER": "test"}
        self.runner = CliRunner()

    def __call__(self, *args: str, ok: bool | None = True) -> Result:
        """Runs `waltz ARGS`; `ok` True expects exit 0, False exit 1 (one-line error), None either."""
        r = self.runner.invoke(main, list(args), env=self.env, catch_exceptions=True)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise AssertionError(f"waltz {' '.join(args)} raised {r.exception!r}") from r.exception
        if ok is None:
            assert r.exit_code in (0, 1), r.output
        elif ok:
            assert r.exit_code == 0, f"waltz {' '.join(args)} exited {r.exit_code}: {r.output}"
        else:
            assert r.exit_code == 1, f"waltz {' '.join(args)} should fail: {r.output}"
            assert "Traceback" not in r.output
        return r

    def json(self, *args: str, ok: bool | None = True) -> Any:
        return json.loads(self("--json", *args, ok=ok).stdout)


class Node:
    """A storage node daemon; `sections` adds TOML sections ([tls], [role_secrets]), `ssl` is the
    client context `run` and `admin` connect with, `credential` the (role, secret) they give."""

    def __init__(
        self,
        directory: pathlib.Path,
        key: uuid.UUID,
        *,
        sections: dict[str, Any] | None = None,
        ssl: Any = None,
        credential: tuple[str, bytes] | None = None,
        **keys: Any,
    ) -> None:
        """`keys` are `storage_keys` and `node_keys` of `write_config`."""
        directory.mkdir()
        self.key = key
        self.ssl = ssl
        self.credential = credential
        self.config, self.ports = write_config(directory, key, partition_count=PARTITIONS, sections=sections, **keys)
        self.proc = start(self.config)
        wait_http(self.ports["http_port"], self.proc)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['port']}"

    def run(self, coro_fn: Any) -> Any:
        async def go() -> Any:
            async with await StorageClient.connect(
                "127.0.0.1",
                self.ports["port"],
                cluster_key=self.key,
                partition_count=PARTITIONS,
                ssl=self.ssl,
                credential=self.credential,
            ) as c:
                return await coro_fn(c)

        return asyncio.run(go())

    def admin(self, coro_fn: Any) -> Any:
        async def go() -> Any:
            async with await StorageAdminClient.connect(
                "127.0.0.1",
                self.ports["admin_port"],
                cluster_key=self.key,
                partition_count=PARTITIONS,
                ssl=self.ssl,
                credential=self.credential,
            ) as c:
                return await coro_fn(c)

        return asyncio.run(go())

    def admin_records(self, partition: int = 0) -> list[Any]:
        """Every record of `partition` through the admin port: no store session, so no fencing."""

        async def go(c: Any) -> list[Any]:
            out: list[Any] = []
            while got := await c.records(partition, len(out), 1000):
                out.extend(got)
            return out

        return self.admin(go)  # type: ignore[no-any-return]


def nodes_cluster(
    metadata_url: str, tmp_path: pathlib.Path, **keys: Any
) -> Iterator[tuple[ClusterMetadata, list[Node], str]]:
    """Cluster "e2e" on three storage nodes with every partition assigned; `keys` go to each
    `Node` (`storage_keys`, `node_keys`)."""
    store = open_store(metadata_url)
    store.start()
    meta = ClusterMetadata(store, "/waltz/e2e")
    info, _ = meta.create("e2e", PARTITIONS, 3)
    nodes = [Node(tmp_path / f"n{i}", info.cluster_key, **keys) for i in range(3)]
    for i, n in enumerate(nodes):
        meta.add_storage_node(n.address, n.ports["admin_port"], i)
        meta.auto_assign(i)

        async def assign_all(c: Any) -> None:
            for p in range(PARTITIONS):
                await c.assign(p)

        n.admin(assign_all)
    yield meta, nodes, metadata_url
    for n in nodes:
        if n.proc.poll() is None:
            stop(n.proc)
    store.close()


@pytest.fixture
def setup(metadata_url: str, tmp_path: pathlib.Path) -> Iterator[tuple[ClusterMetadata, list[Node], str]]:
    yield from nodes_cluster(metadata_url, tmp_path)


def start_server(
    tmp_path: pathlib.Path,
    url: str,
    name: str,
    http_port: int = 0,
    sections: dict[str, Any] | None = None,
    event_loop: str = "uvloop",
    server: dict[str, Any] | None = None,
    file_limit: int | None = None,
    session_timeout: float = 2.0,
) -> subprocess.Popen[str]:
    """A server daemon logging to `tmp_path/<name>.log`; `sections` adds TOML sections ([tls]),
    `server` more [server] keys; `file_limit` is its RLIMIT_NOFILE (soft and hard)."""
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[server]\nmetadata = "{url}"\ncluster = "e2e"\nport = 0\nhttp_port = {http_port}\n'
        f"session_timeout = {session_timeout}\n"
        f'event_loop = "{event_loop}"\n'
        + "".join(f"{k} = {v}\n" for k, v in (server or {}).items())
        + '\n[logging]\nlevel = "info"\n'
        + toml_sections(sections)
    )
    log = open(tmp_path / f"{name}.log", "a")

    def limit_files() -> None:
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (file_limit, file_limit))

    return subprocess.Popen(
        [sys.executable, "-m", "waltz.cli.node", "server", "--config", str(config)],
        stderr=log,
        text=True,
        preexec_fn=limit_files if file_limit is not None else None,
    )


def wait_served(
    meta: ClusterMetadata, partition: int, not_by: int | None = None, timeout: float = 60.0
) -> tuple[str, int]:
    """(endpoint, generation) of the live server serving `partition` under its current generation."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assignment, _ = meta.assignment()
        a = assignment.get(partition)
        for s in meta.servers():
            if a is not None and s.server_id == a.server != not_by and s.serving.get(partition) == a.generation:
                return s.endpoint, a.generation
        time.sleep(0.1)
    raise AssertionError(f"partition {partition} not served: {meta.assignment()[0]}, {meta.servers()}")
