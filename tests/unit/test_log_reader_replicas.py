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
    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last

    async def records(self, partition: int, txid: int, count: int) -> list[Any]:
        if txid < self.first:
            raise errors.BelowLogStartError(f"transaction {txid} is below the partition's first transaction id {self.first}")
        return [types.SimpleNamespace(txid=t) for t in range(txid, min(self.last, txid + count - 1) + 1)]

    async def status(self) -> list[dict[str, int]]:
        return [{"partition": 0, "first_transaction_id": self.first}]


class _Reader(LogReader):
    def __init__(self, replicas: dict[str, _Replica]) -> None:  # no metadata store: the replicas are given
        self.replicas, self.timeout = replicas, 2.0
        self._info = types.SimpleNamespace(partitions=1)  # type: ignore[assignment]

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

    with pytest.raises(errors.BelowLogStartError, match="partition 0: transaction 100 is held by no replica any more"):
        asyncio.run(go())
