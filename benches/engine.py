#!/usr/bin/env python3
"""Storage engine benchmark: durable appends, concurrency, scan, recovery.

    python benches/engine.py [--quick] [--json PATH] [--dir DIR] [--plot PATH]

Every reference is measured in the same run on the same disk: the raw ceiling (write + fdatasync
of the same bytes in a minimal native loop) and the peers a Python user would pick for a durable
local log (SQLite WAL synchronous=FULL, LMDB sync=True, RocksDB sync=True). Prints markdown tables
and writes JSON with the raw cells, a `ratios` object (ours / reference) and the targets, each
MET or MISSED. Nothing here asserts: timings belong to benchmarks, not tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from itertools import repeat
from pathlib import Path

from waltz._native import __version__ as engine_version
from waltz._native import native_writers, raw_append_loop
from waltz.errors import NonDenseAppendError
from waltz.storage import RecordBatch, ReqId, Storage, iter_scan

RECORD_OVERHEAD = 40  # encoded size on disk = 40 + len(data)
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
RESULTS = Path(__file__).resolve().parent / "results"
WARMUP_CALLS = 2
PEERS = ("sqlite", "lmdb", "rocksdb")


@dataclass(frozen=True)
class Config:
    quick: bool
    batches: tuple[int, ...]
    record_sizes: tuple[int, ...]
    max_cell_bytes: int  # skip cells whose single batch is larger than this (1000 x 64 KiB)
    cell_seconds: float  # time budget per (system, cell, round)
    cell_bytes: int  # byte budget per (system, cell, round)
    min_calls: int  # per round
    tuple_cells: tuple[tuple[int, int], ...]  # (batch, size) cells that also run the tuple path
    rounds: int = 2
    threads: tuple[int, ...] = (1, 4, 16)
    partitions: tuple[int, ...] = (1, 4)
    conc_batches: tuple[int, ...] = (1, 100)
    conc_record_size: int = KIB
    conc_seconds: float = 2.0
    scan_bytes: int = GIB
    recovery_records: int = 1_000_000
    recovery_record_size: int = KIB


def make_config(quick: bool) -> Config:
    if quick:
        return Config(
            quick=True,
            batches=(1, 100, 1000),
            record_sizes=(100, KIB, 64 * KIB),
            max_cell_bytes=16 * MIB,
            cell_seconds=0.15,
            cell_bytes=64 * MIB,
            min_calls=3,
            tuple_cells=((100, KIB),),
            conc_seconds=0.5,
            scan_bytes=200 * 1000 * 1000,
            recovery_records=250_000,
        )
    return Config(
        quick=False,
        batches=(1, 10, 100, 1000),
        record_sizes=(100, KIB, 64 * KIB),
        max_cell_bytes=16 * MIB,
        cell_seconds=0.75,
        cell_bytes=512 * MIB,
        min_calls=5,
        tuple_cells=tuple((b, KIB) for b in (1, 10, 100, 1000)),
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Timing helpers


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return float(sorted_ns[max(0, min(len(sorted_ns) - 1, math.ceil(q * len(sorted_ns)) - 1))])


def time_calls(call: Callable[[], object], seconds: float, max_calls: int, min_calls: int) -> list[int]:
    """Calls `call` until the time budget (at least min_calls, at most max_calls); ns per call."""
    out: list[int] = []
    deadline = time.perf_counter_ns() + int(seconds * 1e9)
    while len(out) < max_calls:
        t0 = time.perf_counter_ns()
        call()
        t1 = time.perf_counter_ns()
        out.append(t1 - t0)
        if t1 >= deadline and len(out) >= min_calls:
            break
    return out


def summarize(latencies_ns: list[int], records_per_call: int, payload_bytes_per_call: int) -> dict:
    s = sorted(latencies_ns)
    total = sum(s) / 1e9
    calls = len(s)
    return {
        "calls": calls,
        "seconds": total,
        "records_s": calls * records_per_call / total,
        "mb_s": calls * payload_bytes_per_call / total / 1e6,
        "p50_us": percentile(s, 0.50) / 1e3,
        "p99_us": percentile(s, 0.99) / 1e3,
    }


# --------------------------------------------------------------------------------------------
# Data directory: a real disk, never tmpfs (tmpfs ignores fsync)


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest mount-point prefix)."""
    path = path.resolve()
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def pick_base_dir(requested: str | None) -> Path:
    candidates = [Path(requested)] if requested else [Path("/var/tmp"), Path("/work"), Path.cwd()]
    for c in candidates:
        if c.is_dir() and fs_type(c) not in ("tmpfs", "ramfs"):
            return c
    if requested:
        log(f"warning: {requested} is {fs_type(Path(requested))}: fsync is a no-op there")
        return Path(requested)
    raise SystemExit("no directory on a real disk found; pass --dir")


