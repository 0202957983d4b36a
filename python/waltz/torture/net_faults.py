"""The nemesis's partial partitions and misbehaving clients (issue 37 items 3 and 7): how
`partial-partition`, `one-way`, `zombie` (a server and half the client workers cut from the
metadata store) and the misbehaving clients start, and what heals them. The
schedule (which fault, when, for how long) stays in `nemesis.py`."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from waltz.local import LocalCluster
from waltz.torture import bad_clients
from waltz.torture.partial import from_process
from waltz.torture.proxy import Direction, FaultProxy


class Nemesis(Protocol):
    """What these faults use of `waltz.torture.nemesis.Nemesis` (a protocol, so that this module
    does not import the nemesis that imports it)."""

    cluster: LocalCluster
    proxies: dict[str, FaultProxy]
    metadata_proxy: FaultProxy | None
    rng: random.Random
    servers: list[str]
    storage: list[str]
    counts: dict[str, int]
    problems: list[str]
    committed: Callable[[], dict[int, int]]
    client_pids: Callable[[], dict[str, int]]
    log: Callable[[dict[str, Any]], None]
    say: Callable[[str], None]

    def _pick_member(self) -> str: ...


Started = tuple[tuple[str, ...], dict[str, Any], Callable[[], None], float]


def start(n: Nemesis, kind: str, hold: float) -> Started:
    """(targets, detail, undo, heal_at) of a new fault of `kind`."""
    now = time.monotonic()
    c = n.cluster
    if kind == "partial-partition":
        server, node = n.rng.choice(n.servers), n.rng.choice(n.storage)
        pid = c.pid(server)
        if pid is None:
            return (server, node), {"skipped": "server not running"}, lambda: None, now + hold
        proxy = n.proxies[node]
        proxy.set_mode("blackhole", only=from_process(pid))
        return (server, node), {"link": f"{server} to {node}"}, lambda: proxy.set_mode("pass"), now + hold
    if kind == "one-way":
        target = n._pick_member()
        way: Direction = n.rng.choice(("up", "down"))
        proxy = n.proxies[target]
        proxy.set_mode("blackhole", direction=way)
        lost = "requests" if way == "up" else "answers"
        return (target,), {"link": f"to {target}", "lost": lost}, lambda: proxy.set_mode("pass"), now + hold
    if kind == "zombie":
        meta = n.metadata_proxy
        assert meta is not None
        server = n.rng.choice(n.servers)
        workers = n.client_pids()
        cut = zombie_clients(n.rng, sorted(workers))
        # Past the session timeout, so that the metadata store expires the session and another
        # server takes the partitions while this one still reaches storage and its clients.
        hold = max(hold, float(c.state.get("server_session_timeout", 3.0)) + 2.0 + n.rng.uniform(0, 2))
        pid = c.pid(server)
        if pid is None:
            return (server,), {"skipped": "server not running"}, lambda: None, now + hold
        # The cut clients see no reassignment: they go on sending the partitions' appends to the
        # zombie while the others follow the new owner and write there, as a real partition that
        # takes a server and part of its clients away from the metadata store does.
        meta.set_mode("blackhole", only=from_process(pid, *(workers[w] for w in cut)))
        detail = {"link": f"{server} to the metadata store", "clients": cut}
        return (server,), detail, lambda: meta.set_mode("pass"), now + hold
    if kind in bad_clients.MODES:
        return _bad_client(n, kind, max(hold, 4.0))
    raise ValueError(kind)


def zombie_clients(rng: random.Random, workers: list[str]) -> list[str]:
    """The client workers a zombie fault cuts from the metadata store with its server: half of
    them (at least one), so that some keep writing to the zombie while the rest write to the
    partitions' new owner (each worker mounts every partition, so every one is the zombie's)."""
    return sorted(rng.sample(workers, max(1, len(workers) // 2))) if workers else []


COMMITTING_WAIT = 20.0
"""Seconds a misbehaving client's start waits for the honest clients to commit (the cluster may
still be recovering from the fault before: a majority just powered back on)."""


def _committing(n: Nemesis, wait: float) -> int | None:
    """The sum of the observed marks once it rises within `wait` seconds, or None: the honest
    clients committed nothing meanwhile, so a standstill during the fault to come could not be
    blamed on it."""
    first = sum(n.committed().values())
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(n.committed().values())
        if now > first:
            return now
    return None


def _bad_client(n: Nemesis, mode: str, hold: float) -> Started:
    c = n.cluster
    # Judged only if the cluster commits when it starts: torture seed 66 started one right after
    # a majority power loss, while a new store session was still recovering, and blamed it.
    committing = _committing(n, COMMITTING_WAIT)
    clients_dir = c.directory.parent / "clients"
    number = sum(n.counts.get(k, 0) for k in bad_clients.MODES)
    spec = {
        "seed": n.rng.randrange(1 << 32),
        "seconds": hold + 30,  # a backstop: the heal stops it
        "partitions": c.partitions,
        "servers": [c.dialed_address(c.member(s)) for s in n.servers],
        "server_pids": [pid for s in n.servers if (pid := c.pid(s)) is not None],
        "clients_dir": str(clients_dir),
    }
    log_path = clients_dir / f"bad-clients-{number}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "waltz.torture.bad_clients", mode, json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    before, started = sum(n.committed().values()), time.monotonic()
    if committing is not None:
        before = max(before, committing)

    def finding(msg: str) -> None:
        n.problems.append(msg)
        n.say(f"nemesis: {msg}")

    def undo() -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            finding(f"{mode}: did not stop within 60 s ({log_path})")
            return
        lines = log_path.read_text(errors="replace").strip().splitlines()
        if proc.returncode == -signal.SIGTERM:  # healed (the run ending) before it installed its handler
            n.log({"f": "nemesis", "type": "observed", "fault": mode, "seen": {"skipped": "stopped while starting"}})
            return
        if proc.returncode != 0:
            finding(lines[-1] if lines else f"{mode}: exit {proc.returncode}")
        elif lines and lines[-1].startswith("{"):
            n.log({"f": "nemesis", "type": "observed", "fault": mode, "seen": json.loads(lines[-1])})
        # Alone that long, the honest clients must have committed. A cluster still recovering from
        # the fault before (a majority just restarted) may hold them up a while: only a standstill
        # that outlasts the misbehaving client by 10 s is a finding.
        after, deadline = sum(n.committed().values()), time.monotonic() + 10
        while after <= before and time.monotonic() < deadline:
            time.sleep(0.5)
            after = sum(n.committed().values())
        if after <= before and time.monotonic() - started >= hold:
            if committing is None:
                n.log(
                    {"f": "nemesis", "type": "observed", "fault": mode, "seen": {"unjudged": "not committing before"}}
                )
                n.say(
                    f"nemesis: {mode}: not judged: the honest clients committed nothing "
                    f"in the {COMMITTING_WAIT:.0f} s before it"
                )
            else:
                finding(f"{mode}: the honest clients committed nothing while it ran nor 10 s after (marks {before})")

    return ("clients",), {}, undo, time.monotonic() + hold
