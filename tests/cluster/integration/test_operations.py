"""docs/operations.md, run as written: every `waltz` and `waltz-node` command it lists is used
by some test, and the procedures it gives (moving a replica to another storage node, replacing
a node) work on a live cluster without losing a committed transaction."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import click
import pytest
from support.client_app import MemoryApp, Write
from waltz.cli.main import main as waltz_main
from waltz.cli.node import main as node_main
from waltz.client import WaltzClient
from waltz.local import LocalCluster

ROOT = pathlib.Path(__file__).parents[3]


def leaf_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out += leaf_commands(cmd, (*prefix, name)) if isinstance(cmd, click.Group) else [(*prefix, name)]
    return out


COMMANDS = [("waltz", *c) for c in leaf_commands(waltz_main)] + [("waltz-node", *c) for c in leaf_commands(node_main)]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_is_documented_and_exercised(command: tuple[str, ...]) -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    words = command[1:]
    assert " ".join(words) in doc, f"`{' '.join(command)}` is not in docs/operations.md"
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    # Invoked as argv lists ("storage", "add-node", ...) or as one string ("storage add-node ...").
    quoted = r'"{}"[^\n]*?"{}"'.format(*map(re.escape, words)) if len(words) == 2 else rf'"{re.escape(words[0])}"'
    assert re.search(quoted, tests) or re.search(r'"[^"\n]*\b' + re.escape(" ".join(words)) + r"\b", tests), (
        f"no test runs `{' '.join(command)}`"
    )


def waltz(cluster: LocalCluster, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **cluster.environment()},
    )
    assert done.returncode == (0 if ok else 1), f"waltz {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def commit(client: WaltzClient, name: str, n: int) -> None:
    for f in [client.submit(Write(f"{name}-{i}", partition=0)) for i in range(n)]:
        f.result(timeout=60)


def replica_holders(cluster: LocalCluster, partition: int) -> set[str]:
    nodes = json.loads(waltz(cluster, "--json", "storage", "list").stdout)
    return {n["address"] for n in nodes if partition in n["partitions"]}


def test_moving_a_replica_to_a_new_storage_node(tmp_path: pathlib.Path) -> None:
    """The procedure of "Adding or replacing a storage node": storage-3 (a spare) takes over
    storage-2's replica of partition 0 while a client keeps writing."""
    cluster = LocalCluster.create(tmp_path / "c", partitions=2, storage_nodes=4, servers=1)
    app = MemoryApp()
    try:
        cluster.start()
        old, new, source = (cluster.member(f"storage-{i}").address for i in (2, 3, 0))
        assert replica_holders(cluster, 0) == {cluster.member(f"storage-{i}").address for i in range(3)}
        with WaltzClient(app, cluster.client_config()) as client:
            commit(client, "before", 50)
            waltz(cluster, "storage", "assign", "--storage", new, "-p", "0")
            waltz(cluster, "storage", "add-partition", "--storage", new, "-p", "0")
            copied = waltz(cluster, "storage", "recover-partition", "--source", source, "--destination", new, "-p", "0")
            assert "copied" in copied.stdout or "up to date" in copied.stdout, copied.stdout
            commit(client, "during", 50)
            waltz(cluster, "storage", "unassign", "--storage", old, "-p", "0")
            waltz(cluster, "storage", "remove-partition", "--storage", old, "-p", "0")
            assert replica_holders(cluster, 0) == {cluster.member(f"storage-{i}").address for i in (0, 1, 3)}
            cluster.wait_served()
            cluster.wait_replicas()
            commit(client, "after", 50)
            client.flush()
            waltz(cluster, "cluster", "verify")
            assert client.high_water_mark(0) == 149
        assert not app.errors
        assert [d["id"] for _, d in app.applied[0]] == [
            f"{w}-{i}" for w in ("before", "during", "after") for i in range(50)
        ]

        async def read(c: object) -> list[str]:
            return [json.loads(bytes(r.data))["id"] for r in await c.records(0, 0, 1000)]  # type: ignore[attr-defined]

        # The new replica holds the whole log, written by recover-partition and the store session.
        assert cluster.admin("storage-3", read) == [d["id"] for _, d in app.applied[0]]
    finally:
        cluster.stop()


def move(cluster: LocalCluster, partition: int, old: str, new: str, source: str) -> None:
    """docs/operations.md's sequence; `remove-partition` without --delete-files keeps old's files."""
    p = str(partition)
    waltz(cluster, "storage", "assign", "--storage", new, "-p", p)
    waltz(cluster, "storage", "add-partition", "--storage", new, "-p", p)
    waltz(cluster, "storage", "recover-partition", "--source", source, "--destination", new, "-p", p)
    waltz(cluster, "storage", "unassign", "--storage", old, "-p", p)
    waltz(cluster, "storage", "remove-partition", "--storage", old, "-p", p)


def test_a_replica_moved_away_and_back_rejoins_with_its_old_files(tmp_path: pathlib.Path) -> None:
    """`waltz torture --seed 62`: storage-2 keeps its files of partition 0 when its replica moves
    to storage-3; moved back, recover-partition refills it past the closing mark of the session
    it was last clean in, under that session's id. The recovery then truncated it to that
    closing mark, below its own low-water mark; the node refused ("would remove committed
    records") and the replica stayed out of every session."""
    cluster = LocalCluster.create(tmp_path / "c", partitions=1, storage_nodes=4, servers=1)
    app = MemoryApp()
    try:
        cluster.start()
        a, b, c, spare = (cluster.member(f"storage-{i}").address for i in range(4))
        with WaltzClient(app, cluster.client_config()) as client:
            commit(client, "before", 50)
            move(cluster, 0, c, spare, a)
            cluster.wait_replicas()
            # Past the closing mark of storage-2's last session, in a later session.
            commit(client, "away", 50)
            move(cluster, 0, spare, c, b)
            cluster.wait_served()
            cluster.wait_replicas(timeout=60)
            commit(client, "back", 50)
            client.flush()
            waltz(cluster, "cluster", "verify")
            assert client.high_water_mark(0) == 149
        assert replica_holders(cluster, 0) == {a, b, c}
        assert [d["id"] for _, d in app.applied[0]] == [
            f"{w}-{i}" for w in ("before", "away", "back") for i in range(50)
        ]
    finally:
        cluster.stop()
