"""A Prometheus collector of one client's state (optional: the application registers it).

    from prometheus_client import REGISTRY
    REGISTRY.register(ClientCollector(client))          # a WaltzClient or an AsyncWaltzClient

Each scrape reads the client as it is then (nothing is kept between scrapes):

- `waltz_client_pending{partition}`: contexts submitted and not yet completed;
- `waltz_client_applied_high_water_mark{partition}`: the newest transaction the application applied;
- `waltz_client_feed_lag{partition}`: the partition's high-water mark on its server minus the
  applied one (how far the application is behind the cluster); asked of the server at scrape
  time, within `lag_timeout`;
- `waltz_client_commits_total`, `waltz_client_retries_total` (executions again after a failed
  attempt), `waltz_client_lock_failures_total`.

When a server does not answer in time, and for a scrape from the client's own event loop (an
`AsyncWaltzClient` application serving metrics on that loop, which cannot wait for answers),
the lag is measured against the newest transaction the feed delivered instead: a lower bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from waltz.client.aio import AsyncWaltzClient
from waltz.client.sync import WaltzClient


class ClientCollector(Collector):
    def __init__(
        self, client: WaltzClient | AsyncWaltzClient, *, lag_timeout: float = 2.0, prefix: str = "waltz_client"
    ) -> None:
        self.client, self.lag_timeout, self.prefix = client, lag_timeout, prefix

    def _core(self) -> AsyncWaltzClient:
        return self.client._core if isinstance(self.client, WaltzClient) else self.client

    def _cluster_marks(self, core: AsyncWaltzClient, partitions: list[int]) -> dict[int, int]:
        try:
            on_loop = asyncio.get_running_loop() is core.loop
        except RuntimeError:
            on_loop = False
        if on_loop or core.loop is None or core.loop.is_closed():
            return {}

        async def ask() -> list[int | BaseException]:
            return await asyncio.gather(*(core.high_water_mark(p) for p in partitions), return_exceptions=True)

        try:
            answers = asyncio.run_coroutine_threadsafe(ask(), core.loop).result(self.lag_timeout)
        except (concurrent.futures.TimeoutError, RuntimeError, concurrent.futures.CancelledError):
            return {}
        return {p: a for p, a in zip(partitions, answers, strict=True) if isinstance(a, int)}

    def collect(self) -> Iterator[Metric]:
        core = self._core()
        rows = core.status() if core._parts else []
        pending = GaugeMetricFamily(
            f"{self.prefix}_pending", "Contexts submitted and not yet completed.", labels=["partition"]
        )
        applied = GaugeMetricFamily(
            f"{self.prefix}_applied_high_water_mark",
            "The newest transaction the application applied.",
            labels=["partition"],
        )
        lag = GaugeMetricFamily(
            f"{self.prefix}_feed_lag",
            "The partition's high-water mark on its server minus the applied one.",
            labels=["partition"],
        )
        marks = self._cluster_marks(core, [r["partition"] for r in rows]) if rows and not core._closed else {}
        for r in rows:
            p = str(r["partition"])
            pending.add_metric([p], r["in_flight"])
            applied.add_metric([p], r["applied"])
            top = marks.get(r["partition"], r["received"])
            if top >= -1 and r["applied"] >= -1:
                lag.add_metric([p], max(0, top - r["applied"]))
        stats = core.stats
        yield pending
        yield applied
        yield lag
        yield CounterMetricFamily(
            f"{self.prefix}_commits", "Contexts whose transaction committed.", value=stats.commits
        )
        yield CounterMetricFamily(
            f"{self.prefix}_retries", "Executions again after a failed attempt.", value=stats.retries
        )
        yield CounterMetricFamily(
            f"{self.prefix}_lock_failures", "Attempts that lost a lock race.", value=stats.lock_failures
        )
        yield CounterMetricFamily(
            f"{self.prefix}_data_requests", "Round trips for transactions' data.", value=stats.data_requests
        )

    def describe(self) -> Iterator[Metric]:
        """Registering must not scrape the client (it may not be started yet)."""
        return iter(())


__all__ = ["ClientCollector"]
