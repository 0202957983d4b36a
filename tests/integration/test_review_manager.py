"""Regression tests from an adversarial review of ServerMembership races (in-process members, one
store session each); each failed on the code as first written."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from waltz.cluster import open_store
from waltz.cluster.manager import ServerMembership
from waltz.cluster.metadata import ClusterMetadata


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
        m_a = ServerMembership(ClusterMetadata(stores(), "/waltz/r"), "127.0.0.1", 7002, rec.deliver_for(box_a, slow_add=5.0))
        box_a[0] = m_a.server_id
        m_a.start()
        members.append(m_a)
        wait(lambda: any(x.server == m_a.server_id for x in meta.assignment()[0].values()))
        moved = next(p for p, x in meta.assignment()[0].items() if x.server == m_a.server_id)
        time.sleep(0.5)  # A read the assignment and is inside deliver
        # Server B joins preferring that partition.
        box_b: list[int] = [0]
        m_b = ServerMembership(ClusterMetadata(stores(), "/waltz/r"), "127.0.0.1", 7003, rec.deliver_for(box_b), preferred=(moved,))
        box_b[0] = m_b.server_id
        m_b.start()
        members.append(m_b)
        wait(lambda: moved in m_b.serving)
        time.sleep(6)  # A's deliver returns
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
