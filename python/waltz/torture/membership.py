"""Membership changes of a torture run, made as an operator makes them (docs/operations.md), through
the `waltz` command, while clients write and other faults strike.

    move-replica   one replica of a partition moves to a storage node that holds none of it:
                   assign, add-partition, recover-partition from a replica in the write path,
                   unassign the old holder, remove-partition there (files parked). The run has a
                   fourth storage node for it (registered, holding nothing at first), so replicas
                   wander over four nodes as the moves go on
    stop-server    SIGTERM a server: it deregisters at once and its partitions move to the other
                   server under a new generation (the graceful handoff); restarted when healed
    remove-node    a storage node leaves the cluster as an operator retires one: each of its
                   replicas moves to a node without one (the move above), `waltz storage
                   remove-node`, the process stopped; healed by starting it and `waltz storage
                   add-node` again (it holds nothing then: later moves bring replicas back onto
                   it, restoring the files parked there)

A move is started only while every replica of the partition is in the serving server's write path
and no storage node or the metadata store is faulted: the operator's rule is one replica of a
partition changed at a time, with a majority of the last store session's replicas reachable.
Faults of the servers and of the clients' links may be active meanwhile.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from waltz.local import LocalCluster
from waltz.local.cluster import REPLICAS

SPARE_NODES = 1
"""Storage nodes beyond the three replicas when a membership fault is on: where replicas move to."""
MEMBERSHIP_FAULTS = ("move-replica", "remove-node")
"""The faults that need the spare storage node."""


def holders(cluster: LocalCluster) -> dict[int, set[str]]:
    """The storage members (by name) assigned each partition's replicas, from the metadata."""
    by_address = {cluster.dialed_address(m): m.name for m in cluster.members if m.role == "storage"}
    out: dict[int, set[str]] = {p: set() for p in range(cluster.partitions)}
    with cluster.metadata() as meta:
        for node in meta.storage_nodes():
            for p in node.partitions:
                out.setdefault(p, set()).add(by_address.get(node.address, node.address))
    return out


