"""Conformance: the engine's files, read back by an independent pure-Python reader of the spec.

`spec_reader` was written from the format text, not from the engine's source; every test here
writes through the real engine and checks, byte for byte, that the spec reader agrees.
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
import time
import uuid
import weakref
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import spec_reader as sr
from waltz.storage import RecordBatch, ReqId, Storage

SEG_SIZE = 4096  # the engine's minimum: many small segments
NAME_RE = re.compile(r"^\d{19}\.(seg|idx)$")
# The next segment prepared ahead, which an open partition may hold (docs/format.md, "Creating files").
SPARES = {"spare.seg.tmp", "spare.idx.tmp"}


def segment_files(folder: Path) -> list[str]:
    """The folder's file names but an open partition's spare."""
    return sorted(set(os.listdir(folder)) - SPARES)


def now_ms() -> int:
    return int(time.time() * 1000)


# The engine keeps index entries since the last checkpoint in memory while a partition is open;
# the files are complete once flushed or closed. Every read below flushes the open storages first.
_OPEN: weakref.WeakSet[Storage] = weakref.WeakSet()


def _flushed(reader):
    def read(*args, **kw):
        for storage in list(_OPEN):
            storage.flush()
        return reader(*args, **kw)

    return read


read_partition = _flushed(sr.read_partition)
read_index = _flushed(sr.read_index)
read_storage = _flushed(sr.read_storage)


def make_storage(path: Path, partitions: int = 2, **kw) -> tuple[Storage, uuid.UUID]:
    key = uuid.uuid4()
    kw.setdefault("segment_size", SEG_SIZE)
    kw.setdefault("checkpoint_interval", 7)
    s = Storage.create(path, key, partitions, **kw)
    _OPEN.add(s)
    return s, key


def rec(i: int, pid: int = 0, size: int | None = None) -> tuple[ReqId, int, bytes]:
    n = (i * 37) % 300 if size is None else size
    data = bytes((i + j) & 0xFF for j in range(n))
    return ReqId(1000 + i % 5, i % 3, pid, i), i * 11 - 50, data


def write_records(p, start: int, count: int, pid: int = 0, batch: int = 1) -> list:
    """Appends `count` records from `start` in batches; returns the (req, header, data) list."""
    written = []
    i = start
    while i < start + count:
        n = min(batch, start + count - i)
        recs = [rec(j, pid) for j in range(i, i + n)]
        assert p.append(i, recs) == i + n - 1
        written.extend(recs)
        i += n
    return written


def assert_records_equal(parsed: list[sr.SpecRecord], first: int, expected: list) -> None:
    assert [r.txid for r in parsed] == list(range(first, first + len(expected)))
    for r, (req, header, data) in zip(parsed, expected):
        req_t = req.as_tuple() if isinstance(req, ReqId) else tuple(req)
        assert (r.req_id, r.header, r.data) == (req_t, header, bytes(data)), r.txid


def file_bytes(folder: Path) -> dict[str, bytes]:
    """The folder's files; data files without the zeros preallocated after their records (an
    open partition has them, a close cuts them off), and no spare (a close removes it)."""
    out = {}
    for n in segment_files(folder):
        raw = (folder / n).read_bytes()
        if n.endswith(".seg"):
            raw = raw[: sr.read_segment(folder / n).records_end]
        out[n] = raw
    return out


def assert_raw_record_bytes(seg: sr.Segment) -> None:
    """Recomputes every record's bytes from its parsed fields and compares with the file; after
    the last record only zeros (preallocated space) may follow."""
    raw = seg.path.read_bytes()
    assert seg.file_size == len(raw)
    pos = sr.HEADER_SIZE
    for r in seg.records:
        assert r.offset == pos, "records must be contiguous"
        body = struct.pack(">qiiiiiiI", r.txid, *r.req_id, r.header, len(r.data), zlib.crc32(r.data)) + r.data
        expected = body + struct.pack(">I", zlib.crc32(body))
        assert raw[r.offset : r.end] == expected
        pos = r.end
    assert pos == seg.records_end
    assert raw[pos:] == bytes(len(raw) - pos), "only zeros may follow the last record"


# --------------------------------------------------------------------------------------------
# Headers
# --------------------------------------------------------------------------------------------


def test_control_file_header(tmp_path):
    before = now_ms()
    s, key = make_storage(tmp_path / "st", partitions=3)
    after = now_ms()
    raw = (tmp_path / "st" / sr.CONTROL_FILE_NAME).read_bytes()
    ctl = sr.read_control(tmp_path / "st" / sr.CONTROL_FILE_NAME)
    assert ctl.version == 1
    assert ctl.cluster_key == key
    assert raw[12:28] == key.bytes  # most significant half first
    assert str(ctl.cluster_key) == s.cluster_key
    assert ctl.partition_count == 3
    assert ctl.creation_time_ms == s.creation_time_ms
    assert before - 1000 <= ctl.creation_time_ms <= after + 1000
    assert len(raw) == 128 + 3 * 60
    assert sorted(e.partition_id for e in ctl.entries) == [0, 1, 2]
    for e in ctl.entries:
        assert any(x.valid for x in e.structs)


def test_control_entries_match_partition_info_on_fresh_storage(tmp_path):
    s, _ = make_storage(tmp_path / "st", partitions=2)
    s.add_partition(0)
    s.add_partition(1)
    ctl = sr.read_control(tmp_path / "st" / sr.CONTROL_FILE_NAME)
    for pid in (0, 1):
        info = s.partition_info(pid)
        newest = ctl.entry(pid).newest
        assert newest.key == (info.session_id, info.low_water_mark, info.local_low_water_mark)


def test_segment_and_index_headers(tmp_path):
    before = now_ms()
    s, key = make_storage(tmp_path / "st", partitions=4)
    s.add_partition(3)
    p = s.partition(3)
    write_records(p, 0, 120, pid=3)
    after = now_ms()
    folder = tmp_path / "st" / "3"
    names = segment_files(folder)
    assert len(names) >= 4 and len(names) % 2 == 0
    for name in names:
        path = folder / name
        h = sr.read_segment_header(path)
        raw = path.read_bytes()[:128]
        assert h.version == 1
        assert h.cluster_key == key
        assert raw[12:28] == key.bytes
        assert h.partition_id == 3
        assert h.first_txid == int(name[:19])
        assert before - 1000 <= h.creation_time_ms <= after + 1000
        assert raw[40:128] == bytes(88)
        # the index header is exactly the data file header
        other = name[:19] + (".idx" if name.endswith(".seg") else ".seg")
        assert (folder / other).read_bytes()[:128] == raw


# --------------------------------------------------------------------------------------------
# Records and index
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 5, 40])
def test_every_record_parses_identically(tmp_path, batch):
    s, _ = make_storage(tmp_path / "st")
    s.add_partition(0)
    p = s.partition(0)
    written = write_records(p, 0, 200, batch=batch)
    part = read_partition(tmp_path / "st" / "0")
    assert len(part.segments) > 1
    assert_records_equal(part.records, 0, written)
    assert part.max_txid == p.max_transaction_id == 199
    for seg in part.segments:
        assert_raw_record_bytes(seg)
    for r in part.records:
        e = p.read_record(r.txid)
        assert (e.txid, e.req_id.as_tuple(), e.header, e.data) == (
            r.txid,
            r.req_id,
            r.header,
            r.data,
        )


def test_record_batch_object_writes_the_same_bytes(tmp_path):
    s, _ = make_storage(tmp_path / "st")
    s.add_partition(0)
    s.add_partition(1)
    recs = [rec(i) for i in range(50)]
    s.partition(0).append(0, recs)
    batch = RecordBatch()
    for r in recs:
        batch.add(*r)
    s.partition(1).append(0, batch)
    a = read_partition(tmp_path / "st" / "0").records
    b = read_partition(tmp_path / "st" / "1").records
    assert [(r.txid, r.req_id, r.header, r.data, r.data_crc, r.offset) for r in a] == [
        (r.txid, r.req_id, r.header, r.data, r.data_crc, r.offset) for r in b
    ]


def test_index_entries_are_record_offsets(tmp_path):
    s, _ = make_storage(tmp_path / "st", checkpoint_interval=3)
    s.add_partition(0)
    p = s.partition(0)
    write_records(p, 0, 150, batch=4)
    folder = tmp_path / "st" / "0"
    n = 0
    for seg_name in sorted(f for f in os.listdir(folder) if f.endswith(".seg")):
        seg = sr.read_segment(folder / seg_name)
        idx = read_index(folder / (seg_name[:-4] + ".idx"))
        assert idx.offsets == [r.offset for r in seg.records]
        assert (folder / idx.path.name).stat().st_size == 128 + 8 * len(seg.records)
        n += len(seg.records)
    assert n == 150


def test_segment_names_dense_and_rollover(tmp_path):
    s, _ = make_storage(tmp_path / "st")
    s.add_partition(0)
    p = s.partition(0)
    write_records(p, 0, 300)  # one record per append: rollover is checked at each append
    folder = tmp_path / "st" / "0"
    names = segment_files(folder)
    assert all(NAME_RE.match(n) for n in names), names
    firsts = sorted({int(n[:19]) for n in names})
    assert names == sorted(f"{f:019d}.{ext}" for f in firsts for ext in ("seg", "idx"))
    assert firsts[0] == 0
    part = read_partition(folder)
    assert [sg.first_txid for sg in part.segments] == firsts
    for a, b in zip(part.segments, part.segments[1:]):
        assert a.records and a.next_txid == b.first_txid
        # sealed once it reached segment_size, not before
        assert a.file_size >= SEG_SIZE
        assert a.file_size - a.records[-1].size < SEG_SIZE
    assert p.segment_count == len(firsts)


def test_empty_and_large_records(tmp_path):
    s, _ = make_storage(tmp_path / "st", max_record_size=4 << 20)
    s.add_partition(0)
    p = s.partition(0)
    big = os.urandom(1 << 20)
    recs = [
        (ReqId(1, 1, 0, 0), 0, b""),
        (ReqId(1, 1, 0, 1), 1, big),
        (ReqId(1, 1, 0, 2), 2, b""),
        (ReqId(1, 1, 0, 3), 3, big[::-1]),
        (ReqId(1, 1, 0, 4), 4, b""),
    ]
    for i, r in enumerate(recs):
        p.append(i, [r])
    part = read_partition(tmp_path / "st" / "0")
    assert_records_equal(part.records, 0, recs)
    sizes = [r.size for r in part.records]
    assert sizes == [40, 40 + (1 << 20), 40, 40 + (1 << 20), 40]
    for seg in part.segments:
        assert_raw_record_bytes(seg)
    for i, r in enumerate(recs):
        assert p.read_record(i).data == r[2]


def test_extreme_field_values(tmp_path):
    s, _ = make_storage(tmp_path / "st")
    s.add_partition(0)
    p = s.partition(0)
    lo, hi = -(2**31), 2**31 - 1
    recs = [((lo, hi, lo, hi), lo, b"\x00"), ((hi, lo, hi, lo), hi, b"\xff" * 3), ((-1, -1, -1, -1), -1, b"")]
    p.append(0, recs)
    part = read_partition(tmp_path / "st" / "0")
    assert_records_equal(part.records, 0, recs)


# --------------------------------------------------------------------------------------------
# Control file structs
# --------------------------------------------------------------------------------------------


def _ctl(path: Path) -> sr.ControlFile:
    return sr.read_control(path / sr.CONTROL_FILE_NAME)


def test_control_structs_alternate(tmp_path):
    root = tmp_path / "st"
    s, _ = make_storage(root, partitions=3)
    for pid in range(3):
        s.add_partition(pid)
    p = s.partition(1)
    write_records(p, 0, 10, pid=1)
    other_before = [_ctl(root).entry(pid) for pid in (0, 2)]

    c0 = _ctl(root).entry(1)
    initial = c0.newest
    info1 = s.set_low_water_mark(1, 7, 9)
    c1 = _ctl(root).entry(1)
    k1 = (info1.session_id, info1.low_water_mark, info1.local_low_water_mark)
    assert (info1.session_id, info1.low_water_mark) == (7, 9)
    assert info1.local_low_water_mark == p.max_transaction_id == 9
    assert all(x.valid for x in c1.structs)
    slot1 = c1.newest_slot
    assert c1.structs[slot1].key == k1
    # the other slot still holds the previous newest struct
    assert c1.structs[1 - slot1].key == initial.key
    # the update went to the slot that did not hold the newest struct
    assert c0.structs[slot1].key != k1

    write_records(p, 10, 5, pid=1)
    info2 = s.set_low_water_mark(1, 8, 20)
    c2 = _ctl(root).entry(1)
    k2 = (info2.session_id, info2.low_water_mark, info2.local_low_water_mark)
    assert k2 == (8, 20, 14)
    assert c2.newest_slot == 1 - slot1, "updates must alternate between the two structs"
    assert c2.structs[1 - slot1].key == k2
    assert c2.structs[slot1].key == k1
    info = s.partition_info(1)
    assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == c2.newest.key == k2

    info3 = s.set_low_water_mark(1, 9, 21)
    c3 = _ctl(root).entry(1)
    assert c3.newest_slot == slot1
    assert c3.structs[slot1].key == (9, 21, 14)
    assert c3.structs[1 - slot1].key == k2
    assert (info3.session_id, info3.low_water_mark) == (9, 21)

    # other partitions' entries are untouched, byte for byte
    assert [_ctl(root).entry(pid) for pid in (0, 2)] == other_before


def test_control_newest_struct_survives_reopen(tmp_path):
    root = tmp_path / "st"
    s, key = make_storage(root, partitions=2)
    s.add_partition(0)
    s.set_low_water_mark(0, 3, -1)
    s.set_partition_info(0, 4, 100, 50)
    s.close()
    s2 = Storage.open(root, key, 2, segment_size=SEG_SIZE)
    info = s2.partition_info(0)
    newest = _ctl(root).entry(0).newest
    assert newest.key == (4, 100, 50)
    assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == newest.key


def test_control_torn_struct_falls_back(tmp_path):
    """One struct with a bad CRC: the spec reader and the engine both use the other one."""
    root = tmp_path / "st"
    s, key = make_storage(root, partitions=1)
    s.add_partition(0)
    s.set_partition_info(0, 1, 10, 5)
    s.set_partition_info(0, 2, 20, 6)
    s.close()
    ctl = _ctl(root)
    e = ctl.entry(0)
    newest = e.newest
    older = e.structs[1 - e.newest_slot]
    raw = bytearray((root / sr.CONTROL_FILE_NAME).read_bytes())
    raw[newest.offset + 3] ^= 0x40  # corrupt the newest struct's session id
    (root / sr.CONTROL_FILE_NAME).write_bytes(bytes(raw))
    e2 = _ctl(root).entry(0)
    assert not e2.structs[e.newest_slot].valid
    assert e2.newest.key == older.key == (1, 10, 5)
    s2 = Storage.open(root, key, 1, segment_size=SEG_SIZE)
    info = s2.partition_info(0)
    assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == (1, 10, 5)


# --------------------------------------------------------------------------------------------
# Truncation and retention
# --------------------------------------------------------------------------------------------


def test_truncate_and_drop_segments(tmp_path):
    root = tmp_path / "st"
    s, key = make_storage(root)
    s.add_partition(0)
    p = s.partition(0)
    written = write_records(p, 0, 300)
    folder = root / "0"
    firsts = [sg.first_txid for sg in read_partition(folder).segments]
    assert len(firsts) >= 6

    # truncate in the middle of a segment
    t = firsts[4] + 3
    assert p.truncate(t) == t
    part = read_partition(folder)
    assert set(part.other_files) <= SPARES  # no truncate.intent or other .tmp left behind
    assert_records_equal(part.records, 0, written[: t + 1])
    assert [sg.first_txid for sg in part.segments] == firsts[:5]
    assert p.max_transaction_id == t

    # truncate exactly at a segment boundary (the previous segment's last id)
    t2 = firsts[4] - 1
    assert p.truncate(t2) == t2
    part = read_partition(folder)
    assert part.max_txid == t2
    assert_records_equal(part.records, 0, written[: t2 + 1])
    # the segment that held t2 + 1 is cut at that record; here it is left empty (header only)
    assert part.segments[-1].next_txid == t2 + 1
    assert [sg.first_txid for sg in part.segments] == firsts[:5]
    assert part.segments[-1].records == [] and part.segments[-1].file_size == 128
    assert read_index(part.indexes[-1].path).offsets == []

    # retention: whole segments below the id are deleted, oldest first
    cut = firsts[2] + 1
    new_first = p.drop_segments_before(cut)
    part = read_partition(folder)
    assert new_first == p.first_transaction_id == part.first_txid == firsts[2]
    assert_records_equal(part.records, firsts[2], written[firsts[2] : t2 + 1])

    # never the last segment
    last_first = part.segments[-1].first_txid
    assert p.drop_segments_before(t2 + 1000) == last_first
    part = read_partition(folder)
    assert len(part.segments) == 1 and part.first_txid == last_first
    assert_records_equal(part.records, last_first, written[last_first : t2 + 1])

    # appending continues densely after truncation and still parses
    more = write_records(p, t2 + 1, 40)
    part = read_partition(folder)
    assert_records_equal(part.records, last_first, written[last_first : t2 + 1] + more)

    # a reopen recovers a clean log without changing any byte
    before = file_bytes(folder)
    s.close()
    s2 = Storage.open(root, key, 2, segment_size=SEG_SIZE)
    p2 = s2.partition(0)
    assert p2.first_transaction_id == last_first
    assert p2.max_transaction_id == t2 + 40
    assert file_bytes(folder) == before


def test_truncate_to_before_first_empties_partition(tmp_path):
    root = tmp_path / "st"
    s, _ = make_storage(root)
    s.add_partition(0)
    p = s.partition(0)
    written = write_records(p, 0, 30)
    assert p.truncate(-1) == -1
    part = read_partition(root / "0")
    assert part.records == []
    assert part.max_txid == -1
    more = write_records(p, 0, 5)
    assert_records_equal(read_partition(root / "0").records, 0, more)
    assert p.max_transaction_id == 4
    assert len(written) == 30


# --------------------------------------------------------------------------------------------
# The spec reader itself is strict (so the tests above can fail)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small_log(tmp_path):
    root = tmp_path / "st"
    s, _ = make_storage(root)
    s.add_partition(0)
    write_records(s.partition(0), 0, 10, batch=10)
    s.close()
    return root / "0" / ("0" * 19 + ".seg")


@pytest.mark.parametrize(
    "where, match",
    [
        (lambda seg: seg.records[3].offset + 40, "data CRC"),  # a data byte
        (lambda seg: seg.records[3].offset + 10, "record CRC"),  # the ReqId
        (lambda seg: seg.records[3].offset + 7, "not dense"),  # the txid
        (lambda seg: seg.records[3].end - 1, "record CRC"),  # the record CRC
    ],
)
def test_spec_reader_rejects_corruption(small_log, where, match):
    seg = sr.read_segment(small_log)
    raw = bytearray(small_log.read_bytes())
    raw[where(seg)] ^= 0x01
    small_log.write_bytes(bytes(raw))
    with pytest.raises(sr.SpecViolation, match=match):
        sr.read_segment(small_log)


def test_spec_reader_rejects_torn_tail_and_bad_index(small_log):
    raw = small_log.read_bytes()
    small_log.write_bytes(raw[:-5])
    with pytest.raises(sr.SpecViolation, match="past end|too short"):
        sr.read_segment(small_log)
    small_log.write_bytes(raw)
    idx = small_log.with_suffix(".idx")
    iraw = bytearray(idx.read_bytes())
    iraw[-1] ^= 0x08
    idx.write_bytes(bytes(iraw))
    with pytest.raises(sr.SpecViolation, match="entry 9"):
        read_partition(small_log.parent)


# --------------------------------------------------------------------------------------------
# Property test
# --------------------------------------------------------------------------------------------

i32 = st.integers(-(2**31), 2**31 - 1)
record_st = st.tuples(st.tuples(i32, i32, i32, i32), i32, st.binary(max_size=1500))
batches_st = st.lists(st.lists(record_st, min_size=1, max_size=12), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=batches_st,
    segment_size=st.integers(4096, 16384),
    checkpoint_interval=st.integers(1, 20),
)
def test_property_random_batches(batches, segment_size, checkpoint_interval):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "st"
        key = uuid.uuid4()
        s = Storage.create(root, key, 1, segment_size=segment_size, checkpoint_interval=checkpoint_interval)
        _OPEN.add(s)
        s.add_partition(0)
        p = s.partition(0)
        expected = []
        for b in batches:
            assert p.append(len(expected), b) == len(expected) + len(b) - 1
            expected.extend(b)

        def check():
            files = read_storage(root)
            assert files.control.cluster_key == key
            part = files.partitions[0]
            assert set(part.other_files) <= SPARES
            assert_records_equal(part.records, 0, expected)
            for seg, idx in zip(part.segments, part.indexes):
                assert idx.offsets == [r.offset for r in seg.records]
                assert_raw_record_bytes(seg)
            for a, b in zip(part.segments, part.segments[1:]):
                assert a.file_size >= segment_size
            return file_bytes(root / "0")

        snapshot = check()
        assert p.max_transaction_id == len(expected) - 1
        s.close()
        s = Storage.open(root, key, 1, segment_size=segment_size, checkpoint_interval=checkpoint_interval)
        _OPEN.add(s)
        assert s.partition(0).max_transaction_id == len(expected) - 1
        assert check() == snapshot
        s.close()