# --------------------------------------------------------------------------------------------
# Systems under test. Each opener yields `append()`, which appends one batch durably.


def req_ids(n: int, pid: int = 0) -> Iterator[ReqId]:
    return (ReqId(1, 1, pid, i) for i in range(n))


def open_storage(path: Path, partitions: int = 1) -> Storage:
    s = Storage.create(str(path), uuid.uuid4(), partitions)
    for pid in range(partitions):
        s.add_partition(pid)
    return s


@contextmanager
def waltz_appender(path: Path, n: int, payload: bytes, tuples: bool = False):
    s = open_storage(path)
    p = s.partition(0)
    records = (
        [((1, 1, 0, i), 0, payload) for i in range(n)] if tuples else RecordBatch([(r, 0, payload) for r in req_ids(n)])
    )
    next_txid = 0

    def append() -> None:
        nonlocal next_txid
        next_txid = p.append(next_txid, records) + 1

    try:
        yield append
    finally:
        s.close_partition(0)


@contextmanager
def sqlite_appender(path: Path, n: int, payload: bytes):
    path.mkdir()
    con = sqlite3.connect(path / "log.db", isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    con.execute("CREATE TABLE log (id INTEGER PRIMARY KEY, data BLOB)")
    next_id = 0

    def append() -> None:
        nonlocal next_id
        con.execute("BEGIN")
        con.executemany("INSERT INTO log (id, data) VALUES (?, ?)", zip(range(next_id, next_id + n), repeat(payload)))
        con.execute("COMMIT")
        next_id += n

    try:
        yield append
    finally:
        con.close()


@contextmanager
def lmdb_appender(path: Path, n: int, payload: bytes):
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 40, sync=True, metasync=True)
    next_id = 0

    def append() -> None:
        nonlocal next_id
        with env.begin(write=True) as txn:
            items = ((i.to_bytes(8, "big"), payload) for i in range(next_id, next_id + n))
            txn.cursor().putmulti(items, append=True)
        next_id += n

    try:
        yield append
    finally:
        env.close()


@contextmanager
def rocksdb_appender(path: Path, n: int, payload: bytes):
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    db = Rdict(str(path), options=Options(raw_mode=True))
    sync = WriteOptions()
    sync.sync = True
    next_id = 0

    def append() -> None:
        nonlocal next_id
        wb = WriteBatch(raw_mode=True)
        for i in range(next_id, next_id + n):
            wb.put(i.to_bytes(8, "big"), payload)
        db.write(wb, sync)
        next_id += n

    try:
        yield append
    finally:
        db.close()


SYSTEMS: dict[str, Callable] = {
    "waltz": waltz_appender,
    "waltz-tuples": partial(waltz_appender, tuples=True),
    "sqlite": sqlite_appender,
    "lmdb": lmdb_appender,
    "rocksdb": rocksdb_appender,
}


