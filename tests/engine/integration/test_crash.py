"""kill -9 in the middle of appends, truncations and segment rolls; injected fsync and write errors.

After every crash the storage is reopened and checked against what the writer had acknowledged:
every acknowledged id is present with its exact bytes, ids are dense, and nothing from before a
completed truncation comes back.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from support import script
from support.chaos_payload import check_payload
from waltz.storage import RecordBatch, ReqId, Storage
from waltz.torture.lazyfs import LazyFs

WRITER = script("crash_writer.py")
ROUNDS = int(os.environ.get("WALTZ_CRASH_ROUNDS", "20"))


class History:
    """What the writer acknowledged, replayed from its output."""

    def __init__(self) -> None:
        self.acked: dict[int, int] = {}  # txid -> epoch of the acknowledged payload
        self.end = -1  # highest id the acknowledged history says must exist
        self.pending_truncate: int | None = None
        self.epoch = 0
        self.failures: list[str] = []
        self.refusals: list[str] = []
        self.acks_seen = 0  # acknowledgements over all rounds: the progress the crashes interrupted

    def feed(self, text: str) -> None:
        for line in text.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "A":
                t, e = map(int, rest.split())
                self.acked[t] = e
                self.end = max(self.end, t)
                self.acks_seen += 1
            elif kind == "T":
                self.pending_truncate = int(rest)
            elif kind == "t":
                target = int(rest)
                self.complete_truncate(target)
            elif kind == "E":
                self.failures.append(rest)
            elif kind == "R":
                self.refusals.append(rest)

    def complete_truncate(self, target: int) -> None:
        self.acked = {t: e for t, e in self.acked.items() if t <= target}
        self.end = target
        self.pending_truncate = None
        self.epoch += 1

    def check(self, data_dir: pathlib.Path) -> int:
        p = Storage.open(data_dir, segment_size=64 << 10, checkpoint_interval=50).partition(0)
        last = p.max_transaction_id
        if self.pending_truncate is not None:
            # A truncation was under way: the end is either the old one or the new one.
            old_end, new_end = self.end, self.pending_truncate
            if last <= new_end:
                assert last == new_end or last >= old_end, (last, old_end, new_end)
                self.complete_truncate(new_end)
            else:
                assert last >= old_end, f"truncation left a third state: {last} (old {old_end}, new {new_end})"
                self.pending_truncate = None
        assert last >= self.end, f"acknowledged transactions lost: log ends at {last}, acknowledged up to {self.end}"
        t = p.first_transaction_id
        while t <= last:
            chunk = p.read_records(t, max_count=1000, max_bytes=8 << 20)
            for r in chunk:
                assert r.txid == t, f"ids not dense: expected {t}, got {r.txid}"
                epoch = check_payload(t, r.data)
                if t in self.acked:
                    assert epoch == self.acked[t], f"transaction {t}: acknowledged epoch {self.acked[t]}, found {epoch}"
                t += 1
        assert t == last + 1
        # Ids beyond the acknowledged end were written but never acknowledged: legal survivors.
        for extra in range(self.end + 1, last + 1):
            self.acked[extra] = check_payload(extra, p.read_record(extra).data)
        self.end = last
        return last


def new_storage(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "storage"
    s = Storage.create(d, uuid.uuid4(), 1, segment_size=64 << 10, checkpoint_interval=50)
    s.add_partition(0)
    return d


def run_and_kill(cmd: list[str], after: float) -> str:
    """Kill the writer `after` seconds into its work. The clock starts at its first line, so a
    slow interpreter start on a loaded machine does not eat the window in which it writes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    time.sleep(after)
    proc.send_signal(signal.SIGKILL)
    # Read on through the same buffered pipe: communicate() reads the raw descriptor, and lost
    # what readline() had buffered past the first line, or tore a line at the buffer's end when
    # more than 8 KiB was waiting (8 threads on a loaded machine).
    assert proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"writer ended by itself ({proc.returncode}): {err}"
    return first + out


@pytest.mark.parametrize("truncate_every", [0, 7], ids=["appends", "appends+truncations"])
def test_kill9_loses_nothing_acknowledged(tmp_path, truncate_every):
    data_dir = new_storage(tmp_path)
    rng = random.Random(1234 + truncate_every)
    history = History()
    for round_no in range(ROUNDS):
        cmd = [sys.executable, str(WRITER), str(data_dir), "--seed", str(round_no), "--epoch", str(history.epoch)]
        if truncate_every:
            cmd += ["--truncate-every", str(truncate_every)]
        history.feed(run_and_kill(cmd, rng.uniform(0.1, 1.0)))
        history.check(data_dir)
    # Truncations walk the log's end back and forth, so its final length says nothing about
    # progress; the acknowledgements seen over all rounds do.
    assert history.acks_seen > 100, "the writer made too little progress to prove anything"


