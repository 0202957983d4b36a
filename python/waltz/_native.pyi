"""Type stubs for the native extension `waltz._native` (Rust, PyO3)."""

import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal, Self, TypedDict, final

__version__: str
SYNC_MICROS_BOUNDS: list[int]
BATCH_RECORDS_BOUNDS: list[int]
# (name, base name, docstring) of each native exception, bases first.
EXCEPTIONS: list[tuple[str, str, str]]

_Key = uuid.UUID | str | bytes
_ReqIdLike = ReqId | tuple[int, int, int, int]
_RecordTuple = tuple[_ReqIdLike, int, bytes | bytearray | memoryview]

@final
class ReqId:
    """Identifies a client request: client id, generation, partition id and sequence number."""
    def __new__(cls, client_id: int, generation: int, partition_id: int, sequence: int) -> ReqId: ...
    @property
    def client_id(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def partition_id(self) -> int: ...
    @property
    def sequence(self) -> int: ...
    def as_tuple(self) -> tuple[int, int, int, int]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class RecordHeader:
    """A transaction's metadata: id, ReqId and the application's header."""
    @property
    def txid(self) -> int: ...
    @property
    def req_id(self) -> ReqId: ...
    @property
    def header(self) -> int: ...

@final
class Record:
    """A stored transaction: id, ReqId, header and data."""
    @property
    def txid(self) -> int: ...
    @property
    def req_id(self) -> ReqId: ...
    @property
    def header(self) -> int: ...
    @property
    def data(self) -> bytes: ...

@final
class RecordBatch:
    """Records packed once (data contiguous, checksums computed), appendable at any id."""
    def __new__(cls, records: Iterable[_RecordTuple | Record] | None = None) -> RecordBatch: ...
    def add(self, req_id: _ReqIdLike, header: int, data: bytes) -> None: ...
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class _ScanBuffers(TypedDict):
    txid: bytes
    header: bytes
    client_id: bytes
    generation: bytes
    partition: bytes
    sequence: bytes
    offsets: bytes
    payload: ScanPayload

@final
class ScanPayload:
    """A chunk's packed data, lent through the buffer protocol (`memoryview`, `pyarrow.py_buffer`)
    without a copy; read-only. `bytes(p)` copies it."""
    def __len__(self) -> int: ...
    def __bytes__(self) -> bytes: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class ScanChunk:
    """A scanned range as column buffers (native-endian arrays, Arrow's binary layout)."""
    def __len__(self) -> int: ...
    @property
    def first_txid(self) -> int | None: ...
    @property
    def last_txid(self) -> int | None: ...
    @property
    def payload_nbytes(self) -> int: ...
    def buffers(self) -> _ScanBuffers: ...

@final
class PartitionInfo:
    """Session information a partition keeps in the control file."""
    @property
    def session_id(self) -> int: ...
    @property
    def low_water_mark(self) -> int: ...
    @property
    def local_low_water_mark(self) -> int: ...

class _Stats(TypedDict):
    appends: int
    records: int
    bytes: int
    syncs: int
    sync_micros: tuple[list[int], int]
    batch_records: tuple[list[int], int]

class _Recovery(TypedDict):
    segments: int
    scanned_records: int
    torn_bytes: int
    torn_survivors: tuple[str, int, int] | None
    corruption_cut: tuple[str, int] | None
    finished_truncation: int | None
    removed_files: list[str]
    foreign_files: list[str]

@final
class Partition:
    """One partition's log. Every method that does I/O releases the GIL."""
    @property
    def id(self) -> int: ...
    @property
    def max_transaction_id(self) -> int:
        """The highest durable transaction id, -1 when empty."""
    @property
    def first_transaction_id(self) -> int:
        """The lowest id still held (retention moves it up)."""
    @property
    def segment_count(self) -> int: ...
    @property
    def failed(self) -> str | None:
        """Why appends are refused (after a write or sync error), or None."""
    @property
    def recovery(self) -> _Recovery: ...
    def stats(self) -> _Stats: ...
    def append(self, first_txid: int, records: RecordBatch | Iterable[_RecordTuple]) -> int:
        """Appends as ids first_txid, first_txid+1, ...; returns the last id once durable."""
    def append_next(self, records: RecordBatch | Iterable[_RecordTuple]) -> tuple[int, int]:
        """Appends at the partition's next ids; returns (first, last) once durable. Threads
        appending concurrently share fsyncs (group commit)."""
    def truncate(self, txid: int) -> int:
        """Drops every transaction after `txid` (crash-safe); returns the new max id."""
    def drop_segments_before(self, txid: int, rate: int | None = None) -> int:
        """Retention: deletes whole segments below `txid`, freeing at most `rate` bytes per
        second (None: unpaced); returns the new first id."""
    def retention(self) -> dict[str, int]:
        """first_transaction_id, segments, bytes_on_disk, oldest_ms (creation of the oldest
        segment, -1 unknown), reclaimed_bytes (deleted since the partition was opened)."""
    def read_record(self, txid: int) -> Record | None: ...
    def read_header(self, txid: int) -> RecordHeader | None: ...
    def read_records(self, txid: int, max_count: int = 1000, max_bytes: int = 4 << 20) -> list[Record]: ...
    def read_headers(self, txid: int, max_count: int = 1000) -> list[RecordHeader]: ...
    def scan(
        self, start: int, end: int | None = None, max_count: int = 1 << 20, max_bytes: int = 16 << 20
    ) -> ScanChunk: ...

@final
class Storage:
    """A storage directory: the control file and the partitions' segment files."""
    @staticmethod
    def create(
        path: str | os.PathLike[str],
        cluster_key: _Key,
        partition_count: int,
        *,
        segment_size: int = 1 << 30,
        checkpoint_interval: int = 1000,
        max_record_size: int = 16 << 20,
        preallocate: int = 1 << 20,
    ) -> Storage: ...
    @staticmethod
    def open(
        path: str | os.PathLike[str],
        cluster_key: _Key | None = None,
        partition_count: int | None = None,
        *,
        read_only: bool = False,
        recovery: Literal["strict", "truncate"] = "strict",
        segment_size: int = 1 << 30,
        checkpoint_interval: int = 1000,
        max_record_size: int = 16 << 20,
        preallocate: int = 1 << 20,
    ) -> Storage: ...
    @property
    def path(self) -> str: ...
    @property
    def cluster_key(self) -> str: ...
    @property
    def partition_count(self) -> int: ...
    @property
    def creation_time_ms(self) -> int: ...
    def partition_ids(self) -> list[int]: ...
    def add_partition(self, partition_id: int) -> None: ...
    def remove_partition(self, partition_id: int, *, delete_files: bool = False) -> None: ...
    def partition(self, partition_id: int) -> Partition: ...
    def reopen_partition(self, partition_id: int) -> Partition: ...
    def repair_partition(self, partition_id: int) -> Partition: ...
    def close_partition(self, partition_id: int) -> None: ...
    def flush(self) -> None:
        """Writes every open partition's in-memory index tail (entries since the last
        checkpoint) to its index file and syncs it, as a clean close would."""
    def close(self) -> None:
        """Closes every open partition, writing their index tails."""
    def __enter__(self) -> Storage: ...
    def __exit__(self, _t: object, _v: object, _tb: object) -> bool: ...
    def partition_info(self, partition_id: int) -> PartitionInfo: ...
    def set_low_water_mark(self, partition_id: int, session_id: int, low_water_mark: int) -> PartitionInfo: ...
    def set_partition_info(
        self, partition_id: int, session_id: int, low_water_mark: int, local_low_water_mark: int
    ) -> None: ...

@final
class StorageNode:
    """A storage node serving a Storage over TCP (storage protocol): each connection on a thread
    of its own, where its appends are queued and made durable together (at most `max_in_flight`
    before they are answered)."""
    @staticmethod
    def start(
        storage: Storage,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        admin_port: int | None = None,
        max_frame: int = 64 << 20,
        max_list_count: int = 10_000,
        max_list_bytes: int = 16 << 20,
        idle_timeout: float = 300.0,
        max_in_flight: int = 1024,
        max_connections: int = 4096,
        retention_interval: float = 1.0,
        retention_rate: int = 64 << 20,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        role_secrets: Mapping[str, str] | None = None,
    ) -> StorageNode:
        """With all of tls_ca, tls_cert and tls_key (PEM files), both ports take only mutual TLS:
        client certificates must chain to tls_ca. Each port keeps at most `max_connections` open
        (one more is closed on accept); a connection must send Hello and a successful Open
        within 10 s (or idle_timeout, if shorter). With `role_secrets` (role -> secret), a peer
        must give the secret of one of those roles (server, admin) in its Hello."""
    @property
    def address(self) -> tuple[str, int]: ...
    @property
    def admin_address(self) -> tuple[str, int] | None: ...
    def stats(self) -> dict[str, int | dict[str, int]]: ...
    def stop(self) -> None:
        """Stops accepting and closes connections; queued appends finish their fsync first."""
    def __enter__(self) -> StorageNode: ...
    def __exit__(self, _t: object, _v: object, _tb: object) -> bool: ...

@final
class ResponseReader:
    """Splits bytes from a storage node into responses: (kind, seq, session_id, partition_id, value)."""
    def __new__(cls, max_frame: int = 64 << 20, *, admin: bool = False) -> ResponseReader: ...
    def feed(self, data: bytes) -> None: ...
    def next_response(self) -> tuple[str, int, int, int, object] | None: ...

@final
class FrameReader:
    """Splits a byte stream into (message type, payload) frames of one protocol (magic)."""

    max_frame: int
    """The largest frame accepted, checked as soon as a frame's length arrives."""
    def __new__(cls, magic: int, max_frame: int = 64 << 20) -> FrameReader: ...
    def feed(self, data: bytes) -> None: ...
    def next_frame(self) -> tuple[int, bytes] | None: ...
    def buffered(self) -> int: ...

@final
class ClientVocabulary:
    """The message classes, enums and exceptions of `waltz.client_protocol`, given once."""
    def __new__(
        cls,
        messages: Mapping[int, type],
        feed_entry: type,
        mount_status: type,
        failure_kind: type,
        limit_exceeded: type[BaseException],
        too_many_locks: type[BaseException],
        python_decode: Callable[[int, bytes, int | None], object],
    ) -> ClientVocabulary: ...
    @property
    def native_types(self) -> list[int]:
        """The message types decoded natively (the others, if any, by the Python decoder)."""

class ClientMessageReader:
    """Bytes in, `waltz.client_protocol` messages out (framing and decoding in native code)."""

    max_frame: int
    """The largest frame accepted, checked as soon as a frame's length arrives."""
    max_locks: int | None
    """The most locks an Append may declare in all, or None."""
    def __new__(cls, vocabulary: ClientVocabulary, max_frame: int = 64 << 20, max_locks: int | None = None) -> Self: ...
    def feed(self, data: bytes) -> None: ...
    def buffered(self) -> int: ...
    def next_message(self) -> Any: ...

def encode_frame(magic: int, msg_type: int, payload: bytes) -> bytes:
    """One frame of the shared framing around `payload`."""

@final
class RequestKind:
    """A storage-protocol request an encoder can build (Append has its own, `encode_append`)."""

    HELLO: ClassVar[RequestKind]
    OPEN: ClassVar[RequestKind]
    LAST_SESSION_INFO: ClassVar[RequestKind]
    MAX_TRANSACTION_ID: ClassVar[RequestKind]
    TRUNCATE: ClassVar[RequestKind]
    SET_LOW_WATER_MARK: ClassVar[RequestKind]
    RECORD_HEADER: ClassVar[RequestKind]
    RECORD: ClassVar[RequestKind]
    RECORD_HEADER_LIST: ClassVar[RequestKind]
    RECORD_LIST: ClassVar[RequestKind]
    RESTART_LOG: ClassVar[RequestKind]
    def __eq__(self, other: object, /) -> bool: ...
    def __int__(self) -> int: ...

_RequestName = Literal[
    "hello",
    "open",
    "last_session_info",
    "max_transaction_id",
    "truncate",
    "set_low_water_mark",
    "record_header",
    "record",
    "record_header_list",
    "record_list",
]

@final
class AdminRequestKind:
    """An admin-protocol request an encoder can build (Append has its own, `encode_admin_append`)."""

    HELLO: ClassVar[AdminRequestKind]
    OPEN: ClassVar[AdminRequestKind]
    ASSIGN: ClassVar[AdminRequestKind]
    UNASSIGN: ClassVar[AdminRequestKind]
    SET_AVAILABILITY: ClassVar[AdminRequestKind]
    STATUS: ClassVar[AdminRequestKind]
    RECORD_LIST: ClassVar[AdminRequestKind]
    SET_PARTITION_INFO: ClassVar[AdminRequestKind]
    RESET_FENCE: ClassVar[AdminRequestKind]
    TRUNCATE: ClassVar[AdminRequestKind]
    RAISE_FENCE: ClassVar[AdminRequestKind]
    RESTART_LOG: ClassVar[AdminRequestKind]
    def __eq__(self, other: object, /) -> bool: ...
    def __int__(self) -> int: ...

_AdminRequestName = Literal[
    "hello",
    "open",
    "assign",
    "unassign",
    "set_availability",
    "status",
    "record_list",
    "set_partition_info",
    "reset_fence",
    "truncate",
    "raise_fence",
]

def encode_request(
    kind: RequestKind | _RequestName,
    session_id: int = ...,  # -1
    seq: int = ...,  # -1
    partition_id: int = ...,  # -1
    *,
    txid: int = 0,
    max_count: int = 0,
    low_water_mark: int = ...,  # -1
    cluster_key: _Key | None = None,
    partition_count: int = 0,
    min_version: int = 1,
    max_version: int = 1,
    role: str | None = None,
    secret: bytes | None = None,
) -> bytes:
    """One storage-protocol request frame (every request but Append); `kind` is a RequestKind
    or its protocol name."""

def encode_admin_request(
    kind: AdminRequestKind | _AdminRequestName,
    seq: int = 0,
    partition_id: int = 0,
    *,
    cluster_key: _Key | None = None,
    partition_count: int = 0,
    delete_files: bool = False,
    readable: bool = True,
    writable: bool = True,
    txid: int = 0,
    max_count: int = 0,
    session_id: int = ...,  # -1
    low_water_mark: int = ...,  # -1
    force: bool = False,
    role: str | None = None,
    secret: bytes | None = None,
) -> bytes:
    """One admin-protocol request frame (every request but Append); `kind` is an
    AdminRequestKind or its protocol name."""

def encode_admin_append(seq: int, partition_id: int, records: Iterable[Record]) -> bytes:
    """An admin Append frame carrying `records` (as read from another node) unchanged."""

def encode_set_retention(
    session_id: int,
    seq: int,
    partition_id: int,
    *,
    max_age_ms: int = ...,  # -1: no limit
    max_bytes: int = ...,  # -1: no limit
    min_kept: int = 0,
    hold_from: int = 2**63 - 1,
    lease_ms: int = 30_000,
) -> bytes:
    """A Set Retention frame: the partition's retention order for `lease_ms` (-1: no limit)."""

def encode_append(session_id: int, seq: int, partition_id: int, first_txid: int, batch: RecordBatch) -> bytes:
    """An Append frame of `batch` as transactions first_txid, first_txid + 1, ..."""

class _ControlStruct(TypedDict):
    session_id: int
    low_water_mark: int
    local_low_water_mark: int
    checksum_ok: bool

class _ControlEntry(TypedDict):
    partition: int
    stored_partition_id: int
    structs: list[_ControlStruct]
    current: Literal[1, 2] | None

class _ControlReport(TypedDict):
    path: str
    file_length: int
    version: int
    creation_time_ms: int
    cluster_key: str
    partition_count: int
    problems: list[str]
    partitions: list[_ControlEntry]

class _SegmentHeader(TypedDict):
    version: int
    creation_time_ms: int
    cluster_key: str
    partition_id: int
    first_txid: int
    reserved_zero: bool

class _RecordProblem(TypedDict):
    offset: int
    txid: int
    reason: str
    torn_tail: bool
    next_valid_offset: int | None
    may_be_torn_write: bool

class _RecordSummary(TypedDict):
    offset: int
    txid: int
    client_id: int
    generation: int
    partition_id: int
    sequence: int
    header: int
    data_length: int

class _IndexReport(TypedDict):
    path: str
    file_length: int
    header_matches: bool
    entries: int
    partial_bytes: int
    extra_entries: int
    mismatch: tuple[int, int, int] | None  # (position, stored offset, real offset)

class _SegmentReport(TypedDict):
    path: str
    file_length: int
    header: _SegmentHeader
    name_txid: int
    record_count: int
    first_txid: int | None
    last_txid: int | None
    valid_end: int
    preallocated_bytes: int
    """Zeros after the valid records up to the end of the file: space preallocated for appends."""
    problem: _RecordProblem | None
    records: list[_RecordSummary]
    index: _IndexReport | None

def inspect_control(path: str | os.PathLike[str]) -> _ControlReport:
    """Decodes a control file (or the one in a storage directory) read-only: the header and,
    per partition, both info structs with their checksum state and which one is current."""

def inspect_segment(
    path: str | os.PathLike[str], limit: int = 50, *, max_record_size: int = 16 << 20
) -> _SegmentReport:
    """Walks a segment data file and its index read-only: header, records, the first invalid
    record (a torn tail when nothing valid follows it, else corruption), the first `limit`
    records, and whether the index agrees with the records."""

def raw_append_loop(path: str | os.PathLike[str], payload: bytes, iterations: int) -> list[int]:
    """Benchmark reference: write + fdatasync of `payload`, `iterations` times; ns per call."""

def native_writers(partition: Partition, threads: int, seconds: float, size: int) -> int:
    """Benchmark: `threads` native threads append single `size`-byte records to `partition`, each
    waiting for its own durability, for `seconds`; returns the records appended."""

# BEGIN generated exceptions classes (scripts/gen_exceptions.py from waltz._native.EXCEPTIONS)
class WaltzError(Exception):
    """Root of every Waltz error."""

class StorageError(WaltzError):
    """An error of the storage engine."""

class StorageIOError(StorageError):
    """A read, write or sync failed."""

class CorruptionError(StorageError):
    """Data on disk fails its checks."""

class ClusterKeyMismatch(StorageError):
    """The files belong to another cluster."""

class PartitionCountMismatch(StorageError):
    """The storage has another partition count."""

class NonDenseAppendError(StorageError):
    """Appended ids do not continue the log."""

class RecordTooLargeError(StorageError):
    """A record exceeds the maximum size."""

class BelowLogStartError(StorageError):
    """The id was removed by retention."""

class PartitionFailedError(StorageError):
    """A write or sync failed; reopen the partition."""

class AppendTruncatedError(StorageError):
    """A truncation cut the append before it was acknowledged."""

class RefusedError(StorageError):
    """A replica refused a destructive request its state shows no server needs."""

class PartitionNotFoundError(StorageError):
    """No such partition here."""

class StorageExistsError(StorageError):
    """The directory is already a storage directory."""

class NotInitialisedError(StorageError):
    """The directory is not a storage directory."""

class ReadOnlyError(StorageError):
    """The storage was opened read-only."""

class StorageLockedError(StorageError):
    """Another writer has the storage directory open."""

class StorageClosedError(StorageError):
    """The storage handle was closed."""

class PartitionClosedError(StorageError):
    """The partition handle was closed."""

class InvalidArgumentError(WaltzError):
    """An argument is out of range."""

class ProtocolError(WaltzError):
    """A peer sent bytes that are not a valid frame."""

class InternalError(WaltzError):
    """A bug: an invariant of the engine failed."""

# END generated exceptions classes
