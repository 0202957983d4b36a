"""Writes the starting corpus of every fuzz target into fuzz/corpus/<target>/ (not in git):
valid frames of every message type, valid control and fence files, segment folders in the
states recovery meets (clean, unindexed tail, torn tail, two segments, an interrupted
truncation). Built from the byte layouts of docs/format.md and docs/protocol.md with struct
and zlib only, except the client protocol's seeds, which come from waltz.client_protocol itself
(skipped when waltz is not importable). Usage: python fuzz/seeds.py [CORPUS_DIR]"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

MAGIC_STORAGE, MAGIC_ADMIN = 0x5753, 0x5741


def frame(magic: int, msg_type: int, payload: bytes) -> bytes:
    body = struct.pack(">HBB", magic, 1, msg_type) + payload
    body += struct.pack(">I", zlib.crc32(body))
    return struct.pack(">I", len(body)) + body


def h(partition: int = 0, session: int = 7, seq: int = 42) -> bytes:
    return struct.pack(">qqi", session, seq, partition)


def raw(b: bytes) -> bytes:
    return struct.pack(">i", len(b)) + b


def wire_record(txid: int, data: bytes) -> bytes:
    return struct.pack(">qiiiii", txid, 1, 2, 3, txid, -5) + raw(data) + struct.pack(">I", zlib.crc32(data))


def wire_records(n: int) -> bytes:
    return struct.pack(">i", n) + b"".join(wire_record(t, bytes([t]) * t) for t in range(n))


def header_only(txid: int) -> bytes:
    return struct.pack(">qiiiii", txid, 1, 2, 3, txid, 0)


def storage_frames() -> list[bytes]:
    m = MAGIC_STORAGE
    return [
        frame(m, 0x01, bytes([1, 1])),
        frame(m, 0x01, bytes([1, 1]) + raw(b"server") + raw(b"a-role-secret-0123")),
        frame(m, 0x10, h(-1) + bytes(range(16)) + struct.pack(">i", 4)),
        frame(m, 0x11, h(1)),
        frame(m, 0x12, h(1)),
        frame(m, 0x13, h(1) + struct.pack(">q", 9)),
        frame(m, 0x14, h(1) + struct.pack(">q", -1)),
        frame(m, 0x15, h(1) + wire_records(3)),
        frame(m, 0x16, h(1) + struct.pack(">q", 5)),
        frame(m, 0x17, h(1) + struct.pack(">q", 5)),
        frame(m, 0x18, h(1) + struct.pack(">qi", 0, 100)),
        frame(m, 0x19, h(1) + struct.pack(">qi", 0, 100)),
        frame(m, 0x82, bytes([1])),
        frame(m, 0x80, h(1)),
        frame(m, 0x81, h(1) + struct.pack(">H", 8) + raw("stale session ✓".encode())),
        frame(m, 0x91, h(1) + struct.pack(">qq", 5, 100)),
        frame(m, 0x92, h(1) + struct.pack(">q", -1)),
        frame(m, 0x96, h(1) + b"\x01" + header_only(3)),
        frame(m, 0x96, h(1) + b"\x00"),
        frame(m, 0x97, h(1) + b"\x01" + wire_record(4, b"data")),
        frame(m, 0x98, h(1) + struct.pack(">i", 2) + header_only(1) + header_only(2)),
        frame(m, 0x99, h(1) + wire_records(2)),
    ]


def admin_frames() -> list[bytes]:
    m = MAGIC_ADMIN
    status = struct.pack(">i", 1) + struct.pack(">iqqqqqq", 1, 0, 9, 3, 5, 5, 4) + b"\x01\x00" + raw(b"fsync: EIO")
    return [
        frame(m, 0x01, bytes([1, 1])),
        frame(m, 0x20, h(-1) + bytes(range(16)) + struct.pack(">i", 4)),
        frame(m, 0x21, h(2)),
        frame(m, 0x22, h(2) + b"\x01"),
        frame(m, 0x23, h(2) + b"\x01\x00"),
        frame(m, 0x24, h(-1)),
        frame(m, 0x25, h(3) + struct.pack(">qi", 7, 100)),
        frame(m, 0x26, h(3) + wire_records(2)),
        frame(m, 0x27, h(3) + struct.pack(">qq", 12, 8)),
        frame(m, 0x01, bytes([1, 1]) + raw(b"admin") + raw(b"a-role-secret-0123")),
        frame(m, 0x28, h(3) + struct.pack(">q", 5)),
        frame(m, 0x29, h(3) + struct.pack(">q", -1) + b"\x01"),
        frame(m, 0x2A, h(3) + struct.pack(">q", 1 << 40) + b"\x00"),
        frame(m, 0x82, bytes([1])),
        frame(m, 0x80, h(0)),
        frame(m, 0x81, h(0) + struct.pack(">H", 2) + raw(b"no")),
        frame(m, 0xA4, h(0) + status),
        frame(m, 0xA5, h(3) + wire_records(2)),
    ]


def parts(flags: int, *ps: bytes, fix: int = 3) -> bytes:
    """An input of the file targets: flags, fix-ups (CRCs the harness rewrites), parts."""
    return bytes([flags, fix]) + b"".join(struct.pack(">H", len(p)) + p for p in ps)


def info(session: int, lwm: int, llwm: int) -> bytes:
    b = struct.pack(">qqq", session, lwm, llwm)
    return b + struct.pack(">I", zlib.crc32(b))


def control(count: int, infos: dict[int, bytes] | None = None) -> bytes:
    b = struct.pack(">iq", 1, 1_700_000_000_000) + bytes([9] * 16) + struct.pack(">i", count)
    b += bytes(128 - len(b))
    for pid in range(count):
        first = (infos or {}).get(pid, info(-1, -1, -1))
        b += struct.pack(">i", pid) + first + info(-1, -1, -1)
    return b


def fence(entries: dict[int, int]) -> bytes:
    b = struct.pack(">ii", 1, len(entries)) + b"".join(struct.pack(">iq", p, s) for p, s in sorted(entries.items()))
    return b + struct.pack(">I", zlib.crc32(b))


KEY, PID = bytes([7] * 16), 3


def seg_header(first: int) -> bytes:
    b = struct.pack(">iq", 1, 1_700_000_000_000) + KEY + struct.pack(">iq", PID, first)
    return b + bytes(128 - len(b))


def record(txid: int, data: bytes) -> bytes:
    b = struct.pack(">qiiiiiiI", txid, 1, 2, PID, txid % 2**31, 0, len(data), zlib.crc32(data)) + data
    return b + struct.pack(">I", zlib.crc32(b))


def segment(first: int, n: int, indexed: int) -> tuple[bytes, bytes]:
    data, offsets = bytearray(seg_header(first)), []
    for t in range(first, first + n):
        offsets.append(len(data))
        data += record(t, bytes([t % 251]) * (3 + t % 13))
    index = seg_header(first) + b"".join(struct.pack(">q", o) for o in offsets[:indexed])
    return bytes(data), index


def intent(txid: int) -> bytes:
    b = struct.pack(">q", txid)
    return b + struct.pack(">I", zlib.crc32(b))


A_IDX, B_SEG, B_IDX, INTENT, CP1 = 4, 8, 16, 32, 64


def segment_seeds() -> list[bytes]:
    clean, clean_idx = segment(0, 10, 10)
    _, part_idx = segment(0, 10, 5)
    torn = clean[:-7]
    damaged = bytearray(clean)
    damaged[128 + 60] ^= 0xFF
    a, a_idx = segment(0, 5, 5)
    b, b_idx = segment(5, 4, 0)
    high, high_idx = segment(2**63 - 3, 3, 3)
    return [
        parts(A_IDX, clean, clean_idx),
        parts(A_IDX, clean, part_idx),
        parts(0, clean),
        parts(A_IDX, torn, part_idx),
        parts(A_IDX | 1, torn, part_idx),
        parts(A_IDX, bytes(damaged), part_idx, fix=0),
        parts(A_IDX | 2, bytes(damaged), part_idx, fix=0),
        parts(A_IDX | B_SEG | B_IDX, a, a_idx, b, b_idx),
        parts(A_IDX | B_SEG | B_IDX | INTENT, a, a_idx, b, b_idx, intent(3)),
        parts(A_IDX | INTENT, clean, clean_idx, b"", b"", intent(6)),
        parts(A_IDX | CP1, clean, part_idx),
        parts(A_IDX | 128, clean, clean_idx),
        parts(A_IDX, high, high_idx),
    ]


def control_seeds() -> list[bytes]:
    return [
        parts(1, control(1)),
        parts(0, control(3, {1: info(5, 10, 9)}), fence({0: 4, 2: 9})),
        parts(2, control(2), fence({})),
        parts(0, control(2, {0: info(2**63 - 1, 0, 0)}), fence({1: 2**63 - 1})),
    ]


def client_seeds() -> list[bytes]:
    try:
        from waltz import client_protocol as cp
    except ImportError:
        return []
    msgs: list[cp.Message] = [
        cp.Hello(),
        cp.Hello(role="client", secret=b"a-role-secret-0123"),
        cp.HelloOk(1),
        cp.Mount(1, 0, 7, -1, 1),
        cp.MountResponse(1, 0, cp.MountStatus.READY, 10, 2),
        cp.Append((1, 2, 0, 3), 5, 0, b"payload", (1, 2), (3,), ()),
        cp.LockFailure((1, 2, 0, 3), 9),
        cp.FeedRequest(2, 0, 5, 100),
        cp.FeedData(-1, 0, (cp.FeedEntry(6, (1, 2, 0, 3), 0), cp.FeedEntry(7, (1, 2, 0, 4), 1))),
        cp.Flush(3, 0),
        cp.FlushResponse(3, 0, 7),
        cp.TransactionDataRequest(4, 0, 6),
        cp.TransactionDataResponse(4, 0, 6, b"data"),
        cp.TransactionDataRangeRequest(4, 0, 6, 10, 1 << 20),
        cp.TransactionDataRangeResponse(4, 0, 6, (b"a", b"", b"ccc")),
        cp.ClientIdRequest(8),
        cp.ClientIdResponse(8, 42),
        cp.HighWaterMarkRequest(5, 0),
        cp.HighWaterMarkResponse(5, 0, 7),
        cp.Failure(6, 0, cp.FailureKind.NOT_COMMITTED, "not yet"),
    ]
    # Mode byte of fuzz/client_protocol.py (its docstring has the details): 0 = type and
    # payload to decode(); 1 = (type, length, payload) list framed and fed in chunks; 2 = raw
    # bytes to the MessageReader.
    seeds = [bytes([0, m.TYPE]) + m.payload() for m in msgs]
    seeds.append(
        bytes([1, 7]) + b"".join(bytes([m.TYPE]) + struct.pack(">H", len(m.payload())) + m.payload() for m in msgs[:5])
    )
    seeds.append(bytes([2, 5]) + b"".join(m.frame() for m in msgs[5:9]))
    # Modes 3 and 4: storage and admin responses, (type, length, payload) each.
    for mode, frames in ((3, storage_frames()), (4, admin_frames())):
        for f in frames:
            if f[7] >= 0x80:
                seeds.append(bytes([mode, 255, f[7]]) + struct.pack(">H", len(f) - 12) + f[8:-4])
    return seeds


def client_reader_seeds() -> list[bytes]:
    """Inputs of fuzz_targets/client_reader.rs: flags, chunk, then a stream of client frames (the
    messages of `client_seeds`, each alone and all together, under each limit)."""
    try:
        from waltz import client_protocol as cp
    except ImportError:
        return []
    frames = [cp.encode_frame(cp.MAGIC, s[1], s[2:]) for s in client_seeds() if s[0] == 0]
    seeds = [bytes([0, 255]) + f for f in frames]
    seeds += [bytes([flags, 6]) + b"".join(frames) for flags in (0, 2, 4, 5)]
    return seeds


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus"
    sets = {
        "storage_protocol": [b"\x00" + f for f in storage_frames()] + [b"\x00" + b"".join(storage_frames()[:6])],
        "admin_protocol": [b"\x00" + f for f in admin_frames()] + [b"\x00" + b"".join(admin_frames()[:6])],
        "control_file": control_seeds(),
        "segment_recovery": segment_seeds(),
        "client_protocol": client_seeds(),
        "client_reader": client_reader_seeds(),
    }
    for target, seeds in sets.items():
        d = root / target
        d.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(seeds):
            (d / f"seed-{i:02d}").write_bytes(s)
        print(f"{target}: {len(seeds)} seeds in {d}")


if __name__ == "__main__":
    main()
