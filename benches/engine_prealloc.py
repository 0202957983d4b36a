"""Zeros ahead of the tail or none: an interleaved A/B of the `preallocate` option.

    python benches/engine_prealloc.py [--appends 2000] [--rounds 3] [--cells 1x100,10x1024]
        [--preallocate 1048576,0]

For each cell (batch x record size) and round, appends `--appends` batches from one writer to a
fresh partition on a real disk with each `preallocate` value in turn (the order reversed every
other round), and prints per run: append p50/p99/max, the syncs that carried zeros (count, mean
µs, from the engine's phase counters), the bytes this process sent to the storage
layer (`write_bytes` of /proc/self/io, counted when pages are dirtied, so a write into a large
folio counts the folio) and the block device's writes and sectors over the run (/proc/diskstats:
includes the journal's writes, and anything else writing to the disk meanwhile). A diagnostic for
docs/performance.md ("Zeros ahead, or none"), not a benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

os.environ["WALTZ_ENGINE_PHASES"] = "1"

from waltz.storage import RecordBatch, ReqId, Storage


def io_write_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def device_of(path: str) -> str:
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if int(parts[0]) == major and int(parts[1]) == minor:
                return parts[2]
    raise SystemExit(f"no /proc/diskstats line for {path}")


def disk_writes(device: str) -> tuple[int, int]:
    """(writes completed, sectors written) of `device`."""
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if parts[2] == device:
                return int(parts[7]), int(parts[9])
    return 0, 0


def run(directory: str, device: str, preallocate: int, batch: RecordBatch, appends: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=directory) as d:
        s = Storage.create(os.path.join(d, "s"), uuid.uuid4(), 1, preallocate=preallocate)
        s.add_partition(0)
        p = s.partition(0)
        p.append_next(batch)  # the first segment's first page, outside the measurement
        lat = []
        io0, (w0, sec0) = io_write_bytes(), disk_writes(device)
        for _ in range(appends):
            t = time.perf_counter()
            p.append_next(batch)
            lat.append(time.perf_counter() - t)
        io1, (w1, sec1) = io_write_bytes(), disk_writes(device)
        phases = p.stats()["phases"]
        s.close()
    lat.sort()
    return {
        "p50": lat[len(lat) // 2] * 1e6,
        "p99": lat[int(len(lat) * 0.99)] * 1e6,
        "max": lat[-1] * 1e6,
        "zero_syncs": phases["sync_zeros"][0],
        "zero_sync_us": phases["sync_zeros"][1] / max(1, phases["sync_zeros"][0]) / 1e3,
        "sync_us": phases["sync"][1] / max(1, phases["sync"][0]) / 1e3,
        "write_kb_per_append": (io1 - io0) / appends / 1e3,
        "disk_writes_per_append": (w1 - w0) / appends,
        "disk_kb_per_append": (sec1 - sec0) * 512 / appends / 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--appends", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", default="1x100,10x1024", help="batch x record size, comma separated")
    ap.add_argument("--preallocate", default="1048576,0", help="values to compare, comma separated")
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a real disk (not tmpfs)")
    args = ap.parse_args()
    device = device_of(args.dir)
    values = [int(v) for v in args.preallocate.split(",")]
    print(
        "| cell | round | preallocate | p50 us | p99 us | max us | syncs with zeros | their mean us | other syncs us "
        "| write_bytes KB/append | disk writes/append | disk KB/append |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in args.cells.split(","):
        n, size = (int(x) for x in cell.split("x"))
        payload = os.urandom(size)
        batch = RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(n)])
        for r in range(args.rounds):
            for pre in values if r % 2 == 0 else values[::-1]:
                m = run(args.dir, device, pre, batch, args.appends)
                print(
                    f"| {n} x {size} B | {r + 1} | {pre} | {m['p50']:,.0f} | {m['p99']:,.0f} | {m['max']:,.0f} | "
                    f"{m['zero_syncs']} | {m['zero_sync_us']:,.0f} | {m['sync_us']:,.0f} | "
                    f"{m['write_kb_per_append']:,.1f} | {m['disk_writes_per_append']:,.2f} | "
                    f"{m['disk_kb_per_append']:,.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
