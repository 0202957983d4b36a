"""`Backoff`: the one retry delay of the client's loops (mounting a partition again after a
failover or a lost connection, requests to a partition's server, taking a new client id,
applying a transaction the application failed to apply, the log reader's requests to servers
and replicas), with full jitter.

Full jitter (AWS, "Exponential Backoff And Jitter"): the n-th wait is uniform in
[0, min(cap, base * 2**n)]. Without it, every client of a server that fails over retries at the
same instants (they all saw the failure at once) and the new server takes their mounts in waves;
with it, the retries spread over the whole window and the expected wait is half the capped one.

Each `Backoff` draws from its own `random.Random`: seeded for a test that needs the same delays
twice, from the OS otherwise (two clients never share a sequence)."""

from __future__ import annotations

import asyncio
import random

_MAX_EXPONENT = 62
"""`base * 2**n` is capped long before; the exponent stops growing here so it stays an int."""


class Backoff:
    def __init__(self, base: float, cap: float, *, rng: random.Random | None = None, seed: int | None = None) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"backoff needs 0 < base <= cap, not base {base} and cap {cap}")
        self.base, self.cap = base, cap
        self.rng = rng if rng is not None else random.Random(seed)
        self.attempt = 0
        self.retries = 0
        """Waits taken over this backoff's life (not reset by `reset`): what metrics count."""

    def reset(self) -> None:
        """The operation succeeded: the next failure starts again from `base`."""
        self.attempt = 0

    def ceiling(self) -> float:
        """The upper bound of the next delay: min(cap, base * 2**attempt)."""
        return min(self.cap, self.base * float(2 ** min(self.attempt, _MAX_EXPONENT)))

    def next_delay(self) -> float:
        """The next wait, uniform in [0, ceiling()]; moves on to the next attempt."""
        delay = self.rng.uniform(0.0, self.ceiling())
        self.attempt += 1
        self.retries += 1
        return delay

    async def sleep(self, limit: float | None = None) -> float:
        """Waits the next delay (at most `limit` seconds when given); returns the wait."""
        delay = self.next_delay()
        if limit is not None:
            delay = max(0.0, min(delay, limit))
        await asyncio.sleep(delay)
        return delay
