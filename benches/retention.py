#!/usr/bin/env python3
"""Retention benchmark: durable append latency with and without a concurrent deletion of the
partition's head, and the time to reclaim it (issue 35).

    python benches/retention.py [--gib 1] [--seconds 10] [--dir DIR] [--json PATH]

A partition is filled with `--gib` GiB in 64 MiB segments; then one thread appends 1 KiB records
(10 per call, each call returning once durable) for `--seconds`, first alone, then while another
thread runs `Partition.drop_segments_before` over everything filled (what a storage node's
retention thread does when a policy lets the whole head go). The deletion is the engine's own;
the node adds only its network path to the appends. Also prints the fdatasync p50 of the same
disk at that moment (a shared machine's disk moves from minute to minute). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from waltz.storage import RecordBatch, ReqId, Storage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import pick_base_dir  # noqa: E402  (the data directory rule every engine bench shares)

SEGMENT = 64 << 20
KIB, GIB = 1 << 10, 1 << 30


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def fdatasync_p50(directory: Path, n: int = 300) -> float:
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        took = []
        for _ in range(n):
            os.pwrite(fd, b"x" * 4096, 0)
            t = time.perf_counter()
            os.fdatasync(fd)
            took.append(time.perf_counter() - t)
        return percentile(took, 0.5) * 1e6
    finally:
        os.close(fd)
        os.unlink(path)


def fill(p, gib: float) -> int:
    """Appends `gib` GiB in batches of 16 x 64 KiB; returns the next id."""
    batch = RecordBatch([(ReqId(1, 1, 0, i), 0, b"f" * (64 * KIB)) for i in range(16)])
    total, nxt = 0, p.max_transaction_id + 1
    while total < gib * GIB:
        nxt = p.append(nxt, batch) + 1
        total += 16 * 64 * KIB
    return nxt


def appends(p, seconds: float) -> list[tuple[float, float]]:
    """(start, duration) of each durable append of 10 x 1 KiB for `seconds`."""
    batch = RecordBatch([(ReqId(2, 1, 0, i), 0, b"a" * KIB) for i in range(10)])
    took: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t = time.perf_counter()
        p.append_next(batch)
        took.append((t, time.perf_counter() - t))
    return took


def stats(calls: list[tuple[float, float]]) -> dict[str, float]:
    xs = [d for _, d in calls]
    return {
        "calls": len(xs),
        "p50_us": round(percentile(xs, 0.5) * 1e6, 1),
        "p99_us": round(percentile(xs, 0.99) * 1e6, 1),
        "max_us": round(max(xs, default=float("nan")) * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB to fill and then delete (default 1)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of appends per phase")
    ap.add_argument("--dir", help="where the data goes (a real disk: tmpfs ignores fsync)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    base = pick_base_dir(args.dir)
    work = Path(tempfile.mkdtemp(prefix="waltz-retention-", dir=base))
    try:
        s = Storage.create(str(work / "s"), uuid.uuid4(), 1, segment_size=SEGMENT)
        s.add_partition(0)
        p = s.partition(0)
        started = time.perf_counter()
        end = fill(p, args.gib)
        fill_s = time.perf_counter() - started
        before = p.retention()
        sync_p50 = fdatasync_p50(work)
        alone = appends(p, args.seconds)

        deletion: dict[str, float] = {}

        def delete() -> None:
            time.sleep(min(1.0, args.seconds / 4))  # appends are under way first
            t = time.perf_counter()
            p.drop_segments_before(end)
            deletion["seconds"] = time.perf_counter() - t
            deletion["at"] = t

        deleter = threading.Thread(target=delete)
        deleter.start()
        during = appends(p, args.seconds)
        deleter.join()
        after = p.retention()
        result = {
            "gib": args.gib,
            "segment_bytes": SEGMENT,
            "fill_seconds": round(fill_s, 2),
            "bytes_before": before["bytes_on_disk"],
            "bytes_after": after["bytes_on_disk"],
            "reclaimed_bytes": after["reclaimed_bytes"],
            "reclaim_seconds": round(deletion["seconds"], 4),
            "fdatasync_p50_us": round(sync_p50, 1),
            "alone": stats(alone),
            "same_run_with_deletion": stats(during),
            # The appends whose call overlapped the deletion itself (none if it was instant).
            "overlapping_the_deletion": stats(
                [(t, d) for t, d in during if t < deletion["at"] + deletion["seconds"] and t + d > deletion["at"]]
            ),
        }
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
