"""An independent, strict, pure-Python reader of the Waltz storage directory format.

Written from the specification text (``spec/on-disk-data-structures.txt`` and the
"On-disk format (exact)" section of DESIGN.md), not from the engine's source, so that the
conformance tests compare two independent readings of the spec. Standard library only.

Layout (all integers big-endian, UUIDs as 16 bytes, most significant half first)::

    <storage>/waltz-storage.ctl            control file
    <storage>/<partition id>/<19 digits>.seg   segment data file, named by its first txid
    <storage>/<partition id>/<19 digits>.idx   segment index file

Every function raises :class:`SpecViolation` (with the file and byte offset) on anything the
spec does not allow: wrong sizes, bad CRCs, non-dense ids, trailing garbage, and so on.
"""

from __future__ import annotations

import os
import re
import struct
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
CONTROL_FILE_NAME = "waltz-storage.ctl"
TRUNCATE_INTENT_NAME = "truncate.intent"

HEADER_SIZE = 128

# Control file header: version i32, creation time i64, key 16 bytes, partition count i32,
# 96 reserved bytes.
_CTL_HEADER = struct.Struct(">iq16si")
assert _CTL_HEADER.size == 32
CTL_RESERVED = HEADER_SIZE - _CTL_HEADER.size  # 96

# Partition info struct: session id i64, low-water mark i64, local low-water mark i64, CRC i32.
_PINFO_BODY = struct.Struct(">qqq")
PINFO_STRUCT_SIZE = _PINFO_BODY.size + 4  # 28
CTL_ENTRY_SIZE = 4 + 2 * PINFO_STRUCT_SIZE  # 60
assert CTL_ENTRY_SIZE == 60

# Segment / index header: version i32, creation time i64, cluster key 16 bytes,
# partition id i32, first transaction id i64, 88 reserved bytes.
_SEG_HEADER = struct.Struct(">iq16siq")
assert _SEG_HEADER.size == 40
SEG_RESERVED = HEADER_SIZE - _SEG_HEADER.size  # 88

# Record prefix: txid i64, ReqId (client id, generation, partition id, sequence: i32 each),
# header i32, data length i32, data CRC32 i32. Then data, then record CRC32 i32.
_RECORD_PREFIX = struct.Struct(">qiiiiiii")
RECORD_PREFIX_SIZE = _RECORD_PREFIX.size  # 36
assert RECORD_PREFIX_SIZE == 36
RECORD_OVERHEAD = RECORD_PREFIX_SIZE + 4  # 40

_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")

SEGMENT_NAME_RE = re.compile(r"^(\d{19})\.(seg|idx)$")


class SpecViolation(ValueError):
    """The bytes on disk do not follow the on-disk format specification."""

    def __init__(self, path: os.PathLike[str] | str, offset: int | None, message: str) -> None:
        self.path = str(path)
        self.offset = offset
        where = self.path if offset is None else f"{self.path} @ byte {offset}"
        super().__init__(f"{where}: {message}")


def crc32(data: bytes) -> int:
    """IEEE CRC32 as an unsigned 32-bit value."""
    return zlib.crc32(data) & 0xFFFFFFFF


def _u32(signed: int) -> int:
    return signed & 0xFFFFFFFF


def _check_reserved(path: Path, buf: bytes, start: int, end: int) -> None:
    if any(buf[start:end]):
        raise SpecViolation(path, start, f"reserved header bytes {start}..{end} are not zero")


# --------------------------------------------------------------------------------------------
# Control file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionInfoStruct:
    session_id: int
    low_water_mark: int
    local_low_water_mark: int
    crc: int  # as stored (unsigned view of the i32)
    valid: bool  # CRC32 of the first 24 bytes matches
    offset: int  # byte offset of the struct in the control file

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.session_id, self.low_water_mark, self.local_low_water_mark)


@dataclass(frozen=True)
class ControlEntry:
    partition_id: int
    structs: tuple[PartitionInfoStruct, PartitionInfoStruct]
    offset: int

    @property
    def newest(self) -> PartitionInfoStruct:
        """The newest valid struct: the larger (session id, low-water mark, local low-water mark)."""
        valid = [s for s in self.structs if s.valid]
        if not valid:
            raise ValueError(f"partition {self.partition_id}: no valid partition info struct")
        return max(valid, key=lambda s: s.key)

    @property
    def newest_slot(self) -> int:
        """0 or 1: which struct is the newest valid one (slot 0 on a tie)."""
        newest = self.newest
        return 0 if self.structs[0] == newest else 1


