"""`LogReader`'s choice among a partition's readable replicas when retention left each with its
own first id (it drops whole segments, so replicas rarely agree): pure selection logic, the
replicas stood in for by objects that answer as a node's admin port does."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from waltz import errors
from waltz.client.log_reader import LogReader


class _Replica:
    def __init__(self, first: int, last: int, *, partitions: int = 1, readable: bool = True) -> None:
        self.first, self.last, self.partitions, self.readable = first, last, partitions, readable
        self.statuses = 0

    async def records(self, partition: int, txid: int, count: int) -> list[Any]:
        if txid < self.first:
            e = errors.BelowLogStartError(
                f"transaction {txid} is below the partition's first transaction id {self.first}"
            )
            e.first = self.first  # as StorageAdminClient sets it from the node's answer
            raise e
        return [types.SimpleNamespace(txid=t) for t in range(txid, min(self.last, txid + count - 1) + 1)]

    async def status(self) -> list[dict[str, Any]]:
        self.statuses += 1
        return [
            {"partition": p, "first_transaction_id": self.first, "readable": self.readable, "failure": None}
            for p in range(self.partitions)
        ]


class _Unopenable(_Replica):
    """A node that cannot open its replica: Status says first id -1 and why; reads fail."""

    async def records(self, partition: int, txid: int, count: int) -> list[Any]:
        raise errors.StorageError("cannot open partition 0: bad segment")

    async def status(self) -> list[dict[str, Any]]:
        return [{"partition": 0, "first_transaction_id": -1, "readable": True, "failure": "cannot open: bad segment"}]


class _Unreachable(_Replica):
    async def status(self) -> list[dict[str, Any]]:
        self.statuses += 1
        raise OSError("connect timed out")


class _Reader(LogReader):
    def __init__(self, replicas: dict[str, _Replica], partitions: int = 1, timeout: float = 2.0) -> None:
        self.replicas, self.timeout = replicas, timeout  # no metadata store: the replicas are given
        self._info = types.SimpleNamespace(partitions=partitions)  # type: ignore[assignment]

    def _readable_replicas(self, partition: int) -> list[str]:
        return sorted(self.replicas)

    async def _admin(self, address: str) -> Any:
        return self.replicas[address]

    async def _drop_admin(self, address: str) -> None:
        pass


def test_the_first_id_is_the_lowest_any_replica_holds_and_reads_from_it_are_whole() -> None:
    reader = _Reader({"a:1": _Replica(150, 300), "b:1": _Replica(120, 300)})

    async def go() -> tuple[int, list[int]]:
        first = await reader.first_transaction_id(0)
        return first, [r.txid async for batch in reader.read(0, first, 200, max_count=25) for r in batch]

    first, ids = asyncio.run(go())
    assert first == 120  # before: a:1's 150, which answered first, and 120..149 were skipped
    assert ids == list(range(120, 201))


def test_a_read_below_every_replicas_first_id_fails_at_once() -> None:
    reader = _Reader({"a:1": _Replica(150, 300), "b:1": _Replica(120, 300)})

    async def go() -> list[int]:
        return [r.txid async for batch in reader.read(0, 100, 200) for r in batch]

    with pytest.raises(
        errors.BelowLogStartError,
        match=r"partition 0: transactions 100\.\.119 are held by no replica any more .*the log starts at 120",
    ) as e:
        asyncio.run(go())
    assert e.value.first == 120


def test_a_replica_that_cannot_serve_the_partition_does_not_lower_the_first_id() -> None:
    """A node that cannot open its replica answers first id -1, and one set unreadable holds
    nothing a read could get: taken as holding from 0, they sent every read below the others'
    first ids, which ended in a timeout."""
    reader = _Reader(
        {
            "a:1": _Replica(150, 300),
            "b:1": _Replica(120, 300),
            "c:1": _Unopenable(0, 0),
            "d:1": _Replica(10, 300, readable=False),
        }
    )

    async def go() -> tuple[int, list[int]]:
        first = await reader.first_transaction_id(0)
        return first, [r.txid async for batch in reader.read(0, first, 200) for r in batch]

    first, ids = asyncio.run(go())
    assert first == 120
    assert ids == list(range(120, 201))


def test_first_ids_of_every_partition_ask_each_replica_once() -> None:
    """One Status per replica for all partitions at once: an unreachable node costs one wait for
    the whole plan, where it cost one per partition in turn."""
    replicas = {"a:1": _Replica(40, 300, partitions=8), "z:1": _Unreachable(0, 0, partitions=8)}
    reader = _Reader(replicas, partitions=8)
    assert asyncio.run(reader.first_transaction_ids()) == {p: 40 for p in range(8)}
    assert replicas["a:1"].statuses == replicas["z:1"].statuses == 1


def test_no_replica_answering_is_a_timeout_naming_the_partition() -> None:
    reader = _Reader({"z:1": _Unreachable(0, 0, partitions=2)}, partitions=2, timeout=0.3)
    with pytest.raises(
        errors.RequestTimeoutError, match=r"partition 0: no replica answered within 0.3 s \(z:1: connect timed out\)"
    ):
        asyncio.run(reader.first_transaction_ids())


class _Dropping(_Replica):
    """Fails the next read once `dropped` is set: its connection closed while the consumer paused."""

    def __init__(self, first: int, last: int) -> None:
        super().__init__(first, last)
        self.dropped = False

    async def records(self, partition: int, txid: int, count: int) -> list[Any]:
        if self.dropped:
            self.dropped = False
            raise errors.StorageConnectionError("storage node a:1 closed the connection")
        return await super().records(partition, txid, count)


def test_a_read_paused_by_its_consumer_for_longer_than_the_timeout_still_retries() -> None:
    replica = _Dropping(0, 100)
    reader = _Reader({"a:1": replica}, timeout=0.2)

    async def go() -> list[int]:
        got = []
        async for batch in reader.read(0, 0, 49, max_count=10):
            got.extend(r.txid for r in batch)
            await asyncio.sleep(0.3)  # the consumer is busy past the timeout; the link drops meanwhile
            replica.dropped = True
        return got

    assert asyncio.run(go()) == list(range(50))
