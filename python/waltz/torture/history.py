"""The history of a torture run: one JSON object per line, one line per event, written by every
workload process as it goes (`HistoryWriter`) and read back whole (`read_history`).

Every event has `process` (int or str), `f`, `partition` (int) and `time` (`time.monotonic_ns()`:
one clock for every process of the machine, so events of different processes compare).

- `"f": "append"`, one operation per unique `payload` id, `type` one of
  - `"invoke"` before the transaction is submitted, with `write_locks`, `read_locks`,
    `append_locks` (lists of strings, default empty) and optionally `client_hwm`;
  - then at most one completion: `"ok"` with `txid` (acknowledged as committed at that id),
    `"fail"` (certainly not committed), `"info"` (outcome unknown, e.g. a timeout); optional
    `error` (string). No completion (the process died) counts as `"info"`; an `"info"` may
    be followed by a definite `"ok"` or `"fail"`.
- `"f": "read"`: a consumer received `txid` of `partition` with `payload` (decoded from the
  data, or null if it did not decode) and `digest` (`payload.digest(data, header)`);
  `connection` counts the consumer's reconnects. A consumer's stream is its (process, partition).
- `"f": "hwm"`: the partition's committed high-water mark was `value`; `time` is when the answer
  arrived and `invoked` (optional) when it was asked. Without `invoked` an observation is only
  compared with the same process's earlier ones (ask one at a time).

`type` may be left out for `read` and `hwm`. Events with any other `f` (a nemesis's log) are kept
in `History.other` and ignored by the checker.
"""

from __future__ import annotations

import dataclasses
import os
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from waltz.torture.jsonl import HistoryError, JsonLinesWriter, expand_paths, read_json_lines

