"""In-memory Waltz for application tests (the Java client's MockDriver): no process, no port.

    cluster = MockCluster(partitions=4, failure_rate=0.1, seed=7)
    with MockWaltzClient(app, cluster) as client:          # or AsyncMockWaltzClient
        client.submit(Transfer(1, 2, 50)).result()
        cluster.force_next_lock_fail()

A mock client IS the real client (`WaltzClient` / `AsyncWaltzClient`: the same transaction
life, transaction monitor, retries, hooks, feed and ordered application); only its connections
end in a `MockCluster` instead of a server. The cluster does what a server does, in memory: it
numbers the committed transactions of each partition, checks locks with the server's own
`LockTable` (exact: every lock keeps its version, no hashed array, so a lock fails only on a
real conflict, docs/locking.md), pushes the feed to every mounted client, and answers mounts,
flushes, high-water marks and transaction data. Several clients on one `MockCluster` share its
partitions, as instances of one service share a cluster: what one commits, the others apply,
and their lock races are real.

Failures to test the application's handling of them:
- `failure_rate` (seeded with `seed`): each append fails with that probability as if the
  server's store session ended; the client mounts again and executes the context again (its
  `execute` runs twice; the transaction commits once);
- `force_next_lock_fail()`: the next append loses a lock race (its `on_lock_failure` hook runs
  with the partition's high-water mark, and it is executed again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import Callable

from waltz import client_protocol as cp
from waltz.client.aio import AsyncWaltzClient
from waltz.client.callbacks import WaltzClientCallbacks
from waltz.client.config import ClientConfig
from waltz.client.network import Link
from waltz.client.sync import WaltzClient
from waltz.server.lock_table import SLOT_BYTES, LockTable

ENDPOINT = "mock:0"
FEED_CHUNK = 1000


def mock_config(**overrides: object) -> ClientConfig:
    """A configuration for mock clients: quick retries (nothing to wait for in memory)."""
    values: dict[str, object] = {
        "metadata": "mock:",
        "cluster": "mock",
        "reconnect_backoff": 0.001,
        "reconnect_backoff_max": 0.02,
        "mount_timeout": 10.0,
    }
    values.update(overrides)
    return ClientConfig(**values)  # type: ignore[arg-type]


def _exact_lock_table() -> LockTable:
    # The smallest array and a budget no test reaches: every lock stays in the exact map (the
    # array, still at -1, never answers for a lock that was written).
    return LockTable(-1, budget_bytes=1 << 60, array_bytes=64 * SLOT_BYTES)


@dataclasses.dataclass
class _Partition:
    entries: list[cp.FeedEntry] = dataclasses.field(default_factory=list)
    data: list[bytes] = dataclasses.field(default_factory=list)
    locks: LockTable = dataclasses.field(default_factory=_exact_lock_table)
    mounted: set[MockLink] = dataclasses.field(default_factory=set)

    @property
    def high_water_mark(self) -> int:
        return len(self.entries) - 1


class MockCluster:
    """The in-memory cluster that mock clients share (thread-safe: each `MockWaltzClient` runs
    its own event loop thread)."""

    def __init__(self, partitions: int = 1, *, failure_rate: float = 0.0, seed: int | None = None) -> None:
        if partitions < 1:
            raise ValueError("a mock cluster needs at least one partition")
        if not 0.0 <= failure_rate < 1.0:
            raise ValueError(f"failure_rate must be in [0, 1), not {failure_rate}")
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._parts = [_Partition() for _ in range(partitions)]
        self._next_client_id = 0
        self._forced_lock_failures = 0
        self.generation = 1
        self.forced_failures = 0
        """Appends failed by `failure_rate` so far."""
        self.lock_failures = 0
        """Appends refused for a lock (forced ones included)."""

    @property
    def partitions(self) -> int:
        return len(self._parts)

    def force_next_lock_fail(self) -> None:
        """The next append (of any client, any partition) loses a lock race."""
        with self._lock:
            self._forced_lock_failures += 1

    def high_water_mark(self, partition: int) -> int:
        with self._lock:
            return self._parts[partition].high_water_mark

    def transactions(self, partition: int) -> list[tuple[int, int, bytes]]:
        """The partition's committed log: (transaction id, header, data)."""
        with self._lock:
            p = self._parts[partition]
            return [(e.transaction_id, e.header, d) for e, d in zip(p.entries, p.data, strict=True)]

    def next_client_id(self) -> int:
        with self._lock:
            self._next_client_id += 1
            return self._next_client_id

    # -- what a server does ------------------------------------------------------------------
    def handle(self, link: MockLink, msg: cp.Message) -> None:
        """One message from a client; the replies and feed pushes are queued on the receiving
        clients' loops under the cluster's lock, so that every client gets the feed in id order."""
        with self._lock:
            pid = msg.req_id[2] if isinstance(msg, cp.Append) else getattr(msg, "partition", -1)
            seq = getattr(msg, "seq", -1)
            if not 0 <= pid < len(self._parts):
                link.deliver(
                    cp.Failure(seq, pid, cp.FailureKind.BAD_REQUEST, f"no partition {pid} in the mock cluster")
                )
                return
            part = self._parts[pid]
            if isinstance(msg, cp.Mount):
                self._mount(link, part, msg)
            elif isinstance(msg, cp.Append):
                self._append(link, part, msg)
            elif isinstance(msg, cp.Flush):
                link.deliver(cp.FlushResponse(msg.seq, pid, part.high_water_mark))
            elif isinstance(msg, cp.HighWaterMarkRequest):
                link.deliver(cp.HighWaterMarkResponse(msg.seq, pid, part.high_water_mark))
            elif isinstance(msg, cp.TransactionDataRequest):
                if 0 <= msg.transaction_id <= part.high_water_mark:
                    link.deliver(
                        cp.TransactionDataResponse(msg.seq, pid, msg.transaction_id, part.data[msg.transaction_id])
                    )
                else:
                    link.deliver(
                        cp.Failure(
                            msg.seq,
                            pid,
                            cp.FailureKind.NOT_COMMITTED,
                            f"partition {pid}: no committed transaction {msg.transaction_id}",
                        )
                    )
            elif isinstance(msg, cp.TransactionDataRangeRequest):
                if 0 <= msg.first <= part.high_water_mark and 1 <= msg.max_count <= cp.MAX_DATA_RANGE_COUNT:
                    data = [part.data[msg.first]]  # the first whatever its size, as a server does
                    size = len(data[0])
                    for d in part.data[msg.first + 1 : msg.first + msg.max_count]:
                        size += len(d)
                        if size > msg.max_bytes:
                            break
                        data.append(d)
                    link.deliver(cp.TransactionDataRangeResponse(msg.seq, pid, msg.first, tuple(data)))
                else:
                    link.deliver(
                        cp.Failure(
                            msg.seq,
                            pid,
                            cp.FailureKind.NOT_COMMITTED,
                            f"partition {pid}: no committed transaction {msg.first} (or max count {msg.max_count})",
                        )
                    )
            else:
                link.deliver(
                    cp.Failure(
                        seq, pid, cp.FailureKind.BAD_REQUEST, f"the mock cluster does not take {type(msg).__name__}"
                    )
                )

    def _mount(self, link: MockLink, part: _Partition, msg: cp.Mount) -> None:
        mark = part.high_water_mark
        if msg.client_high_water_mark > mark:
            link.deliver(cp.MountResponse(msg.seq, msg.partition, cp.MountStatus.CLIENT_AHEAD, mark, self.generation))
            return
        backlog = part.entries[msg.client_high_water_mark + 1 :]
        for i in range(0, len(backlog), FEED_CHUNK):
            link.deliver(cp.FeedData(-1, msg.partition, tuple(backlog[i : i + FEED_CHUNK])))
        part.mounted.add(link)
        link.deliver(cp.MountResponse(msg.seq, msg.partition, cp.MountStatus.READY, mark, self.generation))

    def _append(self, link: MockLink, part: _Partition, msg: cp.Append) -> None:
        pid = msg.req_id[2]
        if link not in part.mounted:
            link.deliver(
                cp.Failure(-1, pid, cp.FailureKind.PARTITION_NOT_HERE, f"partition {pid} is not mounted on this link")
            )
            return
        if self._forced_lock_failures:
            self._forced_lock_failures -= 1
            self.lock_failures += 1
            link.deliver(cp.LockFailure(msg.req_id, part.high_water_mark))
            return
        if self.failure_rate and self._rng.random() < self.failure_rate:
            self.forced_failures += 1
            # As when a server's store session ends: the client mounts again, and READY tells it
            # that its pending appends failed.
            part.mounted.discard(link)
            link.deliver(
                cp.Failure(-1, pid, cp.FailureKind.STORE_UNAVAILABLE, "forced failure (MockCluster failure_rate)")
            )
            return
        txid = part.high_water_mark + 1
        failed = part.locks.check_and_update(
            msg.client_high_water_mark, txid, msg.write_locks, msg.read_locks, msg.append_locks
        )
        if failed is not None:
            self.lock_failures += 1
            link.deliver(cp.LockFailure(msg.req_id, failed.transaction_id))
            return
        entry = cp.FeedEntry(txid, msg.req_id, msg.header)
        part.entries.append(entry)
        part.data.append(msg.data)
        for subscriber in part.mounted:
            subscriber.deliver(cp.FeedData(-1, pid, (entry,)))

    def detach(self, link: MockLink) -> None:
        with self._lock:
            for part in self._parts:
                part.mounted.discard(link)


