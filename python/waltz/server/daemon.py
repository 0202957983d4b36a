"""`waltz-node server`: serves the partitions the cluster manager assigns to this server.

The membership (registration, election, assignment; `waltz.cluster.manager`) calls
`PartitionHost.deliver` from the metadata store's threads. Stopping a partition is immediate:
it leaves the registry at once (connections answer NOT_READY / not here) and closes in the
background. Starting one opens its store session in the background and retries until it opens
or the partition is taken away; a store session that ends (lost quorum, fenced) is replaced by
a new one the same way (each attempt is a new session that runs the recovery; while the vote is
undecidable it keeps retrying and says why in the log). A served partition moves to a new store
session in place when its replica assignment changes (a watch on the assignment) and every
`checkpoint_interval` transactions.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CollectorRegistry

from waltz import client_protocol as cp
from waltz import errors, role_secrets, tls
from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.manager import ServerMembership
from waltz.cluster.metadata import ClusterMetadata
from waltz.cluster.store import DataWatch
from waltz.config import PartitionSection, ServerConfig
from waltz.event_loop import loop_factory
from waltz.http import serve_endpoint
from waltz.limits import Refusals, raise_file_limit
from waltz.sd_notify import notify
from waltz.server.connection import ClientConnection, ClientIdBindings, ConnectionLimits, Partitions
from waltz.server.metrics import ServerCollector, health
from waltz.server.partition import ServerPartition
from waltz.server.retention import RetentionPusher
from waltz.server.store_session import StoreSession

log = logging.getLogger("waltz.server")

NO_TLS_WARNING = (
    "TLS is not configured: every link of this server (clients, storage nodes) is plaintext and "
    "unauthenticated: anyone who reaches its port can read and append ([tls] in docs/configuration.md)"
)


FILES_BESIDES_CONNECTIONS = 256
"""Descriptors kept for store sessions (one per partition replica), the metadata store, the
HTTP port and the interpreter."""


def fit_connection_limit(max_connections: int) -> int:
    """`max_connections`, or fewer when the file descriptor limit cannot hold them (raised first
    as far as the hard limit allows): a server out of descriptors cannot reopen its store
    sessions (EMFILE) and refuses new clients without saying why (issue 34)."""
    need = max_connections + FILES_BESIDES_CONNECTIONS
    soft = raise_file_limit(need)
    if soft >= need:
        return max_connections
    fitted = max(16, soft - FILES_BESIDES_CONNECTIONS)
    log.warning(
        "the file descriptor limit (%d) is below the %d that [server] max_connections = %d may take: serving at most "
        "%d client connections (raise the limit, ulimit -n, for more)",
        soft,
        need,
        max_connections,
        fitted,
    )
    return min(fitted, max_connections)


class ClientPort:
    """Accepts client connections up to a cap. When it is reached, a new connection takes the
    place of the oldest one that has not mounted (closed at once): a flood of idle connections
    cannot lock a real client out, and a mounted client is never cut for it. When every
    connection has mounted, the new one is closed. Each refusal is counted and logged."""

    def __init__(
        self,
        partitions: Partitions,
        limits: ConnectionLimits,
        max_connections: int,
        secrets: Mapping[str, str] | None = None,
        client_ids: Callable[[], Awaitable[int]] | None = None,
        bindings: ClientIdBindings | None = None,
    ) -> None:
        self.partitions, self.limits, self.max_connections = partitions, limits, max_connections
        self.secrets = dict(secrets or {})
        self.client_ids, self.bindings = client_ids, bindings
        self._open: dict[ClientConnection, None] = {}  # in the order they came; evicted ones leave at once
        self.refusals = Refusals(logging.getLogger("waltz.server.connection"), "client connection")

    @property
    def open(self) -> int:
        return len(self._open)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if len(self._open) >= self.max_connections:
            victim = next((c for c in self._open if not c.mounted), None)
            if victim is None:
                self.refusals.refuse(
                    "max_connections",
                    f"{peer}: [server] max_connections = {self.max_connections} "
                    "client connections are open, all mounted",
                )
                writer.transport.abort()
                return
            del self._open[victim]
            self.refusals.refuse(
                "evicted",
                f"{victim.peer}, not mounted, closed to make way for {peer}: [server] "
                f"max_connections = {self.max_connections} client connections were open",
            )
            victim.writer.transport.abort()
        conn = ClientConnection(
            reader, writer, self.partitions, self.limits, self.refusals, self.secrets, self.client_ids, self.bindings
        )
        self._open[conn] = None
        try:
            await conn.run()
        finally:
            self._open.pop(conn, None)


class PartitionHost:
    """Keeps the served partitions equal to what the membership delivers: one runner task per
    wanted partition opens it, serves it while its store session lives, and reopens it."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        metadata: ClusterMetadata,
        partitions: Partitions,
        tuning: PartitionSection,
        storage_ssl: ssl.SSLContext | None = None,
        credential: role_secrets.Credential | None = None,
    ) -> None:
        self.loop, self.metadata, self.partitions, self.tuning = loop, metadata, partitions, tuning
        self.storage_ssl = storage_ssl
        self.credential = credential
        """The server role's secret given to the storage nodes at Hello (`[role_secrets] server`)."""
        self.desired: dict[int, int] = {}
        self._runners: dict[int, tuple[int, asyncio.Task[None]]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled runners still unwinding

    def deliver(self, wanted: dict[int, int]) -> None:
        """From the membership (a store thread): returns once the registry matches `wanted`
        (partitions no longer wanted are out of it; wanted ones are opening or served)."""
        asyncio.run_coroutine_threadsafe(self._apply(wanted), self.loop).result(timeout=30)

    def _close_later(self, part: ServerPartition) -> asyncio.Task[None]:
        task = asyncio.ensure_future(part.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _apply(self, wanted: dict[int, int]) -> None:
        self.desired = dict(wanted)
        for pid, part in list(self.partitions.by_id.items()):
            if wanted.get(pid) != part.generation:
                del self.partitions.by_id[pid]  # no longer served, from this instant
                log.info("partition %d (generation %d): stopped", pid, part.generation)
                self._close_later(part)
        for pid, (gen, task) in list(self._runners.items()):
            if wanted.get(pid) != gen:
                task.cancel()
                del self._runners[pid]
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
        for pid, gen in wanted.items():
            if pid not in self._runners:
                self._runners[pid] = (gen, asyncio.ensure_future(self._run(pid, gen)))

    def _wanted(self, pid: int, gen: int) -> bool:
        return self.desired.get(pid) == gen

    async def _run(self, pid: int, gen: int) -> None:
        delay = 0.2
        part: ServerPartition | None = None  # opened and not (or no longer) in the registry: ours to close
        try:
            while self._wanted(pid, gen):
                try:
                    session = await StoreSession.open(
                        self.metadata,
                        pid,
                        gen,
                        timeout=self.tuning.storage_timeout,
                        ssl=self.storage_ssl,
                        credential=self.credential,
                    )
                except errors.StaleGenerationError as e:
                    log.info("partition %d: %s", pid, e)
                    return
                except (errors.WaltzError, OSError) as e:
                    log.warning(
                        "partition %d (generation %d): cannot open a store session yet (retrying): %s", pid, gen, e
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                delay = 0.2
                t = self.tuning
                part = ServerPartition(
                    pid,
                    gen,
                    session,
                    max_batch_records=t.max_batch_records,
                    max_batch_bytes=t.max_batch_bytes,
                    max_batches_in_flight=t.max_batches_in_flight,
                    gather_turns=t.gather_turns,
                    queue_limit=t.queue_limit,
                    lock_budget_bytes=t.lock_budget_bytes,
                    feed_cache_bytes=t.feed_cache_bytes,
                    data_cache_bytes=t.data_cache_bytes,
                    checkpoint_interval=t.checkpoint_interval,
                    max_transaction_bytes=t.max_transaction_bytes,
                    max_transaction_locks=t.max_transaction_locks,
                    open_session=lambda: StoreSession.open(
                        self.metadata,
                        pid,
                        gen,
                        timeout=t.storage_timeout,
                        ssl=self.storage_ssl,
                        credential=self.credential,
                    ),
                )
                await part.start()
                if not self._wanted(pid, gen):
                    return
                self.partitions.by_id[pid] = served = part
                part = None  # from here on whoever takes it out of the registry closes it
                log.info(
                    "partition %d (generation %d): serving from high-water mark %d", pid, gen, served.high_water_mark
                )
                # A change while the session opened reached no registered partition: look again.
                await self._check_replicas(only=pid)
                while served.session.failed is None and self.partitions.by_id.get(pid) is served:
                    await asyncio.sleep(0.2)
                if self.partitions.by_id.get(pid) is not served:
                    return
                log.warning("partition %d: %s; opening a new store session", pid, served.session.failed)
                del self.partitions.by_id[pid]
                await asyncio.shield(self._close_later(served))  # a cancelled runner must not cut the close short
        finally:
            if part is not None:
                self._close_later(part)
            if self._runners.get(pid, (None, None))[1] is asyncio.current_task():
                del self._runners[pid]

    def replicas_changed(self) -> None:
        """From the metadata store's thread: the replica assignment changed; partitions whose
        replica set differs from their session's move to a new session."""
        asyncio.run_coroutine_threadsafe(self._check_replicas(), self.loop)

    async def _check_replicas(self, only: int | None = None) -> None:
        try:
            nodes = await asyncio.to_thread(self.metadata.storage_nodes)  # one read for every partition
        except Exception as e:  # noqa: BLE001 - also runs inside a partition's runner, which must go on
            log.warning("cannot read the replica assignment: %s", e)
            return
        for pid, part in list(self.partitions.by_id.items()):
            if only is not None and pid != only:
                continue
            now = sorted(n.address for n in nodes if pid in n.partitions)
            if now != sorted(part.session.assigned_replicas):
                part.request_new_session(f"replicas now {', '.join(now)}")

    async def close(self) -> None:
        await self._apply({})
        while self._stopping or self._closing:  # runners unwinding may still schedule closes
            await asyncio.gather(*self._stopping, *self._closing, return_exceptions=True)


async def serve(config: ServerConfig, stop: asyncio.Event, ready: asyncio.Future[int] | None = None) -> None:
    s = config.server
    store = open_store(
        s.metadata,
        session_timeout=s.session_timeout,
        role=config.role_secrets.credential("server"),
        acl_secrets=config.role_secrets.admitted(*role_secrets.ROLES),
    )
    await asyncio.to_thread(store.start)
    try:
        metadata = ClusterMetadata(store, cluster_root(s.cluster))
        await asyncio.to_thread(metadata.info)  # a clear error when the cluster does not exist
        partitions = Partitions()
        server_ssl = config.tls.server_context() if config.tls.enabled else None

        limits = ConnectionLimits(
            handshake_timeout=s.handshake_timeout,
            mount_timeout=s.mount_timeout,
            max_frame_before_mount=s.max_frame_before_mount,
            max_transaction_locks=config.partition.max_transaction_locks,
        )
        on_client = ClientPort(
            partitions,
            limits,
            fit_connection_limit(s.max_connections),
            config.role_secrets.admitted(*tls.CLIENT_PORT_ROLES),
            # Clients get their ids through a server, so they need no write rights on the metadata.
            lambda: asyncio.to_thread(metadata.next_id, "client"),
            ClientIdBindings(metadata.bind_client_id, metadata.client_id_binding),
        )
        server = await tls.start_server(
            on_client,
            s.host,
            s.port,
            server_ssl,
            what="client",
            roles=tls.CLIENT_PORT_ROLES,
            refusal=lambda why: cp.Failure(-1, -1, cp.FailureKind.CLIENT_REFUSED, why).frame(),
        )
        port = server.sockets[0].getsockname()[1]
        storage_ssl = config.tls.client_context() if config.tls.enabled else None
        host = PartitionHost(
            asyncio.get_running_loop(),
            metadata,
            partitions,
            config.partition,
            storage_ssl,
            config.role_secrets.credential("server"),
        )
        public_host, public_port = s.host, port
        if s.advertised_address:
            public_host, _, advertised_port = s.advertised_address.rpartition(":")
            public_port = int(advertised_port)
        membership = ServerMembership(metadata, public_host, public_port, host.deliver)
        await asyncio.to_thread(membership.start)
        replica_watch = await asyncio.to_thread(
            DataWatch, store, metadata.paths.replica_assignment, lambda _data, _stat: host.replicas_changed()
        )
        retention = RetentionPusher(metadata, partitions)
        await retention.start()
        registry = CollectorRegistry()
        registry.register(ServerCollector(partitions, on_client))
        http = serve_endpoint(
            s.host, s.http_port, registry, lambda: health(store, partitions, lambda: dict(host.desired))
        )
        log.info(
            "server %d serving cluster %s on %s:%d, http %s:%d (metadata %s, event loop %s)%s",
            membership.server_id,
            s.cluster,
            s.host,
            port,
            s.host,
            http.server_address[1],
            store.description,
            type(asyncio.get_running_loop()).__module__.partition(".")[0],
            f"; clients and storage nodes through mutual TLS (CA {config.tls.ca}), HTTP is plaintext"
            if config.tls.enabled
            else "",
        )
        if not config.tls.enabled:
            log.warning(NO_TLS_WARNING)
        if ready is not None:
            ready.set_result(port)
        notify(f"READY=1\nSTATUS=server {membership.server_id} serving cluster {s.cluster} on {s.host}:{port}")
        await stop.wait()
        notify("STOPPING=1")
        log.info("stopping server %d", membership.server_id)
        await asyncio.to_thread(membership.close)
        replica_watch.stop()
        await retention.close()
        server.close()
        await host.close()
        http.shutdown()
    finally:
        await asyncio.to_thread(store.close)
    log.info("server stopped")


def run(config: ServerConfig) -> None:
    """Serves until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    with asyncio.Runner(loop_factory=loop_factory(config.server.event_loop, "[server] event_loop")) as runner:
        runner.run(main())