APPEND, READ, HWM = "append", "read", "hwm"
INVOKE, OK, FAIL, INFO = "invoke", "ok", "fail", "info"
_COMPLETIONS = (OK, FAIL, INFO)


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    f: str
    type: str
    process: int | str
    partition: int
    time: int
    payload: str | None = None
    txid: int | None = None
    digest: str | None = None
    connection: int = 0
    value: int | None = None
    invoked: int | None = None
    write_locks: tuple[str, ...] = ()
    read_locks: tuple[str, ...] = ()
    append_locks: tuple[str, ...] = ()
    client_hwm: int | None = None
    error: str | None = None
    where: str = ""
    """file:line the event was read from, for reports."""

    def describe(self) -> str:
        """One line for a report: who did what, and where it is in the history."""
        parts = [f"process {self.process}", f"{self.type} {self.f}"]
        if self.payload is not None:
            parts.append(self.payload)
        if self.txid is not None:
            parts.append(f"txid={self.txid}")
        if self.f == READ:
            parts.append(f"connection={self.connection}")
        if self.value is not None:
            parts.append(f"value={self.value}")
        if self.f == APPEND and self.type == INVOKE:
            parts.append(
                f"w={list(self.write_locks)} r={list(self.read_locks)}"
                + (f" a={list(self.append_locks)}" if self.append_locks else "")
            )
        if self.error:
            parts.append(f"error={self.error!r}")
        parts.append(f"t={self.time}")
        return " ".join(parts) + (f" @ {self.where}" if self.where else "")

    def to_json_obj(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "process": self.process,
            "f": self.f,
            "type": self.type,
            "partition": self.partition,
            "time": self.time,
        }
        for key in ("payload", "txid", "digest", "value", "invoked", "client_hwm", "error"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.f == READ:
            out["connection"] = self.connection
        if self.f == APPEND and self.type == INVOKE:
            out.update(
                write_locks=list(self.write_locks),
                read_locks=list(self.read_locks),
                append_locks=list(self.append_locks),
            )
        if self.where:
            out["at"] = self.where
        return out


@dataclasses.dataclass
class History:
    events: list[Event]
    """Checked events in file order, files in the order given: each process's events in the order it wrote them."""
    other: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Events of other kinds (`f` not append/read/hwm), untouched."""
    warnings: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_objects(cls, objects: Iterable[Mapping[str, Any]], source: str = "<memory>") -> History:
        """A history from already parsed lines (validated as `read_history` does)."""
        history = cls([])
        for number, obj in enumerate(objects, start=1):
            history._add(obj, f"{source}:{number}")
        return history

    def _add(self, obj: Mapping[str, Any], where: str) -> None:
        event = parse_event(obj, where)
        if event is None:
            self.other.append(dict(obj))
        else:
            self.events.append(event)


def read_history(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> History:
    """Every event of the given files (a directory stands for its `*.jsonl`). A torn last line
    is skipped with a warning (`History.warnings`); any other bad line raises HistoryError."""
    history = History([])
    for path in expand_paths(paths):
        for number, obj in read_json_lines(path, history.warnings):
            history._add(obj, f"{path}:{number}")
    return history


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, *, required: bool = True) -> Any:
    value = obj.get(key)
    if value is None:
        if required:
            raise HistoryError(f"{where}: missing {key!r}")
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise HistoryError(f"{where}: {key!r} must be {getattr(kind, '__name__', kind)}, not {value!r}")
    return value


def _locks(obj: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = obj.get(key) or []
    if not isinstance(value, list) or not all(isinstance(lock, str) for lock in value):
        raise HistoryError(f"{where}: {key!r} must be a list of strings, not {value!r}")
    return tuple(value)


def parse_event(obj: Mapping[str, Any], where: str) -> Event | None:
    """The event of one line; None for an `f` the checker does not know; HistoryError if malformed."""
    f = obj.get("f")
    if f not in (APPEND, READ, HWM):
        return None
    process = obj.get("process")
    if not isinstance(process, (int, str)) or isinstance(process, bool):
        raise HistoryError(f"{where}: 'process' must be an int or a string, not {process!r}")
    common: dict[str, Any] = dict(
        f=f,
        process=process,
        partition=_get(obj, "partition", int, where),
        time=_get(obj, "time", int, where),
        where=where,
    )
    if f == APPEND:
        type_ = _get(obj, "type", str, where)
        payload = _get(obj, "payload", str, where)
        if type_ == INVOKE:
            return Event(
                type=type_,
                payload=payload,
                client_hwm=_get(obj, "client_hwm", int, where, required=False),
                write_locks=_locks(obj, "write_locks", where),
                read_locks=_locks(obj, "read_locks", where),
                append_locks=_locks(obj, "append_locks", where),
                **common,
            )
        if type_ not in _COMPLETIONS:
            raise HistoryError(f"{where}: an append's 'type' is one of invoke, ok, fail, info; not {type_!r}")
        return Event(
            type=type_,
            payload=payload,
            txid=_get(obj, "txid", int, where, required=type_ == OK),
            error=_get(obj, "error", str, where, required=False),
            **common,
        )
    type_ = obj.get("type", OK)
    if type_ != OK:
        raise HistoryError(f"{where}: a {f} is an observation: its 'type' can only be 'ok', not {type_!r}")
    if f == READ:
        return Event(
            type=OK,
            txid=_get(obj, "txid", int, where),
            payload=_get(obj, "payload", str, where, required=False),
            digest=_get(obj, "digest", str, where),
            connection=_get(obj, "connection", int, where, required=False) or 0,
            **common,
        )
    return Event(
        type=OK,
        value=_get(obj, "value", int, where),
        invoked=_get(obj, "invoked", int, where, required=False),
        **common,
    )


class HistoryWriter:
    """One workload process's history file (append-only; one write per event, so a SIGKILL loses
    at most the event being written). Give each process its own file; `time` defaults to now."""

    def __init__(self, path: str | os.PathLike[str], process: int | str, *, fsync: bool = False) -> None:
        self.process = process
        self._out = JsonLinesWriter(path, fsync=fsync)

    def _emit(self, f: str, type_: str, partition: int, time: int | None, fields: dict[str, Any]) -> None:
        event = {
            "process": self.process,
            "type": type_,
            "f": f,
            "partition": partition,
            "time": _time.monotonic_ns() if time is None else time,
        }
        event.update((k, v) for k, v in fields.items() if v is not None)
        self._out.write(event)

    def invoke(
        self,
        partition: int,
        payload: str,
        *,
        write_locks: Sequence[str] = (),
        read_locks: Sequence[str] = (),
        append_locks: Sequence[str] = (),
        client_hwm: int | None = None,
        time: int | None = None,
    ) -> None:
        """Before submitting: the locks of the first execution (the committed bytes carry the
        ones the server checked)."""
        self._emit(
            APPEND,
            INVOKE,
            partition,
            time,
            dict(
                payload=payload,
                write_locks=list(write_locks),
                read_locks=list(read_locks),
                append_locks=list(append_locks) or None,
                client_hwm=client_hwm,
            ),
        )

    def ok(self, partition: int, payload: str, txid: int, *, time: int | None = None) -> None:
        self._emit(APPEND, OK, partition, time, dict(payload=payload, txid=txid))

    def fail(self, partition: int, payload: str, *, error: str | None = None, time: int | None = None) -> None:
        """Only when the transaction certainly did not commit."""
        self._emit(APPEND, FAIL, partition, time, dict(payload=payload, error=error))

    def info(self, partition: int, payload: str, *, error: str | None = None, time: int | None = None) -> None:
        self._emit(APPEND, INFO, partition, time, dict(payload=payload, error=error))

    def read(
        self, partition: int, txid: int, payload: str | None, digest: str, connection: int, *, time: int | None = None
    ) -> None:
        self._emit(READ, OK, partition, time, dict(txid=txid, payload=payload, digest=digest, connection=connection))

    def hwm(self, partition: int, value: int, *, invoked: int | None = None, time: int | None = None) -> None:
        """`invoked`: `time.monotonic_ns()` taken before asking."""
        self._emit(HWM, OK, partition, time, dict(value=value, invoked=invoked))

    def write(self, obj: Mapping[str, Any]) -> None:
        """Any other event, as is (e.g. `{"f": "nemesis", ...}`, kept in `History.other`)."""
        self._out.write(obj)

    def close(self) -> None:
        self._out.close()

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
