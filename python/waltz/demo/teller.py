"""One client process of the demo: submits transfers through a `WaltzClient`, keeping up to
`--in-flight` of them pending, and applies the whole log to its own SQLite database.

It talks to the demo runner through files in its directory:
    acks.log      one line per completed transfer when it completes: its id once committed
                  (acknowledged), `-` and its id when declined (the source account was empty)
    done.json     its counters and the high-water marks it saw, once every transfer completed
    final.json    (written by the runner, in the parent directory) the high-water marks every
                  client must reach before reporting
    report.json   its database's summary once it applied up to those marks

usage: python -m waltz.demo.teller DIRECTORY INDEX TRANSFERS CLIENT_CONFIG_JSON"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import sys
import threading

from waltz.client import ClientConfig, WaltzClient
from waltz.client.sql import SqlCallbacks
from waltz.demo.bank import Stats, Transfer, apply_transfer, ledger_summary, open_ledger, random_transfer

IN_FLIGHT = 8


def _write_json(path: pathlib.Path, value: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def main(directory: pathlib.Path, index: int, count: int, config: ClientConfig) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    directory.mkdir(parents=True, exist_ok=True)
    engine = open_ledger(f"sqlite:///{directory / 'ledger.db'}", _partitions(config))
    callbacks = SqlCallbacks(engine, apply_transfer, stream="bank")
    stats = Stats()
    acks = open(directory / "acks.log", "a", buffering=1)
    acks_lock = threading.Lock()

    def completed(transfer: str, committed: bool) -> None:
        with acks_lock:
            acks.write(("" if committed else "-") + transfer + "\n")

    rng = random.Random(index)
    slots = threading.Semaphore(IN_FLIGHT)
    with WaltzClient(callbacks, config) as client:
        partitions = client.partitions
        futures = []
        for n in range(count):
            while not slots.acquire(timeout=0.2):
                if stop.is_set():
                    return 143
            if stop.is_set():
                return 143
            p, source, target = random_transfer(rng, partitions)
            future = client.submit(Transfer(f"c{index}-{n}", p, source, target, engine, stats, completed))
            future.add_done_callback(lambda _f: slots.release())
            futures.append(future)
        while not all(f.done() for f in futures):
            if stop.wait(0.1):
                return 143
        client.flush()
        marks = {p: client.high_water_mark(p) for p in range(partitions)}
        _write_json(directory / "done.json", {"counts": stats.counts, "high_water_marks": marks})
        final = directory.parent / "final.json"
        while not final.exists():
            if stop.wait(0.1):
                return 143
        targets = {int(p): m for p, m in json.loads(final.read_text()).items()}
        while any(callbacks.get_client_high_water_mark(p) < m for p, m in targets.items()):
            if stop.wait(0.1):
                return 143
        summary = ledger_summary(engine)
        summary["high_water_marks"] = {p: callbacks.get_client_high_water_mark(p) for p in range(partitions)}
        _write_json(directory / "report.json", summary)
    acks.close()
    return 0


def _partitions(config: ClientConfig) -> int:
    from waltz.cluster import open_store
    from waltz.cluster.layout import cluster_root
    from waltz.cluster.metadata import ClusterMetadata

    store = open_store(config.metadata)
    store.start(timeout=30.0)
    try:
        return ClusterMetadata(store, cluster_root(config.cluster)).info().partitions
    finally:
        store.close()


if __name__ == "__main__":
    path, idx, n, raw = sys.argv[1:5]
    sys.exit(main(pathlib.Path(path), int(idx), int(n), ClientConfig(**json.loads(raw))))
