"""The storage node's HTTP endpoint: `/health` (real checks) and `/metrics` (Prometheus)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from waltz import clock, errors
from waltz._native import BATCH_RECORDS_BOUNDS, SYNC_MICROS_BOUNDS, Storage, StorageNode
from waltz.http import buckets as _buckets
from waltz.http import serve_endpoint


def health(storage: Storage) -> tuple[bool, dict[str, Any]]:
    """Checks that the disk takes a synced write, every partition opens, and none has failed."""
    checks: dict[str, Any] = {}
    try:
        # A file of its own per probe: concurrent probes must not race on one name.
        fd, probe = tempfile.mkstemp(prefix=".health-", dir=storage.path)
        try:
            os.write(fd, b"ok")
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
        checks["disk_writable"] = True
    except OSError as e:
        checks["disk_writable"] = f"{type(e).__name__}: {e}"
    partitions: dict[str, Any] = {}
    try:
        for pid in storage.partition_ids():
            try:
                failed = storage.partition(pid).failed
                partitions[str(pid)] = True if failed is None else f"failed: {failed}"
            except errors.WaltzError as e:
                partitions[str(pid)] = f"cannot open: {e}"
    except errors.WaltzError as e:
        checks["partitions"] = f"cannot list: {e}"
    else:
        checks["partitions"] = partitions
    ok = checks["disk_writable"] is True and isinstance(checks["partitions"], dict)
    ok = ok and all(v is True for v in partitions.values())
    return ok, checks


class NodeCollector(Collector):
    def __init__(self, storage: Storage, node: StorageNode) -> None:
        self.storage = storage
        self.node = node

    def collect(self) -> Iterator[Any]:
        s = self.node.stats()
        for name, help_text in (
            ("connections", "Connections accepted"),
            ("requests", "Requests received"),
            ("failures", "Failure responses sent"),
            ("closed_bad_frames", "Connections closed for a malformed frame"),
            ("appended_records", "Records appended through the storage protocol"),
            ("bytes_in", "Bytes received"),
            ("bytes_out", "Bytes sent"),
            ("tls_handshake_failures", "TLS handshakes refused on the storage and admin ports"),
            ("tls_role_refusals", "TLS peers refused on the storage and admin ports: no server or admin role"),
            ("refused_connections", "Connections closed on accept: [node] max_connections were open on their port"),
            (
                "secret_refusals",
                "Peers refused at Hello: no role secret, a wrong one, or a role the port does not admit",
            ),
            ("role_request_refusals", "Requests refused: the peer lacks the role they need (Restart Log: server)"),
        ):
            value = s.get(name, 0)
            yield CounterMetricFamily(f"waltz_storage_{name}", help_text, value=value if isinstance(value, int) else 0)
        by_kind = CounterMetricFamily("waltz_storage_failures_by_kind", "Failure responses by kind", labels=["kind"])
        kinds: dict[str, int] = s.get("failures_by_kind", {})  # type: ignore[assignment]
        for kind, n in kinds.items():
            by_kind.add_metric([kind], n)
        yield by_kind
        gauges = {
            "max_transaction_id": GaugeMetricFamily(
                "waltz_storage_partition_max_transaction_id", "Highest durable id", labels=["partition"]
            ),
            "failed": GaugeMetricFamily(
                "waltz_storage_partition_failed", "1 when the partition refuses appends", labels=["partition"]
            ),
            "first_transaction_id": GaugeMetricFamily(
                "waltz_storage_partition_first_transaction_id",
                "Lowest id still held (retention moves it up)",
                labels=["partition"],
            ),
            "bytes_on_disk": GaugeMetricFamily(
                "waltz_storage_partition_bytes_on_disk", "Segment and index bytes on disk", labels=["partition"]
            ),
            "oldest_age": GaugeMetricFamily(
                "waltz_storage_partition_oldest_segment_age_seconds",
                "Age of the oldest segment held: an upper bound on the age of the oldest transaction",
                labels=["partition"],
            ),
        }
        reclaimed = CounterMetricFamily(
            "waltz_storage_partition_reclaimed_bytes",
            "Bytes retention deleted since the node opened the partition",
            labels=["partition"],
        )
        now_ms = clock.time() * 1000
        counters = {
            k: CounterMetricFamily(f"waltz_storage_partition_{k}", h, labels=["partition"])
            for k, h in (
                ("appends", "Append batches"),
                ("records", "Records appended"),
                ("bytes", "Bytes appended"),
                ("syncs", "fdatasync calls"),
            )
        }
        sync_hist = HistogramMetricFamily("waltz_storage_fsync_seconds", "fdatasync latency", labels=["partition"])
        batch_hist = HistogramMetricFamily(
            "waltz_storage_append_batch_records", "Records per append", labels=["partition"]
        )
        try:
            pids = self.storage.partition_ids()
        except errors.WaltzError:
            pids = []
        for pid in pids:
            try:
                p = self.storage.partition(pid)
            except errors.WaltzError:
                continue
            label = [str(pid)]
            gauges["max_transaction_id"].add_metric(label, p.max_transaction_id)
            gauges["failed"].add_metric(label, 0 if p.failed is None else 1)
            try:
                r = p.retention()
            except errors.WaltzError:
                r = None
            if r is not None:
                gauges["first_transaction_id"].add_metric(label, r["first_transaction_id"])
                gauges["bytes_on_disk"].add_metric(label, r["bytes_on_disk"])
                if r["oldest_ms"] >= 0:
                    gauges["oldest_age"].add_metric(label, max(0.0, (now_ms - r["oldest_ms"]) / 1000))
                reclaimed.add_metric(label, r["reclaimed_bytes"])
            st = p.stats()
            for k, fam in counters.items():
                fam.add_metric(label, st[k])  # type: ignore[literal-required]
            sync_hist.add_metric(label, *_buckets(st["sync_micros"], SYNC_MICROS_BOUNDS, 1e-6))
            batch_hist.add_metric(label, *_buckets(st["batch_records"], BATCH_RECORDS_BOUNDS, 1))
        yield from gauges.values()
        yield from counters.values()
        yield reclaimed
        yield sync_hist
        yield batch_hist


def serve_http(storage: Storage, node: StorageNode, host: str, port: int) -> ThreadingHTTPServer:
    """Starts the endpoint on a daemon thread; `server.shutdown()` stops it."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(storage, node))
    return serve_endpoint(host, port, registry, lambda: health(storage))
