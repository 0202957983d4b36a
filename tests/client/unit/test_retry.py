"""`waltz.client.retry.Backoff`: full jitter within its bounds, seedable, and two clients that
fail at the same moment do not retry at the same moments (issue 36, item 14)."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest
from waltz.client import AsyncWaltzClient, ClientConfig, WaltzClientCallbacks
from waltz.client.retry import Backoff


def test_every_delay_is_within_zero_and_the_capped_doubling() -> None:
    b = Backoff(0.05, 2.0, seed=1)
    ceilings = []
    for _ in range(2000):
        ceiling = b.ceiling()
        ceilings.append(ceiling)
        assert 0.0 <= b.next_delay() <= ceiling
    assert ceilings[:7] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    assert set(ceilings[6:]) == {2.0}  # capped, and the exponent's growth does not overflow
    b.reset()
    assert b.ceiling() == 0.05 and b.retries == 2000


def test_delays_are_uniform_over_the_whole_window() -> None:
    """Full jitter: not "cap/2 plus a little", but the whole [0, cap] (mean cap/2, spread cap/√12)."""
    b = Backoff(1.0, 1.0, seed=7)
    delays = [b.next_delay() for _ in range(20_000)]
    assert statistics.fmean(delays) == pytest.approx(0.5, abs=0.01)
    assert statistics.pstdev(delays) == pytest.approx(1 / 12**0.5, abs=0.01)
    deciles = [sum(1 for d in delays if i / 10 <= d < (i + 1) / 10) for i in range(10)]
    assert min(deciles) > 1800 and max(deciles) < 2200, deciles


def test_seeded_backoffs_repeat_and_unseeded_ones_differ() -> None:
    assert [Backoff(0.05, 2.0, seed=3).next_delay() for _ in range(1)] == [Backoff(0.05, 2.0, seed=3).next_delay()]
    one, two = Backoff(0.05, 2.0, seed=3), Backoff(0.05, 2.0, seed=3)
    assert [one.next_delay() for _ in range(20)] == [two.next_delay() for _ in range(20)]
    with pytest.raises(ValueError, match="base <= cap"):
        Backoff(3.0, 2.0)


def test_two_clients_do_not_retry_in_lockstep() -> None:
    """Two clients that lose their server at the same instant: their remount attempts spread out
    instead of arriving together (the lockstep the issue saw after a failover)."""
    config = ClientConfig(metadata="embedded:/nonexistent/metadata.db")
    a, b = AsyncWaltzClient(WaltzClientCallbacks(), config), AsyncWaltzClient(WaltzClientCallbacks(), config)
    times_a, times_b = [], []
    for client, times in ((a, times_a), (b, times_b)):
        backoff, t = client.backoff(), 0.0
        for _ in range(8):
            t += backoff.next_delay()
            times.append(t)
    # Each retry of one lands well apart from the other's same retry (the windows reach 2 s).
    gaps = [abs(x - y) for x, y in zip(times_a, times_b, strict=True)]
    assert sum(g > 0.01 for g in gaps) >= 6, gaps
    # ... and with the same seed they would have been the same: the difference is the jitter's.
    seeded = ClientConfig(metadata="embedded:/nonexistent/metadata.db", retry_seed=5)
    c, d = AsyncWaltzClient(WaltzClientCallbacks(), seeded), AsyncWaltzClient(WaltzClientCallbacks(), seeded)
    bc, bd = c.backoff(), d.backoff()
    assert [bc.next_delay() for _ in range(8)] == [bd.next_delay() for _ in range(8)]


def test_sleep_waits_the_delay_bounded_by_a_limit() -> None:
    b = Backoff(10.0, 10.0, rng=random.Random(0))
    waited = asyncio.run(b.sleep(limit=0.01))
    assert 0.0 <= waited <= 0.01
