"""A committed transaction as the feed delivers it: id, header and ReqId, its data fetched on
first use over the RPC connection and kept; in the apply path, with the data of the batch's later
transactions (`DataPrefetch`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from waltz import errors
from waltz.client.serializers import BYTES, Serializer
from waltz.client_protocol import MAX_DATA_RANGE_COUNT, ReqIdTuple


class _DataSource(Protocol):
    @property
    def config(self) -> Any: ...

    async def transaction_data(self, partition: int, transaction_id: int) -> bytes: ...

    async def transaction_data_range(
        self, partition: int, first: int, max_count: int, max_bytes: int
    ) -> list[bytes]: ...


class DataPrefetch:
    """The data of one applied batch (transactions up to `last`): the first `data()` that misses
    fetches from its transaction to `last` in one range request of at most
    `ClientConfig.data_prefetch_bytes`, and later ones take theirs from it. Applying 1,000
    transactions that each read their data then costs a round trip per 4 MiB instead of 1,000
    (docs/client.md). Kept only while the batch's transactions are referenced; data handed out
    is dropped from here (the Transaction keeps it)."""

    def __init__(self, source: _DataSource, last: int) -> None:
        self._source, self._last = source, last
        self._got: dict[int, bytes] = {}
        self._lock: asyncio.Lock | None = None

    async def fetch(self, partition: int, transaction_id: int) -> bytes:
        max_bytes = self._source.config.data_prefetch_bytes
        if max_bytes == 0 or transaction_id >= self._last:
            return await self._source.transaction_data(partition, transaction_id)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent data_async() calls share one range, not one each
            data = self._got.pop(transaction_id, None)
            if data is not None:
                return data
            count = min(self._last - transaction_id + 1, MAX_DATA_RANGE_COUNT)
            got = await self._source.transaction_data_range(partition, transaction_id, count, max_bytes)
            for i, d in enumerate(got[1:], transaction_id + 1):
                self._got[i] = d
            return got[0]


class Transaction:
    __slots__ = ("partition", "transaction_id", "header", "req_id", "_fetch", "_loop", "_data")

    def __init__(
        self,
        partition: int,
        transaction_id: int,
        header: int,
        req_id: ReqIdTuple,
        fetch: Callable[[int, int], Coroutine[Any, Any, bytes]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.partition = partition
        self.transaction_id = transaction_id
        self.header = header
        self.req_id = req_id
        """(client id, generation, partition, sequence) of the append that wrote it."""
        self._fetch, self._loop = fetch, loop
        self._data: bytes | None = None

    def __repr__(self) -> str:
        return (
            f"Transaction(partition={self.partition}, id={self.transaction_id}, header={self.header}, "
            f"req_id={self.req_id})"
        )

    def data(self, serializer: Serializer[Any] = BYTES) -> Any:
        """The data, deserialized; blocks the calling thread while it is fetched. In `async`
        code use `await transaction.data_async()`."""
        if self._data is None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                raise RuntimeError(
                    "Transaction.data() would block the client's event loop: use `await transaction.data_async()`"
                )
            fetch = self._fetch(self.partition, self.transaction_id)
            try:
                future = asyncio.run_coroutine_threadsafe(fetch, self._loop)
            except RuntimeError:
                fetch.close()  # never scheduled: not left to be reported as never awaited
                if not self._loop.is_closed():
                    raise
                raise errors.ClientClosedError(
                    "the client is closed: the transaction's data cannot be fetched"
                ) from None
            self._data = self._wait(future)
        return serializer.deserialize(self._data)

    def _wait(self, future: concurrent.futures.Future[bytes]) -> bytes:
        # A client closed meanwhile stops its loop without finishing the fetch: the caller (an
        # apply callback thread, which interpreter exit joins) must not wait for it forever.
        # The wait's own timeout is told apart from the fetch's outcome by `wait`, not by catching
        # TimeoutError: the fetch fails with TimeoutError subclasses (RequestTimeoutError), and
        # taking one for "not done yet" re-raised it in a busy loop whose traceback grew without
        # bound, until the kernel killed the process (found by `waltz torture`).
        while True:
            done, _ = concurrent.futures.wait((future,), timeout=0.5)
            if done:
                try:
                    return future.result()
                except concurrent.futures.CancelledError:
                    raise errors.ClientClosedError("the client closed before the transaction's data arrived") from None
            if self._loop.is_closed() or not self._loop.is_running():
                future.cancel()
                raise errors.ClientClosedError("the client closed before the transaction's data arrived")

    async def data_async(self, serializer: Serializer[Any] = BYTES) -> Any:
        if self._data is None:
            self._data = await self._fetch(self.partition, self.transaction_id)
        return serializer.deserialize(self._data)
