"""Configuration files (TOML). Every key and its default is documented in docs/configuration.md;
an unknown key or a wrong type is an error naming the file and the key.

Environment variables override the file, so that one file can serve every member of a
container deployment: `WALTZ_STORAGE__<SECTION>__<KEY>` for a storage node and
`WALTZ_SERVER__<SECTION>__<KEY>` for a server (`WALTZ_STORAGE__NODE__PORT=55380`). An unknown
section or key, or a value that does not parse as the key's type, is an error naming the
variable."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import tomllib
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from waltz.errors import ConfigError as ConfigError
from waltz.event_loop import EVENT_LOOPS
from waltz.role_secrets import RoleSecretsSection
from waltz.tls import TlsSection


@dataclasses.dataclass(frozen=True)
class StorageSection:
    directory: pathlib.Path
    cluster_key: uuid.UUID | None = None
    partition_count: int | None = None
    segment_size: int = 1 << 30
    checkpoint_interval: int = 1000
    max_record_size: int = 16 << 20
    preallocate: int = 1 << 20


@dataclasses.dataclass(frozen=True)
class NodeSection:
    host: str = "127.0.0.1"
    port: int = 55280
    admin_port: int = 55281
    http_port: int = 55282
    max_frame: int = 64 << 20
    max_list_count: int = 10_000
    max_list_bytes: int = 16 << 20
    idle_timeout: float = 300.0
    max_in_flight: int = 1024
    max_connections: int = 4096
    retention_interval: float = 1.0
    retention_rate: int = 64 << 20


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    json: bool = False


@dataclasses.dataclass(frozen=True)
class StorageNodeConfig:
    storage: StorageSection
    node: NodeSection = NodeSection()
    logging: LoggingSection = LoggingSection()
    tls: TlsSection = TlsSection()
    role_secrets: RoleSecretsSection = RoleSecretsSection()


T = TypeVar("T")


def _section(cls: type[T], raw: dict[str, Any], where: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        kind = str(fields[name].type)
        try:
            values[name] = _coerce(kind, value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}.{name}: {e}") from None
    return cls(**values)


def _coerce(kind: str, value: Any) -> Any:
    if "Path" in kind:
        if not isinstance(value, str):
            raise TypeError(f"expected a path string, got {value!r}")
        return pathlib.Path(value)
    if "UUID" in kind:
        return uuid.UUID(str(value))
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if kind.startswith("int"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"expected an integer, got {value!r}")
        return value
    if kind.startswith("float"):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise TypeError(f"expected a finite number, got {value!r}")
        return float(value)
    if kind.startswith("str"):
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
    return value


def _requirer(where: str | pathlib.Path) -> Callable[[bool, str], None]:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {what}")

    return need


def _check_ranges(where: str, config: StorageNodeConfig) -> None:
    need = _requirer(where)
    n, st = config.node, config.storage
    for name in ("port", "admin_port", "http_port"):
        need(0 <= getattr(n, name) <= 65535, f"[node] {name} must be between 0 and 65535")
    for name in ("max_frame", "max_list_count", "max_list_bytes", "max_in_flight", "max_connections"):
        need(getattr(n, name) > 0, f"[node] {name} must be positive")
    need(0 < n.idle_timeout <= 86_400, "[node] idle_timeout must be between 0 and 86400 seconds")
    need(0 < n.retention_interval <= 86_400, "[node] retention_interval must be between 0 and 86400 seconds")
    need(n.retention_rate >= 0, "[node] retention_rate must be 0 (unpaced) or a positive number of bytes per second")
    need(st.partition_count is None or st.partition_count > 0, "[storage] partition_count must be positive")
    need(st.segment_size >= 4096, "[storage] segment_size must be at least 4096")
    need(st.checkpoint_interval > 0, "[storage] checkpoint_interval must be positive")
    need(0 < st.max_record_size <= 1 << 30, "[storage] max_record_size must be between 1 and 1 GiB")
    need(0 <= st.preallocate <= 1 << 30, "[storage] preallocate must be between 0 (off) and 1 GiB")


def _read_toml(path: pathlib.Path, sections: set[str]) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = sorted(set(raw) - sections)
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}")
    return raw


STORAGE_ENV_PREFIX = "WALTZ_STORAGE__"
SERVER_ENV_PREFIX = "WALTZ_SERVER__"


def _env_value(variable: str, kind: str, text: str) -> Any:
    """`text` as the key's type: strings, paths and UUIDs as written; numbers, booleans and lists
    as TOML values (`1_048_576`, `true`, `["a", "b"]`); empty for an optional key unsets it."""
    if text == "" and "None" in kind:
        return None
    if kind.startswith(("str", "Path", "pathlib.Path", "UUID", "uuid.UUID")):
        return text
    if kind.startswith("bool"):
        word = text.strip().lower()
        if word in ("true", "1", "yes", "on"):
            return True
        if word in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{variable}={text!r}: expected true or false")
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        what = "an integer" if kind.startswith("int") else "a number" if kind.startswith("float") else "a TOML value"
        raise ConfigError(f"{variable}={text!r}: expected {what}") from None


def _env_overrides(cls: type[Any], prefix: str, env: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The `prefix<SECTION>__<KEY>` variables of `env` as TOML tables (None: unset the key), and
    their names."""
    sections = typing.get_type_hints(cls)
    tables: dict[str, dict[str, Any]] = {}
    used = sorted(name for name in env if name.upper().startswith(prefix))
    for variable in used:
        section, sep, key = variable[len(prefix) :].lower().partition("__")
        if not sep or not key:
            raise ConfigError(f"{variable}: name a section and a key, as {prefix}<SECTION>__<KEY>")
        if section not in sections:
            raise ConfigError(f"{variable}: no section [{section}] (known: {', '.join(sections)})")
        fields = {f.name: str(f.type) for f in dataclasses.fields(sections[section])}
        if key not in fields:
            raise ConfigError(f"{variable}: no key {key} in [{section}] (known: {', '.join(fields)})")
        tables.setdefault(section, {})[key] = _env_value(variable, fields[key], env[variable])
    return tables, used


