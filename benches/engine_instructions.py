"""Instructions the engine executes for a fixed workload, counted by callgrind.

    python benches/engine_instructions.py [--batches 300]

Timings on these machines move 2.5x with the disk and with whatever else runs; instruction counts
do not (fsync is a system call, not counted). So a change that should not touch the engine's
work (a move of code, a refactor) is checked here: the same workload on two builds gives the same
count within a fraction of a percent. The workload: appends of 100 x 1 KiB records through
`append_next`, bounded reads of all of them, a clean close and a reopen.
Prints the instructions inside `_native` (the engine and its bindings) and in the whole process.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid


def workload(batches: int) -> None:
    from waltz.storage import RecordBatch, Storage

    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        path = os.path.join(d, "s")
        storage = Storage.create(path, uuid.UUID(int=1), partition_count=1)
        storage.add_partition(0)
        log = storage.partition(0)
        payload = b"x" * 1024
        n = 0
        for _ in range(batches):
            log.append_next(RecordBatch([((1, 1, 0, n + i), 0, payload) for i in range(100)]))
            n += 100
        for i in range(0, n, 100):
            log.read_records(i, max_count=100)
        storage.close()
        with Storage.open(path) as again:
            again.partition(0).read_record(n - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        workload(args.batches)
        return
    if not shutil.which("valgrind"):
        sys.exit("engine_instructions: needs valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "callgrind.out")
        cmd = [sys.executable, __file__, "--workload", "--batches", str(args.batches)]
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd], check=True, capture_output=True
        )
        report = subprocess.run(["callgrind_annotate", out], check=True, capture_output=True, text=True).stdout
    total = int(re.search(r"^([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", report, re.M).group(1).replace(",", ""))
    native = sum(
        int(m.group(1).replace(",", ""))
        for m in re.finditer(r"^\s*([\d,]+) \([^)]*\)\s+.*\[[^\]]*_native[^\]]*\]$", report, re.M)
    )
    print(f"batches {args.batches} x 100 x 1 KiB: {native:,} instructions in _native, {total:,} in the process")


if __name__ == "__main__":
    main()
