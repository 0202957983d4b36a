"""Membership changes of a torture run, made as an operator makes them (docs/operations.md), through
the `waltz` command, while clients write and other faults strike.

    move-replica   one replica of a partition moves to a storage node that holds none of it:
                   assign, add-partition, recover-partition from a replica in the write path,
                   unassign the old holder, remove-partition there (files parked). The run has a
                   fourth storage node for it (registered, holding nothing at first), so replicas
                   wander over four nodes as the moves go on
    stop-server    SIGTERM a server: it deregisters at once and its partitions move to the other
                   server under a new generation (the graceful handoff); restarted when healed

A move is started only while every replica of the partition is in the serving server's write path
and no storage node or the metadata store is faulted: the operator's rule is one replica of a
partition changed at a time, with a majority of the last store session's replicas reachable.
Faults of the servers and of the clients' links may be active meanwhile.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from waltz.local import LocalCluster
from waltz.local.cluster import REPLICAS

SPARE_NODES = 1
"""Storage nodes beyond the three replicas when move-replica is on: where replicas move to."""


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
    addr = {m.name: cluster.dialed_address(m) for m in cluster.members if m.role == "storage"}
    deadline = time.monotonic() + timeout
    part = ["-p", str(p)]
    say(f"nemesis: move-replica partition {p}: {old} -> {new}")
    waltz_storage(cluster, ["assign", "--storage", addr[new], *part], deadline)
    waltz_storage(cluster, ["add-partition", "--storage", addr[new], *part], deadline)
    copies = [["recover-partition", "--source", addr[s], "--destination", addr[new], *part] for s in sources]
    waltz_storage(cluster, copies[0], deadline, retry_with=copies[1:])
    waltz_storage(cluster, ["unassign", "--storage", addr[old], *part], deadline)
    if cluster.pid(old) is not None:
        waltz_storage(cluster, ["remove-partition", "--storage", addr[old], *part], deadline)
    return {"partition": p, "from": old, "to": new}


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
