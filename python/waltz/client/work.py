"""`Work`: one submitted context, from submit to completion: the state the partition (sending,
settling) and the transaction's life (executing, retrying, hooks) share."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable

from waltz.client.context import TransactionContext


@dataclasses.dataclass(eq=False)
class Work:
    """One submitted context, from submit to completion."""

    pid: int
    """The partition the context's `partition_id` chose."""
    context: TransactionContext
    future: asyncio.Future[bool] | concurrent.futures.Future[bool]
    """`AsyncWaltzClient`'s callers await an asyncio future; `WaltzClient`'s block on a
    concurrent one, resolved right here on the loop (no hop back through the loop to copy it)."""
    deadline: float
    release: Callable[[], None]
    """Frees the slot the context took at admission (`max_pending`)."""
    executions: int = 0
    transaction_id: int = -1
    """Its committed transaction, once the feed delivered it."""
    finished: bool = False
    completing: asyncio.Task[None] | None = None
    """`on_completion` running: `on_application` comes after it."""
