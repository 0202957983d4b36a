"""The event loop a Waltz process runs its own asyncio work on: uvloop unless the standard
library's is asked for. The server (`[server] event_loop`) and `WaltzClient` (`event_loop`) take
their loop from here; an `AsyncWaltzClient` runs on whatever loop its application runs. Also
`tell_listener`: how the server's hot paths hear of a completed future in the same turn."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from waltz.errors import ConfigError

F = TypeVar("F", bound="asyncio.Future[Any]")

EVENT_LOOPS = ("uvloop", "asyncio")


def loop_factory(name: str, setting: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A new-loop function for `name` (one of EVENT_LOOPS). uvloop is a dependency wherever it
    builds; a missing one is a clear error naming `setting`, not a silent fall back to the
    slower loop."""
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as e:
        raise ConfigError(
            f'{setting} is "uvloop" but it cannot be imported ({e}): install uvloop, or set it to "asyncio"'
        ) from None
    return uvloop.new_event_loop


def tell_listener(listener: Callable[[F], None] | None, future: F, what: str) -> None:
    """Calls a listener of a completed future at once, where a done callback would wait for the
    next loop turn (the server's commit path runs in these). Like the loop with a failing done
    callback, an exception goes to the loop's exception handler: the caller (a connection's
    read loop, the commit of a batch) must go on."""
    if listener is None:
        return
    try:
        listener(future)
    except Exception as e:
        future.get_loop().call_exception_handler({"message": f"{what} failed", "exception": e, "future": future})
