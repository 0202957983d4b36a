"""What a `ClientPartition` needs from the client around it, as two narrow protocols, so the
partition layer never depends on the client class (`AsyncWaltzClient` satisfies `ClientHost`,
`waltz.client.submission.TransactionLife` satisfies `TransactionOwner`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from waltz.client.callbacks import WaltzClientCallbacks
from waltz.client.config import ClientConfig
from waltz.client.network import Link
from waltz.client.retry import Backoff
from waltz.client.stats import ClientStats
from waltz.client.transaction import Transaction
from waltz.client.work import Work

T = TypeVar("T")


class ClientHost(Protocol):
    """The client's services: configuration, the application's code, tasks, links, the cluster."""

    config: ClientConfig
    callbacks: WaltzClientCallbacks
    loop: asyncio.AbstractEventLoop
    stats: ClientStats
    client_token: bytes
    """Sent with every Mount: servers refuse a Mount of a client id mounted under another token."""

    async def call(self, fn: Callable[..., T | Awaitable[T]], *args: Any) -> T:
        """Runs application code (on the loop or in a callback thread)."""
        ...

    async def apply(self, txns: list[Transaction]) -> tuple[int, BaseException | None]:
        """Applies committed transactions in order: how many were applied, and the failure that
        stopped the rest."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
        """A task the client cancels when it closes (None: closed, the coroutine never runs)."""
        ...

    async def locate(self, partition: int) -> tuple[str, int, int]:
        """(endpoint, server id, generation) of the partition's server."""
        ...

    async def link(self, endpoint: str, kind: str) -> Link: ...

    def backoff(self) -> Backoff:
        """A new retry delay (full jitter between `reconnect_backoff` and `reconnect_backoff_max`)."""
        ...

    async def next_client_id(self) -> int:
        """A new client id from the cluster's counter."""
        ...

    async def transaction_data(self, partition: int, transaction_id: int) -> bytes: ...

    async def transaction_data_range(self, partition: int, first: int, max_count: int, max_bytes: int) -> list[bytes]:
        """The data of transactions `first`, `first + 1`, ... in one round trip (at least one)."""
        ...


class TransactionOwner(Protocol):
    """Who runs a submitted transaction's life; the partition reports what the server said."""

    def retry(self, work: Work) -> None:
        """The attempt failed without committing: execute the context again."""
        ...

    def committed(self, work: Work) -> None:
        """The feed delivered the attempt's transaction (`work.transaction_id`)."""
        ...

    def lost_lock_race(self, work: Work, transaction_id: int) -> None:
        """The attempt lost a lock to `transaction_id`."""
        ...

    async def applied(self, works: list[Work]) -> None:
        """The application is applying these contexts' transactions: their `on_application`
        hooks run before the transactions count as applied."""
        ...
