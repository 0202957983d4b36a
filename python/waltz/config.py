"""Configuration files (TOML). Every key and its default is documented in docs/configuration.md;
an unknown key or a wrong type is an error naming the file and the key."""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
import uuid
from typing import Any, TypeVar

from waltz.errors import WaltzError


class ConfigError(WaltzError, ValueError):
    """A configuration file is missing, unreadable, or has a bad key or value."""


@dataclasses.dataclass(frozen=True)
class StorageSection:
    directory: pathlib.Path
    cluster_key: uuid.UUID | None = None
    partition_count: int | None = None
    segment_size: int = 1 << 30
    checkpoint_interval: int = 1000
    max_record_size: int = 16 << 20


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


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    json: bool = False


@dataclasses.dataclass(frozen=True)
class StorageNodeConfig:
    storage: StorageSection
    node: NodeSection = NodeSection()
    logging: LoggingSection = LoggingSection()


T = TypeVar("T")


def _section(cls: type[T], raw: dict[str, Any], where: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        kind = fields[name].type
        try:
            if "Path" in str(kind):
                value = pathlib.Path(value)
            elif "UUID" in str(kind):
                value = uuid.UUID(str(value))
            elif "int" in str(kind) and not isinstance(value, int) or isinstance(value, bool) and "bool" not in str(kind):
                raise TypeError(f"expected an integer, got {value!r}")
            elif "float" in str(kind):
                value = float(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}.{name}: {e}") from None
        values[name] = value
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_storage_node_config(path: str | pathlib.Path) -> StorageNodeConfig:
    path = pathlib.Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = sorted(set(raw) - {"storage", "node", "logging"})
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}")
    if "storage" not in raw or "directory" not in raw["storage"]:
        raise ConfigError(f"{path}: [storage] directory is required")
    config = StorageNodeConfig(
        storage=_section(StorageSection, raw["storage"], f"{path} [storage]"),
        node=_section(NodeSection, raw.get("node", {}), f"{path} [node]"),
        logging=_section(LoggingSection, raw.get("logging", {}), f"{path} [logging]"),
    )
    if config.logging.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"{path} [logging] level: one of debug, info, warning, error")
    return config
