"""The client's configuration: a dataclass to build in code, or the `[client]` section of a TOML
file (`ClientConfig.from_file`). Every key and its default is in docs/configuration.md."""

from __future__ import annotations

import dataclasses
import pathlib

from waltz.client_protocol import MAX_DATA_RANGE_BYTES
from waltz.config import ConfigError, _read_toml, _requirer, _section
from waltz.event_loop import EVENT_LOOPS
from waltz.tls import TlsSection, check

_WHERE = "client config"


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    metadata: str
    """The cluster's metadata store: `zk://host:port[/chroot]` or `embedded:/path/metadata.db`."""
    cluster: str = "default"
    client_id: int = -1
    """-1: a new id from the cluster for every client instance (ids must never be reused while
    a transaction of the old owner may still be pending)."""
    client_secret: str = ""
    """With a fixed `client_id`: the secret its Mounts prove (their token is derived from it), so
    that a restart takes the id over at once from the previous run's connections, even ones the
    server has not yet seen die. Empty: a random token per client instance; a restart then waits
    until the server has closed the previous run's connections (docs/client.md, client identity)."""
    max_pending: int = 256
    """Transactions per partition submitted and not yet completed; `submit` waits beyond it."""
    mount_timeout: float = 30.0
    """How long mounting a partition may take (find its server, replay the feed) before the
    waiting transactions fail with `MountTimeoutError`; mounting goes on in the background."""
    request_timeout: float = 30.0
    """How long a transaction data or high-water mark request may take, retries included."""
    transaction_timeout: float = 60.0
    """A context not completed this long after its submit expires instead of being retried."""
    settle_after: float = 1.0
    """An append neither committed nor refused after this long is settled with a Flush (the
    server may have dropped it: a stale generation)."""
    reconnect_backoff: float = 0.05
    """The first retry's upper bound (remount, reconnect, request, apply): waits are drawn
    with full jitter, uniform in [0, min(reconnect_backoff_max, reconnect_backoff * 2**n)]."""
    reconnect_backoff_max: float = 2.0
    retry_seed: int | None = None
    """Seeds the retry delays' random numbers (tests); None: from the OS, so that clients do
    not retry in lockstep."""
    partitions: tuple[int, ...] | None = None
    """Mount only these partitions (the Java client's `setPartitions`): instances of one service
    split the partitions between them. None: every partition of the cluster."""
    callback_threads: int = 4
    """Threads running the application's plain (non-async) callbacks and contexts."""
    event_loop: str = "uvloop"
    """The loop of `WaltzClient`'s own thread: "uvloop" or "asyncio" (the standard library's);
    uvloop takes less CPU per transaction. Not used by `AsyncWaltzClient` (the application's loop)."""
    metadata_session_timeout: float = 10.0
    max_frame: int = 64 << 20
    """The largest frame accepted from a server."""
    data_prefetch_bytes: int = 4 << 20
    """The first `Transaction.data()` of an applied batch fetches the data of the batch's later
    transactions too, in ranges of up to this many bytes (one round trip each instead of one per
    transaction). 0: each `data()` is its own request (for applications that read the data of
    few transactions, chosen by header). At most 16 MiB."""
    tls_ca: pathlib.Path | None = None
    """With tls_cert and tls_key: connect to servers through mutual TLS; their certificates must
    chain to this CA (PEM)."""
    tls_cert: pathlib.Path | None = None
    """The client's certificate (PEM), presented to servers."""
    tls_key: pathlib.Path | None = None
    """The private key of `tls_cert` (PEM, unencrypted)."""
    role_secret: str = dataclasses.field(default="", repr=False)
    """The client role's shared secret (a server's `[role_secrets] client`), given in the Hello of
    every connection to a server: what a plaintext cluster asks of clients instead of a
    certificate. It crosses the network in clear (docs/operations.md, "Security model")."""

    def __post_init__(self) -> None:
        need = _requirer(pathlib.Path(_WHERE))
        need(bool(self.metadata), "metadata is required (zk://host:port/chroot or embedded:/path/metadata.db)")
        need(
            self.client_id == -1 or 0 <= self.client_id < 2**31,
            "client_id must be -1 (a new id) or a non-negative 32-bit id",
        )
        need(not self.client_secret or self.client_id >= 0, "client_secret needs a fixed client_id")
        need(not self.client_secret or len(self.client_secret) >= 16, "client_secret must be at least 16 characters")
        need(not self.role_secret or len(self.role_secret) >= 16, "role_secret must be at least 16 characters")
        for name in ("max_pending", "callback_threads", "max_frame"):
            need(getattr(self, name) > 0, f"{name} must be positive")
        for name in (
            "mount_timeout",
            "request_timeout",
            "transaction_timeout",
            "settle_after",
            "reconnect_backoff",
            "reconnect_backoff_max",
            "metadata_session_timeout",
        ):
            need(getattr(self, name) > 0, f"{name} must be a positive number of seconds")
        need(
            0 <= self.data_prefetch_bytes <= MAX_DATA_RANGE_BYTES,
            f"data_prefetch_bytes must be 0 (no prefetch) to {MAX_DATA_RANGE_BYTES}",
        )
        need(self.event_loop in EVENT_LOOPS, f"event_loop must be one of {', '.join(map(repr, EVENT_LOOPS))}")
        need(
            self.reconnect_backoff <= self.reconnect_backoff_max,
            "reconnect_backoff must not exceed reconnect_backoff_max",
        )
        if self.partitions is not None:
            if not isinstance(self.partitions, (list, tuple, set, frozenset)):
                need(False, "partitions must be a list of partition ids (or absent: every partition)")
            parts = tuple(sorted(set(self.partitions)))
            need(bool(parts), "partitions must name at least one partition (or be absent: every partition)")
            need(
                all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in parts),
                "partitions must be non-negative partition ids",
            )
            object.__setattr__(self, "partitions", parts)
        for name in ("tls_ca", "tls_cert", "tls_key"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, pathlib.Path(getattr(self, name)))
        check([self.tls_ca, self.tls_cert, self.tls_key], ("tls_ca", "tls_cert", "tls_key"), _WHERE + ":")

    @property
    def tls(self) -> TlsSection:
        """The TLS settings as a `TlsSection` (not enabled when no tls_* key is set)."""
        return TlsSection(self.tls_ca, self.tls_cert, self.tls_key)

    @staticmethod
    def from_file(path: str | pathlib.Path) -> ClientConfig:
        path = pathlib.Path(path)
        raw = _read_toml(path, {"client"})
        if "metadata" not in raw.get("client", {}):
            raise ConfigError(
                f"{path}: [client] metadata is required (zk://host:port/chroot or embedded:/path/metadata.db)"
            )
        try:
            return _section(ClientConfig, raw["client"], f"{path} [client]")
        except ConfigError as e:
            if str(e).startswith(str(path)):
                raise
            # __post_init__'s checks name the key; the file is added here
            raise ConfigError(f"{path} [client]: {str(e).removeprefix(_WHERE + ': ')}") from None
