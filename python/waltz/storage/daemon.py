"""`waltz-node storage`: runs one storage node from a configuration file until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from waltz import errors
from waltz._native import Storage, StorageNode
from waltz.config import StorageNodeConfig
from waltz.limits import raise_file_limit
from waltz.sd_notify import notify
from waltz.storage.http import serve_http

log = logging.getLogger("waltz.storage")

NO_TLS_WARNING = (
    "TLS is not configured: every link of this node is plaintext and unauthenticated: anyone who reaches "
    "its ports can read and write the log ([tls] in docs/configuration.md)"
)
SECRETS_WITHOUT_TLS_WARNING = (
    "TLS is not configured: every link of this node is plaintext; peers prove their role with [role_secrets], "
    "which cross the network in clear, as does every record ([tls] in docs/configuration.md)"
)


def open_storage(config: StorageNodeConfig) -> Storage:
    """Opens the storage directory, creating it when the configuration names the cluster."""
    s = config.storage

    def with_tuning(make: Callable[..., Storage], *args: object) -> Storage:
        return make(
            *args,
            segment_size=s.segment_size,
            checkpoint_interval=s.checkpoint_interval,
            max_record_size=s.max_record_size,
            preallocate=s.preallocate,
        )

    try:
        return with_tuning(Storage.open, s.directory, s.cluster_key, s.partition_count)
    except errors.NotInitialisedError:
        if s.cluster_key is None or s.partition_count is None:
            raise errors.NotInitialisedError(
                f"{s.directory} is not a storage directory yet: set [storage] cluster_key and partition_count to "
                "create it"
            ) from None
        log.info("creating storage directory %s", s.directory)  # not the key: logs must not hold it
        return with_tuning(Storage.create, s.directory, s.cluster_key, s.partition_count)


FILES_BESIDES_CONNECTIONS = 256
"""Descriptors kept for segment, index and control files, the HTTP port and the interpreter."""


def fit_file_limit(max_connections: int) -> int:
    """`max_connections`, or fewer when the file descriptor limit cannot hold them: a storage
    connection holds three descriptors (its socket and its thread's event loop), an admin one its
    socket, and a node out of descriptors fails its next segment roll, and that partition refuses
    appends until reopened. The soft limit is raised as far as the hard one allows first."""
    need = 4 * max_connections + FILES_BESIDES_CONNECTIONS
    soft = raise_file_limit(need)
    if soft >= need:
        return max_connections
    fitted = max(16, (soft - FILES_BESIDES_CONNECTIONS) // 4)
    log.warning(
        "the file descriptor limit (%d) is below the %d that [node] max_connections = %d may take with the storage "
        "files: "
        "serving at most %d connections per port (raise the limit, ulimit -n, for more)",
        soft,
        need,
        max_connections,
        fitted,
    )
    return min(fitted, max_connections)


def check_connections_for_partitions(max_connections: int, partitions: int) -> None:
    """Each partition replica a node holds keeps one storage connection open for its store
    session (two while sessions hand over), beside readers and admin tools."""
    wanted = 2 * partitions + 64
    if max_connections < wanted:
        log.warning(
            "[node] max_connections = %d is low for the %d partitions this node holds: store sessions keep one "
            "connection "
            "per partition open (two during a hand-over); at least %d is advised",
            max_connections,
            partitions,
            wanted,
        )


def wait_for_stop(stop: threading.Event) -> None:
    """Waits in short slices until `stop` is set by the SIGTERM/SIGINT handler. Python runs
    signal handlers in the main thread, but the kernel may deliver the signal to any thread (the
    node's native threads included): an untimed wait of the main thread is then never
    interrupted and the node never stops (CI saw it three times at teardown). A slice that ends
    brings the main thread back to Python, which runs the pending handler."""
    while not stop.wait(0.5):
        pass


def run(config: StorageNodeConfig, ready: threading.Event | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then stops cleanly (queued appends finish their fsync)."""
    stop = threading.Event()
    storage = open_storage(config)
    node: StorageNode | None = None
    http = None
    previous = {}
    try:
        n, tls = config.node, config.tls
        max_connections = fit_file_limit(n.max_connections)
        check_connections_for_partitions(max_connections, len(storage.partition_ids()))
        node = StorageNode.start(
            storage,
            n.host,
            n.port,
            admin_port=n.admin_port,
            max_frame=n.max_frame,
            max_list_count=n.max_list_count,
            max_list_bytes=n.max_list_bytes,
            idle_timeout=n.idle_timeout,
            max_in_flight=n.max_in_flight,
            max_connections=max_connections,
            retention_interval=n.retention_interval,
            retention_rate=n.retention_rate,
            tls_ca=tls.ca,
            tls_cert=tls.cert,
            tls_key=tls.key,
            role_secrets=config.role_secrets.admitted("server", "admin"),
        )
        http = serve_http(storage, node, n.host, n.http_port)
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        host, port = node.address
        admin = node.admin_address
        log.info(
            "storage node serving %s on %s:%d (admin %s:%d, http %s:%d)%s",
            storage.path,
            host,
            port,
            admin[0] if admin else "-",
            admin[1] if admin else 0,
            n.host,
            http.server_address[1],
            f"; storage and admin ports take only mutual TLS (CA {tls.ca}), HTTP is plaintext" if tls.enabled else "",
        )
        if not tls.enabled:
            log.warning(
                SECRETS_WITHOUT_TLS_WARNING if config.role_secrets.admitted("server", "admin") else NO_TLS_WARNING
            )
        if ready is not None:
            ready.set()
        notify(f"READY=1\nSTATUS=serving {storage.path} on {host}:{port}")
        wait_for_stop(stop)
        notify("STOPPING=1")
        log.info("stopping storage node")
    finally:
        if http is not None:
            http.shutdown()
        if node is not None:
            node.stop()
        storage.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("storage node stopped")
