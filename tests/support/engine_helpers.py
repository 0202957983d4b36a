"""Shared test helpers: deterministic payloads and whole-log checks."""

from __future__ import annotations

import hashlib
import os
import pathlib

from waltz.storage import Partition, ReqId


def payload(txid: int, size: int | None = None) -> bytes:
    """The bytes transaction `txid` carries: derived from the id, so any reader can check them."""
    seed = hashlib.sha256(str(txid).encode()).digest()
    n = size if size is not None else 1 + (txid * 37) % 300
    return (seed * (n // len(seed) + 1))[:n]


def records(start: int, count: int, size: int | None = None) -> list[tuple[ReqId, int, bytes]]:
    return [(ReqId(7, 1, 0, t), t % 1000, payload(t, size)) for t in range(start, start + count)]


def append_range(p: Partition, start: int, count: int, size: int | None = None) -> int:
    return p.append(start, records(start, count, size))


def assert_log(p: Partition, last: int, first: int = 0) -> None:
    """The partition holds exactly ids first..=last, each with its exact payload."""
    assert p.max_transaction_id == last
    assert p.first_transaction_id == first
    t = first
    while t <= last:
        batch = p.read_records(t, max_count=500)
        assert batch, f"no records from {t}"
        for r in batch:
            assert r.txid == t
            assert r.data == payload(t), f"payload of {t} differs"
            assert r.req_id == ReqId(7, 1, 0, t)
            t += 1
    assert p.read_record(last + 1) is None


def segment_files(part_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(part_dir.glob("*.seg"))


def flip_byte(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def record_offsets(part_dir: pathlib.Path, seg: pathlib.Path) -> list[int]:
    """Offsets of the records in `seg`, found by the independent spec reader."""
    from support import spec_reader

    return [r.offset for r in spec_reader.read_segment(seg).records]
