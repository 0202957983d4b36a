"""The storage engine through its Python API: behaviour, errors, and recovery from damaged files."""

from __future__ import annotations

import ast
import ctypes
import gc
import multiprocessing
import os
import pathlib
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
from support.engine_helpers import append_range, assert_log, flip_byte, payload, record_offsets, records, segment_files
from waltz import errors
from waltz._native import encode_append
from waltz.storage import RecordBatch, Storage

# One writer per directory: reopening closes the handles a test opened before, as an operator
# restarting a node would.
_handles: list[Storage] = []


@pytest.fixture
def storage(data_dir, cluster_key):
    s = Storage.create(data_dir, cluster_key, 4, segment_size=8192, checkpoint_interval=16)
    s.add_partition(0)
    _handles.append(s)
    yield s
    while _handles:
        _handles.pop().close()


def reopen(data_dir, **kw):
    kw.setdefault("segment_size", 8192)
    kw.setdefault("checkpoint_interval", 16)
    if not kw.get("read_only"):
        while _handles:
            _handles.pop().close()
    s = Storage.open(data_dir, **kw)
    _handles.append(s)
    return s


# --- storage directory -------------------------------------------------------------------------


def test_create_then_open_checks_key_and_partition_count(data_dir, cluster_key):
    s = Storage.create(data_dir, cluster_key, 3)
    assert s.cluster_key == str(cluster_key)
    assert s.partition_count == 3
    s.close()
    assert Storage.open(data_dir, cluster_key, 3).cluster_key == str(cluster_key)
    assert Storage.open(data_dir, str(cluster_key)).partition_count == 3
    # Neither key in the message: it ends up in logs, and the key is the cluster's credential.
    with pytest.raises(errors.ClusterKeyMismatch, match="belongs to another cluster") as refused:
        Storage.open(data_dir, other := uuid.uuid4())
    assert str(cluster_key) not in str(refused.value) and str(other) not in str(refused.value)
    with pytest.raises(errors.PartitionCountMismatch):
        Storage.open(data_dir, cluster_key, 4)
    with pytest.raises(errors.StorageExistsError):
        Storage.create(data_dir, cluster_key, 3)
    with pytest.raises(errors.NotInitialisedError):
        Storage.open(data_dir / "nope")
    with pytest.raises(errors.InvalidArgumentError):
        Storage.open(data_dir, "not-a-uuid")


def test_one_writer_per_directory_but_readers_may_watch(data_dir, cluster_key):
    s = Storage.create(data_dir, cluster_key, 1)
    s.add_partition(0)
    append_range(s.partition(0), 0, 3)
    with pytest.raises(errors.StorageLockedError, match="in use"):
        Storage.open(data_dir)
    assert_log(Storage.open(data_dir, read_only=True).partition(0), 2)
    s.close()
    with pytest.raises(errors.StorageClosedError):
        s.partition(0)
    with Storage.open(data_dir) as again:
        assert_log(again.partition(0), 2)
    assert_log(Storage.open(data_dir).partition(0), 2)


def _append_until(data_dir: pathlib.Path, stop: Any) -> None:
    with Storage.open(data_dir, segment_size=16384, preallocate=1 << 20) as s:
        t = 0
        while not stop.is_set():
            n = 1 + t % 7
            append_range(s.partition(0), t, n)
            t += n


def test_read_only_opens_of_a_directory_being_written_see_a_whole_prefix(data_dir, cluster_key):
    """A reader of a running node's files (the Spark source) opens them read-only while the node
    appends and rolls segments. It failed about half the time: the scan took zeros the writer
    had just filled for damage with valid records after it, and a listing made during a roll
    missed a segment. Every open must now see a dense log, each record whole."""
    with Storage.create(data_dir, cluster_key, 1, segment_size=4096) as s:
        s.add_partition(0)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    writer = ctx.Process(target=_append_until, args=(data_dir, stop))
    writer.start()
    opens, seen, until = 0, -1, time.monotonic() + 60
    try:
        while seen < 20_000:  # about 200 segments: rolls all along
            with Storage.open(data_dir, read_only=True) as r:
                last = r.partition(0).max_transaction_id
                if last >= 0:
                    assert_log(r.partition(0), last, first=r.partition(0).first_transaction_id)
            opens, seen = opens + 1, max(seen, last)
            assert writer.is_alive() and time.monotonic() < until, f"the writer stopped at {seen}"
    finally:
        stop.set()
        writer.join(30)
    assert writer.exitcode == 0