def measure_system(name: str, path: Path, n: int, size: int, cfg: Config) -> list[int]:
    payload = os.urandom(size)
    max_calls = max(cfg.min_calls, cfg.cell_bytes // (n * size))
    with SYSTEMS[name](path, n, payload) as append:
        for _ in range(WARMUP_CALLS):
            append()
        return time_calls(append, cfg.cell_seconds, max_calls, cfg.min_calls)


def measure_raw(path: Path, n: int, size: int, cfg: Config) -> list[int]:
    """The ceiling: the same bytes per batch, one write + fdatasync per call, in native code."""
    payload = os.urandom(n * (RECORD_OVERHEAD + size))
    path.mkdir()
    probe = raw_append_loop(str(path / "probe"), payload, WARMUP_CALLS + 3)[WARMUP_CALLS:]
    per_call = sum(probe) / len(probe) / 1e9
    max_calls = max(cfg.min_calls, cfg.cell_bytes // len(payload))
    calls = max(cfg.min_calls, min(max_calls, int(cfg.cell_seconds / per_call)))
    return raw_append_loop(str(path / "log"), payload, calls)


# --------------------------------------------------------------------------------------------
# 1. Durable appends


def append_cells(cfg: Config) -> list[tuple[int, int]]:
    return [(b, s) for s in cfg.record_sizes for b in cfg.batches if b * s <= cfg.max_cell_bytes]


def measure(name: str, path: Path, n: int, size: int, cfg: Config) -> list[int]:
    try:
        return measure_raw(path, n, size, cfg) if name == "raw" else measure_system(name, path, n, size, cfg)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench_appends(base: Path, cfg: Config) -> list[dict]:
    """Each cell runs its systems in alternating rounds (so drift on a shared machine hits them
    alike) and pools each system's latencies."""
    rows = []
    for n, size in append_cells(cfg):
        systems = ["raw", "waltz"] + (["waltz-tuples"] if (n, size) in cfg.tuple_cells else []) + list(PEERS)
        pooled: dict[str, list[int]] = {name: [] for name in systems}
        for rnd in range(cfg.rounds):
            for name in systems:
                pooled[name] += measure(name, base / f"append-{name}-{n}-{size}-{rnd}", n, size, cfg)
        for name in systems:
            row = {"system": name, "batch": n, "record_size": size, **summarize(pooled[name], n, n * size)}
            rows.append(row)
            log(f"  append {name:>12} batch={n:<5} size={size:<6} {row['records_s']:>12,.0f} rec/s")
    return rows


# --------------------------------------------------------------------------------------------
# 2. Concurrency: writers on a partition need dense ids in submission order


def ordered_append(p, scheme: str) -> Callable[[RecordBatch, int], None]:
    """A thread-safe `append(batch, n)` on one partition under the given id-ordering scheme.

    append_next  the engine assigns ids under its own lock (concurrent callers share fsyncs).
    ticket       a writer reserves ids and its turn under a Condition, then calls p.append; a
                 later id that reaches the engine before an earlier one gets NonDenseAppendError
                 (nothing is written) and retries. Correct, and lets fsyncs be shared, but the
                 retries cost GIL round trips.
    serialised   the lock is held across p.append: one fsync per batch, no sharing (reference).
    """
    if scheme == "append_next":
        return lambda batch, n: p.append_next(batch)
    cond = threading.Condition()
    state = {"next": 0, "turn": 0}
    if scheme == "serialised":

        def serialised(batch: RecordBatch, n: int) -> None:
            with cond:
                state["next"] = p.append(state["next"], batch) + 1

        return serialised

    def ticket(batch: RecordBatch, n: int) -> None:
        with cond:
            txid = state["next"]
            state["next"] += n
            while state["turn"] != txid:
                cond.wait()
            state["turn"] = txid + n
            cond.notify_all()
        while True:
            try:
                p.append(txid, batch)
                return
            except NonDenseAppendError:
                if p.failed:
                    raise
                time.sleep(0)

    return ticket


# The engine assigning ids is the real thing; the other schemes are references.
BEST_SCHEME = "append_next"


def writers_row(
    threads: int, partitions: int, n: int, size: int, scheme: str, elapsed: float, records: int, syncs: int
) -> dict:
    return {
        "threads": threads,
        "partitions": partitions,
        "batch": n,
        "record_size": size,
        "scheme": scheme,
        "seconds": elapsed,
        "records": records,
        "records_s": records / elapsed,
        "syncs": syncs,
        "records_per_sync": records / max(syncs, 1),
    }


def run_writers(base: Path, threads: int, partitions: int, n: int, size: int, seconds: float, scheme: str) -> dict:
    path = base / f"conc-{threads}-{partitions}-{n}-{scheme}"
    s = open_storage(path, partitions)
    try:
        parts = [s.partition(pid) for pid in range(partitions)]
        appends = [ordered_append(p, scheme) for p in parts]
        payload = os.urandom(size)
        batches = [RecordBatch([(r, 0, payload) for r in req_ids(n, pid)]) for pid in range(partitions)]
        counts = [0] * threads
        start, stop = threading.Barrier(threads + 1), threading.Event()

        def writer(k: int) -> None:
            pid = k % partitions
            append, batch = appends[pid], batches[pid]
            start.wait()
            while not stop.is_set():
                append(batch, n)
                counts[k] += n

        workers = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        syncs0 = sum(p.stats()["syncs"] for p in parts)
        start.wait()
        t0 = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        syncs = sum(p.stats()["syncs"] for p in parts) - syncs0
        return writers_row(threads, partitions, n, size, scheme, elapsed, sum(counts), syncs)
    finally:
        for pid in range(partitions):
            s.close_partition(pid)
        del s
        shutil.rmtree(path, ignore_errors=True)


def run_native_writers(base: Path, threads: int, size: int, seconds: float) -> dict:
    """Single-record writers on native threads (as a storage node's connections append): the
    engine's group commit without Python's wake-ups and GIL hand-offs between appends."""
    path = base / f"conc-native-{threads}"
    s = open_storage(path, 1)
    try:
        p = s.partition(0)
        syncs0 = p.stats()["syncs"]
        t0 = time.perf_counter()
        records = native_writers(p, threads, seconds, size)
        elapsed = time.perf_counter() - t0
        return writers_row(threads, 1, 1, size, "native", elapsed, records, p.stats()["syncs"] - syncs0)
    finally:
        s.close_partition(0)
        del s
        shutil.rmtree(path, ignore_errors=True)


def bench_concurrency(base: Path, cfg: Config) -> list[dict]:
    cells = [
        (t, p, n, BEST_SCHEME)
        for n in cfg.conc_batches
        for p in cfg.partitions
        for t in cfg.threads
        if t >= p  # a writer per partition at least; fewer would leave partitions idle
    ]
    # References for the key cell (16 writers, 1 partition, batch 1): the other id schemes.
    cells += [(16, 1, 1, scheme) for scheme in ("ticket", "serialised") if scheme != BEST_SCHEME]
    cells += [(t, 1, 1, "native") for t in (1, 16)]
    rows = []
    for t, p, n, scheme in cells:
        if scheme == "native":
            row = run_native_writers(base, t, cfg.conc_record_size, cfg.conc_seconds)
        else:
            row = run_writers(base, t, p, n, cfg.conc_record_size, cfg.conc_seconds, scheme)
        rows.append(row)
        log(
            f"  writers={t:<2} partitions={p} batch={n:<3} {row['scheme']:>11} {row['records_s']:>10,.0f} rec/s "
            f"{row['records_per_sync']:.1f} rec/sync"
        )
    return rows


# --------------------------------------------------------------------------------------------
# 3. Scan with CRC checks, from the page cache


def fill_partition(p, total_bytes: int, size: int, per_append: int = 4096) -> int:
    payload = os.urandom(size)
    batch = RecordBatch([(r, 0, payload) for r in req_ids(per_append)])
    appends = max(1, total_bytes // (per_append * size))
    txid = 0
    for _ in range(appends):
        txid = p.append(txid, batch) + 1
    return txid


def scan_once(p) -> tuple[int, int, float]:
    t0 = time.perf_counter()
    records = nbytes = 0
    for chunk in iter_scan(p):
        records += len(chunk)
        nbytes += chunk.payload_nbytes
    return records, nbytes, time.perf_counter() - t0


def read_files_once(files: list[Path]) -> tuple[int, float]:
    """Reference: plain sequential reads of the segment files (no parsing, no CRC)."""
    buf = bytearray(16 * MIB)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(view):
                total += k
    return total, time.perf_counter() - t0


def bench_scan(base: Path, cfg: Config, passes: int = 3) -> dict:
    path = base / "scan"
    s = open_storage(path)
    try:
        p = s.partition(0)
        written = fill_partition(p, cfg.scan_bytes, KIB)
        scan_once(p)  # warm the page cache
        scans = [scan_once(p) for _ in range(passes)]
        records, nbytes, best = min(scans, key=lambda r: r[2])
        files = sorted((path / "0").glob("*.seg"))
        file_bytes, raw_best = min((read_files_once(files) for _ in range(passes)), key=lambda r: r[1])
        return {
            "records_written": written,
            "records_scanned": records,
            "payload_bytes": nbytes,
            "scan_seconds": best,
            "scan_gb_s": nbytes / best / 1e9,
            "scan_records_s": records / best,
            "file_bytes": file_bytes,
            "raw_read_gb_s": file_bytes / raw_best / 1e9,
            # the same bytes as the raw read, for a like-for-like ratio
            "scan_file_gb_s": file_bytes / best / 1e9,
        }
    finally:
        s.close_partition(0)
        del s
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# 4. Recovery after SIGKILL; writer memory as the log grows

# The writer: `total` records in batches of `per_append`, RSS at 0/10/50/100 %, then it keeps
# appending small unaligned batches until the parent's SIGKILL lands mid-write.
CHILD = r"""
import json, os, sys, uuid
from waltz.storage import RecordBatch, ReqId, Storage

def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

path, total, size, per_append = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = Storage.create(path, uuid.uuid4(), 1)
s.add_partition(0)
p = s.partition(0)
payload = os.urandom(size)
batch = RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(per_append)])
tail = RecordBatch([(ReqId(1, 1, 0, i), 0, payload) for i in range(7)])
marks = [total * k // 10 for k in (1, 5, 10)]
print(json.dumps({"records": 0, "rss_kib": rss_kib()}), flush=True)
txid = 0
while txid < total:
    txid = p.append(txid, batch) + 1
    while marks and txid >= marks[0]:
        print(json.dumps({"records": txid, "rss_kib": rss_kib()}), flush=True)
        marks.pop(0)
print(json.dumps({"done": True, "records": txid}), flush=True)
while True:
    txid = p.append(txid, tail) + 1
"""


def write_then_kill(
    path: Path, records: int, size: int, per_append: int = 1000, kill_after: float = 0.05, timeout: float = 900
) -> list[dict]:
    """Runs the writer in a child process and SIGKILLs it mid-append, `kill_after` seconds after
    `records` are durable."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(records), str(size), str(per_append)],
        stdout=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    marks: list[dict] = []
    try:
        for line in proc.stdout:
            msg = json.loads(line)
            if msg.get("done"):
                time.sleep(kill_after)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return marks
            marks.append(msg)
        raise RuntimeError(f"writer exited early with status {proc.wait()}")
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def bench_recovery(base: Path, cfg: Config) -> dict:
    path = base / "recovery"
    try:
        marks = write_then_kill(path, cfg.recovery_records, cfg.recovery_record_size)
        t0 = time.perf_counter()
        s = Storage.open(str(path))
        p = s.partition(0)
        seconds = time.perf_counter() - t0
        rec = p.recovery
        result = {
            "records": p.max_transaction_id + 1,
            "record_size": cfg.recovery_record_size,
            "seconds": seconds,
            "recovered_max_txid": p.max_transaction_id,
            "scanned_records": rec["scanned_records"],
            "recovery": rec,
            "writer_rss_kib": marks,
        }
        s.close_partition(0)
        return result
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Ratios and targets


@dataclass
class Target:
    name: str
    value: float | None
    threshold: float
    higher_is_better: bool = True
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold


def size_label(size: int) -> str:
    return f"{size // KIB}KiB" if size >= KIB and size % KIB == 0 else f"{size}B"


def cell_key(n: int, size: int) -> str:
    return f"b{n}/{size_label(size)}"


def append_ratios(rows: list[dict]) -> dict[str, float]:
    by = {(r["system"], r["batch"], r["record_size"]): r["records_s"] for r in rows}
    p99 = {(r["system"], r["batch"], r["record_size"]): r["p99_us"] for r in rows}
    ratios = {}
    for (system, n, size), rate in by.items():
        if system != "waltz":
            continue
        key = cell_key(n, size)
        ratios[f"append_vs_raw/{key}"] = rate / by[("raw", n, size)]
        ratios[f"append_p99_vs_raw/{key}"] = p99[(system, n, size)] / p99[("raw", n, size)]
        best_name = max(PEERS, key=lambda peer: by[(peer, n, size)])
        ratios[f"append_vs_best_peer/{key}"] = rate / by[(best_name, n, size)]
        if ("waltz-tuples", n, size) in by:
            ratios[f"tuples_vs_batch/{key}"] = by[("waltz-tuples", n, size)] / rate
    return ratios


def concurrency_ratios(rows: list[dict]) -> dict[str, float]:
    def rate(t: int, p: int, n: int, scheme: str | None = None) -> float | None:
        for r in rows:
            if (r["threads"], r["partitions"], r["batch"]) == (t, p, n) and scheme in (None, r["scheme"]):
                return r["records_s"]
        return None

    out = {}
    for r in rows:
        # Native writers against one native writer; Python's schemes against one Python writer.
        one = rate(1, 1, r["batch"], "native" if r["scheme"] == "native" else BEST_SCHEME)
        if one and r["threads"] > 1:
            out[f"writers_vs_one/{r['threads']}w/{r['partitions']}p/b{r['batch']}/{r['scheme']}"] = r["records_s"] / one
    return out


def build_targets(ratios: dict, conc: list[dict], scan: dict, recovery: dict, cfg: Config) -> list[Target]:
    large = [n for n in cfg.batches if n >= 100]
    targets = [
        Target(f"append >= 0.9x raw, {cell_key(n, size)}", ratios.get(f"append_vs_raw/{cell_key(n, size)}"), 0.9)
        for size in (100, KIB)
        for n in large
    ]
    targets += [
        Target(f"append >= 0.8x raw, {cell_key(1, size)}", ratios.get(f"append_vs_raw/{cell_key(1, size)}"), 0.8)
        for size in (100, KIB)
    ]
    tail = {k.split("/", 1)[1]: v for k, v in ratios.items() if k.startswith("append_p99_vs_raw/")}
    worst_tail = max(tail, key=tail.get)
    targets.append(
        Target(
            "append p99 <= 1.5x raw's p99, every cell (worst cell)",
            tail[worst_tail],
            1.5,
            higher_is_better=False,
            note=f"worst: {worst_tail}",
        )
    )
    peer = {k.split("/", 1)[1]: v for k, v in ratios.items() if k.startswith("append_vs_best_peer/")}
    worst = min(peer, key=peer.get)
    targets.append(
        Target(
            "append > best of sqlite/lmdb/rocksdb, every cell (worst cell)", peer[worst], 1.0, note=f"worst: {worst}"
        )
    )
    targets.append(Target("append >= 1.25x best peer, b100/1KiB", peer.get("b100/1KiB"), 1.25))
    key_best = next(
        (r for r in conc if (r["threads"], r["partitions"], r["batch"], r["scheme"]) == (16, 1, 1, BEST_SCHEME)), None
    )
    targets.append(
        Target(
            "16 single-record writers on 1 partition >= 5x one writer",
            ratios.get(f"writers_vs_one/16w/1p/b1/{key_best['scheme']}") if key_best else None,
            5.0,
            note=f"scheme {key_best['scheme']}, {key_best['records_per_sync']:.1f} records/fsync" if key_best else "",
        )
    )
    native = next((r for r in conc if (r["threads"], r["scheme"]) == (16, "native")), None)
    targets.append(
        Target(
            "16 single-record writers on 1 partition >= 5x one writer, native threads",
            ratios.get("writers_vs_one/16w/1p/b1/native"),
            5.0,
            note=f"{native['records_per_sync']:.1f} records/fsync" if native else "",
        )
    )
    targets.append(Target("scan with CRC >= 1 GB/s (payload)", scan["scan_gb_s"], 1.0))
    targets.append(
        Target(
            f"recovery after a kill at {cfg.recovery_records:,} records <= 1 s",
            recovery["seconds"],
            1.0,
            higher_is_better=False,
            note=f"{recovery['records']:,} records recovered, {recovery['scanned_records']:,} scanned",
        )
    )
    rss = {m["records"]: m["rss_kib"] for m in recovery["writer_rss_kib"]}
    marks = sorted(k for k in rss if k > 0)
    growth = (rss[marks[-1]] - rss[marks[0]]) / KIB if len(marks) >= 2 else None
    targets.append(
        Target(
            "writer memory flat (RSS growth from 10% to 100% of the log, MiB)",
            growth,
            16.0,
            higher_is_better=False,
            note=" / ".join(f"{rss[k] / KIB:.0f} MiB @ {k:,}" for k in marks),
        )
    )
    return targets


# --------------------------------------------------------------------------------------------
# Output


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def verdict(t: Target) -> str:
    return {True: "MET", False: "MISSED", None: "n/a"}[t.met]


def report(results: dict, targets: list[Target]) -> str:
    ratios = results["ratios"]
    out = [f"## Waltz storage engine benchmark ({'quick' if results['meta']['quick'] else 'full'})", ""]
    out.append(
        f"Data on {results['meta']['dir']} ({results['meta']['fs']}), {results['meta']['cpus']} CPUs, "
        f"engine {results['meta']['engine_version']}. MB/s counts record payload only."
    )
    out += ["", "### Durable appends", ""]
    rows = []
    for r in results["append"]:
        key = cell_key(r["batch"], r["record_size"])
        ratio = ratios.get(f"append_vs_raw/{key}") if r["system"] == "waltz" else None
        peer = ratios.get(f"append_vs_best_peer/{key}") if r["system"] == "waltz" else None
        tail = ratios.get(f"append_p99_vs_raw/{key}") if r["system"] == "waltz" else None
        rows.append(
            [
                r["batch"],
                size_label(r["record_size"]),
                r["system"],
                fmt(r["records_s"]),
                fmt(r["mb_s"], 1),
                fmt(r["p50_us"], 1),
                fmt(r["p99_us"], 1),
                fmt(ratio, 2) if ratio else "",
                fmt(tail, 2) if tail else "",
                fmt(peer, 2) if peer else "",
            ]
        )
    headers = [
        "batch",
        "record",
        "system",
        "records/s",
        "MB/s",
        "p50 µs",
        "p99 µs",
        "÷ raw",
        "p99 ÷ raw's",
        "÷ best peer",
    ]
    out.append(md_table(headers, rows))
    out += ["", "### Concurrent writers (1 KiB records)", ""]
    rows = [
        [
            r["threads"],
            r["partitions"],
            r["batch"],
            r["scheme"],
            fmt(r["records_s"]),
            r["syncs"],
            fmt(r["records_per_sync"], 1),
            fmt(ratios.get(f"writers_vs_one/{r['threads']}w/{r['partitions']}p/b{r['batch']}/{r['scheme']}"), 2),
        ]
        for r in results["concurrency"]
    ]
    out.append(
        md_table(
            ["writers", "partitions", "batch", "id scheme", "records/s", "fsyncs", "records/fsync", "÷ 1 writer"], rows
        )
    )
    sc = results["scan"]
    out += ["", "### Scan with CRC checks (page cache, 1 KiB records)", ""]
    out.append(
        md_table(
            [
                "records",
                "payload GB",
                "scan GB/s (payload)",
                "scan GB/s (file bytes)",
                "raw read GB/s",
                "÷ raw read",
                "records/s",
            ],
            [
                [
                    f"{sc['records_scanned']:,}",
                    fmt(sc["payload_bytes"] / 1e9, 2),
                    fmt(sc["scan_gb_s"], 2),
                    fmt(sc["scan_file_gb_s"], 2),
                    fmt(sc["raw_read_gb_s"], 2),
                    fmt(ratios["scan_vs_raw_read"], 2),
                    fmt(sc["scan_records_s"]),
                ]
            ],
        )
    )
    rc = results["recovery"]
    out += ["", "### Recovery after SIGKILL", ""]
    out.append(
        md_table(
            ["records", "open + partition s", "scanned records", "recovered max id", "writer RSS (MiB) @ records"],
            [
                [
                    f"{rc['records']:,}",
                    fmt(rc["seconds"], 3),
                    f"{rc['scanned_records']:,}",
                    rc["recovered_max_txid"],
                    ", ".join(f"{m['rss_kib'] / KIB:.0f} @ {m['records']:,}" for m in rc["writer_rss_kib"]),
                ]
            ],
        )
    )
    out += ["", "### Targets", ""]
    out.append(
        md_table(
            ["target", "value", "threshold", "verdict", "note"],
            [[t.name, fmt(t.value, 3), t.threshold, verdict(t), t.note] for t in targets],
        )
    )
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["record_size"] for r in results["append"]})
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    axes = list(axes.flat)
    for ax, size in zip(axes, sizes):
        for system in dict.fromkeys(r["system"] for r in results["append"]):
            pts = sorted(
                (r["batch"], r["records_s"])
                for r in results["append"]
                if r["system"] == system and r["record_size"] == size
            )
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker="o", label=system, linestyle="--" if system == "raw" else "-")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="batch size (records)",
            ylabel="records/s",
            title=f"durable appends, {size_label(size)} records",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    grid = [r for r in results["concurrency"] if r["scheme"] == BEST_SCHEME]
    for p, n in sorted({(r["partitions"], r["batch"]) for r in grid}):
        pts = sorted((r["threads"], r["records_s"]) for r in grid if (r["partitions"], r["batch"]) == (p, n))
        ax.plot(*zip(*pts), marker="o", label=f"{p} partition(s), batch {n}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="writer threads",
        ylabel="aggregate records/s",
        title="concurrent writers, 1 KiB records",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cells and shorter timings (< 60 s)")
    ap.add_argument("--json", type=Path, help="JSON output (default benches/results/engine[-quick].json)")
    ap.add_argument("--dir", help="where data files go (default: /var/tmp, /work or cwd, whichever is not tmpfs)")
    ap.add_argument("--plot", type=Path, help="PNG output (default benches/results/engine[-quick].png)")
    args = ap.parse_args(argv)
    cfg = make_config(args.quick)
    stem = "engine-quick" if cfg.quick else "engine"
    json_path = args.json or RESULTS / f"{stem}.json"
    plot_path = args.plot or RESULTS / f"{stem}.png"

    base_parent = pick_base_dir(args.dir)
    base = Path(tempfile.mkdtemp(prefix="waltz-bench-", dir=base_parent))
    t_start = time.perf_counter()
    try:
        log(f"data in {base} ({fs_type(base)})")
        log("durable appends")
        appends = bench_appends(base, cfg)
        log("concurrent writers")
        conc = bench_concurrency(base, cfg)
        log("scan")
        scan = bench_scan(base, cfg)
        log("recovery")
        recovery = bench_recovery(base, cfg)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    ratios = {
        **append_ratios(appends),
        **concurrency_ratios(conc),
        "scan_vs_raw_read": scan["scan_file_gb_s"] / scan["raw_read_gb_s"],
    }
    results = {
        "meta": {
            "quick": cfg.quick,
            "dir": str(base_parent),
            "fs": fs_type(base_parent),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "engine_version": engine_version,
            "config": asdict(cfg),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "append": appends,
        "concurrency": conc,
        "scan": scan,
        "recovery": recovery,
        "ratios": ratios,
    }
    targets = build_targets(ratios, conc, scan, recovery, cfg)
    results["targets"] = [{**asdict(t), "met": t.met} for t in targets]
    results["meta"]["wall_seconds"] = time.perf_counter() - t_start

    print(report(results, targets))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {json_path}")
    try:
        plot(results, plot_path)
        log(f"wrote {plot_path}")
    except ImportError:
        log("matplotlib not installed: no plot (pip install --group bench, or scripts/setup.sh)")
    log(f"total {results['meta']['wall_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
