"""`waltz` against real storage node daemons, on the embedded store and on real ZooKeeper."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from support import script
from support.daemons import PARTITIONS, Cli, Node
from support.processes import stop
from waltz import errors
from waltz.cli.main import main
from waltz.cluster import open_store
from waltz.cluster.layout import encode
from waltz.cluster.metadata import ClusterMetadata, PartitionAssignment, PartitionMetadata, ReplicaState, ServerInfo
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient

MEMBER = str(script("cluster_member.py"))


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
        assert cli.json(
            "storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i)
        )["changed"]
    assert not cli.json(
        "storage",
        "add-node",
        "--storage",
        nodes[0].address,
        "--admin-port",
        str(nodes[0].ports["admin_port"]),
        "--group",
        "0",
    )["changed"]
    assert (
        "already in the cluster"
        in cli("storage", "add-node", "--storage", nodes[0].address, "--admin-port", "1", ok=False).output
    )

    # Not assigned yet: add-partition refuses; verify fails on replicas.
    assert "not assigned" in cli("storage", "add-partition", "--storage", nodes[0].address, "-p", "0", ok=False).output
    for i in range(3):
        placement = cli.json("storage", "auto-assign", "--group", str(i))["placement"]
        assert placement == {nodes[i].address: list(range(PARTITIONS))}
    listed = cli.json("storage", "list")
    assert [r["partitions"] for r in listed] == [list(range(PARTITIONS))] * 3

    for n in nodes:
        assert cli.json("storage", "add-partition", "--storage", n.address, *[f"-p{p}" for p in range(PARTITIONS)])[
            "changed"
        ]
    assert not cli.json("storage", "add-partition", "--storage", nodes[0].address, "-p0")["changed"]
    assert "does not exist" in cli("storage", "unassign", "--storage", nodes[0].address, "-p", "99", ok=False).output
    status = cli.json("storage", "list", "--status")
    assert all(
        r["reachable"] and sorted(s["partition"] for s in r["status"]) == list(range(PARTITIONS)) for r in status
    )

    # Storage is complete; no server runs yet, so verify fails on that alone.
    report = cli.json("cluster", "verify", ok=False)
    failed = {c["check"] for c in report["checks"] if c["status"] == "FAIL"}
    assert failed == {"servers"}
    assert {c["check"]: c["status"] for c in report["checks"]}["quorums"] == "PASS"

    # Availability and max transaction id.
    nodes[0].run(lambda c: c.append(1, 1, 0, batch(5, b"x")))
    assert (
        cli.json("storage", "max-transaction-id", "--storage", nodes[0].address, "-p", "1")["max_transaction_id"] == 4
    )
    assert cli("storage", "max-transaction-id", "--storage", nodes[1].address, "-p", "1").stdout.strip() == "-1"
    cli("storage", "availability", "--storage", nodes[0].address, "-p", "1", "--unwritable")
    with pytest.raises(errors.StorageRequestError, match="not writable"):
        nodes[0].run(lambda c: c.append(1, 1, 5, batch(1, b"y")))
    report = cli.json("cluster", "verify", ok=False)
    assert (
        "marked unavailable: [1]" in {c["check"]: c["detail"] for c in report["checks"]}[f"storage {nodes[0].address}"]
    )
    cli("storage", "availability", "--storage", nodes[0].address, "-p", "1", "--writable")
    nodes[0].run(lambda c: c.append(1, 1, 5, batch(1, b"y")))

    # Removing: a node that still holds partitions, a partition still assigned.
    assert "unassign them first" in cli("storage", "remove-node", "--storage", nodes[2].address, ok=False).output
    assert (
        "still assigned"
        in cli("storage", "remove-partition", "--storage", nodes[2].address, "-p", "3", ok=False).output
    )
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
        cli(
            "storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i)
        )
        cli("storage", "auto-assign", "--group", str(i))
        cli("storage", "add-partition", "--storage", n.address, "-p", "0")
    src, dst, other = nodes

    async def fill(c: StorageClient, first: int, n: int, lwm: int) -> None:
        await c.append(0, 7, first, batch(n, b"src"))
        await c.set_low_water_mark(0, 7, lwm)

    src.run(lambda c: fill(c, 0, 200, 149))
    done = cli.json(
        "storage",
        "recover-partition",
        "--source",
        src.address,
        "--destination",
        dst.address,
        "-p",
        "0",
        "--batch-size",
        "64",
    )
    # The destination keeps its own session id (none yet): only its low-water mark is the source's.
    assert (done["copied"], done["destination_max"], done["low_water_mark"], done["session_id"]) == (150, 149, 149, -1)

    # Runs again as a no-op, then continues after the source moved on.
    assert (
        cli.json("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0")[
            "copied"
        ]
        == 0
    )
    src.run(lambda c: fill(c, 200, 100, 299))
    assert (
        cli.json("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0")[
            "copied"
        ]
        == 150
    )

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
    out = cli(
        "storage", "recover-partition", "--source", src.address, "--destination", other.address, "-p", "0", ok=False
    ).output
    assert "differs from the source at transaction 0" in out
    assert "stays unwritable for servers until" in out and "or until its node restarts" in out
    assert {s["partition"]: s for s in other.admin(lambda c: c.status())}[0]["max_transaction_id"] == 2


def test_verify_passes_on_a_healthy_cluster_and_names_what_breaks(
    cli: Cli, nodes: list[Node], metadata_url: str, tmp_path: pathlib.Path
) -> None:
    for i, n in enumerate(nodes):
        cli(
            "storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i)
        )
        cli("storage", "auto-assign", "--group", str(i))
        cli("storage", "add-partition", "--storage", n.address, *[f"-p{p}" for p in range(PARTITIONS)])
    member = subprocess.Popen(
        [sys.executable, MEMBER, metadata_url, "/waltz/test", "0", str(tmp_path / "m.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
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
                meta.set_partition_metadata(
                    p, PartitionMetadata(1, 1, {n.address: ReplicaState(1) for n in nodes}), version
                )
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
        stdout=subprocess.PIPE,
        text=True,
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
        assert rows == [
            {
                "id": sid,
                "endpoint": "127.0.0.1:7100",
                "assigned": {"0": 1, "1": 1},
                "serving": {"0": 1, "1": 1},
                "preferred": [],
            }
        ]
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
    r = subprocess.run(
        [str(exe), "--json", "--cluster", "ep", "cluster", "create", "--partitions", "1", "--replicas", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["created"] is True
    r = subprocess.run(
        [str(exe), "--cluster", "nope", "cluster", "show"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 1 and r.stderr.startswith("waltz: no cluster at /waltz/nope") and "Traceback" not in r.stderr


# -- Regressions from an adversarial review of `waltz cluster verify` and `waltz storage
#    recover-partition`: each failed on the code as first written. ------------------------------


def setup_nodes(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    for i, n in enumerate(nodes):
        cli(
            "storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i)
        )
        cli("storage", "auto-assign", "--group", str(i))
        cli("storage", "add-partition", "--storage", n.address, *[f"-p{p}" for p in range(PARTITIONS)])


def status(node: Node, p: int) -> dict[str, Any]:
    return {s["partition"]: s for s in node.admin(lambda c: c.status())}[p]


def test_truncate_and_raise_fence_force_only_with_the_admin_role(
    cli: Cli, nodes: list[Node], metadata_url: str
) -> None:  # noqa: F811
    """`waltz storage truncate` and `raise-fence` do what the node allows anyway; --force is
    refused on plaintext nodes without role secrets (nobody proved the admin role), and
    raise-fence never goes above the newest session the metadata issued."""
    setup_nodes(cli, nodes)
    with open_store(metadata_url) as store:
        meta = ClusterMetadata(store, "/waltz/test")
        _, version = meta.partition_metadata(0)
        far = 3 + (1 << 40)
        meta.set_partition_metadata(0, PartitionMetadata(1, far, {n.address: ReplicaState(1) for n in nodes}), version)
    node = nodes[0]
    node.run(lambda c: c.set_low_water_mark(0, 2, -1))
    node.run(lambda c: c.append(0, 2, 0, batch(6, b"t")))
    node.run(lambda c: c.set_low_water_mark(0, 2, 3))
    where = ["--storage", node.address, "-p", "0"]
    assert "issued sessions up to" in cli("storage", "raise-fence", *where, "--to", str(far + 1), ok=False).output
    assert "may force it" in cli("storage", "raise-fence", *where, "--to", str(far), ok=False).output
    assert "needs the admin role" in cli("storage", "raise-fence", *where, "--to", str(far), "--force", ok=False).output
    assert cli.json("storage", "raise-fence", *where, "--to", "9")["fence"] == 9
    assert status(node, 0)["newest_session"] == 9
    assert "mark it unwritable" in cli("storage", "truncate", *where, "--to", "4", ok=False).output
    cli("storage", "availability", *where, "--unwritable")
    assert cli.json("storage", "truncate", *where, "--to", "4")["max_transaction_id"] == 4
    assert "may force it" in cli("storage", "truncate", *where, "--to", "1", ok=False).output
    assert "needs the admin role" in cli("storage", "truncate", *where, "--to", "1", "--force", ok=False).output
    assert status(node, 0)["max_transaction_id"] == 4


# -- cluster verify: false PASS -----------------------------------------------------------------
def test_verify_passes_while_two_live_servers_report_serving_one_partition(
    cli: Cli, nodes: list[Node], metadata_url: str
) -> None:  # noqa: F811
    setup_nodes(cli, nodes)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    store = open_store(metadata_url)
    store.start()
    try:
        meta = ClusterMetadata(store, "/waltz/test")
        for p in range(PARTITIONS):
            _, v = meta.partition_metadata(p)
            meta.set_partition_metadata(p, PartitionMetadata(1, 1, {n.address: ReplicaState(1) for n in nodes}), v)
        sid = store.session_id
        # Server 1 is assigned everything and serves it; server 2 is assigned nothing but reports
        # serving partition 0 too (a stale incarnation, a bug, a missed revocation).
        store.create(
            meta.paths.server(1),
            encode(ServerInfo(1, "127.0.0.1", port, (), {p: 1 for p in range(PARTITIONS)}).to_json()),
            ephemeral=True,
        )
        store.create(
            meta.paths.server(2), encode(ServerInfo(2, "127.0.0.1", port, (), {0: 1}).to_json()), ephemeral=True
        )
        _, v = meta.assignment()
        meta.set_assignment({p: PartitionAssignment(1, 1, sid) for p in range(PARTITIONS)}, v)
        report = cli.json("cluster", "verify", ok=None)
        checks = {c["check"]: c for c in report["checks"]}
        assert not report["ok"], f"two servers serve partition 0 and verify says: {checks['partition assignment']}"
    finally:
        store.close()
        listener.close()


def test_verify_counts_one_node_under_two_names_as_two_replicas(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    """Replicas 3: node0 is added as 127.0.0.1:P and again as localhost:P, node1 once; node2 is not
    used. verify PASSes replicas and quorums although only two physical replicas exist and a
    "quorum" of two can be one disk."""
    n0, n1, _ = nodes
    alias = f"localhost:{n0.ports['port']}"
    for addr, node, g in ((n0.address, n0, 0), (alias, n0, 1), (n1.address, n1, 2)):
        cli("storage", "add-node", "--storage", addr, "--admin-port", str(node.ports["admin_port"]), "--group", str(g))
        cli("storage", "auto-assign", "--group", str(g))
    for node in (n0, n1):
        cli("storage", "add-partition", "--storage", node.address, *[f"-p{p}" for p in range(PARTITIONS)])
    checks = {c["check"]: c for c in cli.json("cluster", "verify", ok=None)["checks"]}
    replicas = [c for name, c in checks.items() if name.endswith("replicas") or name == "replica assignment"]
    assert any(c["status"] == "FAIL" for c in replicas) or checks["quorums"]["status"] != "PASS", checks


# -- recover-partition --------------------------------------------------------------------------
def test_recover_partition_restores_availability_the_operator_had_turned_off(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    setup_nodes(cli, nodes)
    src, dst, _ = nodes
    src.run(lambda c: c.append(0, 7, 0, batch(10, b"src")))
    src.run(lambda c: c.set_low_water_mark(0, 7, 9))
    cli("storage", "availability", "--storage", dst.address, "-p", "0", "--unreadable", "--unwritable")
    cli.json("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0")
    s = status(dst, 0)
    assert (s["readable"], s["writable"]) == (False, False), (
        "the operator's unreadable/unwritable marks were overwritten"
    )


def test_recover_partition_failing_halfway_leaves_the_destination_writable(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    """The source's low-water mark is above what it holds (a replica not caught up yet): the copy
    stops halfway with an error, but the destination is made writable and readable anyway."""
    setup_nodes(cli, nodes)
    src, dst, _ = nodes
    src.run(lambda c: c.append(0, 7, 0, batch(10, b"src")))
    src.run(lambda c: c.set_low_water_mark(0, 7, 20))
    out = cli(
        "storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=False
    ).output
    assert "returned no record" in out
    s = status(dst, 0)
    assert s["max_transaction_id"] == 9 and s["session_id"] < 7
    assert not s["writable"], "a half-copied destination was handed back to servers"


def test_recover_partition_from_a_shorter_source_asks_for_a_longer_one(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    """A destination holding more than the source is not different from it: the advice to
    delete its files would wipe transactions the source lacks, possibly acknowledged ones."""
    setup_nodes(cli, nodes)
    src, dst, _ = nodes
    src.run(lambda c: c.append(0, 7, 0, batch(5, b"same")))
    src.run(lambda c: c.set_low_water_mark(0, 7, 4))
    dst.run(lambda c: c.append(0, 7, 0, batch(8, b"same")))
    out = cli(
        "storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=False
    ).output
    assert "ends before transaction 5" in out and "pick a source" in out, out
    assert "remove the destination's files" not in out, out
    assert status(dst, 0)["max_transaction_id"] == 7


def test_recover_partition_resume_check_misses_a_diverged_prefix(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    """The destination's records 0-3 differ from the (committed) source's; its record 4 is the
    same (the same request retried at the same id). The copy "resumes", and the destination
    then claims a low-water mark of 49 over records that were never committed."""
    setup_nodes(cli, nodes)
    src, dst, _ = nodes
    src.run(lambda c: c.append(0, 7, 0, batch(60, b"src")))
    src.run(lambda c: c.set_low_water_mark(0, 7, 49))

    async def diverged(c: StorageClient) -> None:
        await c.append(0, 3, 0, batch(4, b"dirty"))
        await c.append(0, 3, 4, RecordBatch([(ReqId(1, 1, 0, 4), 4, b"src-4")]))

    dst.run(diverged)
    done = cli(
        "storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=None
    ).output
    mine = dst.admin(lambda c: c.records(0, 0, 50))
    theirs = src.admin(lambda c: c.records(0, 0, 50))
    lwm = status(dst, 0)["low_water_mark"]
    bad = [r.txid for r, t in zip(mine, theirs) if r != t and r.txid <= lwm]
    assert not bad, (
        f"recover-partition said {done}; destination differs from the committed log at {bad} below its low-water mark "
        f"{status(dst, 0)['low_water_mark']}"
    )


def test_recover_partition_regresses_the_session_of_a_destination_that_joined_a_newer_session(
    cli: Cli,
    nodes: list[Node],
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """The destination's status is read before it is marked unwritable. A server's recovery for
    session 9 sets its low-water mark in between; at the end the CLI overwrites (9, 30) with the
    source's older (7, 19)."""
    setup_nodes(cli, nodes)
    src, dst, _ = nodes
    src.run(lambda c: c.append(0, 7, 0, batch(20, b"src")))
    src.run(lambda c: c.set_low_water_mark(0, 7, 19))
    real = StorageAdminClient.set_availability

    async def racing(self: StorageAdminClient, partition: int, *, readable: bool, writable: bool) -> None:
        if not writable and self.address.endswith(f":{dst.ports['admin_port']}"):
            async with await StorageClient.connect(
                "127.0.0.1", dst.ports["port"], cluster_key=dst.key, partition_count=PARTITIONS
            ) as c:
                await c.set_low_water_mark(0, 9, 30)  # session 9's recovery, just before
        await real(self, partition, readable=readable, writable=writable)

    monkeypatch.setattr(StorageAdminClient, "set_availability", racing)
    cli("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=None)
    s = status(dst, 0)
    assert (s["session_id"], s["low_water_mark"]) == (9, 30), (
        f"session info regressed to {(s['session_id'], s['low_water_mark'])}"
    )


def test_admin_set_partition_info_accepts_a_session_older_than_the_fence(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    setup_nodes(cli, nodes)
    node = nodes[0]
    node.run(lambda c: c.set_low_water_mark(0, 9, -1))

    async def older(c: StorageAdminClient) -> None:
        await c.set_availability(0, readable=True, writable=False)
        await c.set_partition_info(0, 4, -1)

    with pytest.raises(Exception):
        node.admin(older)
    assert status(node, 0)["session_id"] == 9


def test_admin_set_partition_info_may_raise_only_the_low_water_mark_under_a_newer_fence(
    cli: Cli, nodes: list[Node]
) -> None:  # noqa: F811
    """A replica that lost its files has no session info, while its fence remembers the session
    that last reached it: recover-partition raises its low-water mark and keeps its session id
    (-1), so recovery still sees what it lost. Any other session id below the fence is refused."""
    setup_nodes(cli, nodes)
    node = nodes[0]
    node.run(lambda c: c.append(0, 9, 0, batch(5, b"x")))  # a store session 9 reached it: fenced at 9
    assert (status(node, 0)["session_id"], status(node, 0)["newest_session"]) == (-1, 9)

    async def raise_lwm(c: StorageAdminClient) -> None:
        await c.set_availability(0, readable=True, writable=False)
        await c.set_partition_info(0, -1, 4)

    node.admin(raise_lwm)
    s = status(node, 0)
    assert (s["session_id"], s["low_water_mark"], s["newest_session"]) == (-1, 4, 9)

    async def older(c: StorageAdminClient) -> None:
        await c.set_partition_info(0, 3, 4)

    with pytest.raises(errors.StaleSessionError):
        node.admin(older)


# -- CLI usability -----------------------------------------------------------------------------
def test_remove_partition_twice_is_idempotent(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    setup_nodes(cli, nodes)
    cli("storage", "unassign", "--storage", nodes[0].address, "-p", "3")
    cli("storage", "remove-partition", "--storage", nodes[0].address, "-p", "3")
    cli("storage", "remove-partition", "--storage", nodes[0].address, "-p", "3")


def test_verify_on_a_node_of_another_cluster_says_so(cli: Cli, nodes: list[Node], tmp_path: Any) -> None:  # noqa: F811
    setup_nodes(cli, nodes[:2])
    stranger = Node(tmp_path / "stranger", uuid.uuid4())
    try:
        cli(
            "storage",
            "add-node",
            "--storage",
            stranger.address,
            "--admin-port",
            str(stranger.ports["admin_port"]),
            "--group",
            "2",
        )
        checks = {c["check"]: c for c in cli.json("cluster", "verify", ok=False)["checks"]}
        detail = checks[f"storage {stranger.address}"]["detail"]
        assert "unreachable" not in detail, detail
    finally:
        from support.processes import stop

        stop(stranger.proc)


def test_reset_fence_lowers_a_wrongly_raised_fence_never_below_the_metadata(
    cli: Cli, nodes: list[Node], metadata_url: str
) -> None:  # noqa: F811
    """Issue 34: a fence raised by a request no server sent (Last Session Info with a wild
    session) made every server's session stale on that replica for good, and no command lowered
    it. `waltz storage reset-fence` does, never below the newest session the metadata issued."""
    setup_nodes(cli, nodes)
    with open_store(metadata_url) as store:
        meta = ClusterMetadata(store, "/waltz/test")
        _, version = meta.partition_metadata(0)
        meta.set_partition_metadata(0, PartitionMetadata(1, 3, {n.address: ReplicaState(1) for n in nodes}), version)
    node = nodes[0]
    node.run(lambda c: c.set_low_water_mark(0, 2, -1))
    wild = 2 + (1 << 32)  # within the bound a replica accepts, but no server issued it
    node.run(lambda c: c.last_session_info(0, wild))
    with pytest.raises(errors.StaleSessionError):
        node.run(lambda c: c.max_transaction_id(0, 4))
    where = ["--storage", node.address, "-p", "0"]
    assert "issued session 3" in cli("storage", "reset-fence", *where, "--to", "2", ok=False).output
    assert status(node, 0)["newest_session"] == wild
    assert cli.json("storage", "reset-fence", *where, "--to", "3")["fence"] == 3
    assert status(node, 0)["newest_session"] == 3
    assert node.run(lambda c: c.max_transaction_id(0, 4)) == -1  # the next server session is served
    # The node itself refuses below the session that set its low-water mark, and any raise.
    with pytest.raises(errors.StorageRequestError, match="cannot go below"):
        node.admin(lambda c: c.reset_fence(0, 1))
    with pytest.raises(errors.StorageRequestError, match="nothing to lower"):
        node.admin(lambda c: c.reset_fence(0, 9))


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_recover_partition_restarts_a_destination_behind_the_sources_retained_start(
    cli: Cli, tmp_path: pathlib.Path
) -> None:
    """The source's retention deleted past the destination's end (issue 35): the destination
    restarts where the source starts and is filled from there; before, an empty destination was
    refused and `waltz torture --retention` could not heal a corrupted replica."""
    created = cli.json("cluster", "create", "--partitions", str(PARTITIONS), "--replicas", "3")
    key = uuid.UUID(created["cluster_key"])
    keys = {"storage_keys": {"segment_size": 8192}, "node_keys": {"retention_interval": 0.1}}
    src, dst = (Node(tmp_path / f"node{i}", key, **keys) for i in range(2))
    try:
        for n in (src, dst):
            cli("storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]))
            cli("storage", "assign", "--storage", n.address, "-p", "0")
            cli("storage", "add-partition", "--storage", n.address, "-p", "0")

        async def fill_and_delete(c: StorageClient) -> int:
            for i in range(20):  # segments roll between appends: 8 KiB segments of a few batches each
                await c.append(0, 7, i * 10, batch(10, b"s" * 100))
            await c.set_low_water_mark(0, 7, 149)
            await c.set_retention(0, 7, max_age_ms=None, max_bytes=0, min_kept=0, hold_from=2**63 - 1, lease_ms=60_000)
            deadline = time.monotonic() + 30
            while (
                first := await c.set_retention(
                    0, 7, max_age_ms=None, max_bytes=0, min_kept=0, hold_from=2**63 - 1, lease_ms=60_000
                )
            ) == 0:
                assert time.monotonic() < deadline, "the source never deleted its head"
                time.sleep(0.1)
            return first

        first = src.run(fill_and_delete)
        assert 0 < first <= 150
        done = cli.json(
            "storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0"
        )
        assert (done["copied"], done["destination_max"], done["low_water_mark"]) == (150 - first, 149, 149), done
        state = {s["partition"]: s for s in dst.admin(lambda c: c.status())}[0]
        assert (state["first_transaction_id"], state["writable"]) == (first, True)
        got = dst.admin(lambda c: c.records(0, first, 1000))
        assert [r.txid for r in got] == list(range(first, 150))
    finally:
        for n in (src, dst):
            if n.proc.poll() is None:
                stop(n.proc)
