"""The server's `/health` and `/metrics`: read from the live partitions at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from waltz.cluster.store import MetadataStore
from waltz.http import buckets
from waltz.limits import Refusals
from waltz.server.connection import Partitions
from waltz.server.partition import COMMIT_SECONDS_BOUNDS

REFUSAL_REASONS = (
    "max_connections",
    "evicted",
    "handshake_timeout",
    "mount_timeout",
    "frame_too_large",
    "too_many_locks",
    "role_secret",
    "client_ids",
)


class ClientPortStats(Protocol):
    @property
    def open(self) -> int: ...

    refusals: Refusals


class ServerCollector(Collector):
    def __init__(self, partitions: Partitions, port: ClientPortStats | None = None) -> None:
        self.partitions = partitions
        self.port = port

    def collect(self) -> Iterator[Any]:
        if self.port is not None:
            yield GaugeMetricFamily("waltz_server_client_connections", "Client connections open", value=self.port.open)
            refused = CounterMetricFamily(
                "waltz_server_limit_refusals",
                "Client connections closed and appends refused by a limit, by reason",
                labels=["reason"],
            )
            counts = self.port.refusals.snapshot()
            for reason in REFUSAL_REASONS:
                refused.add_metric([reason], counts.get(reason, 0))
            yield refused
        served = list(self.partitions.by_id.items())  # a snapshot: the event loop changes the dict
        counters = {
            k: CounterMetricFamily(f"waltz_server_{k}", h, labels=["partition"])
            for k, h in (
                ("appended", "Transactions handed to the store session"),
                ("committed", "Transactions committed by a majority of replicas"),
                ("lock_failures", "Appends refused by the lock table"),
                ("ignored", "Appends ignored for a stale generation"),
                (
                    "lock_fallback_failures",
                    "Lock failures decided by the hashed array: an upper bound of false positives",
                ),
            )
        }
        gauges = {
            k: GaugeMetricFamily(f"waltz_server_{k}", h, labels=["partition"])
            for k, h in (
                ("high_water_mark", "Highest committed transaction id"),
                ("queue_depth", "Appends waiting in the partition's queue"),
                ("replicas_in_write_path", "Replicas the store session writes to"),
                ("store_session", "The partition's store session id"),
                ("generation", "The partition's generation on this server"),
            )
        }
        latency = HistogramMetricFamily(
            "waltz_server_commit_seconds", "From handing a batch to the store to its commit", labels=["partition"]
        )
        for pid, p in served:
            label = [str(pid)]
            for k in ("appended", "committed", "lock_failures", "ignored"):
                counters[k].add_metric(label, p.stats[k])
            counters["lock_fallback_failures"].add_metric(label, p.locks.fallback_failures)
            gauges["high_water_mark"].add_metric(label, p.high_water_mark)
            gauges["queue_depth"].add_metric(label, p.queue_depth)
            gauges["replicas_in_write_path"].add_metric(label, len(p.session.replicas_in_write_path))
            gauges["store_session"].add_metric(label, p.session.session_id)
            gauges["generation"].add_metric(label, p.generation)
            latency.add_metric(label, *buckets(p.commit_seconds, COMMIT_SECONDS_BOUNDS, 1.0))
        yield from counters.values()
        yield from gauges.values()
        yield latency


def health(
    store: MetadataStore, partitions: Partitions, desired: Callable[[], dict[int, int]]
) -> tuple[bool, dict[str, Any]]:
    """Healthy: the metadata session is alive and every assigned partition is served with a
    live store session (an opening one is reported, and counts as failing)."""
    checks: dict[str, Any] = {
        "metadata_session": True if store.is_connected else f"not connected ({store.description})"
    }
    state: dict[str, Any] = {}
    for pid, gen in sorted(desired().items()):
        p = partitions.by_id.get(pid)
        if p is None or p.generation != gen:
            state[str(pid)] = f"opening (generation {gen})"
        elif p.session.failed is not None:
            state[str(pid)] = f"store session ended: {p.session.failed}"
        else:
            state[str(pid)] = True
    checks["partitions"] = state
    ok = checks["metadata_session"] is True and all(v is True for v in state.values())
    return ok, checks
