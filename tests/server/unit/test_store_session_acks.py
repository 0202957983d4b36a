"""How the store session counts acknowledgements: pure logic, so the storage clients here are
fakes that record what was sent and answer when the test says."""

from __future__ import annotations

import asyncio
from typing import Any

from waltz import errors
from waltz.server.store_session import StoreSession, _Replica
from waltz.storage import RecordBatch, ReqId


class FakeClient:
    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []  # (first id, the session's answer callback)

    def send_append(self, partition: int, session: int, first: int, batch: Any, answered: Any) -> None:
        self.sent.append((first, answered))

    def answer(self, first: int, exc: BaseException | None = None) -> None:
        """Answers the latest send of the batch starting at `first`."""
        answered = next(a for f, a in reversed(self.sent) if f == first)
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if exc is None:
            f.set_result(None)
        else:
            f.set_exception(exc)
        answered(f)


def session(*names: str) -> tuple[StoreSession, dict[str, _Replica]]:
    replicas = {n: _Replica(n, client=FakeClient(), in_write_path=True, served=True) for n in names}
    # Leaving starts the replica's catch-up task; here the test plays that part itself.
    for r in replicas.values():
        r.catching_up = True
    s = StoreSession(0, 7, list(replicas.values()), max_lag=256, metadata=None, connect=None, offload=None)  # type: ignore[arg-type]
    return s, replicas


def batch(n: int) -> RecordBatch:
    return RecordBatch([(ReqId(1, 1, 0, i), 0, b"x") for i in range(n)])


def client(r: _Replica) -> FakeClient:
    assert isinstance(r.client, FakeClient)
    return r.client


def test_a_replica_that_rejoins_holding_in_flight_batches_counts_for_them() -> None:
    """A replica whose acknowledgement was lost (a timeout, a dropped connection) leaves the
    write path holding the batch durably. When it rejoins past the batch, it must count for it:
    two such losses on one batch would otherwise leave it short of a quorum for good, and every
    later batch waits behind it."""

    async def go() -> None:
        s, r = session("a", "b", "c")
        f1, f2 = s.append(batch(3)), s.append(batch(2))  # ids 0-2 and 3-4
        client(r["b"]).answer(0)
        client(r["b"]).answer(3)
        client(r["a"]).answer(0, errors.StorageTimeoutError("no answer in time"))
        assert r["a"].in_write_path is False
        client(r["a"]).answer(3, errors.StorageTimeoutError("no answer in time"))
        f3 = s.append(batch(1))  # id 5: sent to b and c only
        # a caught up: its log ends at 4, both earlier batches durable on it.
        s._join(r["a"], 5)
        assert r["a"].in_write_path
        assert [first for first, _ in client(r["a"]).sent] == [0, 3, 5], "a is sent the batch it lacks"
        assert f1.done() and f2.done() and not f3.done()
        assert (f1.result(), f2.result(), s.high_water_mark) == ((0, 2), (3, 4), 4)
        # c's acknowledgements are lost too: it leaves; a and b carry the session on.
        client(r["c"]).answer(0, errors.StorageConnectionError("reset"))
        client(r["a"]).answer(5)
        client(r["b"]).answer(5)
        assert f3.result() == (5, 5) and s.failed is None

    asyncio.run(go())


def test_a_replica_that_rejoins_inside_the_in_flight_batches_counts_only_for_those_it_holds() -> None:
    async def go() -> None:
        s, r = session("a", "b", "c")
        f1, f2 = s.append(batch(3)), s.append(batch(2))
        client(r["a"]).answer(0, errors.StorageTimeoutError("no answer in time"))
        client(r["a"]).answer(3, errors.StorageConnectionError("reset"))
        client(r["b"]).answer(3)
        s._join(r["a"], 3)  # it holds the first batch only
        assert [first for first, _ in client(r["a"]).sent] == [0, 3, 3], "the second batch is sent again"
        assert not f1.done(), "one acknowledgement (a's, recounted) is not a quorum of three"
        client(r["b"]).answer(0)
        assert f1.result() == (0, 2) and not f2.done(), "the second batch has b's acknowledgement only"
        client(r["a"]).answer(3)
        assert f2.result() == (3, 4)

    asyncio.run(go())
