"""Where an append's time goes: per-phase timing of the engine's append path.

    python benches/engine_phases.py [--appends 300] [--batch 100] [--size 1024] [--writers 1]
    strace -f -T -e trace=pwrite64,pwritev,write,fdatasync,fsync,openat,rename -o /tmp/t \\
        python benches/engine_phases.py --appends 100

Sets WALTZ_ENGINE_PHASES=1 (the engine's opt-in phase counters, read when the first partition
opens), appends `--appends` batches per writer to a fresh partition on a real disk, and prints the
append latency percentiles with each phase's count, mean and maximum (docs/performance.md,
"Where an append's time goes"). A diagnostic, not a benchmark: nothing is compared or asserted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid

os.environ["WALTZ_ENGINE_PHASES"] = "1"

from waltz._native import raw_append_loop  # noqa: E402
from waltz.storage import RecordBatch, ReqId, Storage  # noqa: E402

RECORD_OVERHEAD = 40


def percentiles(lat_us: list[float]) -> dict[int, float]:
    lat_us = sorted(lat_us)
    return {q: lat_us[min(len(lat_us) - 1, int(q / 100 * len(lat_us)))] for q in (50, 90, 99, 100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--appends", type=int, default=300, help="batches per writer")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--writers", type=int, default=1, help="threads appending with append_next")
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a real disk (not tmpfs)")
    args = ap.parse_args()
    payload = os.urandom(args.size)
    batch = RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(args.batch)])
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        s = Storage.create(os.path.join(d, "s"), uuid.uuid4(), 1)
        s.add_partition(0)
        p = s.partition(0)
        lat: list[float] = []

        def writer() -> None:
            for _ in range(args.appends):
                t = time.perf_counter()
                p.append_next(batch)
                lat.append(time.perf_counter() - t)

        threads = [threading.Thread(target=writer) for _ in range(args.writers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stats = p.stats()
        s.close()
    pct = percentiles([x * 1e6 for x in lat])
    recs = args.appends * args.writers * args.batch
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        raw_ns = raw_append_loop(
            os.path.join(d, "raw"), bytes(args.batch * (RECORD_OVERHEAD + args.size)), args.appends
        )
    raw = percentiles([x / 1e3 for x in raw_ns])
    print(
        f"raw ceiling, same bytes per call: {args.appends * args.batch / (sum(raw_ns) / 1e9):,.0f} rec/s; "
        f"p50 {raw[50]:,.0f} p90 {raw[90]:,.0f} p99 {raw[99]:,.0f} max {raw[100]:,.0f} us"
    )
    print(
        f"{args.writers} writer(s), {args.appends} x {args.batch} x {args.size} B: {recs / wall:,.0f} rec/s, "
        f"{stats['syncs']} syncs; append p50 {pct[50]:,.0f} p90 {pct[90]:,.0f} p99 {pct[99]:,.0f} "
        f"max {pct[100]:,.0f} us"
    )
    print("| phase | count | mean us | max us | total ms |")
    print("|---|---|---|---|---|")
    for name, (count, total, most) in stats["phases"].items():
        mean = total / count / 1e3 if count else 0.0
        print(f"| {name} | {count} | {mean:,.1f} | {most / 1e3:,.1f} | {total / 1e6:,.1f} |")


if __name__ == "__main__":
    main()
