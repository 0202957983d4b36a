"""The event loop a Waltz process runs its own asyncio work on: uvloop unless the standard
library's is asked for. The server (`[server] event_loop`) and `WaltzClient` (`event_loop`) take
their loop from here; an `AsyncWaltzClient` runs on whatever loop its application runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from waltz.errors import ConfigError

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
        raise ConfigError(f'{setting} is "uvloop" but it cannot be imported ({e}): install uvloop, or set it to "asyncio"') from None
    return uvloop.new_event_loop
