"""What a torture transaction's bytes carry, so that a drained log can be checked on its own.

A committed transaction must tell the checker which operation wrote it (the payload id) and what
the server checked it against (its locks and the client high-water mark the client sent), without
the history: replicas are drained from their files, where nothing else is known. The bytes are

    one line of compact JSON, sorted keys:
        {"a":[append locks],"h":client hwm,"n":total length,"p":"payload id","r":[read locks],"w":[write locks]}
    b"\\n"
    filler up to the total length: blake2b-256(payload id) repeated, cut to length

A workload with its own state (bank, list-append: `waltz/torture/workloads.py`) adds `"x"`, any
JSON value: what the operation did (a transfer, the lists it read and the values it appended),
so that its checker can replay the committed log alone; it seeds the filler with the payload id.

The filler is a function of the payload id and the length is recorded, so damage anywhere in the
bytes (not only in the JSON), truncation included, is found by `decode_payload`, even when every
copy is damaged the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any


class PayloadError(ValueError):
    """Bytes that are not an intact torture payload."""


@dataclasses.dataclass(frozen=True)
class Payload:
    payload: str
    """The operation's unique id (e.g. "p3-000017")."""
    client_hwm: int
    """The client high-water mark the transaction was built at (`TransactionBuilder.client_high_water_mark`)."""
    write_locks: tuple[str, ...] = ()
    read_locks: tuple[str, ...] = ()
    append_locks: tuple[str, ...] = ()
    extra: Any = None
    """The workload's own description of the operation (JSON; None for the plain workload)."""


def lock_name(name: str, id: int) -> str:
    """How a `PartitionLocalLock(name, id)` is written in histories and payloads."""
    return f"{name}:{id}"


def _filler(payload: str, n: int, extra: Any = None) -> bytes:
    # A workload's description seeds the filler too: a flip that leaves it valid JSON still shows.
    key = payload if extra is None else payload + json.dumps(extra, separators=(",", ":"), sort_keys=True)
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return (seed * (n // len(seed) + 1))[:n]


def encode_payload(
    payload: str,
    *,
    client_hwm: int,
    write_locks: Sequence[str] = (),
    read_locks: Sequence[str] = (),
    append_locks: Sequence[str] = (),
    size: int = 0,
    extra: Any = None,
) -> bytes:
    """The transaction data for one operation, padded to at least `size` bytes."""
    for group in (write_locks, read_locks, append_locks):
        if isinstance(group, str) or not all(isinstance(lock, str) for lock in group):
            raise TypeError(f"locks are sequences of strings (see lock_name), not {group!r}")
    if not isinstance(client_hwm, int) or isinstance(client_hwm, bool) or client_hwm < -1:
        raise ValueError(f"client_hwm must be an id >= -1, not {client_hwm!r}")
    fields = {"p": payload, "h": client_hwm, "w": list(write_locks), "r": list(read_locks), "a": list(append_locks)}
    if extra is not None:
        fields["x"] = extra
    n = size
    while True:  # the header holds the total length, which may grow with the header (a digit or two)
        head = json.dumps({**fields, "n": n}, separators=(",", ":"), sort_keys=True).encode() + b"\n"
        if len(head) <= n:
            return head + _filler(payload, n - len(head), extra)
        n = len(head)


def decode_payload(data: bytes) -> Payload:
    """The payload carried by `data`; PayloadError if the bytes are not exactly what
    `encode_payload` writes (damaged JSON, damaged or missing filler, foreign data)."""
    end = data.find(b"\n")
    if end < 0:
        raise PayloadError(f"no payload header line in {len(data)} bytes")
    try:
        obj: Any = json.loads(data[:end])
    except ValueError as e:
        raise PayloadError(f"payload header is not JSON: {e}") from None
    if not isinstance(obj, dict) or set(obj) - {"x"} != {"p", "h", "w", "r", "a", "n"}:
        raise PayloadError(f"payload header has the wrong fields: {data[: min(end, 200)]!r}")
    payload, hwm, n = obj["p"], obj["h"], obj["n"]
    if not isinstance(payload, str) or not all(isinstance(x, int) and not isinstance(x, bool) for x in (hwm, n)):
        raise PayloadError(f"payload header has the wrong types: {data[: min(end, 200)]!r}")
    locks: list[tuple[str, ...]] = []
    for key in ("w", "r", "a"):
        group = obj[key]
        if not isinstance(group, list) or not all(isinstance(lock, str) for lock in group):
            raise PayloadError(f"payload header's {key!r} locks are not a list of strings")
        locks.append(tuple(group))
    decoded = Payload(payload, hwm, locks[0], locks[1], locks[2], extra=obj.get("x"))
    if n != len(data):
        raise PayloadError(f"payload {payload!r} has {len(data)} bytes, not the {n} written")
    # Re-encoding pins down every byte: the header's exact spelling and the filler.
    expected = encode_payload(
        payload,
        client_hwm=hwm,
        write_locks=locks[0],
        read_locks=locks[1],
        append_locks=locks[2],
        size=n,
        extra=decoded.extra,
    )
    if expected != data:
        at = next((i for i, (a, b) in enumerate(zip(expected, data)) if a != b), min(len(expected), len(data)))
        raise PayloadError(f"payload {payload!r} is damaged at byte {at} of {len(data)}")
    return decoded


def digest(data: bytes, header: int = 0) -> str:
    """The hex digest every source (consumer, cluster, replica file) reports for a transaction:
    its 32-bit header and its data, so two sources agree only on identical bytes."""
    return hashlib.blake2b(header.to_bytes(4, "big", signed=True) + data, digest_size=16).hexdigest()