@dataclass(frozen=True)
class ControlFile:
    version: int
    creation_time_ms: int
    cluster_key: uuid.UUID
    partition_count: int
    entries: list[ControlEntry]

    def entry(self, partition_id: int) -> ControlEntry:
        for e in self.entries:
            if e.partition_id == partition_id:
                return e
        raise KeyError(partition_id)


def _parse_pinfo(buf: bytes, off: int) -> PartitionInfoStruct:
    session_id, lwm, llwm = _PINFO_BODY.unpack_from(buf, off)
    (stored,) = _I32.unpack_from(buf, off + _PINFO_BODY.size)
    computed = crc32(buf[off : off + _PINFO_BODY.size])
    return PartitionInfoStruct(session_id, lwm, llwm, _u32(stored), _u32(stored) == computed, off)


def read_control(path: os.PathLike[str] | str, *, require_valid: bool = True) -> ControlFile:
    """Parses ``waltz-storage.ctl``.

    A struct whose CRC fails is reported (``valid=False``), as the spec allows one torn struct;
    with ``require_valid`` an entry whose two structs are both invalid is a violation (the spec
    says such a partition fails to open).
    """
    path = Path(path)
    buf = path.read_bytes()
    if len(buf) < HEADER_SIZE:
        raise SpecViolation(path, 0, f"control file is {len(buf)} bytes, shorter than the header")
    version, ctime, key, count = _CTL_HEADER.unpack_from(buf, 0)
    if version != FORMAT_VERSION:
        raise SpecViolation(path, 0, f"format version {version}, expected {FORMAT_VERSION}")
    if count < 0:
        raise SpecViolation(path, 28, f"negative partition count {count}")
    _check_reserved(path, buf, _CTL_HEADER.size, HEADER_SIZE)
    expected = HEADER_SIZE + count * CTL_ENTRY_SIZE
    if len(buf) != expected:
        raise SpecViolation(path, None, f"control file is {len(buf)} bytes; {count} partitions need {expected}")
    entries: list[ControlEntry] = []
    seen: set[int] = set()
    for i in range(count):
        off = HEADER_SIZE + i * CTL_ENTRY_SIZE
        (pid,) = _I32.unpack_from(buf, off)
        if pid in seen:
            raise SpecViolation(path, off, f"partition {pid} appears twice")
        seen.add(pid)
        s1 = _parse_pinfo(buf, off + 4)
        s2 = _parse_pinfo(buf, off + 4 + PINFO_STRUCT_SIZE)
        if require_valid and not (s1.valid or s2.valid):
            raise SpecViolation(path, off, f"partition {pid}: both partition info structs fail CRC")
        entries.append(ControlEntry(pid, (s1, s2), off))
    return ControlFile(version, ctime, uuid.UUID(bytes=key), count, entries)


# --------------------------------------------------------------------------------------------
# Segment data and index files
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentHeader:
    version: int
    creation_time_ms: int
    cluster_key: uuid.UUID
    partition_id: int
    first_txid: int


@dataclass(frozen=True)
class SpecRecord:
    txid: int
    req_id: tuple[int, int, int, int]  # (client id, generation, partition id, sequence)
    header: int
    data: bytes
    data_crc: int
    record_crc: int
    offset: int  # byte offset of the record in the data file
    size: int  # total bytes, prefix + data + record CRC

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Segment:
    path: Path
    header: SegmentHeader
    records: list[SpecRecord]
    file_size: int
    records_end: int
    """Where the records end: the file size, or less when zeros (preallocated space) follow."""

    @property
    def first_txid(self) -> int:
        return self.header.first_txid

    @property
    def next_txid(self) -> int:
        return self.header.first_txid + len(self.records)


@dataclass(frozen=True)
class Index:
    path: Path
    header: SegmentHeader
    offsets: list[int]


def _first_txid_from_name(path: Path) -> int | None:
    m = SEGMENT_NAME_RE.match(path.name)
    return int(m.group(1)) if m else None


def _parse_segment_header(path: Path, buf: bytes) -> SegmentHeader:
    if len(buf) < HEADER_SIZE:
        raise SpecViolation(path, 0, f"file is {len(buf)} bytes, shorter than the 128-byte header")
    version, ctime, key, pid, first = _SEG_HEADER.unpack_from(buf, 0)
    if version != FORMAT_VERSION:
        raise SpecViolation(path, 0, f"format version {version}, expected {FORMAT_VERSION}")
    if first < 0:
        raise SpecViolation(path, 32, f"negative first transaction id {first}")
    _check_reserved(path, buf, _SEG_HEADER.size, HEADER_SIZE)
    named = _first_txid_from_name(path)
    if named is not None and named != first:
        raise SpecViolation(path, 32, f"header first txid {first} differs from file name {named}")
    return SegmentHeader(version, ctime, uuid.UUID(bytes=key), pid, first)