def test_every_error_is_a_waltz_error():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.WaltzError)


def test_partitions_add_remove_and_list(storage, data_dir):
    storage.add_partition(2)
    storage.add_partition(2)  # idempotent
    assert storage.partition_ids() == [0, 2]
    with pytest.raises(errors.PartitionNotFoundError):
        storage.partition(1)
    with pytest.raises(errors.PartitionNotFoundError):
        storage.add_partition(4)
    p2 = storage.partition(2)
    append_range(p2, 0, 3)
    storage.remove_partition(2)
    with pytest.raises(errors.PartitionClosedError):
        p2.read_record(0)
    # Files kept but parked: not listed, not served, until assigned again.
    assert storage.partition_ids() == [0]
    assert (data_dir / "2.unassigned").is_dir()
    with pytest.raises(errors.PartitionNotFoundError):
        storage.partition(2)
    storage.add_partition(2)
    assert_log(storage.partition(2), 2)
    storage.remove_partition(2, delete_files=True)
    assert storage.partition_ids() == [0]
    assert not (data_dir / "2").exists()


def test_a_removal_interrupted_after_renaming_is_finished_on_open(storage, data_dir):
    storage.add_partition(3)
    (data_dir / "3").rename(data_dir / "3.deleting")
    reopen(data_dir)
    assert not (data_dir / "3.deleting").exists()


# --- appends and reads -------------------------------------------------------------------------


def test_append_and_read_back(storage):
    p = storage.partition(0)
    assert p.max_transaction_id == -1
    assert append_range(p, 0, 10) == 9
    assert p.append(10, RecordBatch(records(10, 5))) == 14
    assert p.append_next(records(15, 5)) == (15, 19)
    assert_log(p, 19)
    h = p.read_header(3)
    assert (h.txid, h.header, h.req_id.as_tuple()) == (3, 3, (7, 1, 0, 3))
    assert [x.txid for x in p.read_headers(5, max_count=4)] == [5, 6, 7, 8]
    assert p.read_header(20) is None


def test_record_batches_with_large_records_read_back_after_reopening(storage, data_dir):
    """Records of 4 KiB or more go from the batch's buffer to the file with pwritev (issue 38),
    small ones are copied; a batch appended, grown and appended again reads back whole."""
    p = storage.partition(0)
    big = [((1, 1, 0, i), i, bytes([i + 1]) * (4096 + 1000 * i)) for i in range(3)]
    batch = RecordBatch(big)
    assert p.append(0, batch) == 2
    batch.add((1, 1, 0, 3), 3, b"small")
    assert p.append_next(batch) == (3, 6)
    del batch
    want = [(h, d) for _, h, d in big] * 2 + [(3, b"small")]
    assert [(r.header, r.data) for r in p.read_records(0, max_count=10)] == want
    again = reopen(data_dir).partition(0)
    assert [(r.header, r.data) for r in again.read_records(0, max_count=10)] == want


