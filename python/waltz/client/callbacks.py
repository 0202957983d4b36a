"""What the client asks of the application."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeGuard

from waltz.client.transaction import Transaction

log = logging.getLogger("waltz.client")


@functools.lru_cache(maxsize=1024)
def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn)


def is_async(fn: Callable[..., Any]) -> TypeGuard[Callable[..., Coroutine[Any, Any, Any]]]:
    """`inspect.iscoroutinefunction`, remembered per function (a bound method by its function):
    the client asks it of the application's code several times a transaction, and walking the
    method and its flags was 12 % of `AsyncWaltzClient`'s CPU at one transaction in flight."""
    try:
        return _is_async(getattr(fn, "__func__", fn))
    except TypeError:  # an unhashable callable object
        return inspect.iscoroutinefunction(fn)


class WaltzClientCallbacks:
    """Subclass it. Methods may be `async def` (run on the client's event loop) or plain (run
    in the client's callback threads)."""

    def get_client_high_water_mark(self, partition: int) -> int | Awaitable[int]:
        """The id of the newest transaction of `partition` applied to the application's state
        (-1: none). The feed starts after it, and locks are checked against it."""
        raise NotImplementedError

    def apply_transaction(self, transaction: Transaction) -> None | Awaitable[None]:
        """Applies one committed transaction and moves the application's high-water mark to its
        id, atomically. Called in id order within a partition, exactly once per transaction per
        client (`waltz.client.sql` makes it exactly once across instances sharing a database)."""
        raise NotImplementedError

    def uncaught_exception(self, partition: int, transaction_id: int, exc: BaseException) -> None | Awaitable[None]:
        """`apply_transaction` raised: the client retries the same transaction after a pause
        (skipping it would break the order every later transaction relies on)."""
        log.error("partition %d: applying transaction %d failed (retrying): %r", partition, transaction_id, exc)
        return None