def parse_record(path: Path, buf: bytes, off: int, expected_txid: int | None = None) -> SpecRecord:
    """Parses and verifies one record at ``off``; raises SpecViolation on any defect."""
    if len(buf) - off < RECORD_OVERHEAD:
        raise SpecViolation(path, off, f"{len(buf) - off} trailing bytes, too short for a record")
    txid, client, gen, rpid, seq, header, length, data_crc = _RECORD_PREFIX.unpack_from(buf, off)
    if expected_txid is not None and txid != expected_txid:
        raise SpecViolation(path, off, f"record txid {txid}, expected {expected_txid} (not dense)")
    if length < 0:
        raise SpecViolation(path, off + 28, f"negative data length {length}")
    data_start = off + RECORD_PREFIX_SIZE
    data_end = data_start + length
    if data_end + 4 > len(buf):
        raise SpecViolation(path, off, f"data length {length} runs past end of file ({len(buf)} bytes)")
    data = bytes(buf[data_start:data_end])
    if crc32(data) != _u32(data_crc):
        raise SpecViolation(path, off, f"txid {txid}: data CRC mismatch")
    (rec_crc,) = _I32.unpack_from(buf, data_end)
    if crc32(buf[off:data_end]) != _u32(rec_crc):
        raise SpecViolation(path, off, f"txid {txid}: record CRC mismatch")
    return SpecRecord(
        txid=txid,
        req_id=(client, gen, rpid, seq),
        header=header,
        data=data,
        data_crc=_u32(data_crc),
        record_crc=_u32(rec_crc),
        offset=off,
        size=data_end + 4 - off,
    )


def read_segment_header(path: os.PathLike[str] | str) -> SegmentHeader:
    path = Path(path)
    with open(path, "rb") as f:
        return _parse_segment_header(path, f.read(HEADER_SIZE))


def read_segment(path: os.PathLike[str] | str) -> Segment:
    """Parses a ``.seg`` file: header, then records back to back with dense txids starting at
    the header's first transaction id, to the end of the file or to zeros that run to the end of
    the file (space preallocated in the last segment of an open partition)."""
    path = Path(path)
    buf = path.read_bytes()
    header = _parse_segment_header(path, buf)
    records: list[SpecRecord] = []
    off = HEADER_SIZE
    txid = header.first_txid
    # Records end where only zeros are left (a record's own last bytes may be zeros too: it is
    # parsed whole from where it starts).
    data_end = len(buf.rstrip(b"\0"))
    while off < data_end:
        rec = parse_record(path, buf, off, txid)
        records.append(rec)
        off = rec.end
        txid += 1
    return Segment(path, header, records, len(buf), off)


def read_index(path: os.PathLike[str] | str) -> Index:
    """Parses an ``.idx`` file: the segment header, then one i64 record offset per record."""
    path = Path(path)
    buf = path.read_bytes()
    header = _parse_segment_header(path, buf)
    body = len(buf) - HEADER_SIZE
    if body % 8:
        raise SpecViolation(path, HEADER_SIZE, f"index body is {body} bytes, not a multiple of 8")
    offsets = [v for (v,) in struct.iter_unpack(">q", buf[HEADER_SIZE:])]
    prev = HEADER_SIZE - 1
    for i, v in enumerate(offsets):
        if v <= prev:
            raise SpecViolation(path, HEADER_SIZE + 8 * i, f"entry {i} offset {v} not increasing (previous {prev})")
        prev = v
    if offsets and offsets[0] != HEADER_SIZE:
        raise SpecViolation(path, HEADER_SIZE, f"first entry {offsets[0]} is not {HEADER_SIZE}")
    return Index(path, header, offsets)


def check_index_matches(segment: Segment, index: Index) -> None:
    """The index header equals the data file header and its entries are the record offsets."""
    if index.header != segment.header:
        raise SpecViolation(index.path, 0, f"index header {index.header} differs from data header {segment.header}")
    actual = [r.offset for r in segment.records]
    if index.offsets != actual:
        for i, (a, b) in enumerate(zip(index.offsets, actual)):
            if a != b:
                raise SpecViolation(
                    index.path,
                    HEADER_SIZE + 8 * i,
                    f"entry {i} (txid {segment.first_txid + i}) is {a}, record is at {b}",
                )
        raise SpecViolation(
            index.path,
            None,
            f"index has {len(index.offsets)} entries, data file has {len(actual)} records",
        )


