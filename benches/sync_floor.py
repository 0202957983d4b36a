"""What the disk work of a storage node costs per partition append: one file a partition, as the
node does it today, against one log shared by the partitions a node holds (issue 33).

At 8 closed-loop clients on 4 partitions, `benches/cluster.py`'s Waltz cell is bound by CPU, and
half of it is the three storage nodes: a store batch carries 1.5 transactions there, and each
node spends about 45 µs of CPU on every batch, nearly all of it in the kernel's `pwrite` and
`fdatasync` (docs/performance.md, "Issue 33: the 8-client cell is bound by the nodes' syncs").
This benchmark measures that floor without a node, in one process, beside the fdatasync reference:

- `per-partition, one thread each`: N threads, each appending a batch (2 transactions of 1 KiB as
  the node writes them, 2,128 bytes) to its own file and syncing it, as a node's connection
  threads do for N partitions;
- `per-partition, one thread`: the same N files appended and synced one after the other by one
  thread (what a connection carrying several partitions would do with today's engine);
- `one shared log`: one thread appends the N partitions' batches with one `pwrite` and one
  `fdatasync` a round, as a node log shared by its partitions would.

Every file is zero-filled and synced beforehand, as the engine's preallocation leaves a segment,
so no sync carries metadata. CPU is the process's (user + system) per partition append; the
GIL is released inside `pwrite` and `fdatasync`, so the threads sync in parallel.

    python benches/sync_floor.py [--partitions 1,4,12] [--seconds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from peers import loadgen  # noqa: E402

BATCH = 2128  # two 1 KiB transactions as the engine lays them out (what a node syncs at 8 clients)
PARTITION_FILE = 32 << 20  # what one partition appends in a run, with room to spare
SHARED_FILE = 256 << 20
LAYOUTS = ("per-partition, one thread each", "per-partition, one thread", "one shared log")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _zero_filled(path: pathlib.Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    chunk = b"\0" * (1 << 20)
    for off in range(0, size, len(chunk)):
        os.pwrite(fd, chunk, off)
    os.fsync(fd)
    return fd


def _appender(fds: list[int], size: int, batch: bytes, until: float, counts: list[int], slot: int) -> None:
    """Appends `batch` to each of `fds` in turn, syncing each, until `until` or the files are
    full; counts appends."""
    off, n = 0, 0
    while time.monotonic() < until and off + len(batch) <= size:
        for fd in fds:
            os.pwrite(fd, batch, off)
            os.fdatasync(fd)
        off += len(batch)
        n += len(fds)
    counts[slot] = n


def measure(layout: str, partitions: int, seconds: float, directory: pathlib.Path) -> dict[str, Any]:
    shared = layout == LAYOUTS[2]
    files = 1 if shared else partitions
    size = SHARED_FILE if shared else PARTITION_FILE
    fds = [_zero_filled(directory / f"p{i}", size) for i in range(files)]
    try:
        if layout == LAYOUTS[0]:
            groups = [[fd] for fd in fds]
            batch = b"\x07" * BATCH
        elif layout == LAYOUTS[1]:
            groups, batch = [fds], b"\x07" * BATCH
        else:
            groups, batch = [fds], b"\x07" * (BATCH * partitions)
        counts = [0] * len(groups)
        cpu0, t0 = _cpu(), time.monotonic()
        threads = [
            threading.Thread(target=_appender, args=(g, size, batch, t0 + seconds, counts, i))
            for i, g in enumerate(groups)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.monotonic() - t0, _cpu() - cpu0
        appends = sum(counts) * (partitions if shared else 1)
        return {
            "layout": layout,
            "partitions": partitions,
            "partition_appends_per_s": appends / wall,
            "cpu_us_per_partition_append": cpu * 1e6 / max(appends, 1),
            "fdatasyncs_per_partition_append": (1 / partitions) if shared else 1.0,
        }
    finally:
        for fd in fds:
            os.close(fd)
        for i in range(files):
            (directory / f"p{i}").unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", default="1,4,12", help="comma-separated partition counts")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    counts = [int(x) for x in args.partitions.split(",")]
    with loadgen.scratch_dir("waltz-sync-floor-") as root:
        before = loadgen.fdatasync_p50_us(root / "before", 500)["p50_us"]
        rows = []
        for n in counts:
            for layout in LAYOUTS:
                if n == 1 and layout != LAYOUTS[0]:
                    continue  # the same loop three times
                row = measure(layout, n, args.seconds, root)
                rows.append(row)
                loadgen.log(
                    f"{n:>3} partitions, {layout}: {row['partition_appends_per_s']:,.0f} appends/s, "
                    f"{row['cpu_us_per_partition_append']:.1f} µs CPU each"
                )
        after = loadgen.fdatasync_p50_us(root / "after", 500)["p50_us"]
    print(f"\nReference: write + fdatasync of 1 KiB p50 {before:.0f} / {after:.0f} µs (before / after)\n")
    print("| partitions | layout | partition appends/s | CPU µs per partition append | fdatasyncs per append |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['partitions']} | {r['layout']} | {r['partition_appends_per_s']:,.0f} | "
            f"{r['cpu_us_per_partition_append']:.1f} | {r['fdatasyncs_per_partition_append']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"fdatasync_p50_us": [before, after], "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
