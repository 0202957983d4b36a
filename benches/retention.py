#!/usr/bin/env python3
"""Retention benchmark: durable append latency with and without a concurrent deletion of the
partition's head, and the time to reclaim it (issue 35).

    python benches/retention.py [--gib 1] [--seconds 10] [--rates 0,256MiB] [--dir DIR] [--json PATH]

A partition is filled with `--gib` GiB in 64 MiB segments for each deletion rate of `--rates`;
then one thread appends 1 KiB records (10 per call, each call returning once durable) for
`--seconds`, first alone, then once per rate while another thread runs
`Partition.drop_segments_before(end, rate)` over the next `--gib` GiB (what a storage node's
retention thread does when a policy lets the whole head go; 0 = unpaced, the node's default is
`[node] retention_rate`). The appends go on until the deletion ends. The deletion is the
engine's own; the node adds only its network path to the appends. Also prints the fdatasync p50
of the same disk before each phase (a shared machine's disk moves from minute to minute) and,
with WALTZ_ENGINE_PHASES=1, the appends' phase timings (where the stall is). Nothing here asserts.

With `--node`, the same through a running storage node (in this process, on loopback): the
appends go through a storage connection in a store session, and the deletion is the node's own
retention thread obeying a Set Retention order (max bytes 0, up to the low-water mark set at the
end of that rate's fill), freeing at `[node] retention_rate` = each rate in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from waltz.storage import RecordBatch, ReqId, Storage, StorageClient, StorageNode

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


def parse_rate(text: str) -> int:
    text = text.strip()
    for unit, k in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", KIB)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * k)
    return int(text)


def phases(p) -> dict[str, tuple[int, int, int]]:
    return dict(p.stats().get("phases", {}))


def phase_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per phase: calls, mean and max µs between two snapshots (max is since the partition opened)."""
    out = {}
    for name, (n, total, mx) in after.items():
        n0, t0, _ = before.get(name, (0, 0, 0))
        if n > n0:
            out[name] = {"count": n - n0, "mean_us": round((total - t0) / (n - n0) / 1e3, 1), "max_us": round(mx / 1e3)}
    return out


def fill(p, gib: float) -> int:
    """Appends `gib` GiB in batches of 16 x 64 KiB; returns the next id."""
    batch = RecordBatch([(ReqId(1, 1, 0, i), 0, b"f" * (64 * KIB)) for i in range(16)])
    total, nxt = 0, p.max_transaction_id + 1
    while total < gib * GIB:
        nxt = p.append(nxt, batch) + 1
        total += 16 * 64 * KIB
    return nxt


def appends(p, seconds: float, busy: threading.Event | None = None) -> list[tuple[float, float]]:
    """(start, duration) of each durable append of 10 x 1 KiB for `seconds`, and on while `busy`."""
    batch = RecordBatch([(ReqId(2, 1, 0, i), 0, b"a" * KIB) for i in range(10)])
    took: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or (busy is not None and busy.is_set()):
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


async def through_node(node, key, p, end: int, session: int, seconds: float, gib: float) -> dict:
    """Appends through `node` for `seconds`, then orders the deletion of everything below `end`
    and appends on until it is done; the calls' (start, duration), and the deletion's window."""
    host, port = node.address
    batch = RecordBatch([(ReqId(2, 1, 0, i), 0, b"a" * KIB) for i in range(10)])
    async with await StorageClient.connect(host, port, cluster_key=key, partition_count=1) as c:
        await c.set_low_water_mark(0, session, end - 1)
        nxt = p.max_transaction_id + 1
        calls: list[tuple[float, float]] = []
        deletion: dict[str, float] = {}
        before = p.retention()["reclaimed_bytes"]
        target = gib * GIB - 2 * SEGMENT  # every whole segment below `end`, give or take the edges
        stop_at = time.perf_counter() + seconds
        polled = 0.0
        while "end" not in deletion or time.perf_counter() < deletion["end"] + 0.5:
            t = time.perf_counter()
            await c.append(0, session, nxt, batch)
            calls.append((t, time.perf_counter() - t))
            nxt += 10
            if "at" not in deletion and t >= stop_at:
                deletion["at"] = time.perf_counter()
                await c.set_retention(
                    0, session, max_age_ms=None, max_bytes=0, min_kept=0, hold_from=2**63 - 1, lease_ms=600_000
                )
            elif "at" in deletion and "end" not in deletion and t - polled > 0.05:
                polled = t
                if p.retention()["reclaimed_bytes"] - before >= target:
                    deletion["end"] = time.perf_counter()
        deletion["bytes"] = p.retention()["reclaimed_bytes"] - before
        return {"calls": calls, **deletion}