class MockLink(Link):
    """A client's connection to a `MockCluster`: what it sends is handled at once; what comes
    back is dispatched on the client's loop, in the order the cluster queued it."""

    def __init__(
        self,
        cluster: MockCluster,
        endpoint: str,
        kind: str,
        on_push: Callable[[Link, cp.Message], None],
        on_closed: Callable[[Link, BaseException | None], None],
        connection_seq: int,
    ) -> None:
        super().__init__(endpoint, kind, on_push, on_closed, connection_seq=connection_seq)
        self.cluster = cluster
        self._loop: asyncio.AbstractEventLoop | None = None

    async def open(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()

    def send(self, msg: cp.Message) -> None:
        if self.closed:
            raise ConnectionError(f"{self} is closed")
        self.cluster.handle(self, msg)

    def deliver(self, msg: cp.Message) -> None:
        """From the cluster (any thread)."""
        loop = self._loop
        if loop is None or self.closed:
            return
        try:
            loop.call_soon_threadsafe(self._receive, msg)
        except RuntimeError:  # the client's loop is closed
            pass

    def _receive(self, msg: cp.Message) -> None:
        if not self.closed:
            self._dispatch(msg)

    def close(self) -> None:
        self.cluster.detach(self)
        super().close()


class AsyncMockWaltzClient(AsyncWaltzClient):
    """`AsyncWaltzClient` on a `MockCluster`: `async with AsyncMockWaltzClient(app, cluster) as c`."""

    def __init__(
        self, callbacks: WaltzClientCallbacks, cluster: MockCluster, config: ClientConfig | None = None
    ) -> None:
        super().__init__(callbacks, config if config is not None else mock_config())
        self.cluster = cluster

    def force_next_lock_fail(self) -> None:
        """The next append to the cluster loses a lock race (`MockCluster.force_next_lock_fail`)."""
        self.cluster.force_next_lock_fail()

    async def _join_cluster(self) -> tuple[int, int]:
        cid = self.config.client_id if self.config.client_id >= 0 else self.cluster.next_client_id()
        return self.cluster.partitions, cid

    async def next_client_id(self) -> int:
        return self.cluster.next_client_id()

    async def locate(self, partition: int) -> tuple[str, int, int]:
        return ENDPOINT, 0, self.cluster.generation

    def _new_link(self, endpoint: str, kind: str, connection_seq: int) -> Link:
        return MockLink(self.cluster, endpoint, kind, self._on_push, self._on_closed, connection_seq)


class MockWaltzClient(WaltzClient):
    """`WaltzClient` on a `MockCluster`: `with MockWaltzClient(app, cluster) as c`."""

    def __init__(
        self, callbacks: WaltzClientCallbacks, cluster: MockCluster, config: ClientConfig | None = None
    ) -> None:
        self.cluster = cluster
        super().__init__(callbacks, config if config is not None else mock_config())

    def _make_core(self, callbacks: WaltzClientCallbacks, config: ClientConfig) -> AsyncWaltzClient:
        return AsyncMockWaltzClient(callbacks, self.cluster, config)

    def force_next_lock_fail(self) -> None:
        """The next append to the cluster loses a lock race (`MockCluster.force_next_lock_fail`)."""
        self.cluster.force_next_lock_fail()


__all__ = ["AsyncMockWaltzClient", "MockCluster", "MockWaltzClient", "mock_config"]
