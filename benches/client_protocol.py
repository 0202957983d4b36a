"""Client-protocol decoding: messages per second through the Python reference decoder
(`PyMessageReader`) and the native one (`MessageReader`, what the server's client port and the
client library read with), on the same bytes, in one process, no network.

    python benches/client_protocol.py [--quick] [--json PATH]

Workloads: Appends of 100-byte data with 2 write, 2 read and 1 append lock (a server's port);
lockless Appends (the server's hot path); Feed Data frames of 1, 16 and 128 entries (a client's
feed), counted in entries. Each reader is fed the whole stream in 64 KiB reads, as a connection
reads it, and drained with next_message(); the best of several rounds is reported. Time is the
process's CPU time (`time.process_time`), so that other load on a shared machine costs less
accuracy than it would in wall time: rates are per CPU-second of the decoding process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

sys.path.insert(0, "python")
from waltz import client_protocol as cp  # noqa: E402

READ = 64 << 10


def appends(n: int, locks: bool) -> list[cp.Message]:
    lk = {"write_locks": (11, 12), "read_locks": (13, 14), "append_locks": (15,)} if locks else {}
    return [cp.Append((7, 1, 0, i), i - 1, 0, bytes(100), **lk) for i in range(n)]


def feeds(n_entries: int, per_frame: int) -> list[cp.Message]:
    frames = []
    for start in range(0, n_entries, per_frame):
        entries = tuple(cp.FeedEntry(t, (7, 1, 0, t), 0) for t in range(start, start + per_frame))
        frames.append(cp.FeedData(-1, 0, entries))
    return frames


def decode_rate(reader_cls: type, stream: bytes, units: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        reader = reader_cls()
        t0 = time.process_time()
        for i in range(0, len(stream), READ):
            reader.feed(stream[i : i + READ])
            while reader.next_message() is not None:
                pass
        best = min(best, time.process_time() - t0)
    return units / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n, rounds = (20_000, 3) if args.quick else (100_000, 5)
    cases = [
        ("Append, 5 locks", appends(n, True), n),
        ("Append, no lock", appends(n, False), n),
        ("Feed Data, 1 entry a frame", feeds(n, 1), n),
        ("Feed Data, 16 entries a frame", feeds(n * 4, 16), n * 4),
        ("Feed Data, 128 entries a frame", feeds(n * 4, 128), n * 4),
    ]
    rows, ratios = [], {}
    print("| workload | Python (per CPU-s) | native (per CPU-s) | native ÷ Python |\n|---|---:|---:|---:|")
    for name, msgs, units in cases:
        stream = b"".join(m.frame() for m in msgs)
        py = decode_rate(cp.PyMessageReader, stream, units, rounds)
        native = decode_rate(cp.MessageReader, stream, units, rounds)
        rows.append({"workload": name, "python_per_s": py, "native_per_s": native, "units": units})
        ratios[name] = native / py
        print(f"| {name} | {py:,.0f} | {native:,.0f} | {native / py:.1f}× |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
