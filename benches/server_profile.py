"""Where the server's CPU goes under load: `benches/cluster.py`'s Waltz cluster and closed-loop
clients, the server process sampled with py-spy, the samples grouped by layer (issue 33).

    python benches/server_profile.py [--clients 32] [--seconds 20] [--locks] [--raw PATH]

Starts 1 server and 3 storage nodes as `benches/cluster.py` does, warms up, then runs
`--clients` closed-loop protocol clients for `--seconds` while `py-spy record --native` samples
the server (`pip install py-spy`; it needs ptrace rights on the server, e.g. root). Prints the
cell's figures (committed tx/s, CPU µs per committed transaction by process, from /proc) and a
table: each layer's share of the event-loop thread's busy samples and the µs per committed
transaction that share is of the server's measured CPU. A sample belongs to the innermost frame
a layer's rule names (`LAYERS`); samples waiting in epoll or for the GIL, and other threads
(the metadata's, the executor's: idle), are left out. py-spy samples wall time, so on a busy
machine a frame where the server is often preempted (a `write` that wakes a peer on the same
core) weighs more than its CPU: the µs column is an estimate, the process's CPU is measured.
`--raw PATH` keeps py-spy's samples (collapsed stacks, one line each) for a closer look.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cluster as bench  # noqa: E402
from peers import loadgen  # noqa: E402
from waltz.event_loop import loop_factory  # noqa: E402

LAYERS = (
    (
        "feed fan-out",
        r"feed_frame|feed_payload|_feed\.<locals>\.push|ServerPartition\._push|_wake_readers|ClientConnection\._feed "
        r"|ServerPartition\.feed |ServerPartition\._cached",
    ),
    (
        "commit and answers",
        r"_on_commit|_answered|_settle|_signal_commit|_write\.<locals>\.on_commit|_cache_data|Committed",
    ),
    (
        "store session and replica links",
        r"StoreSession\.|_AppendWait|_Connection\.data_received|_Connection\._answers|send_append|_sweep"
        r"|_Connection\._write|_Pending"
        r"|StorageClient",
    ),
    (
        "append path (requests, queue, lock table, ids, batch)",
        r"ServerPartition\._write |_append_loop|_gather|LockTable|ServerPartition\.enqueue|ServerPartition\.append"
        r"|ServerPartition\._queued|ServerPartition\._check|ClientConnection\._append|_dispatch|AppendRequest|_coming"
        r"|_sole_appender|RecordBatch|_Queued|_switch_session",
    ),
    (
        "client port reading and decoding",
        r"ClientConnection\.run|ClientConnection\._read|next_message|MessageReader|StreamReader|client_protocol"
        r"|_InlineReading|ClientConnection\._take|ClientConnection\._queue_appends|ClientConnection\._more",
    ),
)
OTHER = "event loop and the rest"
IN_LIBC = re.compile(r"\(libc\.so|\(\[vdso\]")
WAITING = re.compile(r"(pthread_cond_\w*wait|epoll_pwait|epoll_wait)\b")


def layers(raw: pathlib.Path) -> tuple[int, dict[str, int], dict[str, int], dict[str, int]]:
    """Busy samples of the event-loop thread; per layer, its samples and those whose leaf is in
    libc (system calls, mostly); samples left out as waiting."""
    rules = [(name, re.compile(rx)) for name, rx in LAYERS]
    busy: collections.Counter[str] = collections.Counter()
    in_libc: collections.Counter[str] = collections.Counter()
    waiting: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n, frames = int(count), stack.split(";")
        if "Runner.run (asyncio/runners.py" not in stack:
            continue  # another thread
        if any(WAITING.match(f) for f in frames[-3:]):
            waiting["GIL" if "pthread_cond" in stack else "epoll"] += n
            continue
        total += n
        layer = next(
            (name for f in reversed(frames) for name, rx in rules if rx.search(f + " ")),
            OTHER,
        )
        busy[layer] += n
        if IN_LIBC.search(frames[-1]):
            in_libc[layer] += n
    return total, dict(busy), dict(in_libc), dict(waiting)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--locks", action="store_true", help="one write lock of 1,000 per transaction")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--raw", type=pathlib.Path, help="keep py-spy's collapsed stacks here")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        sys.exit("py-spy not found: pip install py-spy")
    with loadgen.scratch_dir("waltz-server-profile-") as root:
        raw = args.raw or pathlib.Path(tempfile.mkstemp(suffix=".txt", dir=root)[1])
        c = bench.WaltzCluster(root / "waltz", servers=1)
        try:
            c.start()
            port, pids = c.ports[0], c.pids

            def run(clients: int, seconds: float) -> dict[str, object]:
                with asyncio.Runner(loop_factory=loop_factory("uvloop", "--event-loop")) as runner:
                    return runner.run(  # type: ignore[no-any-return]
                        bench.closed_loop(
                            lambda i: bench.WaltzSession.open(port, i % bench.PARTITIONS, locks=args.locks),
                            clients,
                            seconds,
                            pids,
                            warmup=0.5,
                        )
                    )

            run(8, 1.5)
            duration = max(1, int(args.seconds) - 1)
            cmd = [spy, "record", "--native", "-r", str(args.rate), "-d", str(duration), "-f", "raw"]
            sampler = subprocess.Popen(
                [*cmd, "-o", str(raw), "-p", str(pids["server"])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            cell = run(args.clients, args.seconds)
            sampler.wait()
        finally:
            c.stop()
        by_process: dict[str, float] = cell["cpu_us_per_tx_by_process"]  # type: ignore[assignment]
        server_us = by_process["server"]
        print(
            f"{args.clients} clients{' with locks' if args.locks else ''}: {cell['tx_per_s']:,.0f} committed tx/s, "
            f"CPU µs per tx by process {by_process}, load average {os.getloadavg()[0]:.1f}"
        )
        total, busy, in_libc, waiting = layers(raw)
        print(f"{total} busy samples of the server's event-loop thread (left out, waiting: {waiting})\n")
        print("| layer | % of the server's busy samples | of which in libc (system calls) | µs per committed tx |")
        print("|---|---:|---:|---:|")
        for name, n in sorted(busy.items(), key=lambda kv: -kv[1]):
            share = n / max(total, 1)
            print(
                f"| {name} | {100 * share:.1f} | {100 * in_libc.get(name, 0) / max(total, 1):.1f} | "
                f"{share * server_us:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