def waltz_storage(cluster: LocalCluster, args: list[str], deadline: float, retry_with: Sequence[list[str]] = ()) -> str:
    """Runs `waltz storage ARGS` until it succeeds or `deadline` passes (other faults may hold a
    server or a link a while); `retry_with`: other argument lists tried in turn on failure."""
    env = {**os.environ, **cluster.environment()}
    choices = [args, *retry_with]
    attempt = 0
    while True:
        argv = choices[attempt % len(choices)]
        r = subprocess.run(
            [sys.executable, "-m", "waltz.cli.main", "storage", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode == 0:
            return r.stdout
        if time.monotonic() > deadline:
            last = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"`waltz storage {' '.join(argv)}` failed: {last[0]}")
        attempt += 1
        time.sleep(0.5)


def pick_move(cluster: LocalCluster, rng: random.Random) -> tuple[int, str, str, list[str]] | None:
    """(partition, from, to, sources): a partition whose replicas are all in its write path, one
    holder to move away from, a storage node without a replica of it, and the other holders to
    copy from. None when no partition qualifies now."""
    storage = [m.name for m in cluster.members if m.role == "storage"]
    in_path = cluster.server_metric("waltz_server_replicas_in_write_path")
    held = holders(cluster)
    candidates = sorted(p for p, names in held.items() if len(names) == REPLICAS and in_path.get(p, 0) >= REPLICAS)
    if not candidates:
        return None
    p = rng.choice(candidates)
    old = rng.choice(sorted(held[p]))
    free = sorted(n for n in storage if n not in held[p])
    if not free:
        return None
    return p, old, rng.choice(free), sorted(held[p] - {old})


def move_replica(
    cluster: LocalCluster, rng: random.Random, say: Callable[[str], None], timeout: float = 180.0
) -> dict[str, Any]:
    """Moves one replica (`pick_move`) with the documented sequence; returns what it did."""
    picked = pick_move(cluster, rng)
    if picked is None:
        return {"skipped": "no partition with all its replicas in its write path"}
    p, old, new, sources = picked
    say(f"nemesis: move-replica partition {p}: {old} -> {new}")
    _move(cluster, p, old, new, sources, time.monotonic() + timeout)
    return {"partition": p, "from": old, "to": new}


def _move(cluster: LocalCluster, p: int, old: str, new: str, sources: list[str], deadline: float) -> None:
    """docs/operations.md's sequence: assign, add-partition, recover-partition (from each source in
    turn until one succeeds), unassign the old holder, remove-partition there (files parked)."""
    addr = {m.name: cluster.dialed_address(m) for m in cluster.members if m.role == "storage"}
    part = ["-p", str(p)]
    waltz_storage(cluster, ["assign", "--storage", addr[new], *part], deadline)
    waltz_storage(cluster, ["add-partition", "--storage", addr[new], *part], deadline)
    copies = [["recover-partition", "--source", addr[s], "--destination", addr[new], *part] for s in sources]
    waltz_storage(cluster, copies[0], deadline, retry_with=copies[1:])
    waltz_storage(cluster, ["unassign", "--storage", addr[old], *part], deadline)
    if cluster.pid(old) is not None:
        waltz_storage(cluster, ["remove-partition", "--storage", addr[old], *part], deadline)


def pick_removal(cluster: LocalCluster, rng: random.Random) -> tuple[str, dict[int, tuple[str, list[str]]]] | None:
    """(node, {partition: (to, sources)}): a registered storage node whose every partition has all
    its replicas in the write path and a registered node without a replica to move to. None when
    no node qualifies (one is already out, or a partition is not fully in its write path)."""
    with cluster.metadata() as meta:
        registered = {n.address for n in meta.storage_nodes()}
    names = [m.name for m in cluster.members if m.role == "storage" and cluster.dialed_address(m) in registered]
    in_path = cluster.server_metric("waltz_server_replicas_in_write_path")
    held = holders(cluster)
    plans = {}
    for node in names:
        plan = {}
        for p, holding in sorted(held.items()):
            if node not in holding:
                continue
            free = sorted(n for n in names if n not in holding)
            if len(holding) != REPLICAS or in_path.get(p, 0) < REPLICAS or not free:
                break
            plan[p] = (rng.choice(free), sorted(holding - {node}))
        else:
            plans[node] = plan
    # A node holding replicas when there is one: retiring the empty spare moves nothing.
    retirable = sorted(n for n, plan in plans.items() if plan) or sorted(plans)
    if not retirable:
        return None
    node = rng.choice(retirable)
    return node, plans[node]


def remove_node(
    cluster: LocalCluster, rng: random.Random, say: Callable[[str], None], timeout: float = 240.0
) -> tuple[dict[str, Any], Callable[[], None]]:
    """Retires one storage node (`pick_removal`): its replicas moved away, the node removed from
    the metadata, its process stopped. Returns what it did and the heal, which starts the node
    and adds it back, empty."""
    picked = pick_removal(cluster, rng)
    if picked is None:
        return {"skipped": "no storage node whose partitions are all in their write path"}, lambda: None
    node, plan = picked
    deadline = time.monotonic() + timeout
    for p, (to, sources) in plan.items():
        say(f"nemesis: remove-node {node}: partition {p} -> {to}")
        _move(cluster, p, node, to, sources, deadline)
    address = cluster.dialed_address(cluster.member(node))
    with cluster.metadata() as meta:
        info = next(n for n in meta.storage_nodes() if n.address == address)
    waltz_storage(cluster, ["remove-node", "--storage", address], deadline)
    cluster.kill(node, signal.SIGTERM)

    def add_back() -> None:
        start_when_stopped(cluster, node)
        waltz_storage(
            cluster,
            ["add-node", "--storage", address, "--admin-port", str(info.admin_port), "--group", str(info.group)],
            time.monotonic() + timeout,
        )

    return {"node": node, "moved": {str(p): to for p, (to, _) in plan.items()}}, add_back


def start_when_stopped(cluster: LocalCluster, name: str, timeout: float = 60.0) -> None:
    """Starts a member sent SIGTERM once it has exited (a server deregisters and closes its
    sessions first); SIGKILL if it has not within `timeout`, which is a finding of its own."""
    deadline = time.monotonic() + timeout
    while cluster.pid(name) is not None:
        if time.monotonic() > deadline:
            cluster.kill(name)
            cluster.start_member(name)
            raise RuntimeError(f"{name} did not exit within {timeout:.0f} s of SIGTERM (killed and restarted)")
        time.sleep(0.1)
    cluster.start_member(name)
