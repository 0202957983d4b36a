"""`waltz` against real storage node daemons, on the embedded store and on real ZooKeeper."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner, Result

from waltz import errors
from waltz.cli.main import main
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient

from support import script
from support.processes import start, stop, wait_http, write_config

PARTITIONS = 4
MEMBER = str(script("cluster_member.py"))


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
    """A storage node daemon; `sections` adds TOML sections ([tls]), `ssl` is the client context
    `run` and `admin` connect with."""

    def __init__(self, directory: pathlib.Path, key: uuid.UUID, *, sections: dict[str, Any] | None = None, ssl: Any = None) -> None:
        directory.mkdir()
        self.key = key
        self.ssl = ssl
        self.config, self.ports = write_config(directory, key, partition_count=PARTITIONS, sections=sections)
        self.proc = start(self.config)
        wait_http(self.ports["http_port"], self.proc)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['port']}"

    def run(self, coro_fn: Any) -> Any:
        async def go() -> Any:
            async with await StorageClient.connect(
                "127.0.0.1", self.ports["port"], cluster_key=self.key, partition_count=PARTITIONS, ssl=self.ssl
            ) as c:
                return await coro_fn(c)

        return asyncio.run(go())

    def admin(self, coro_fn: Any) -> Any:
        async def go() -> Any:
            async with await StorageAdminClient.connect(
                "127.0.0.1", self.ports["admin_port"], cluster_key=self.key, partition_count=PARTITIONS, ssl=self.ssl
            ) as c:
                return await coro_fn(c)

        return asyncio.run(go())


@pytest.fixture
def cli(metadata_url: str) -> Cli:
    return Cli(metadata_url)


@pytest.fixture
def nodes(cli: Cli, tmp_path: pathlib.Path) -> Iterator[list[Node]]:
    created = cli.json("cluster", "create", "--partitions", str(PARTITIONS), "--replicas", "3")
    key = uuid.UUID(created["cluster_key"])
    ns = [Node(tmp_path / f"node{i}", key) for i in range(3)]
    yield ns
    for n in ns:
        if n.proc.poll() is None:
            stop(n.proc)


def batch(n: int, tag: bytes) -> RecordBatch:
    return RecordBatch([(ReqId(1, 1, 0, i), i, tag + b"-%d" % i) for i in range(n)])


def test_cluster_lifecycle_and_storage_admin(cli: Cli, nodes: list[Node]) -> None:
    again = cli.json("cluster", "create", "--partitions", str(PARTITIONS), "--replicas", "3")
    assert again["created"] is False
    assert "not changing it" in cli("cluster", "create", "--partitions", "9", "--replicas", "3", ok=False).output

    for i, n in enumerate(nodes):
        assert cli.json("storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i))["changed"]
    assert not cli.json("storage", "add-node", "--storage", nodes[0].address, "--admin-port", str(nodes[0].ports["admin_port"]), "--group", "0")["changed"]
    assert "already in the cluster" in cli("storage", "add-node", "--storage", nodes[0].address, "--admin-port", "1", ok=False).output

    # Not assigned yet: add-partition refuses; verify fails on replicas.
    assert "not assigned" in cli("storage", "add-partition", "--storage", nodes[0].address, "-p", "0", ok=False).output
    for i in range(3):
        placement = cli.json("storage", "auto-assign", "--group", str(i))["placement"]
        assert placement == {nodes[i].address: list(range(PARTITIONS))}
    listed = cli.json("storage", "list")
    assert [r["partitions"] for r in listed] == [list(range(PARTITIONS))] * 3

    for n in nodes:
        assert cli.json("storage", "add-partition", "--storage", n.address, *[f"-p{p}" for p in range(PARTITIONS)])["changed"]
    assert not cli.json("storage", "add-partition", "--storage", nodes[0].address, "-p0")["changed"]
    assert "does not exist" in cli("storage", "unassign", "--storage", nodes[0].address, "-p", "99", ok=False).output
    status = cli.json("storage", "list", "--status")
    assert all(r["reachable"] and sorted(s["partition"] for s in r["status"]) == list(range(PARTITIONS)) for r in status)

    # Storage is complete; no server runs yet, so verify fails on that alone.
    report = cli.json("cluster", "verify", ok=False)
    failed = {c["check"] for c in report["checks"] if c["status"] == "FAIL"}
    assert failed == {"servers"}
    assert {c["check"]: c["status"] for c in report["checks"]}["quorums"] == "PASS"

    # Availability and max transaction id.
    nodes[0].run(lambda c: c.append(1, 1, 0, batch(5, b"x")))
    assert cli.json("storage", "max-transaction-id", "--storage", nodes[0].address, "-p", "1")["max_transaction_id"] == 4
    assert cli("storage", "max-transaction-id", "--storage", nodes[1].address, "-p", "1").stdout.strip() == "-1"
    cli("storage", "availability", "--storage", nodes[0].address, "-p", "1", "--unwritable")
    with pytest.raises(errors.StorageRequestError, match="not writable"):
        nodes[0].run(lambda c: c.append(1, 1, 5, batch(1, b"y")))
    report = cli.json("cluster", "verify", ok=False)
    assert "marked unavailable: [1]" in {c["check"]: c["detail"] for c in report["checks"]}[f"storage {nodes[0].address}"]
    cli("storage", "availability", "--storage", nodes[0].address, "-p", "1", "--writable")
    nodes[0].run(lambda c: c.append(1, 1, 5, batch(1, b"y")))

    # Removing: a node that still holds partitions, a partition still assigned.
    assert "unassign them first" in cli("storage", "remove-node", "--storage", nodes[2].address, ok=False).output
    assert "still assigned" in cli("storage", "remove-partition", "--storage", nodes[2].address, "-p", "3", ok=False).output
    cli("storage", "unassign", "--storage", nodes[2].address, "-p", "3")
    assert not cli.json("storage", "unassign", "--storage", nodes[2].address, "-p", "3")["changed"]
    checks = {c["check"]: c for c in cli.json("cluster", "verify", ok=False)["checks"]}
    assert checks[f"storage {nodes[2].address} extra"]["status"] == "WARN"  # held, no longer assigned
    cli("storage", "remove-partition", "--storage", nodes[2].address, "-p", "3")
    assert 3 not in [s["partition"] for s in nodes[2].admin(lambda c: c.status())]
    report = cli.json("cluster", "verify", ok=False)
    assert {c["check"]: c["status"] for c in report["checks"]}["partition 3 replicas"] == "FAIL"

    shown = cli.json("cluster", "show")
    assert shown["partitions"] == PARTITIONS and len(shown["storage_nodes"]) == 3
    assert sorted(shown["assignment"][3]["replicas"]) == sorted([nodes[0].address, nodes[1].address])

    # Deleting the cluster: asks unless --yes (and never deletes silently in JSON mode); idempotent.
    assert "needs --yes" in cli("--json", "cluster", "delete", ok=False).output
    assert "Aborted" in cli("cluster", "delete", ok=False).output  # no answer on stdin
    cli("cluster", "delete", "--yes")
    assert cli.json("cluster", "delete", "--yes")["deleted"] is False
    assert "no cluster" in cli("cluster", "show", ok=False).output


def test_recover_partition_copies_the_committed_prefix_and_resumes(cli: Cli, nodes: list[Node]) -> None:
    for i, n in enumerate(nodes):
        cli("storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i))
        cli("storage", "auto-assign", "--group", str(i))
        cli("storage", "add-partition", "--storage", n.address, "-p", "0")
    src, dst, other = nodes

    async def fill(c: StorageClient, first: int, n: int, lwm: int) -> None:
        await c.append(0, 7, first, batch(n, b"src"))
        await c.set_low_water_mark(0, 7, lwm)

    src.run(lambda c: fill(c, 0, 200, 149))
    done = cli.json("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", "--batch-size", "64")
    # The destination keeps its own session id (none yet): only its low-water mark is the source's.
    assert (done["copied"], done["destination_max"], done["low_water_mark"], done["session_id"]) == (150, 149, 149, -1)

    # Runs again as a no-op, then continues after the source moved on.
    assert cli.json("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0")["copied"] == 0
    src.run(lambda c: fill(c, 200, 100, 299))
    assert cli.json("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0")["copied"] == 150

    async def read_all(c: StorageClient) -> list[Any]:
        out: list[Any] = []
        while len(out) < 300:
            got = await c.records(0, 7, len(out), 1000)
            assert got
            out.extend(got)
        return out

    assert dst.run(read_all) == src.run(read_all)[:300]
    state = {s["partition"]: s for s in dst.admin(lambda c: c.status())}[0]
    assert (state["readable"], state["writable"], state["max_transaction_id"]) == (True, True, 299)

    # A destination whose log differs from the source's is refused, not overwritten.
    other.run(lambda c: c.append(0, 7, 0, batch(3, b"other")))
    out = cli("storage", "recover-partition", "--source", src.address, "--destination", other.address, "-p", "0", ok=False).output
    assert "differs from the source at transaction 0" in out
    assert "stays unwritable for servers until" in out and "or until its node restarts" in out
    assert {s["partition"]: s for s in other.admin(lambda c: c.status())}[0]["max_transaction_id"] == 2


def test_verify_passes_on_a_healthy_cluster_and_names_what_breaks(cli: Cli, nodes: list[Node], metadata_url: str, tmp_path: pathlib.Path) -> None:
    for i, n in enumerate(nodes):
        cli("storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i))
        cli("storage", "auto-assign", "--group", str(i))
        cli("storage", "add-partition", "--storage", n.address, *[f"-p{p}" for p in range(PARTITIONS)])
    member = subprocess.Popen([sys.executable, MEMBER, metadata_url, "/waltz/test", "0", str(tmp_path / "m.log")], stdout=subprocess.PIPE, text=True)
    try:
        assert member.stdout is not None
        member.stdout.readline()
        # What a server's recovery writes once every replica joined its store session.
        from waltz.cluster import open_store
        from waltz.cluster.metadata import ClusterMetadata, PartitionMetadata, ReplicaState

        with open_store(metadata_url) as store:
            meta = ClusterMetadata(store, "/waltz/test")
            for p in range(PARTITIONS):
                _, version = meta.partition_metadata(p)
                meta.set_partition_metadata(p, PartitionMetadata(1, 1, {n.address: ReplicaState(1) for n in nodes}), version)
        deadline = time.monotonic() + 30
        while not (report := cli.json("cluster", "verify", ok=None))["ok"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {c["status"] for c in report["checks"]} == {"PASS"}
        assert "all checks passed" in cli("cluster", "verify").stdout

        stop(nodes[0].proc)  # one replica down: that node fails, the quorums hold
        status = {c["check"]: c["status"] for c in cli.json("cluster", "verify", ok=False)["checks"]}
        assert status[f"storage {nodes[0].address}"] == "FAIL" and status["quorums"] == "PASS"
        stop(nodes[1].proc)  # two of three down: no quorum anywhere
        checks = {c["check"]: c for c in cli.json("cluster", "verify", ok=False)["checks"]}
        assert checks["quorums"]["status"] == "FAIL" and "0 (1/2)" in checks["quorums"]["detail"]
    finally:
        member.kill()
        member.wait()


def test_admin_writes_need_the_partition_unwritable(cli: Cli, nodes: list[Node]) -> None:
    node = nodes[0]
    node.admin(lambda c: c.assign(2))
    node.run(lambda c: c.append(2, 1, 0, batch(2, b"a")))
    records = node.admin(lambda c: c.records(2, 0, 10))
    assert [r.txid for r in records] == [0, 1]

    async def copy_back(c: StorageAdminClient) -> None:
        await c.append(2, records)

    with pytest.raises(errors.StorageRequestError, match="mark it unwritable"):
        node.admin(copy_back)
    with pytest.raises(errors.StorageRequestError, match="mark it unwritable"):
        node.admin(lambda c: c.set_partition_info(2, 3, 1))


def test_server_list_shows_registered_servers(cli: Cli, metadata_url: str, tmp_path: pathlib.Path) -> None:
    cli("cluster", "create", "--partitions", "2", "--replicas", "1")
    assert cli.json("server", "list") == []
    member = subprocess.Popen(
        [sys.executable, MEMBER, metadata_url, "/waltz/test", "7100", str(tmp_path / "m.log")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert member.stdout is not None
        sid = int(member.stdout.readline())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = cli.json("server", "list")
            if rows and rows[0]["serving"] == {"0": 1, "1": 1}:
                break
            time.sleep(0.1)
        assert rows == [{"id": sid, "endpoint": "127.0.0.1:7100", "assigned": {"0": 1, "1": 1}, "serving": {"0": 1, "1": 1}, "preferred": []}]
        assert "servers are registered" in cli("cluster", "delete", "--yes", ok=False).output
    finally:
        member.kill()
        member.wait()


def test_user_mistakes_are_one_line_errors(cli: Cli, tmp_path: pathlib.Path) -> None:
    assert "no cluster at /waltz/test" in cli("cluster", "show", ok=False).output
    r = CliRunner().invoke(main, ["cluster", "show"], env={"WALTZ_METADATA": ""})
    assert r.exit_code == 1 and "no metadata store given" in r.output
    r = CliRunner().invoke(main, ["--metadata", "nope://x", "cluster", "show"])
    assert r.exit_code == 1 and "unknown metadata store" in r.output
    assert "bad cluster name" in cli("--cluster", "a/b", "cluster", "show", ok=False).output


def test_the_installed_entry_point_runs(metadata_url: str) -> None:
    env = {"WALTZ_METADATA": metadata_url, "PATH": "/usr/bin:/bin"}
    exe = pathlib.Path(sys.executable).parent / "waltz"
    r = subprocess.run([str(exe), "--json", "--cluster", "ep", "cluster", "create", "--partitions", "1", "--replicas", "1"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["created"] is True
    r = subprocess.run([str(exe), "--cluster", "nope", "cluster", "show"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("waltz: no cluster at /waltz/nope") and "Traceback" not in r.stderr