def test_kill9_with_concurrent_writers_loses_nothing(tmp_path):
    """Group commit under fire: 8 threads share fsyncs; every id any of them saw acknowledged
    survives with exactly its bytes."""
    data_dir = new_storage(tmp_path)
    rng = random.Random(77)
    acked: dict[int, tuple[str, int]] = {}
    for round_no in range(max(ROUNDS // 2, 3)):
        cmd = [sys.executable, str(WRITER), str(data_dir), "--threads", "8", "--seed", str(round_no)]
        for line in run_and_kill(cmd, rng.uniform(0.3, 1.0)).splitlines():
            kind, txid, tag, size = line.split()
            assert kind == "C"
            acked[int(txid)] = (tag, int(size))
        p = Storage.open(data_dir, segment_size=64 << 10, checkpoint_interval=50).partition(0)
        assert p.max_transaction_id >= max(acked), "acknowledged transactions lost"
        for txid, (tag, size) in acked.items():
            data = p.read_record(txid).data
            assert data == (tag.encode() * size)[:size], f"transaction {txid} differs"
        assert len(p.read_records(0, max_count=10**6, max_bytes=1 << 30)) == p.max_transaction_id + 1
    assert len(acked) > 500


def direct_descriptors(under: pathlib.Path) -> list[str]:
    """This process's files under `under` open with O_DIRECT."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            flags = int(pathlib.Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError):
            continue
        if target.startswith(str(under)) and flags & os.O_DIRECT:
            found.append(target)
    return found


def test_power_loss_under_large_batches_loses_nothing_acknowledged(tmp_path):
    """kill -9, then a power loss (LazyFS: every unsynced write dropped, the last one maybe torn at
    a page boundary), under RecordBatch appends of up to 1.2 MB: their flushes go past the page
    cache and rewrite the tail's last partial block (docs/format.md, "Preallocation")."""
    disk = LazyFs(tmp_path / "backing", tmp_path / "mnt", f"test-crash-{uuid.uuid4().hex[:8]}", tmp_path / "lazyfs.log")
    disk.start()
    try:
        data_dir = new_storage(disk.mountpoint)
        rng = random.Random(4242)
        history = History()
        for round_no in range(max(ROUNDS // 2, 4)):
            cmd = [sys.executable, str(WRITER), str(data_dir), "--seed", str(round_no), "--record-batch"]
            history.feed(run_and_kill(cmd, rng.uniform(0.2, 1.0)))
            disk.power_loss(tear=rng.choice([None, rng.random()]))
            history.check(data_dir)
        assert history.acks_seen > 100, "the writer made too little progress to prove anything"
        # The writer's large flushes took the direct path: this file system offers it.
        s = Storage.open(data_dir, segment_size=1 << 30, checkpoint_interval=50)
        p = s.partition(0)
        nxt = p.max_transaction_id + 1
        p.append(nxt, RecordBatch([(ReqId(1, 1, 0, t), 0, b"d" * 100) for t in range(nxt, nxt + 1000)]))
        assert direct_descriptors(disk.mountpoint), "a 140 KB flush on LazyFS did not go past the page cache"
        s.close()
    finally:
        disk.stop()


@pytest.mark.slow
def test_kill9_long_run(tmp_path):
    """The same check over many more crashes (make test-all)."""
    data_dir = new_storage(tmp_path)
    rng = random.Random(99)
    history = History()
    for round_no in range(150):
        cmd = [sys.executable, str(WRITER), str(data_dir), "--seed", str(round_no), "--epoch", str(history.epoch)]
        if round_no % 2:
            cmd += ["--truncate-every", "11"]
        history.feed(run_and_kill(cmd, rng.uniform(0.2, 1.5)))
        history.check(data_dir)


def strace_cmd(inject: str, trace: str) -> list[str]:
    strace = shutil.which("strace")
    assert strace, "strace is required (installed by the project's setup)"
    return [strace, "-f", "-qq", "-o", "/dev/null", "-e", f"trace={trace}", "-e", f"inject={inject}"]


@pytest.mark.parametrize(
    "inject,trace,errno_name,writer_args",
    [
        ("fdatasync:error=EIO:when=40+", "fdatasync", "Input/output error", []),
        ("pwrite64:error=ENOSPC:when=60+", "pwrite64", "No space left on device", []),
        # RecordBatch appends: records of 4 KiB or more are written from the batch with pwritev.
        ("fdatasync:error=EIO:when=40+", "fdatasync", "Input/output error", ["--record-batch"]),
        ("pwrite64,pwritev:error=ENOSPC:when=60+", "pwrite64,pwritev", "No space left on device", ["--record-batch"]),
    ],
    ids=["fsync-EIO", "disk-full", "fsync-EIO-vectored", "disk-full-vectored"],
)
def test_io_errors_fail_the_append_and_lose_nothing(tmp_path, inject, trace, errno_name, writer_args):
    data_dir = new_storage(tmp_path)
    cmd = strace_cmd(inject, trace) + [sys.executable, str(WRITER), str(data_dir), "--max-batches", "100000"]
    cmd += writer_args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    history = History()
    history.feed(proc.stdout)
    assert history.failures, f"no failure was injected: {proc.stderr[-2000:]}"
    assert errno_name in history.failures[0]
    assert history.failures[0].startswith("StorageIOError")
    assert history.refusals == ["PartitionFailedError"], "a failed partition must refuse further appends"
    assert history.end >= 0, "the fault came before any append succeeded: raise the 'when' count"
    # Reopened without faults: every acknowledged record is there; the failed batch may or may
    # not be (it was never acknowledged), and the partition accepts appends again.
    last = history.check(data_dir)
    s = Storage.open(data_dir, segment_size=64 << 10, checkpoint_interval=50)
    p = s.partition(0)
    assert p.append(last + 1, [((1, 1, 0, 0), 0, b"after the fault")]) == last + 1