def test_one_record_batch_appended_by_many_threads_lands_whole_at_each_id(storage, data_dir):
    """A RecordBatch is laid out as records once and its ids patched at each append (issue 38):
    threads appending the same batch at once each land it at the ids they got, and still share
    fsyncs (an append hands the batch back once queued, not once durable)."""
    p = reopen(data_dir, segment_size=1 << 20).partition(0)
    sizes = [100] * 50 + [5000, 3]
    batch = RecordBatch([((2, 1, 0, k), k, bytes([k + 1]) * n) for k, n in enumerate(sizes)])
    barrier = threading.Barrier(9)
    firsts: list[int] = []

    def writer() -> None:
        barrier.wait()
        for _ in range(30):
            firsts.append(p.append_next(batch)[0])

    def interloper() -> None:
        barrier.wait()
        for _ in range(60):
            p.append_next([((3, 1, 0, 0), -1, b"between")])

    threads = [threading.Thread(target=writer) for _ in range(8)] + [threading.Thread(target=interloper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = p.stats()
    assert p.max_transaction_id == 8 * 30 * len(sizes) + 60 - 1
    assert stats["syncs"] < stats["appends"] // 2
    want = [(k, bytes([k + 1]) * n) for k, n in enumerate(sizes)]

    def check(part) -> None:
        for first in firsts:
            got = part.read_records(first, max_count=len(sizes), max_bytes=1 << 20)
            assert [(r.txid, r.header, r.data) for r in got] == [(first + k, h, d) for k, (h, d) in enumerate(want)]
        assert len([r for r in part.read_records(0, max_count=20_000, max_bytes=1 << 30) if r.header == -1]) == 60

    assert p.segment_count > 2
    check(p)
    check(reopen(data_dir, segment_size=1 << 20).partition(0))


def test_a_record_batch_encoded_for_replicas_while_appended_locally_encodes_the_same_frame(storage, data_dir):
    """The server encodes a store batch once per replica with `encode_append`, which takes the
    batch without releasing the GIL when it is free and waits for it when a local append holds
    it. Encoders and local appenders of one batch at once: every frame is the frame the batch
    encodes alone, laid out or not, and nobody is left waiting for a batch handed back."""
    p = reopen(data_dir, segment_size=1 << 20).partition(0)
    sizes = [100] * 20 + [3000, 1]
    batch = RecordBatch([((2, 1, 0, k), k, bytes([k + 1]) * n) for k, n in enumerate(sizes)])
    want = encode_append(5, 17, 0, 1000, batch)  # packed, never laid out yet
    barrier = threading.Barrier(8)
    frames: list[bytes] = []
    firsts: list[int] = []

    def encoder() -> None:
        barrier.wait()
        frames.extend(encode_append(5, 17, 0, 1000, batch) for _ in range(200))

    def appender() -> None:
        barrier.wait()
        firsts.extend(p.append_next(batch)[0] for _ in range(25))

    threads = [threading.Thread(target=encoder) for _ in range(4)] + [
        threading.Thread(target=appender) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting for the batch"
    assert len(frames) == 800 and all(f == want for f in frames)
    assert encode_append(5, 17, 0, 1000, batch) == want  # laid out by now: the same frame
    assert len(firsts) == 100
    for first in firsts:
        got = p.read_records(first, max_count=len(sizes), max_bytes=1 << 20)
        assert [(r.txid, r.data) for r in got] == [(first + k, bytes([k + 1]) * n) for k, n in enumerate(sizes)]


def test_phase_timing_is_off_unless_asked_for(tmp_path, cluster_key):
    code = (
        "import sys, uuid; from waltz.storage import Storage, RecordBatch\n"
        "s = Storage.create(sys.argv[1], uuid.uuid4(), 1); s.add_partition(0); p = s.partition(0)\n"
        "[p.append_next(RecordBatch([((1, 1, 0, 0), 0, b'x' * 10)])) for _ in range(3)]\n"
        "[p.append_next([((1, 1, 0, 0), 0, b'x' * 10)]) for _ in range(2)]\n"
        "print(p.stats().get('phases')); s.close()"
    )
    run = lambda env, d: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, str(tmp_path / d)], env={**os.environ, **env}, capture_output=True, text=True
    )
    off = run({"WALTZ_ENGINE_PHASES": "0"}, "off")
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "None"
    on = run({"WALTZ_ENGINE_PHASES": "1"}, "on")
    assert on.returncode == 0, on.stderr
    phases = ast.literal_eval(on.stdout.strip())
    # A RecordBatch's ids are patched before the state lock (encode); small batches of tuples are
    # encoded under it (enqueue), large ones before it.
    assert phases["encode"][0] == 3 and phases["enqueue"][0] == 5 and phases["lock_wait"][0] == 5
    assert phases["sync"][0] + phases["sync_zeros"][0] >= 1 and phases["roll"][0] == 0


def test_reads_are_bounded_by_count_and_bytes(storage):
    p = storage.partition(0)
    append_range(p, 0, 50, size=1000)
    assert len(p.read_records(0, max_count=7)) == 7
    got = p.read_records(0, max_bytes=3500)
    assert [r.txid for r in got] == [0, 1, 2]
    # One record is always returned, even when it alone exceeds the byte bound.
    assert len(p.read_records(10, max_bytes=1)) == 1


def test_non_dense_append_is_refused_and_writes_nothing(storage):
    p = storage.partition(0)
    append_range(p, 0, 5)
    for bad in (4, 6, 100, -1):
        with pytest.raises(errors.NonDenseAppendError, match="expected 5"):
            p.append(bad, records(bad, 1))
    assert_log(p, 4)


def test_oversized_record_is_refused(data_dir, cluster_key):
    s = Storage.create(data_dir, cluster_key, 1, max_record_size=1000)
    s.add_partition(0)
    p = s.partition(0)
    with pytest.raises(errors.RecordTooLargeError, match="1001 bytes"):
        p.append(0, [((1, 1, 0, 0), 0, b"x" * 1001)])
    p.append(0, [((1, 1, 0, 0), 0, b"x" * 1000)])
    assert p.max_transaction_id == 0


def test_bad_arguments_get_clear_errors(storage):
    p = storage.partition(0)
    with pytest.raises(errors.InvalidArgumentError, match="tuple"):
        p.append(0, [b"not a tuple"])
    with pytest.raises(errors.InvalidArgumentError, match="req_id"):
        p.append(0, [("nope", 1, b"x")])
    assert p.max_transaction_id == -1


def test_data_may_be_any_bytes_like(storage):
    p = storage.partition(0)
    p.append(0, [((1, 1, 0, 0), 0, bytearray(b"abc")), ((1, 1, 0, 1), 0, memoryview(b"def")), ((1, 1, 0, 2), 0, b"")])
    assert [p.read_record(i).data for i in range(3)] == [b"abc", b"def", b""]


def test_segments_roll_and_everything_survives_reopen(storage, data_dir):
    p = storage.partition(0)
    for start in range(0, 400, 20):
        append_range(p, start, 20)
    assert p.segment_count > 5
    assert_log(p, 399)
    assert_log(reopen(data_dir).partition(0), 399)


def test_concurrent_appenders_share_fsyncs(storage):
    p = storage.partition(0)
    barrier = threading.Barrier(16)

    def writer():
        barrier.wait()
        for _ in range(40):
            p.append_next([((1, 1, 0, 0), 0, b"x" * 100)])

    threads = [threading.Thread(target=writer) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = p.stats()
    assert p.max_transaction_id == 639
    assert stats["appends"] == 640
    assert stats["syncs"] < stats["appends"] // 2


# --- truncation and retention ------------------------------------------------------------------


def test_truncate_across_segments(storage, data_dir):
    p = storage.partition(0)
    for start in range(0, 300, 30):
        append_range(p, start, 30)
    segs_before = len(segment_files(data_dir / "0"))
    assert p.truncate(57) == 57
    assert_log(p, 57)
    assert len(segment_files(data_dir / "0")) < segs_before
    assert p.truncate(1000) == 57  # beyond the end: nothing to drop
    append_range(p, 58, 10)
    assert_log(p, 67)
    assert_log(reopen(data_dir).partition(0), 67)
    p = reopen(data_dir).partition(0)
    assert p.truncate(-1) == -1
    assert_log(p, -1)
    append_range(p, 0, 3)
    assert_log(p, 2)


def test_retention_drops_old_segments_and_the_start_survives_reopen(storage, data_dir):
    p = storage.partition(0)
    for start in range(0, 300, 30):
        append_range(p, start, 30)
    first = p.drop_segments_before(150)
    assert 0 < first <= 150
    with pytest.raises(errors.BelowLogStartError, match=f"first transaction id {first}"):
        p.read_record(first - 1)
    with pytest.raises(errors.BelowLogStartError):
        p.scan(0)
    assert_log(p, 299, first=first)
    p = reopen(data_dir).partition(0)
    assert_log(p, 299, first=first)
    with pytest.raises(errors.BelowLogStartError):
        p.truncate(first - 5)


# --- control file ------------------------------------------------------------------------------


def test_session_info_alternates_and_falls_back(storage, data_dir):
    p = storage.partition(0)
    append_range(p, 0, 10)
    assert storage.partition_info(0).session_id == -1
    first = storage.set_low_water_mark(0, 5, 12)
    assert (first.session_id, first.low_water_mark, first.local_low_water_mark) == (5, 12, 9)
    storage.set_low_water_mark(0, 6, 9)
    info = reopen(data_dir).partition_info(0)
    assert (info.session_id, info.low_water_mark) == (6, 9)
    # Damage the struct holding the newest update (slot 0: fresh entries start there, the first
    # update went to slot 1): the partition falls back to the previous session.
    ctl = data_dir / "waltz-storage.ctl"
    flip_byte(ctl, 128 + 4 + 2)
    assert reopen(data_dir).partition_info(0) == first
    # Both damaged: that partition refuses to open; others still work.
    flip_byte(ctl, 128 + 4 + 28 + 2)
    s = reopen(data_dir)
    with pytest.raises(errors.CorruptionError, match="both info structs of partition 0"):
        s.partition(0)
    s.add_partition(1)
    append_range(s.partition(1), 0, 2)


# --- recovery from damaged files ---------------------------------------------------------------


@pytest.fixture
def written(storage, data_dir):
    p = storage.partition(0)
    for start in range(0, 200, 10):
        append_range(p, start, 10)
    storage.close()
    part = data_dir / "0"
    return part, segment_files(part)[-1]


def last_segment_first_id(seg: pathlib.Path) -> int:
    return int(seg.stem)


def test_cut_mid_record_is_truncated(written, data_dir):
    part, seg = written
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size - 7)
    p = reopen(data_dir).partition(0)
    assert p.recovery["torn_bytes"] > 0
    assert_log(p, 198)
    append_range(p, 199, 5)
    assert_log(reopen(data_dir).partition(0), 203)


def test_garbage_appended_is_truncated(written, data_dir):
    part, seg = written
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(bytes(range(256)) * 9)
    p = reopen(data_dir).partition(0)
    assert p.recovery["torn_bytes"] == 256 * 9
    assert seg.stat().st_size == size
    assert_log(p, 199)


def test_zeroed_tail_is_truncated(written, data_dir):
    part, seg = written
    with open(seg, "ab") as f:
        f.write(b"\0" * 4096)
    p = reopen(data_dir).partition(0)
    assert_log(p, 199)


def test_flipped_byte_in_last_record_is_truncated(written, data_dir):
    part, seg = written
    last_off = record_offsets(part, seg)[-1]
    flip_byte(seg, last_off + 50)
    p = reopen(data_dir).partition(0)
    assert_log(p, 198)


def test_a_torn_write_with_valid_records_after_it_is_cut(written, data_dir):
    """A power loss may keep any pages written since the last sync: a hole with survivors near
    the end of the last segment, above the low-water mark, is a torn write (torture seed 61)."""
    part, seg = written
    offsets = record_offsets(part, seg)
    bad, after = offsets[len(offsets) // 2], offsets[len(offsets) // 2 + 1]
    with open(seg, "r+b") as f:  # a block the disk never wrote: the zeros it held
        f.seek(bad)
        f.write(bytes(after - bad))
    p = reopen(data_dir, checkpoint_interval=1000).partition(0)
    assert p.recovery["torn_survivors"] == (str(seg), bad, after)
    assert_log(p, last_segment_first_id(seg) + len(offsets) // 2 - 1)


def test_corruption_in_the_middle_is_an_error_naming_file_and_offset(written, data_dir):
    part, seg = written
    offsets = record_offsets(part, seg)
    bad = offsets[len(offsets) // 2]
    # Committed records (the low-water mark is the last one): damage there is not a torn write.
    reopen(data_dir).set_low_water_mark(0, 1, 199)
    flip_byte(seg, bad + 45)
    # Opening with a checkpoint interval larger than the segment makes recovery scan all of it.
    with pytest.raises(errors.CorruptionError) as e:
        reopen(data_dir, checkpoint_interval=1000).partition(0)
    assert str(seg) in str(e.value)
    assert f"offset {bad}" in str(e.value)
    assert "valid record after it" in str(e.value)
    # Nothing was changed by the failed open.
    with pytest.raises(errors.CorruptionError):
        reopen(data_dir, checkpoint_interval=1000).partition(0)
    # Explicit repair cuts the partition at the bad record.
    s = reopen(data_dir, checkpoint_interval=1000)
    p = s.repair_partition(0)
    first = last_segment_first_id(seg)
    assert_log(p, first + len(offsets) // 2 - 1)
    assert p.recovery["corruption_cut"] == (str(seg), bad)
    assert_log(reopen(data_dir).partition(0), first + len(offsets) // 2 - 1)


def test_corruption_below_the_last_checkpoint_is_found_when_read(written, data_dir):
    part, seg = written
    offsets = record_offsets(part, seg)
    flip_byte(seg, offsets[1] + 45)
    # Records below a proven checkpoint were fsynced before it: open trusts them (as raft-wal
    # and SQLite do) and every read checks both checksums.
    p = reopen(data_dir).partition(0)
    first = last_segment_first_id(seg)
    with pytest.raises(errors.CorruptionError, match=f"{seg}.*offset {offsets[1]}"):
        p.read_record(first + 1)
    assert p.read_record(first).data == payload(first)


def test_corruption_in_a_sealed_segment_is_an_error(written, data_dir):
    part, _ = written
    sealed = segment_files(part)[0]
    off = record_offsets(part, sealed)[2]
    flip_byte(sealed, off + 41)
    # The cheap sealed check only looks at the last record; the damage is found when read.
    p = reopen(data_dir).partition(0)
    assert [r.txid for r in p.read_records(0)] == [0, 1]  # the good prefix
    with pytest.raises(errors.CorruptionError, match=f"{sealed}.*offset {off}.*checksum"):
        p.read_records(2)
    # With the index gone the segment is rescanned and the damage is found on open.
    sealed.with_suffix(".idx").unlink()
    with pytest.raises(errors.CorruptionError, match=str(sealed)):
        reopen(data_dir).partition(0)


def test_open_with_recovery_truncate_repairs(written, data_dir):
    part, seg = written
    offsets = record_offsets(part, seg)
    flip_byte(seg, offsets[1] + 40)
    p = reopen(data_dir, recovery="truncate", checkpoint_interval=1000).partition(0)
    assert p.max_transaction_id == last_segment_first_id(seg)


@pytest.mark.parametrize("damage", ["delete", "truncate", "garbage-header", "zero-entries"])
def test_damaged_index_is_rebuilt(written, data_dir, damage):
    part, seg = written
    for s in segment_files(part):
        idx = s.with_suffix(".idx")
        if damage == "delete":
            idx.unlink()
        elif damage == "truncate":
            with open(idx, "r+b") as f:
                f.truncate(128 + 8 * 3 + 5)
        elif damage == "garbage-header":
            flip_byte(idx, 30)
        else:
            with open(idx, "r+b") as f:
                f.seek(128 + 8)
                f.write(b"\0" * 64)
    p = reopen(data_dir).partition(0)
    assert_log(p, 199)
    # The rebuilt index is written back: a second open scans nothing past the checkpoints.
    again = reopen(data_dir).partition(0)
    assert again.recovery["scanned_records"] < 16
    assert_log(again, 199)


def test_foreign_files_are_left_alone(written, data_dir):
    part, _ = written
    (part / "notes.txt").write_text("an operator's notes")
    (part / "0000000000000000abc.seg").write_text("not ours either")
    p = reopen(data_dir).partition(0)
    assert sorted(pathlib.Path(f).name for f in p.recovery["foreign_files"]) == ["0000000000000000abc.seg", "notes.txt"]
    assert (part / "notes.txt").exists()
    assert_log(p, 199)


def test_leftover_temporary_and_orphan_index_files_are_removed(written, data_dir):
    part, seg = written
    (part / "0000000000000009999.seg.tmp").write_bytes(b"half a header")
    (part / "0000000000000009999.idx").write_bytes(b"\0" * 128)
    p = reopen(data_dir).partition(0)
    assert not (part / "0000000000000009999.seg.tmp").exists()
    assert not (part / "0000000000000009999.idx").exists()
    assert_log(p, 199)


def test_segment_of_another_cluster_is_refused(written, data_dir):
    part, seg = written
    with open(seg, "r+b") as f:
        f.seek(12)
        f.write(uuid.uuid4().bytes)
    with pytest.raises(errors.ClusterKeyMismatch, match=str(seg)):
        reopen(data_dir).partition(0)


def test_read_only_open_changes_nothing(written, data_dir):
    part, seg = written
    with open(seg, "ab") as f:
        f.write(b"\xff" * 100)
    before = {f.name: f.read_bytes() for f in part.iterdir()}
    p = reopen(data_dir, read_only=True).partition(0)
    assert_log(p, 199)
    with pytest.raises(errors.ReadOnlyError):
        p.append(200, records(200, 1))
    assert {f.name: f.read_bytes() for f in part.iterdir()} == before


def test_scan_returns_columns(storage):
    p = storage.partition(0)
    append_range(p, 0, 100)
    chunk = p.scan(10, 59)
    assert (len(chunk), chunk.first_txid, chunk.last_txid) == (50, 10, 59)
    b = chunk.buffers()
    offs = memoryview(b["offsets"]).cast("i")
    txids = memoryview(b["txid"]).cast("q")
    assert list(txids) == list(range(10, 60))
    data = memoryview(b["payload"])
    for i, t in enumerate(txids):
        assert data[offs[i] : offs[i + 1]] == payload(t)
    # The payload is lent, not copied: read-only, and alive as long as a view of it is.
    assert data.readonly and len(b["payload"]) == chunk.payload_nbytes == offs[50]
    with pytest.raises(TypeError, match="not writable"):
        ctypes.c_char.from_buffer(b["payload"])
    first = bytes(data[: offs[1]])
    del chunk, b
    gc.collect()
    assert bytes(data[: offs[1]]) == first == payload(10)
    assert len(p.scan(0, max_bytes=1)) == 1
    assert len(p.scan(200)) == 0


def test_relative_paths_work(tmp_path, monkeypatch, cluster_key):
    monkeypatch.chdir(tmp_path)
    with Storage.create("rel", cluster_key, 1) as s:
        s.add_partition(0)
        append_range(s.partition(0), 0, 3)
    assert_log(Storage.open("rel").partition(0), 2)


def test_scan_helpers_build_arrow_batches_covering_the_partition(storage):
    import pyarrow as pa  # the `arrow` extra, which scripts/setup.sh installs
    from waltz.storage import iter_scan, scan_to_arrow

    p = storage.partition(0)
    for start in range(0, 300, 50):
        append_range(p, start, 50)
    chunks = list(iter_scan(p, 10, 250, chunk_bytes=4000))
    assert len(chunks) > 5
    table = pa.Table.from_batches([scan_to_arrow(c, partition_id=0) for c in chunks])
    assert table.column_names == [
        "partition",
        "transaction_id",
        "header",
        "client_id",
        "generation",
        "sequence",
        "data",
    ]
    assert table.column("transaction_id").to_pylist() == list(range(10, 251))
    assert table.column("data").to_pylist() == [payload(t) for t in range(10, 251)]
    assert table.column("sequence").to_pylist() == list(range(10, 251))
    assert set(table.column("partition").to_pylist()) == {0}


@pytest.mark.parametrize("exists", [False, True])
def test_storage_files_are_private_whatever_the_umask(data_dir, cluster_key, exists):
    """Issue 34: the control file and every segment header hold the cluster key, and under umask
    022 they were created readable by every user of the host. Directories are 0700 and files
    0600, an existing empty storage directory included."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        if exists:
            data_dir.mkdir(mode=0o755)
        s = Storage.create(data_dir, cluster_key, 2, segment_size=8192, checkpoint_interval=16)
        try:
            s.add_partition(0)
            append_range(s.partition(0), 0, 200, 100)  # several segments and their index files
            s.set_low_water_mark(0, 1, 10)
        finally:
            s.close()
    finally:
        os.umask(old)
    paths = [data_dir, *data_dir.rglob("*")]
    suffixes = {p.suffix for p in paths}
    assert {".ctl", ".seg", ".idx"} <= suffixes, suffixes
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
