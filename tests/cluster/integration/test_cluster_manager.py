"""The cluster manager with real member processes on both metadata stores: servers join, leave
cleanly and are killed with SIGKILL; assignments converge, generations are never reused, and no
two servers ever serve one partition at the same time."""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from support import script
from waltz.cluster import open_store
from waltz.cluster.manager import LIVE_MOVE, ServerMembership
from waltz.cluster.metadata import Assignment, ClusterMetadata
from waltz.cluster.store import MetadataStore

PARTITIONS = 8
MEMBER = str(script("cluster_member.py"))


class Members:
    def __init__(self, url: str, root: str, log: pathlib.Path) -> None:
        self.url, self.root, self.log = url, root, log
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.ended: dict[int, float] = {}
        self.port = 7000

    def start(self, preferred: str = "") -> int:
        self.port += 1
        proc = subprocess.Popen(
            [sys.executable, MEMBER, self.url, self.root, str(self.port), str(self.log), preferred],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        sid = int(proc.stdout.readline())
        self.procs[sid] = proc
        return sid

    def kill(self, sid: int) -> None:
        proc = self.procs.pop(sid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.ended[sid] = time.monotonic()

    def leave(self, sid: int) -> None:
        proc = self.procs.pop(sid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        self.ended[sid] = time.monotonic()

    def stop_all(self) -> None:
        for sid in list(self.procs):
            self.kill(sid)


@pytest.fixture
def cluster(metadata_url: str) -> Iterator[tuple[MetadataStore, ClusterMetadata]]:
    store = open_store(metadata_url, session_timeout=2.0)
    store.start()
    meta = ClusterMetadata(store, "/waltz/test")
    meta.create("test", PARTITIONS, 3)
    yield store, meta
    store.close()


def test_auto_assign_only_adds_replicas(cluster) -> None:
    """Nodes added without `--group` all sit in group 0. Auto-assign used to keep one replica per
    partition there and unassign the others in one change, silently leaving one copy."""
    _, meta = cluster
    nodes = [f"127.0.0.1:{7100 + i}" for i in range(4)]
    for a in nodes[:3]:
        meta.add_storage_node(a, 9000)
        for p in range(PARTITIONS):
            meta.assign_partition(a, p)
    full = list(range(PARTITIONS))
    assert meta.auto_assign(0) == {a: full for a in nodes[:3]}
    meta.add_storage_node(nodes[3], 9000, group=1)
    assert meta.auto_assign(1) == {nodes[3]: full}
    assert meta.auto_assign(1) == {nodes[3]: full}  # idempotent
    assert {r.address for p in range(PARTITIONS) for r in meta.replicas_of(p)} == set(nodes)
    assert all(len(meta.replicas_of(p)) == 4 for p in range(PARTITIONS))


def served(log: pathlib.Path) -> dict[int, dict[int, int]]:
    """The last reported serving set of every server, from the members' log."""
    last: dict[int, dict[int, int]] = {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        last[e["server"]] = {int(k): v for k, v in e["serving"].items()}
    return last


def wait_converged(meta: ClusterMetadata, members: Members, timeout: float = 60.0) -> Assignment:
    deadline = time.monotonic() + timeout
    live = set(members.procs)
    while time.monotonic() < deadline:
        a, _ = meta.assignment()
        owners = [x.server for x in a.values()]
        if live and all(o in live for o in owners):
            loads = [owners.count(s) for s in live]
            report = served(members.log) if members.log.exists() else {}
            mine = {s: {p: x.generation for p, x in a.items() if x.server == s} for s in live}
            if max(loads) - min(loads) <= 1 and all(report.get(s, {}) == mine[s] for s in live):
                return a
        time.sleep(0.1)
    raise AssertionError(f"assignment did not converge on {sorted(live)}: {meta.assignment()[0]}")


def leader(store: MetadataStore, meta: ClusterMetadata) -> int:
    candidates = store.children(meta.paths.manager)
    return int(json.loads(store.get(f"{meta.paths.manager}/{min(candidates)}")[0]))


def check_never_two_servers(log: pathlib.Path, ended: dict[int, float]) -> None:
    """Builds each server's serving intervals per partition and checks no two overlap."""
    intervals: dict[int, list[tuple[float, float, int]]] = {}
    open_: dict[tuple[int, int], float] = {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        sid, t, now = e["server"], e["t"], {int(k) for k in e["serving"]}
        for (s, p), start in list(open_.items()):
            if s == sid and p not in now:
                intervals.setdefault(p, []).append((start, t, sid))
                del open_[(s, p)]
        for p in now:
            open_.setdefault((sid, p), t)
    for (s, p), start in open_.items():
        intervals.setdefault(p, []).append((start, ended.get(s, float("inf")), s))
    for p, spans in intervals.items():
        spans.sort()
        for (s1, e1, a), (s2, e2, b) in zip(spans, spans[1:]):
            assert a == b or e1 <= s2, f"partition {p}: server {a} served until {e1} but server {b} started at {s2}"


def test_servers_join_leave_and_crash(cluster, tmp_path: pathlib.Path, metadata_url: str) -> None:
    store, meta = cluster
    members = Members(metadata_url, meta.paths.root, tmp_path / "members.jsonl")
    history: list[Assignment] = []
    lock = threading.Lock()

    def record(a: Assignment) -> None:
        with lock:
            history.append(a)

    watch = meta.watch_assignment(record)
    try:
        first = [members.start() for _ in range(3)]
        wait_converged(meta, members)
        assert leader(store, meta) == first[0]  # the oldest candidate leads
        members.kill(first[0])  # the leader crashes: its session must expire first
        wait_converged(meta, members)
        members.start()  # a newcomer takes a fair share from live servers
        wait_converged(meta, members)
        members.leave(first[1])  # a clean leave
        a = wait_converged(meta, members)
        pinned = members.start(preferred="0,1")  # preferred partitions are honoured
        a = wait_converged(meta, members)
        assert a[0].server == pinned and a[1].server == pinned
    finally:
        watch.stop()
        members.stop_all()

    with lock:
        seen: dict[tuple[int, int], tuple[int | None, int]] = {}
        last_gen = {p: -1 for p in range(PARTITIONS)}
        for snapshot in history:
            for p, x in snapshot.items():
                assert x.generation >= last_gen[p], f"partition {p}: generation went back"
                last_gen[p] = x.generation
                owner = seen.setdefault((p, x.generation), (x.server, x.session))
                assert owner == (x.server, x.session), f"partition {p} generation {x.generation} given twice"
    assert all(g >= 1 for g in last_gen.values())
    check_never_two_servers(members.log, members.ended)


# -- Regressions from an adversarial review of ServerMembership races (in-process members, one
#    store session each): each failed on the code as first written. -----------------------------


class Recorder:
    """Records, per partition, who serves it and when (a start is logged when deliver returns,
    a stop when deliver begins: the most lenient reading of "serving")."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.serving: dict[int, set[int]] = {}  # partition -> servers serving it now
        self.overlaps: list[str] = []

    def deliver_for(self, sid_box: list[int], slow_add: float = 0.0):  # type: ignore[no-untyped-def]
        current: dict[int, int] = {}

        def deliver(partitions: dict[int, int]) -> None:
            sid = sid_box[0]
            with self.lock:
                for p in set(current) - set(partitions):
                    self.serving[p].discard(sid)
            added = set(partitions) - set(current)
            if added and slow_add:
                time.sleep(slow_add)  # starting a partition takes a while (store sessions, recovery)
            with self.lock:
                for p in added:
                    others = self.serving.setdefault(p, set()) - {sid}
                    if others:
                        self.overlaps.append(f"partition {p}: server {sid} starts while {sorted(others)} serve it")
                    self.serving[p].add(sid)
            current.clear()
            current.update(partitions)

        return deliver


@pytest.fixture
def stores(metadata_url: str) -> Iterator[list]:  # type: ignore[type-arg]
    opened = []

    def new():  # type: ignore[no-untyped-def]
        s = open_store(metadata_url, session_timeout=2.0)
        s.start()
        opened.append(s)
        return s

    yield new  # type: ignore[misc]
    for s in opened:
        s.close()


def wait(cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_partition_handed_on_while_the_old_owner_is_still_starting_it(stores) -> None:  # type: ignore[no-untyped-def]
    """A server that read "p is yours" and is inside deliver (starting p) has not reported p yet.
    The leader moves p away (unassign), sees nobody reporting p, and hands it to another server at
    once: when the first server's deliver returns, two servers serve p."""
    admin = stores()
    meta = ClusterMetadata(admin, "/waltz/r")
    meta.create("r", 2, 1)
    rec = Recorder()
    members: list[ServerMembership] = []
    try:
        # Server L leads and starts with both partitions (fast deliver).
        box_l: list[int] = [0]
        m_l = ServerMembership(ClusterMetadata(stores(), "/waltz/r"), "127.0.0.1", 7001, rec.deliver_for(box_l))
        box_l[0] = m_l.server_id
        m_l.start()
        members.append(m_l)
        wait(lambda: set(m_l.serving) == {0, 1})
        # Server A joins; starting a partition takes it 5 s.
        box_a: list[int] = [0]
        m_a = ServerMembership(
            ClusterMetadata(stores(), "/waltz/r"), "127.0.0.1", 7002, rec.deliver_for(box_a, slow_add=5.0)
        )
        box_a[0] = m_a.server_id
        m_a.start()
        members.append(m_a)
        wait(lambda: any(x.server == m_a.server_id for x in meta.assignment()[0].values()))
        moved = next(p for p, x in meta.assignment()[0].items() if x.server == m_a.server_id)
        time.sleep(0.5)  # A read the assignment and is inside deliver
        # Server B joins preferring that partition.
        box_b: list[int] = [0]
        m_b = ServerMembership(
            ClusterMetadata(stores(), "/waltz/r"), "127.0.0.1", 7003, rec.deliver_for(box_b), preferred=(moved,)
        )
        box_b[0] = m_b.server_id
        m_b.start()
        members.append(m_b)
        wait(lambda: moved in m_b.serving)
        time.sleep(6)  # A's deliver returns
        assert not rec.overlaps, rec.overlaps
    finally:
        for m in reversed(members):
            m.close()


def test_the_leader_logs_each_partition_it_takes_from_a_live_server(stores, caplog) -> None:  # type: ignore[no-untyped-def]
    """`waltz torture` counts partition moves between live servers by these lines (LIVE_MOVE): a
    server that joins gets its share from the live one that held everything."""
    caplog.set_level(logging.INFO, logger="waltz.cluster.manager")
    meta = ClusterMetadata(stores(), "/waltz/r")
    meta.create("r", 2, 1)
    rec = Recorder()
    members: list[ServerMembership] = []
    try:
        boxes: list[list[int]] = [[0], [0]]
        for i, box in enumerate(boxes):
            m = ServerMembership(ClusterMetadata(stores(), "/waltz/r"), "127.0.0.1", 7001 + i, rec.deliver_for(box))
            box[0] = m.server_id
            m.start()
            members.append(m)
            wait(lambda m=m: len(m.serving) == 2 // len(members))
        first, joined = members
        wait(lambda: len(first.serving) == 1)
        moved = next(iter(joined.serving))
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(LIVE_MOVE)]
        assert lines == [f"{LIVE_MOVE} {moved} from server {first.server_id} (generation 1)"]
        assert not rec.overlaps, rec.overlaps
    finally:
        for m in reversed(members):
            m.close()


def test_a_session_event_dispatched_during_close_restarts_serving(stores) -> None:  # type: ignore[no-untyped-def]
    """`_notify` runs a copy of the listener list: a CONNECTED event copied before close() removed
    the listener runs `_on_state` after close() delivered {}. Nothing checks `_stop`, so the
    closed member serves its partitions again (with its registration gone, the leader hands them
    to others)."""
    from waltz.cluster.store import SessionState

    store = stores()
    meta = ClusterMetadata(store, "/waltz/c")
    meta.create("c", 2, 1)
    delivered: list[dict[int, int]] = []
    m = ServerMembership(meta, "127.0.0.1", 7001, delivered.append)
    m.start()
    wait(lambda: set(m.serving) == {0, 1})
    m.close()
    assert delivered[-1] == {}
    m._on_state(SessionState.CONNECTED)  # the event _notify had already picked up ...
    m._reread_assignment()  # ... and the store work it schedules
    assert delivered[-1] == {}, f"a closed member was told to serve {delivered[-1]}"