def node_mode(work: Path, args: argparse.Namespace, rates: list[int]) -> dict:
    key = uuid.uuid4()
    s = Storage.create(str(work / "n"), key, 1, segment_size=SEGMENT)
    s.add_partition(0)
    p = s.partition(0)
    started = time.perf_counter()
    ends = [fill(p, args.gib) for _ in rates]
    result: dict = {
        "mode": "node",
        "gib_per_deletion": args.gib,
        "fill_seconds": round(time.perf_counter() - started, 2),
    }
    for session, (rate, end) in enumerate(zip(rates, ends, strict=True), start=1):
        sync_p50 = fdatasync_p50(work)
        with StorageNode.start(s, "127.0.0.1", 0, retention_interval=0.2, retention_rate=rate) as node:
            run = asyncio.run(through_node(node, key, p, end, session, args.seconds, args.gib))
        lo, hi = run["at"], run["end"]
        before = stats([(t, d) for t, d in run["calls"] if t + d <= lo])
        over = stats([(t, d) for t, d in run["calls"] if t < hi and t + d > lo])
        result[f"rate_{rate}"] = {
            "rate_bytes_per_s": rate,
            "fdatasync_p50_us": round(sync_p50, 1),
            "reclaimed_bytes": run["bytes"],
            "reclaim_seconds": round(hi - lo, 3),
            "reclaim_mb_per_s": round(run["bytes"] / (hi - lo) / 1e6, 1),
            "just_before_the_deletion": before,
            "overlapping_the_deletion": over,
            "p99_ratio_to_just_before": round(over["p99_us"] / before["p99_us"], 2),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB to fill and then delete (default 1)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of appends per phase")
    ap.add_argument("--rates", default="0", help="deletion rates to compare, bytes/s (0 = unpaced), e.g. 0,256MiB")
    ap.add_argument("--dir", help="where the data goes (a real disk: tmpfs ignores fsync)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--node", action="store_true", help="append and delete through a running storage node")
    args = ap.parse_args()
    base = pick_base_dir(args.dir)
    work = Path(tempfile.mkdtemp(prefix="waltz-retention-", dir=base))
    try:
        rates = [parse_rate(r) for r in args.rates.split(",")]
        if args.node:
            result = node_mode(work, args, rates)
            print(json.dumps(result, indent=2))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            return
        s = Storage.create(str(work / "s"), uuid.uuid4(), 1, segment_size=SEGMENT)
        s.add_partition(0)
        p = s.partition(0)
        started = time.perf_counter()
        ends = [fill(p, args.gib) for _ in rates]
        fill_s = time.perf_counter() - started
        result: dict = {"gib_per_deletion": args.gib, "segment_bytes": SEGMENT, "fill_seconds": round(fill_s, 2)}
        result["fdatasync_p50_us_alone"] = round(fdatasync_p50(work), 1)
        ph = phases(p)
        result["alone"] = stats(appends(p, args.seconds))
        result["alone"]["phases"] = phase_delta(ph, phases(p))
        for rate, end in zip(rates, ends, strict=True):
            deletion: dict[str, float] = {}
            busy = threading.Event()
            busy.set()

            def delete(
                end: int = end, rate: int = rate, deletion: dict = deletion, busy: threading.Event = busy
            ) -> None:
                time.sleep(min(2.0, args.seconds / 2))  # appends are under way first
                t = time.perf_counter()
                before = p.retention()["reclaimed_bytes"]
                p.drop_segments_before(end, rate or None)
                deletion["seconds"] = time.perf_counter() - t
                deletion["at"] = t
                deletion["bytes"] = p.retention()["reclaimed_bytes"] - before
                busy.clear()

            sync_p50 = fdatasync_p50(work)
            ph = phases(p)
            deleter = threading.Thread(target=delete)
            deleter.start()
            during = appends(p, args.seconds, busy)
            deleter.join()
            lo, hi = deletion["at"], deletion["at"] + deletion["seconds"]
            over = stats([(t, d) for t, d in during if t < hi and t + d > lo])
            over["phases"] = phase_delta(ph, phases(p))
            # The same minute without the deletion: a shared disk's latency moves between phases.
            just_before = stats([(t, d) for t, d in during if t + d <= lo])
            row = {
                "rate_bytes_per_s": rate,
                "fdatasync_p50_us": round(sync_p50, 1),
                "reclaimed_bytes": deletion["bytes"],
                "reclaim_seconds": round(deletion["seconds"], 3),
                "reclaim_mb_per_s": round(deletion["bytes"] / deletion["seconds"] / 1e6, 1),
                # The appends whose call overlapped the deletion itself.
                "overlapping_the_deletion": over,
                "just_before_the_deletion": just_before,
                "p99_ratio_to_alone": round(over["p99_us"] / result["alone"]["p99_us"], 2),
                "p99_ratio_to_just_before": round(over["p99_us"] / just_before["p99_us"], 2),
            }
            result[f"rate_{rate}"] = row
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
