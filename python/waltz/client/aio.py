"""`AsyncWaltzClient`: the client on asyncio. `WaltzClient` (waltz.client.sync) runs one of these
on a background event loop.

    async with AsyncWaltzClient(callbacks, ClientConfig(metadata="embedded:/var/waltz/meta.db")) as client:
        done = await client.submit(MyContext(...))   # returns once the attempt is built and queued
        committed = await done                       # True: committed; False: execute declined

The client finds each partition's server in the cluster metadata (and follows reassignments by a
watch), mounts every partition, applies every committed transaction to the application in order
(`WaltzClientCallbacks.apply_transaction`), and re-executes contexts whose appends failed.
Application code may be `async def` (awaited on this loop) or plain (run in `callback_threads`
worker threads, so a blocking database call never stalls the feed).

The client holds the services (configuration, application code, tasks, links, the cluster
metadata); a submitted transaction's life is `waltz.client.submission.TransactionLife`'s, and
each partition's sending and feed are `waltz.client.partition.ClientPartition`'s."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import inspect
import logging
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from waltz import client_protocol as cp
from waltz import clock, errors
from waltz.client.callbacks import WaltzClientCallbacks, is_async
from waltz.client.config import ClientConfig
from waltz.client.context import Append, PartitionLocalLock, TransactionContext
from waltz.client.network import Link
from waltz.client.partition import ClientPartition, Unavailable
from waltz.client.retry import Backoff
from waltz.client.serializers import BYTES, Serializer
from waltz.client.stats import ClientStats
from waltz.client.submission import Executed, TransactionLife
from waltz.client.transaction import Transaction
from waltz.client.work import Work
from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.metadata import Assignment, ClusterMetadata
from waltz.cluster.store import DataWatch, MetadataStore

log = logging.getLogger("waltz.client")

T = TypeVar("T")

_callback_thread = threading.local()


def in_callback_thread() -> bool:
    return getattr(_callback_thread, "active", False)


def _mark_callback_thread() -> None:
    _callback_thread.active = True


def _apply_all(fn: Callable[[Transaction], Any], txns: list[Transaction]) -> tuple[int, BaseException | None]:
    """In a callback thread: applies in order, stops at the first failure."""
    for i, t in enumerate(txns):
        try:
            fn(t)
        except Exception as e:
            return i, e
    return len(txns), None


class AsyncWaltzClient:
    def __init__(self, callbacks: WaltzClientCallbacks, config: ClientConfig) -> None:
        if not isinstance(config, ClientConfig):
            raise TypeError(f"config must be a waltz.client.ClientConfig, not {type(config).__name__}")
        self.callbacks, self.config = callbacks, config
        self.client_id = -1
        self.num_partitions = 0
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self.metadata: ClusterMetadata | None = None
        self._store: MetadataStore | None = None
        self._watch: DataWatch | None = None
        self._parts: dict[int, ClientPartition] = {}
        self._life = TransactionLife(self, self._parts)
        self._links: dict[tuple[str, str], Link] = {}
        self._link_locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Servers drop mounts from a client's older connections (a lower seq). Counted from the
        # clock, a client restarted with the same fixed `client_id` starts above its last run.
        self._connection_seq = clock.time_ns() // 1000
        # Proves to servers that this instance holds its client ids: while one of its connections
        # has a partition mounted, a Mount of it under the same id with another token is refused.
        self.client_token = (
            hashlib.blake2b(
                config.client_secret.encode(), digest_size=cp.TOKEN_BYTES, person=b"waltz-client-id"
            ).digest()
            if config.client_secret
            else secrets.token_bytes(cp.TOKEN_BYTES)
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._started = False
        self._closed = False
        self._ssl = config.tls.client_context() if config.tls.enabled else None
        self._rng = random.Random(config.retry_seed)
        self.stats = ClientStats()

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncWaltzClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connects to the cluster and mounts its partitions (`ClientConfig.partitions`, else
        all). Returns once all are mounted, or after `mount_timeout` with at least one mounted
        (the others keep mounting in the background; their transactions fail with
        `MountTimeoutError` meanwhile). Raises `ClientAheadError` for a refused partition and
        `MountTimeoutError` if none could be mounted."""
        if self._started:
            raise errors.ClientError("the client is already started")
        self._started = True
        self.loop = asyncio.get_running_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.config.callback_threads, thread_name_prefix="waltz-callback", initializer=_mark_callback_thread
        )
        try:
            self.num_partitions, self.client_id = await self._join_cluster()
            wanted = self.config.partitions if self.config.partitions is not None else range(self.num_partitions)
            beyond = [p for p in wanted if p >= self.num_partitions]
            if beyond:
                raise errors.ConfigError(
                    f"client config: partitions {beyond} do not exist: cluster {self.config.cluster} "
                    f"has {self.num_partitions} (0 to {self.num_partitions - 1})"
                )
            self._parts.update((p, ClientPartition(self, self._life, p, self.client_id)) for p in wanted)
            for part in self._parts.values():
                part.start()
            self.spawn(self._settle_loop())
            await self._first_mounts()
            log.info(
                "client %d: mounted %d of %d partition(s) of cluster %s",
                self.client_id,
                sum(p.mounted.is_set() for p in self._parts.values()),
                len(self._parts),
                self.config.cluster,
            )
        except BaseException:
            await self.close()
            raise

    async def _join_cluster(self) -> tuple[int, int]:
        """Opens the metadata store and watches the assignment; (the cluster's number of
        partitions, this client's id). `waltz.client.mock` joins an in-memory cluster instead."""
        self._store = open_store(
            self.config.metadata,
            session_timeout=self.config.metadata_session_timeout,
            role=("client", self.config.role_secret.encode()) if self.config.role_secret else None,
        )
        await asyncio.to_thread(self._store.start, self.config.mount_timeout)
        self.metadata = metadata = ClusterMetadata(self._store, cluster_root(self.config.cluster))
        info = await asyncio.to_thread(metadata.info)
        client_id = self.config.client_id if self.config.client_id >= 0 else await self._first_client_id()
        loop = self.loop

        def on_assignment(a: Assignment) -> None:  # a store thread
            loop.call_soon_threadsafe(self._on_assignment, a)

        self._watch = await asyncio.to_thread(metadata.watch_assignment, on_assignment)
        return info.partitions, client_id

    async def _first_mounts(self) -> None:
        """Returns once every partition is mounted, or once `mount_timeout` has passed with at
        least one mounted: a stuck partition goes on mounting in the background and fails only
        the transactions submitted to it (`MountTimeoutError`, as any partition unavailable for
        `mount_timeout`). Raises a partition refused for good (`ClientAheadError`), and
        `MountTimeoutError` when no partition is mounted and none has made progress (its feed
        replaying) for `mount_timeout`: a client far behind may replay for longer than that."""
        timeout = self.config.mount_timeout
        began = time.monotonic()
        progress = {p.pid: (p.received, began) for p in self._parts.values()}
        told = began  # a start that replays for long says so every mount_timeout
        while True:
            if self._closed:  # by another task: the mount loops have ended, nothing will mount
                raise errors.ClientClosedError("the client was closed while it was starting")
            parts = self._parts.values()
            for part in parts:
                if part.error is not None:
                    raise part.error
            waiting = [p for p in parts if not p.mounted.is_set()]
            if not waiting:
                return
            now = time.monotonic()
            for p in waiting:
                seen, at = progress[p.pid]
                if p.received != seen:
                    # Asking the application for its mark (from -2) is no progress; the feed is.
                    progress[p.pid] = (p.received, now if seen >= -1 else at)
            if len(waiting) < len(self._parts):
                if now - began >= timeout or all(p.unavailable is not None for p in waiting):
                    log.warning(
                        "client %d: started without partition(s) %s, not mounted within %g s (still trying: %s)",
                        self.client_id,
                        [p.pid for p in waiting],
                        timeout,
                        self._mount_states(waiting),
                    )
                    return
            elif all(now - progress[p.pid][1] >= timeout for p in waiting):
                # By progress, not by the partitions' `unavailable`: one judged so early on (not
                # located yet) may be replaying now; and even if no mount loop has judged its
                # partition unavailable yet (an attempt can outlast mount_timeout: a connect waits
                # up to request_timeout).
                raise next(
                    (p.unavailable for p in waiting if p.unavailable is not None),
                    errors.MountTimeoutError(
                        f"no partition could be mounted within {timeout:g} s: {self._mount_states(waiting)}"
                    ),
                )
            elif now - told >= timeout:
                told = now
                log.info("client %d: still mounting: %s", self.client_id, self._mount_states(waiting))
            await asyncio.sleep(0.02)

    @staticmethod
    def _mount_states(parts: list[ClientPartition]) -> str:
        return "; ".join(f"partition {p.pid}: {p.mount_state()}" for p in parts)

    async def close(self) -> None:
        """Stops the client. Contexts not completed fail with `ClientClosedError` (an append
        already sent may still commit: call `flush()` first to wait for them)."""
        if self._closed:
            return
        self._closed = True
        why = errors.ClientClosedError("the client was closed before this transaction completed")
        for part in self._parts.values():
            part.close(why)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for p in self._parts.values() for t in p.tasks), return_exceptions=True)
        for link in list(self._links.values()):
            link.close()
        if self._watch is not None:
            await asyncio.to_thread(self._watch.stop)
        if self._store is not None:
            await asyncio.to_thread(self._store.close)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.ClientClosedError("the client is closed")
        if not self._parts:
            raise errors.ClientError(
                "the client is not started: use `async with AsyncWaltzClient(...)` or `await client.start()`"
            )

    # -- the API ---------------------------------------------------------------------------
    @property
    def partitions(self) -> int:
        """The cluster's number of partitions."""
        return self.num_partitions

    @property
    def mounted_partitions(self) -> tuple[int, ...]:
        """The partitions this client mounts (`ClientConfig.partitions`, else all)."""
        return tuple(self._parts)

    async def submit(self, context: TransactionContext) -> asyncio.Future[bool]:
        """Waits for room among the partition's pending transactions (`max_pending`), executes
        the context once and queues its append; returns the future of its completion: True
        committed, False declined; `on_exception`'s error, `TransactionExpiredError`,
        `MountTimeoutError`, `ClientAheadError` otherwise."""
        part = self.route(context)
        await part.slots.acquire()
        if self._closed:
            part.slots.release()
            raise errors.ClientClosedError("the client is closed")
        future = self.loop.create_future()
        await self._life.submit(Work(part.pid, context, future, self.deadline_of(context), part.slots.release))
        return future

    async def append(
        self,
        partition: int,
        data: Any,
        *,
        locks: Iterable[PartitionLocalLock] = (),
        read_locks: Iterable[PartitionLocalLock] = (),
        append_locks: Iterable[PartitionLocalLock] = (),
        header: int = 0,
        serializer: Serializer[Any] = BYTES,
        timeout: float | None = None,
    ) -> int:
        """Appends `data` (bytes, or what `serializer` takes) to the partition with these write,
        read and append locks, without a context of your own; returns the committed
        transaction's id once it committed, raises what `submit`'s future raises otherwise.
        See `waltz.client.context.Append`."""
        context = Append(
            partition,
            data,
            serializer=serializer,
            header=header,
            locks=locks,
            read_locks=read_locks,
            append_locks=append_locks,
            timeout=timeout,
        )
        await (await self.submit(context))
        return context.committed_transaction_id

    def route(self, context: TransactionContext) -> ClientPartition:
        """The context's partition; raises what `submit` raises before it waits for room. Reads
        only, so `WaltzClient` calls it from the submitting thread."""
        self._check_open()
        if not isinstance(context, TransactionContext):
            raise TypeError(f"submit takes a TransactionContext, not {type(context).__name__}")
        pid = context.partition_id(self.num_partitions)
        if not isinstance(pid, int) or not 0 <= pid < self.num_partitions:
            raise ValueError(
                f"{type(context).__name__}.partition_id({self.num_partitions}) returned {pid!r}, not a partition id"
            )
        part = self._parts.get(pid)
        if part is None:
            raise errors.PartitionNotMountedError(
                f"partition {pid} is not mounted by this client (it mounts partitions {list(self._parts)}: "
                "ClientConfig.partitions)"
            )
        refused = part.error or part.unavailable
        if refused is not None:
            raise refused
        return part

    def deadline_of(self, context: TransactionContext) -> float:
        timeout = context.timeout if context.timeout is not None else self.config.transaction_timeout
        return time.monotonic() + timeout

    def submitted(self, work: Work, executed: Executed) -> None:
        """A context `WaltzClient` admitted and executed in the submitting thread
        (`waltz.client.submission.execute_here`), on the loop now."""
        self._life.submitted(work, executed, closed=self._closed)

    async def flush(self) -> None:
        """Waits until every context submitted so far has completed and this client has applied
        its own committed transactions."""
        self._check_open()
        await asyncio.gather(*(p.idle() for p in self._parts.values()))

    async def high_water_mark(self, partition: int) -> int:
        """The partition's high-water mark on its server now (RPC)."""
        self._check_partition(partition)
        resp = await self._rpc(partition, lambda seq: cp.HighWaterMarkRequest(seq, partition))
        assert isinstance(resp, cp.HighWaterMarkResponse)
        return resp.high_water_mark

    async def transaction_data(self, partition: int, transaction_id: int) -> bytes:
        """A committed transaction's data (RPC; `Transaction.data` caches it)."""
        self._check_partition(partition)
        self.stats.data_requests += 1
        try:
            resp = await self._rpc(partition, lambda seq: cp.TransactionDataRequest(seq, partition, transaction_id))
        except errors.RequestFailedError as e:
            if e.kind == "transactions_deleted":
                raise errors.transactions_deleted(partition, transaction_id, errors.log_start_in(str(e))) from e
            raise
        assert isinstance(resp, cp.TransactionDataResponse)
        return resp.data

    async def transaction_data_range(
        self, partition: int, first: int, max_count: int, max_bytes: int = cp.MAX_DATA_RANGE_BYTES
    ) -> list[bytes]:
        """The data of committed transactions `first`, `first + 1`, ... in one round trip: at most
        `max_count` (up to 10,000) and `max_bytes` (up to 16 MiB) of data, at least one whatever
        its size. A bound outside those is refused (`RequestFailedError`, kind bad_request)."""
        self._check_partition(partition)
        self.stats.data_requests += 1
        try:
            resp = await self._rpc(
                partition, lambda seq: cp.TransactionDataRangeRequest(seq, partition, first, max_count, max_bytes)
            )
        except errors.RequestFailedError as e:
            if e.kind == "transactions_deleted":
                raise errors.transactions_deleted(partition, first, errors.log_start_in(str(e))) from e
            raise
        assert isinstance(resp, cp.TransactionDataRangeResponse)
        return list(resp.data)

    def status(self) -> list[dict[str, Any]]:
        """Per partition: mounted, feed position, applied, pending and queued appends, last error."""
        return [p.describe() for p in self._parts.values()]

    def _check_partition(self, partition: int) -> None:
        self._check_open()
        if not isinstance(partition, int) or not 0 <= partition < self.num_partitions:
            raise ValueError(f"no partition {partition}: the cluster has {self.num_partitions}")

    # -- executing contexts ----------------------------------------------------------------
    async def call(self, fn: Callable[..., T | Awaitable[T]], *args: Any) -> T:
        """Runs application code: `async def` on this loop, plain functions in a callback thread."""
        if is_async(fn):
            return await fn(*args)  # type: ignore[no-any-return]
        assert self._pool is not None
        result = await self.loop.run_in_executor(self._pool, fn, *args)
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            return await result
        return result

    async def apply(self, txns: list[Transaction]) -> tuple[int, BaseException | None]:
        fn = self.callbacks.apply_transaction
        if is_async(fn):
            for i, t in enumerate(txns):
                try:
                    await fn(t)
                except Exception as e:
                    return i, e
            return len(txns), None
        assert self._pool is not None
        return await self.loop.run_in_executor(self._pool, _apply_all, fn, txns)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
        if self._closed:
            coro.close()
            return None
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("client task failed", exc_info=task.exception())

    def backoff(self) -> Backoff:
        """A new retry delay; all of this client's draw from its one generator (`retry_seed`)."""
        return Backoff(self.config.reconnect_backoff, self.config.reconnect_backoff_max, rng=self._rng)

    # -- servers and links -----------------------------------------------------------------
    async def next_client_id(self) -> int:
        """A new client id, allocated by one of the cluster's servers (Client Id Request): the
        server takes it from the cluster's counter with its own metadata credentials, so a client
        only ever reads the metadata (ZooKeeper ACLs give clients read rights only)."""
        metadata = self.metadata
        assert metadata is not None
        servers = await asyncio.to_thread(metadata.servers)
        if not servers:
            raise Unavailable("no client id: servers not registered yet (a server allocates client ids)")
        self._rng.shuffle(servers)
        last: BaseException | None = None
        for server in servers:
            try:
                link = await self.link(server.endpoint, "rpc")
                resp = await link.request(lambda seq: cp.ClientIdRequest(seq), self.config.request_timeout)
                assert isinstance(resp, cp.ClientIdResponse), resp
                return resp.client_id
            except (OSError, TimeoutError, errors.ProtocolError, errors.RequestFailedError) as e:
                last = e
        raise Unavailable(f"no server allocated a client id ({last})")

    async def _first_client_id(self) -> int:
        """`next_client_id`, retried until `mount_timeout` (servers may still be starting)."""
        deadline = time.monotonic() + self.config.mount_timeout
        backoff = self.backoff()
        while True:
            try:
                return await self.next_client_id()
            except errors.HelloRefusedError:
                raise  # our credential is refused: waiting does not change it
            except (Unavailable, OSError, TimeoutError, errors.ProtocolError, errors.RequestFailedError) as e:
                if time.monotonic() >= deadline:
                    raise errors.MountTimeoutError(
                        f"no client id within mount_timeout {self.config.mount_timeout:g} s: {e}"
                    ) from e
                await backoff.sleep(deadline - time.monotonic())

    async def locate(self, partition: int) -> tuple[str, int, int]:
        """(endpoint, server id, generation) of the server assigned the partition."""
        metadata = self.metadata
        assert metadata is not None

        def read() -> tuple[str, int, int]:
            try:
                server, generation = metadata.partition_server(partition)
            except errors.PartitionNotServedError as e:
                raise Unavailable(str(e)) from None
            return server.endpoint, server.server_id, generation

        return await asyncio.to_thread(read)

    async def link(self, endpoint: str, kind: str) -> Link:
        key = (endpoint, kind)
        async with self._link_locks.setdefault(key, asyncio.Lock()):
            if self._closed:  # also before an open link: close() closes the links last
                raise errors.ClientClosedError("the client is closed")
            existing = self._links.get(key)
            if existing is not None and not existing.closed:
                return existing
            self._connection_seq += 1
            link = self._new_link(endpoint, kind, self._connection_seq)
            await link.open(self.config.request_timeout)
            if self._closed:  # closed during the (TLS) handshake: close() has not seen this link
                link.close()
                raise errors.ClientClosedError("the client is closed")
            self._links[key] = link
            return link

    def _new_link(self, endpoint: str, kind: str, connection_seq: int) -> Link:
        return Link(
            endpoint,
            kind,
            self._on_push,
            self._on_closed,
            connection_seq=connection_seq,
            max_frame=self.config.max_frame,
            ssl=self._ssl,
            credential=("client", self.config.role_secret.encode()) if self.config.role_secret else None,
        )

    def _on_push(self, link: Link, msg: cp.Message) -> None:
        if isinstance(msg, cp.FeedData):
            part = self._parts.get(msg.partition)
            if part is not None:
                part.on_feed(link, msg.entries)
        elif isinstance(msg, cp.LockFailure):
            part = self._parts.get(msg.req_id[2])
            if part is not None and msg.req_id[0] == part.client_id:
                part.on_lock_failure(link, msg)
        elif isinstance(msg, cp.Failure):
            part = self._parts.get(msg.partition)
            if part is not None:
                part.on_failure(link, msg)
            else:
                log.warning("%s: %s", link, msg.message)
        # Late answers (a mount or flush whose caller gave up) need nothing.

    def _on_closed(self, link: Link, why: BaseException | None) -> None:
        if self._links.get((link.endpoint, link.kind)) is link:
            del self._links[(link.endpoint, link.kind)]
        if not self._closed:
            log.info("%s closed: %s", link, why)
            for part in self._parts.values():
                part.on_link_closed(link)

    def _on_assignment(self, assignment: Assignment) -> None:
        for pid, part in self._parts.items():
            a = assignment.get(pid)
            if part.server is not None and (a is None or (a.server, a.generation) != part.server):
                part.request_remount("the partition was reassigned")

    async def _settle_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.settle_after / 2)
            for part in self._parts.values():
                if len(part.monitor):
                    self.spawn(part.settle_stale())

    async def _rpc(self, partition: int, make: Callable[[int], cp.Message]) -> cp.Message:
        """A request to the partition's server, retried on other links and servers until
        `request_timeout`."""
        deadline = time.monotonic() + self.config.request_timeout
        backoff, last = self.backoff(), "no attempt"
        part = self._parts.get(partition)  # None: not mounted here, its server is looked up each time
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.RequestTimeoutError(
                    f"partition {partition}: no answer within {self.config.request_timeout} s ({last})"
                )
            try:
                current = part.link if part is not None and part.mounted.is_set() else None
                endpoint = current.endpoint if current is not None else (await self.locate(partition))[0]
                link = await self.link(endpoint, "rpc")
                return await link.request(make, remaining)
            except errors.RequestFailedError as e:
                if e.kind not in ("partition_not_here", "store_unavailable"):
                    raise
                last = str(e)
            except (TimeoutError, Unavailable, errors.MetadataError, ConnectionError, OSError) as e:
                last = str(e) or type(e).__name__
            await backoff.sleep(deadline - time.monotonic())
