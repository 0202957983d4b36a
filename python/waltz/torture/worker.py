"""One client process of a torture run: appends transactions with unique payloads through a
`WaltzClient` (some under locks over a small pool), consumes the whole feed, and records every
operation in its history file (`docs/internals.md`, "Torture histories").

It talks to the run through files in the run's `clients/` directory:
    stop              (written by the run) stop submitting; finish what is pending
    worker-N.done     this worker's count, once every submitted operation completed
    final.json        (written by the run) the high-water marks to consume up to before exiting

usage: python -m waltz.torture.worker RUN_DIRECTORY INDEX SPEC_JSON
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import pathlib
import random
import signal
import sys
import threading
import time
from typing import Any

from waltz import errors
from waltz.client import ClientConfig, WaltzClient
from waltz.torture.drain import Record
from waltz.torture.history import HistoryWriter
from waltz.torture.op import Op
from waltz.torture.workloads import workload_for


def outcome_is_certain_failure(exc: BaseException) -> bool:
    """A definite failure, by the client's own word (`ClientError.outcome_unknown` False: never
    sent, refused by the server, expired between attempts that each failed): the checker then
    holds the client to it (such a payload must never be committed). A request that timed out,
    and anything the client does not vouch for, may have committed (the feed will tell)."""
    if isinstance(exc, errors.RequestTimeoutError):
        return False
    return isinstance(exc, errors.ClientError) and not exc.outcome_unknown


def _watch_memory(limit_mb: int) -> None:
    """Diagnosis of a client that grows: past `limit_mb` of RSS, every thread's stack goes to the
    log (the busy loop is on one of them), then the process exits rather than take the machine
    down with it."""

    def watch() -> None:
        while True:
            time.sleep(1)
            rss = int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
            if rss > limit_mb:
                print(f"worker: {rss} MiB resident, above WALTZ_TORTURE_MEMORY={limit_mb}", file=sys.stderr)
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(70)

    threading.Thread(target=watch, daemon=True, name="memory-watch").start()


def main(directory: pathlib.Path, index: int, spec: dict[str, Any]) -> int:
    # The run sends SIGUSR1 to a worker that does not finish: every thread's stack goes to its log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get("WALTZ_TORTURE_MEMORY"):
        _watch_memory(int(os.environ["WALTZ_TORTURE_MEMORY"]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    clients = directory / "clients"
    history = HistoryWriter(directory / "history" / f"worker-{index}.jsonl", f"w{index}")
    rng = random.Random(f"{spec['seed']}/{index}")

    def on_record(partition: int, record: Record) -> None:
        history.read(partition, record.txid, record.payload, record.digest, 0)

    workload = workload_for(spec, directory, index)
    feed = workload.feed(on_record)

    def applied(op: Op) -> None:
        txid = feed.committed_ids.get(op.payload)
        if txid is not None:  # applied means the feed delivered it, so this always holds
            history.ok(op.partition, op.payload, txid)

    def completed(op: Op, future: Any) -> None:
        slots.release()
        exc = future.exception()
        if exc is None:
            return  # committed: acknowledged once applied (`applied`), where its id is known
        kind = type(exc).__name__
        if outcome_is_certain_failure(exc):
            history.fail(op.partition, op.payload, error=f"{kind}: {exc}")
        else:
            history.info(op.partition, op.payload, error=f"{kind}: {exc}")

    slots = threading.Semaphore(spec["in_flight"])
    config = ClientConfig(**spec["client"])
    submitted = 0
    with WaltzClient(feed, config) as client:
        partitions = client.partitions
        # The dup-client-id fault mounts under this id with another token.
        (clients / f"worker-{index}.id").write_text(str(client.client_id))
        # Mounted: the run starts its faults only now (a client that cannot mount at start exits).
        (clients / f"worker-{index}.ready").write_text("")
        pending = []
        while not (clients / "stop").exists() and not stop.is_set():
            if not slots.acquire(timeout=0.2):
                continue
            p = rng.randrange(partitions)
            op = workload.op(rng, f"w{index}-{submitted:07d}", p, applied)
            history.invoke(
                p,
                op.payload,
                write_locks=op.lock_names("w"),
                read_locks=op.lock_names("r"),
                append_locks=op.lock_names("a"),
            )
            submitted += 1
            try:
                future = client.submit(op)
            except errors.ClientError as e:
                # Refused before anything was sent (the partition could not be mounted within
                # mount_timeout): certainly not committed. Mounting goes on in the background.
                history.fail(p, op.payload, error=f"{type(e).__name__}: {e}")
                slots.release()
                stop.wait(0.2)
                continue
            future.add_done_callback(functools.partial(completed, op))
            pending.append(future)
            pending = [f for f in pending if not f.done()]
        # Every operation ends within its timeout; what is still open then is left unknown.
        deadline = time.monotonic() + spec["op_timeout"] + 30
        while any(not f.done() for f in pending) and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.1)
        (clients / f"worker-{index}.done").write_text(json.dumps({"submitted": submitted}))
        final = clients / "final.json"
        while not final.exists():
            if stop.wait(0.1):
                return 143
        targets = {int(p): m for p, m in json.loads(final.read_text()).items()}
        behind = feed.wait_for(targets, spec["drain_timeout"], stop)
        if behind:
            print(f"worker {index}: the feed of partitions {behind} did not reach {targets}", file=sys.stderr)
            return 3
    history.close()
    return 0


if __name__ == "__main__":
    run_dir, idx, raw = sys.argv[1:4]
    sys.exit(main(pathlib.Path(run_dir), int(idx), json.loads(raw)))
