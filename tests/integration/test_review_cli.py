"""Regression tests from an adversarial review of `waltz cluster verify` and `waltz storage
recover-partition`; each failed on the code as first written."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest

from waltz import errors
from waltz.cluster import open_store
from waltz.cluster.layout import encode
from waltz.cluster.metadata import ClusterMetadata, PartitionAssignment, PartitionMetadata, ReplicaState, ServerInfo
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient

from test_cli import PARTITIONS, Cli, Node, batch, cli, nodes  # noqa: F401  (fixtures)


def setup_nodes(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    for i, n in enumerate(nodes):
        cli("storage", "add-node", "--storage", n.address, "--admin-port", str(n.ports["admin_port"]), "--group", str(i))
        cli("storage", "auto-assign", "--group", str(i))
        cli("storage", "add-partition", "--storage", n.address, *[f"-p{p}" for p in range(PARTITIONS)])


def status(node: Node, p: int) -> dict[str, Any]:
    return {s["partition"]: s for s in node.admin(lambda c: c.status())}[p]


# -- cluster verify: false PASS -----------------------------------------------------------------
def test_verify_passes_while_two_live_servers_report_serving_one_partition(cli: Cli, nodes: list[Node], metadata_url: str) -> None:  # noqa: F811
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
        store.create(meta.paths.server(1), encode(ServerInfo(1, "127.0.0.1", port, (), {p: 1 for p in range(PARTITIONS)}).to_json()), ephemeral=True)
        store.create(meta.paths.server(2), encode(ServerInfo(2, "127.0.0.1", port, (), {0: 1}).to_json()), ephemeral=True)
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
    assert (s["readable"], s["writable"]) == (False, False), "the operator's unreadable/unwritable marks were overwritten"


def test_recover_partition_failing_halfway_leaves_the_destination_writable(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
    """The source's low-water mark is above what it holds (a replica not caught up yet): the copy
    stops halfway with an error, but the destination is made writable and readable anyway."""
    setup_nodes(cli, nodes)
    src, dst, _ = nodes
    src.run(lambda c: c.append(0, 7, 0, batch(10, b"src")))
    src.run(lambda c: c.set_low_water_mark(0, 7, 20))
    out = cli("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=False).output
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
    out = cli("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=False).output
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
    done = cli("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=None).output
    mine = dst.admin(lambda c: c.records(0, 0, 50))
    theirs = src.admin(lambda c: c.records(0, 0, 50))
    lwm = status(dst, 0)["low_water_mark"]
    bad = [r.txid for r, t in zip(mine, theirs) if r != t and r.txid <= lwm]
    assert not bad, f"recover-partition said {done}; destination differs from the committed log at {bad} below its low-water mark {status(dst, 0)['low_water_mark']}"


def test_recover_partition_regresses_the_session_of_a_destination_that_joined_a_newer_session(
    cli: Cli, nodes: list[Node], monkeypatch: pytest.MonkeyPatch  # noqa: F811
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
            async with await StorageClient.connect("127.0.0.1", dst.ports["port"], cluster_key=dst.key, partition_count=PARTITIONS) as c:
                await c.set_low_water_mark(0, 9, 30)  # session 9's recovery, just before
        await real(self, partition, readable=readable, writable=writable)

    monkeypatch.setattr(StorageAdminClient, "set_availability", racing)
    cli("storage", "recover-partition", "--source", src.address, "--destination", dst.address, "-p", "0", ok=None)
    s = status(dst, 0)
    assert (s["session_id"], s["low_water_mark"]) == (9, 30), f"session info regressed to {(s['session_id'], s['low_water_mark'])}"


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


def test_admin_set_partition_info_may_raise_only_the_low_water_mark_under_a_newer_fence(cli: Cli, nodes: list[Node]) -> None:  # noqa: F811
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
        cli("storage", "add-node", "--storage", stranger.address, "--admin-port", str(stranger.ports["admin_port"]), "--group", "2")
        checks = {c["check"]: c for c in cli.json("cluster", "verify", ok=False)["checks"]}
        detail = checks[f"storage {stranger.address}"]["detail"]
        assert "unreachable" not in detail, detail
    finally:
        from support.processes import stop

        stop(stranger.proc)
