"""The server daemon's PartitionHost (daemon.py), in process over fake store sessions and
partitions: reassignments, closes and replica changes racing a session that opens or closes.
Regressions from an adversarial review; each failed on the code as first written."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from waltz import errors
from waltz.config import PartitionSection
from waltz.server import daemon
from waltz.server.connection import Partitions


class _FakeSession:
    def __init__(self) -> None:
        self.failed: errors.StoreSessionError | None = None
        self.closed = False
        self.assigned_replicas = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # as read when it opened


class _FakePartition:
    instances: list[_FakePartition] = []

    def __init__(self, pid: int, gen: int, session: _FakeSession, **_: Any) -> None:
        self.partition_id, self.generation, self.session = pid, gen, session
        self.high_water_mark = -1
        self.close_started = self.close_finished = False
        self.new_sessions_asked: list[str] = []
        _FakePartition.instances.append(self)

    def request_new_session(self, why: str) -> None:
        self.new_sessions_asked.append(why)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.close_started = True
        await asyncio.sleep(0.3)  # closing takes a moment (cancelling the append task, storage connections)
        self.session.closed = True
        self.close_finished = True


@pytest.fixture
def fake_host(monkeypatch: pytest.MonkeyPatch) -> Any:
    _FakePartition.instances = []
    gate: dict[str, asyncio.Event | None] = {"open": None}

    async def fake_open(metadata: Any, pid: int, gen: int, **_: Any) -> _FakeSession:
        if gate["open"] is not None:
            await gate["open"].wait()
        return _FakeSession()

    monkeypatch.setattr(daemon.StoreSession, "open", staticmethod(fake_open))
    monkeypatch.setattr(daemon, "ServerPartition", _FakePartition)
    return gate


async def _until(cond: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_a_reassignment_while_a_failed_session_closes_leaves_it_half_closed(fake_host) -> None:
    """The store session ends (fenced by the server the partition moved to); the runner takes the
    partition out and closes it; the membership then delivers the new assignment, which cancels
    the runner in the middle of that close: the partition and its store session are never closed."""

    async def go() -> None:
        parts = Partitions()
        host = daemon.PartitionHost(asyncio.get_running_loop(), None, parts, PartitionSection())  # type: ignore[arg-type]
        await host._apply({0: 1})
        await _until(lambda: 0 in parts.by_id)
        served = parts.by_id[0]
        served.session.failed = errors.StoreSessionError("fenced")
        await _until(lambda: served.close_started)
        await host._apply({})  # partition 0 moved away
        await host.close()
        await asyncio.sleep(0.5)
        assert served.close_finished and served.session.closed, "partition left half closed"

    asyncio.run(go())


def test_close_returns_before_cancelled_runners_finish(fake_host) -> None:
    """PartitionHost.close() cancels the runners but gathers `self._runners` after `_apply({})`
    emptied it: a runner still opening (or closing) is not waited for, nor the close it schedules."""

    async def go() -> None:
        fake_host["open"] = asyncio.Event()
        parts = Partitions()
        host = daemon.PartitionHost(asyncio.get_running_loop(), None, parts, PartitionSection())  # type: ignore[arg-type]
        await host._apply({0: 1})
        await asyncio.sleep(0.05)
        runner = host._runners[0][1]
        await host.close()
        assert runner.done(), "close() returned while the runner was still running"

    asyncio.run(go())


class _Node:
    def __init__(self, address: str, partitions: set[int]) -> None:
        self.address, self.partitions = address, partitions


class _Assignment:
    """The metadata's replica assignment, as `PartitionHost._check_replicas` reads it."""

    def __init__(self, *addresses: str) -> None:
        self.nodes = [_Node(a, {0}) for a in addresses]

    def storage_nodes(self) -> list[_Node]:
        return self.nodes


def test_a_replica_change_while_the_session_opens_moves_it_to_a_new_session(fake_host) -> None:
    """The assignment changes while the partition's first store session is opening (it read the
    old replicas): the watch's check finds no registered partition and does nothing. Once the
    partition is served, its runner checks again, and the session is replaced."""

    async def go() -> None:
        fake_host["open"] = asyncio.Event()
        parts = Partitions()
        assignment = _Assignment("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
        host = daemon.PartitionHost(asyncio.get_running_loop(), assignment, parts, PartitionSection())  # type: ignore[arg-type]
        await host._apply({0: 1})
        await asyncio.sleep(0.05)  # the runner waits in the session's open
        assignment.nodes[2] = _Node("127.0.0.1:4", {0})
        await host._check_replicas()  # the watch fires: nothing is registered yet
        fake_host["open"].set()
        await _until(lambda: 0 in parts.by_id)
        served = parts.by_id[0]
        await _until(lambda: bool(served.new_sessions_asked))
        assert served.new_sessions_asked == ["replicas now 127.0.0.1:1, 127.0.0.1:2, 127.0.0.1:4"]
        await host.close()

    asyncio.run(go())


def test_an_unchanged_assignment_keeps_the_session(fake_host) -> None:
    async def go() -> None:
        parts = Partitions()
        host = daemon.PartitionHost(
            asyncio.get_running_loop(),
            _Assignment("127.0.0.1:3", "127.0.0.1:1", "127.0.0.1:2"),
            parts,
            PartitionSection(),  # type: ignore[arg-type]
        )
        await host._apply({0: 1})
        await _until(lambda: 0 in parts.by_id)
        await asyncio.sleep(0.3)  # the runner's own check has run
        assert parts.by_id[0].new_sessions_asked == []
        await host.close()

    asyncio.run(go())