def _merge(raw: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`overrides` over `raw`; None (an empty variable) removes the key, leaving its default."""
    merged = {name: dict(table) for name, table in raw.items()}
    for section, table in overrides.items():
        target = merged.setdefault(section, {})
        for key, value in table.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    return merged


C = TypeVar("C")


def _load(
    path: pathlib.Path,
    cls: type[C],
    required: tuple[str, str],
    hint: str = "",
    *,
    env_prefix: str,
    env: Mapping[str, str] | None,
) -> tuple[C, str]:
    """Reads a TOML file whose sections are the fields of `cls` (each a dataclass), with the
    `env_prefix` variables of `env` (the process's environment by default) over it. Returns the
    configuration and the name its errors go by: the file, and the variables when there are any."""
    sections = typing.get_type_hints(cls)
    overrides, variables = _env_overrides(cls, env_prefix, os.environ if env is None else env)
    raw = _merge(_read_toml(path, set(sections)), overrides)
    where = f"{path} (with {', '.join(variables)})" if variables else str(path)
    section, key = required
    if section not in raw or key not in raw[section]:
        raise ConfigError(f"{where}: [{section}] {key} is required{hint}")
    values = {}
    for name, kind in sections.items():
        try:
            values[name] = _section(kind, raw.get(name, {}), f"{where} [{name}]")
        except ConfigError as e:
            # A section's own checks (TlsSection's) name the key; the file is added here.
            raise ConfigError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    config = cls(**values)
    level = config.logging.level  # type: ignore[attr-defined]
    _requirer(where)(
        level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "[logging] level: one of debug, info, warning, error"
    )
    return config, where


def load_storage_node_config(path: str | pathlib.Path, env: Mapping[str, str] | None = None) -> StorageNodeConfig:
    """The file at `path` with the `WALTZ_STORAGE__<SECTION>__<KEY>` variables of `env` (default:
    the process's environment) over it."""
    config, where = _load(
        pathlib.Path(path), StorageNodeConfig, ("storage", "directory"), env_prefix=STORAGE_ENV_PREFIX, env=env
    )
    _check_ranges(where, config)
    return config


@dataclasses.dataclass(frozen=True)
class ServerSection:
    metadata: str
    cluster: str = "default"
    host: str = "127.0.0.1"
    port: int = 55290
    http_port: int = 55291
    session_timeout: float = 10.0
    advertised_address: str = ""
    """`host:port` clients connect to, when it is not `host` and the bound port (a proxy, NAT)."""
    event_loop: str = "uvloop"
    """"uvloop" or "asyncio" (the standard library's): uvloop runs the same code with less CPU
    per event-loop turn, and a transaction crosses a dozen turns in the server."""
    max_connections: int = 4096
    """Client connections open at once; more are closed on accept. Lowered to what the file
    descriptor limit holds (raised first as far as the hard limit allows)."""
    handshake_timeout: float = 10.0
    """A client connection that sends no Hello within this is closed."""
    mount_timeout: float = 60.0
    """A connection that has not mounted any partition and sends no request for this long is
    closed. A mounted connection is never closed for silence (clients sit idle)."""
    max_frame_before_mount: int = 64 << 10
    """The largest frame taken from a connection that has not mounted (checked on the frame's
    length, before any of it is buffered); after a Mount, the client protocol's 64 MiB."""


@dataclasses.dataclass(frozen=True)
class PartitionSection:
    queue_limit: int = 10_000
    max_batch_records: int = 1000
    max_batch_bytes: int = 4 << 20
    max_batches_in_flight: int = 16
    gather_turns: int = 6
    """At most this many event-loop turns a new store batch waits for the partition's other
    clients, while one that appended in the last second has nothing queued or in flight (0 cuts
    at once: more store batches under load)."""
    lock_budget_bytes: int = 8 << 20
    feed_cache_bytes: int = 16 << 20
    data_cache_bytes: int = 64 << 20
    storage_timeout: float = 10.0
    max_transaction_bytes: int = (16 << 20) - 1024
    """Larger appends are refused (APPEND_REJECTED); keep it below the storage nodes'
    max_record_size minus 40 bytes."""
    max_transaction_locks: int = 4096
    """Appends with more locks (write, read and append together) are refused (APPEND_REJECTED):
    the lock check of one append holds the server's event loop, about 6 µs a lock."""
    checkpoint_interval: int = 100_000
    """Transactions after which a new store session starts (the spec's storage.checkpointInterval):
    it bounds what an inconsistent replica is truncated back by."""


FRAME_LIMIT = 64 << 20
"""The storage protocol's default frame limit (`[node] max_frame`): a store batch is one Append."""
CLIENT_FRAME_LIMIT = 64 << 20
"""The client protocol's frame limit once a connection has mounted."""
RECORD_FRAMING = 64
"""Bytes an Append spends around each record's data (id, request id, header, length, CRC), rounded up."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    server: ServerSection
    partition: PartitionSection = PartitionSection()
    logging: LoggingSection = LoggingSection()
    tls: TlsSection = TlsSection()
    role_secrets: RoleSecretsSection = RoleSecretsSection()


def load_server_config(path: str | pathlib.Path, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The file at `path` with the `WALTZ_SERVER__<SECTION>__<KEY>` variables of `env` (default:
    the process's environment) over it."""
    config, where = _load(
        pathlib.Path(path),
        ServerConfig,
        ("server", "metadata"),
        " (zk://host:port/chroot or embedded:/path/metadata.db)",
        env_prefix=SERVER_ENV_PREFIX,
        env=env,
    )
    need = _requirer(where)
    need(0 <= config.server.port <= 65535, "[server] port must be between 0 and 65535")
    need(0 <= config.server.http_port <= 65535, "[server] http_port must be between 0 and 65535")
    need(0 < config.server.session_timeout <= 600, "[server] session_timeout must be between 0 and 600 seconds")
    if config.server.advertised_address:
        host, sep, port = config.server.advertised_address.rpartition(":")
        need(
            bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
            "[server] advertised_address must be host:port",
        )
    need(config.server.max_connections > 0, "[server] max_connections must be positive")
    need(0 < config.server.handshake_timeout <= 600, "[server] handshake_timeout must be between 0 and 600 seconds")
    need(config.server.mount_timeout > 0, "[server] mount_timeout must be positive")
    need(
        1024 <= config.server.max_frame_before_mount <= CLIENT_FRAME_LIMIT,
        f"[server] max_frame_before_mount must be between 1024 and {CLIENT_FRAME_LIMIT}",
    )
    need(
        config.server.event_loop in EVENT_LOOPS,
        f"[server] event_loop must be one of {', '.join(map(repr, EVENT_LOOPS))}",
    )
    for f in dataclasses.fields(PartitionSection):
        if f.name != "gather_turns":
            need(getattr(config.partition, f.name) > 0, f"[partition] {f.name} must be positive")
    need(0 <= config.partition.gather_turns <= 1000, "[partition] gather_turns must be between 0 and 1000")
    p = config.partition
    frame = p.max_batch_bytes + p.max_transaction_bytes + p.max_batch_records * RECORD_FRAMING + 1024
    need(
        frame <= FRAME_LIMIT,
        f"[partition] max_batch_bytes + max_transaction_bytes (+ {RECORD_FRAMING} bytes per record of "
        "max_batch_records) "
        f"must fit one frame of {FRAME_LIMIT} bytes, the most a storage node takes ({frame} here): a batch gathers "
        "transactions while under max_batch_bytes, so its last one may bring it to their sum",
    )
    return config
