"""Retention in the cluster's metadata: the policy (cluster-wide, with per-partition overrides)
and the holds, in one entry, `<root>/retention`, changed by compare-and-set.

Absent, the entry means "keep everything", as does a policy with neither a maximum age nor a
maximum size. Servers watch it and hand each replica of the partitions they serve an order
(`waltz.server.retention`); storage nodes delete by it, never above their own low-water mark
(docs/internals.md, "Retention").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from waltz import clock, errors
from waltz.cluster.layout import decode, encode
from waltz.cluster.store import DataWatch, Stat

NO_HOLD = 2**63 - 1
"""`hold_from` when no hold protects anything on a partition."""

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_UNITS_BYTES = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_NONE = ("none", "unlimited", "off")


def parse_duration(text: str) -> int | None:
    """Milliseconds from `7d`, `12h`, `30m`, `45s`, `500ms` (or several: `1h30m`); None for
    `none`. Raises `InvalidArgumentError` with what is wrong."""
    t = text.strip().lower()
    if t in _NONE:
        return None
    parts = re.findall(r"(\d+)\s*(ms|s|m|h|d|w)", t)
    if not parts or re.sub(r"\d+\s*(ms|s|m|h|d|w)", "", t).strip():
        raise errors.InvalidArgumentError(
            f"bad duration {text!r}: a number and a unit (ms, s, m, h, d, w), e.g. 7d or 12h30m, or 'none'"
        )
    ms = sum(int(n) * _UNITS_MS[u] for n, u in parts)
    if ms <= 0:
        raise errors.InvalidArgumentError(f"bad duration {text!r}: must be above zero (or 'none')")
    return ms


def parse_size(text: str) -> int | None:
    """Bytes from `500MB`, `10GiB`, `1048576`; None for `none`."""
    t = text.strip().lower().replace(" ", "")
    if t in _NONE:
        return None
    m = re.fullmatch(r"(\d+)([a-z]*)", t)
    if not m or m.group(2) not in _UNITS_BYTES:
        raise errors.InvalidArgumentError(
            f"bad size {text!r}: a number and an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or 'none'"
        )
    n = int(m.group(1)) * _UNITS_BYTES[m.group(2)]
    if n <= 0:
        raise errors.InvalidArgumentError(f"bad size {text!r}: must be above zero (or 'none')")
    return n


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    max_age_ms: int | None = None
    """A sealed segment goes once its newest transaction is older than this."""
    max_bytes: int | None = None
    """The oldest segments go while a replica holds more than this of the partition."""
    min_kept: int = 0
    """Transactions always kept below the low-water mark, however old or large."""

    @property
    def keeps_everything(self) -> bool:
        return self.max_age_ms is None and self.max_bytes is None


@dataclasses.dataclass(frozen=True)
class Hold:
    name: str
    partition: int
    txid: int
    """Protected: this id and every later one stay on every replica while the hold is active."""
    created_ms: int
    expires_ms: int | None = None

    def active(self, now_ms: int) -> bool:
        return self.expires_ms is None or now_ms < self.expires_ms


_FIELDS = ("max_age_ms", "max_bytes", "min_kept")


@dataclasses.dataclass(frozen=True)
class RetentionConfig:
    default: RetentionPolicy = RetentionPolicy()
    overrides: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Partition → the fields it sets differently (a field absent inherits the default; None
    means no limit on that count)."""
    holds: dict[str, Hold] = dataclasses.field(default_factory=dict)

    def policy_for(self, partition: int) -> RetentionPolicy:
        return dataclasses.replace(self.default, **self.overrides.get(partition, {}))

    def hold_from(self, partition: int, now_ms: int) -> int:
        """The lowest id an active hold protects on `partition`, or `NO_HOLD`."""
        ids = [h.txid for h in self.holds.values() if h.partition == partition and h.active(now_ms)]
        return min(ids, default=NO_HOLD)

    def to_json(self) -> dict[str, Any]:
        return {
            "default": dataclasses.asdict(self.default),
            "partitions": {str(p): dict(o) for p, o in sorted(self.overrides.items())},
            "holds": {n: dataclasses.asdict(h) for n, h in sorted(self.holds.items())},
        }

    @staticmethod
    def from_json(d: dict[str, Any] | None) -> RetentionConfig:
        if not d:
            return RetentionConfig()
        default = RetentionPolicy(**{k: d.get("default", {}).get(k, getattr(RetentionPolicy(), k)) for k in _FIELDS})
        overrides = {int(p): {k: v for k, v in o.items() if k in _FIELDS} for p, o in d.get("partitions", {}).items()}
        holds = {n: Hold(**h) for n, h in d.get("holds", {}).items()}
        return RetentionConfig(default, overrides, holds)


