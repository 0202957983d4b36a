"""The drained logs: what each source (the cluster's feed, each replica's files) holds per
partition after the faults healed, as an ordered list of `Record`s.

In memory: `{source: {partition: [Record, ...]}}`. On disk, JSON lines (`DrainWriter`,
`read_drains`), one record per line: `{"source": "cluster", "partition": 0, "txid": 57,
"digest": "..", "payload": "p3-000017", "client_hwm": 41, "write_locks": [..],
"read_locks": [..], "append_locks": [..], "error": null}`; a source's records of a partition in
log order. Build records with `record_from_bytes`, which decodes the payload.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from waltz.torture.jsonl import HistoryError, JsonLinesWriter, expand_paths, read_json_lines
from waltz.torture.payload import PayloadError, decode_payload, digest

Drains = Mapping[str, Mapping[int, Sequence["Record"]]]


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    txid: int
    digest: str
    payload: str | None
    """None when the bytes did not decode (then `error` says why)."""
    client_hwm: int | None = None
    write_locks: tuple[str, ...] = ()
    read_locks: tuple[str, ...] = ()
    append_locks: tuple[str, ...] = ()
    error: str | None = None
    extra: Any = dataclasses.field(default=None, compare=False, hash=False)
    """The workload's description of the operation (payload "x"), None for the plain workload."""

    def describe(self, source: str) -> str:
        what = self.payload if self.payload is not None else f"undecodable ({self.error})"
        locks = (
            f" hwm={self.client_hwm} w={list(self.write_locks)} r={list(self.read_locks)}"
            if self.payload is not None
            else ""
        )
        if self.append_locks:
            locks += f" a={list(self.append_locks)}"
        return f"{source} txid={self.txid} {what}{locks} digest={self.digest[:12]}"

    def to_json_obj(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("write_locks", "read_locks", "append_locks"):
            out[key] = list(out[key])
        return out


def record_from_bytes(txid: int, data: bytes, header: int = 0) -> Record:
    """The record of transaction `txid` with these bytes, its payload decoded if it can be."""
    d = digest(data, header)
    try:
        p = decode_payload(data)
    except PayloadError as e:
        return Record(txid, d, None, error=str(e))
    return Record(txid, d, p.payload, p.client_hwm, p.write_locks, p.read_locks, p.append_locks, extra=p.extra)


class DrainWriter:
    """Streams drained records to a JSON lines file (one per line, so a huge drain never sits in memory)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._out = JsonLinesWriter(path)

    def record(self, source: str, partition: int, record: Record) -> None:
        self._out.write({"source": source, "partition": partition, **record.to_json_obj()})

    def close(self) -> None:
        self._out.close()

    def __enter__(self) -> DrainWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_drains(path: str | os.PathLike[str], drains: Drains) -> None:
    with DrainWriter(path) as out:
        for source, partitions in drains.items():
            for partition, records in partitions.items():
                for record in records:
                    out.record(source, partition, record)


def _record(obj: Mapping[str, Any], where: str) -> tuple[str, int, Record]:
    def field(key: str, kind: type, optional: bool = False) -> Any:
        value = obj.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise HistoryError(f"{where}: {key!r} must be {kind.__name__}, not {value!r}")
        return value

    locks = []
    for key in ("write_locks", "read_locks", "append_locks"):
        group = obj.get(key) or []
        if not isinstance(group, list) or not all(isinstance(x, str) for x in group):
            raise HistoryError(f"{where}: {key!r} must be a list of strings")
        locks.append(tuple(group))
    record = Record(
        field("txid", int),
        field("digest", str),
        field("payload", str, True),
        field("client_hwm", int, True),
        write_locks=locks[0],
        read_locks=locks[1],
        append_locks=locks[2],
        error=field("error", str, True),
        extra=obj.get("extra"),
    )
    return field("source", str), field("partition", int), record


def read_drains(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> dict[str, dict[int, list[Record]]]:
    """`{source: {partition: [records in file order]}}` from the given files (or directories)."""
    out: dict[str, dict[int, list[Record]]] = {}
    ignored: list[str] = []
    for path in expand_paths(paths):
        for number, obj in read_json_lines(path, ignored):
            source, partition, record = _record(obj, f"{path}:{number}")
            out.setdefault(source, {}).setdefault(partition, []).append(record)
    return out