def read_truncate_intent(path: os.PathLike[str] | str) -> int:
    """Parses ``truncate.intent``: target txid i64 then CRC32 of those 8 bytes."""
    path = Path(path)
    buf = path.read_bytes()
    if len(buf) != 12:
        raise SpecViolation(path, 0, f"truncate intent is {len(buf)} bytes, expected 12")
    (target,) = _I64.unpack_from(buf, 0)
    (stored,) = _I32.unpack_from(buf, 8)
    if crc32(buf[:8]) != _u32(stored):
        raise SpecViolation(path, 8, "truncate intent CRC mismatch")
    return target


# --------------------------------------------------------------------------------------------
# Partitions and the whole storage directory
# --------------------------------------------------------------------------------------------


@dataclass
class PartitionFiles:
    path: Path
    partition_id: int | None
    segments: list[Segment]
    indexes: list[Index]
    other_files: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[SpecRecord]:
        return [r for s in self.segments for r in s.records]

    @property
    def first_txid(self) -> int | None:
        return self.segments[0].first_txid if self.segments else None

    @property
    def max_txid(self) -> int:
        """The highest txid held, -1 when there is none."""
        for s in reversed(self.segments):
            if s.records:
                return s.records[-1].txid
        return -1 if not self.segments else self.segments[0].first_txid - 1


def read_partition(
    path: os.PathLike[str] | str,
    *,
    cluster_key: uuid.UUID | None = None,
    check_index: bool = True,
) -> PartitionFiles:
    """Reads every segment of a partition folder in id order.

    Checks: each ``.seg`` has its ``.idx`` and vice versa; each header's partition id equals the
    folder name (when it is a number) and the cluster keys agree; consecutive segments are dense
    (the next segment's first txid is the previous one's last txid + 1); with ``check_index`` each
    index equals its data file's record offsets. Files with other names are listed in
    ``other_files``, not parsed.
    """
    path = Path(path)
    pid = int(path.name) if path.name.isdigit() else None
    segs: dict[int, Path] = {}
    idxs: dict[int, Path] = {}
    other: list[str] = []
    for name in sorted(os.listdir(path)):
        m = SEGMENT_NAME_RE.match(name)
        if not m:
            other.append(name)
            continue
        (segs if m.group(2) == "seg" else idxs)[int(m.group(1))] = path / name
    for first in segs.keys() - idxs.keys():
        raise SpecViolation(segs[first], None, "data file without an index file")
    for first in idxs.keys() - segs.keys():
        raise SpecViolation(idxs[first], None, "index file without a data file")

    segments: list[Segment] = []
    indexes: list[Index] = []
    key = cluster_key
    for first in sorted(segs):
        seg = read_segment(segs[first])
        if first != max(segs) and seg.records_end != seg.file_size:
            raise SpecViolation(seg.path, seg.records_end, "a sealed segment must end at its last record")
        idx = read_index(idxs[first])
        if pid is not None and seg.header.partition_id != pid:
            raise SpecViolation(seg.path, 28, f"partition id {seg.header.partition_id} in folder {path.name}")
        if key is None:
            key = seg.header.cluster_key
        elif seg.header.cluster_key != key:
            raise SpecViolation(seg.path, 12, f"cluster key {seg.header.cluster_key} != {key}")
        if segments and segments[-1].next_txid != first:
            raise SpecViolation(
                seg.path,
                None,
                f"segment starts at {first}, previous segment ends before {segments[-1].next_txid}: ids not dense",
            )
        if check_index:
            check_index_matches(seg, idx)
        elif idx.header != seg.header:
            raise SpecViolation(idx.path, 0, "index header differs from data header")
        segments.append(seg)
        indexes.append(idx)
    return PartitionFiles(path, pid, segments, indexes, other)


@dataclass
class StorageFiles:
    control: ControlFile
    partitions: dict[int, PartitionFiles]
    other_files: list[str]


def read_storage(path: os.PathLike[str] | str) -> StorageFiles:
    """Reads the control file and every numbered partition folder of a storage directory."""
    path = Path(path)
    control = read_control(path / CONTROL_FILE_NAME)
    partitions: dict[int, PartitionFiles] = {}
    other: list[str] = []
    for name in sorted(os.listdir(path)):
        if name == CONTROL_FILE_NAME:
            continue
        if name.isdigit() and (path / name).is_dir():
            partitions[int(name)] = read_partition(path / name, cluster_key=control.cluster_key)
        else:
            other.append(name)
    return StorageFiles(control, partitions, other)