def read(meta: Any) -> tuple[RetentionConfig, int]:
    """(config, version); version -1 when the entry does not exist yet."""
    try:
        data, stat = meta.store.get(meta.paths.retention)
    except errors.MetadataNotFoundError:
        meta.info()  # a clear error when the cluster itself is missing
        return RetentionConfig(), -1
    return RetentionConfig.from_json(decode(data, meta.paths.retention)), stat.version


def change(meta: Any, fn: Callable[[RetentionConfig], RetentionConfig]) -> RetentionConfig:
    """Applies `fn` by compare-and-set (creating the entry on first use); returns the result."""
    while True:
        config, version = read(meta)
        new = fn(config)
        body = encode(new.to_json())
        try:
            if version < 0:
                meta.store.create(meta.paths.retention, body)
            else:
                meta.store.set(meta.paths.retention, body, version=version)
            return new
        except (errors.MetadataVersionError, errors.MetadataExistsError):
            continue


def watch(meta: Any, fn: Callable[[RetentionConfig], None]) -> DataWatch:
    """Calls `fn(config)` now and after every change (keep-everything while absent)."""

    def on_data(data: bytes | None, _stat: Stat | None) -> None:
        fn(RetentionConfig.from_json(decode(data, meta.paths.retention)) if data else RetentionConfig())

    return DataWatch(meta.store, meta.paths.retention, on_data)


def set_policy(meta: Any, partition: int | None, clear: bool = False, **fields: Any) -> RetentionConfig:
    """Sets the cluster-wide policy's `fields` (partition None) or a partition's overrides;
    `clear` drops a partition's overrides first."""
    if partition is not None:
        meta._check_partition(partition)
    for k, v in fields.items():
        if k not in _FIELDS:
            raise errors.InvalidArgumentError(f"unknown retention field {k!r}")
        if v is not None and (not isinstance(v, int) or v < 0):
            raise errors.InvalidArgumentError(f"{k} must be a non-negative integer, or none")
    if fields.get("min_kept", 0) is None:
        raise errors.InvalidArgumentError("min_kept is a number of transactions (0 for none)")

    def apply(c: RetentionConfig) -> RetentionConfig:
        if partition is None:
            return dataclasses.replace(c, default=dataclasses.replace(c.default, **fields))
        overrides = dict(c.overrides)
        mine = {} if clear else dict(overrides.get(partition, {}))
        mine.update(fields)
        if mine:
            overrides[partition] = mine
        else:
            overrides.pop(partition, None)
        return dataclasses.replace(c, overrides=overrides)

    return change(meta, apply)


def add_hold(meta: Any, name: str, partition: int, txid: int, ttl_ms: int | None) -> Hold:
    if not name or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", name):
        raise errors.InvalidArgumentError(f"bad hold name {name!r}: 1 to 128 letters, digits, '_', '.', ':' or '-'")
    if txid < 0:
        raise errors.InvalidArgumentError(f"a hold protects a transaction id (0 or above), not {txid}")
    meta._check_partition(partition)
    now = clock.now_ms()
    hold = Hold(name, partition, txid, now, None if ttl_ms is None else now + ttl_ms)

    def apply(c: RetentionConfig) -> RetentionConfig:
        return dataclasses.replace(c, holds={**c.holds, name: hold})

    change(meta, apply)
    return hold


def release_hold(meta: Any, name: str) -> bool:
    """Removes the hold; False when there was none of that name."""
    found: list[bool] = []

    def apply(c: RetentionConfig) -> RetentionConfig:
        found[:] = [name in c.holds]
        return dataclasses.replace(c, holds={n: h for n, h in c.holds.items() if n != name})

    change(meta, apply)
    return found[0]


__all__ = [
    "NO_HOLD",
    "Hold",
    "RetentionConfig",
    "RetentionPolicy",
    "add_hold",
    "change",
    "parse_duration",
    "parse_size",
    "read",
    "release_hold",
    "set_policy",
    "watch",
]
