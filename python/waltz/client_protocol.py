"""The client protocol (client ↔ server), shared by both sides: message payloads here, the
framing (length, magic "WC", version, type, CRC) in the native codec. Byte layouts are in
docs/protocol.md. Decoding is strict: short fields, trailing bytes, counts that cannot fit in the
frame and data whose CRC fails raise `ProtocolError`, and the connection is closed."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from waltz._native import FrameReader, ProtocolError, encode_frame

MAGIC = 0x5743  # "WC"
VERSION = 2
"""2: a Mount carries the client's token (issue 34: a Mount under another client's id locked
that client out). A version-1 peer is refused at the Hello, with a Failure saying why."""
TOKEN_BYTES = 16

ReqIdTuple = tuple[int, int, int, int]
"""(client id, generation, partition id, sequence)."""

_I32, _I64, _U32, _U8 = struct.Struct(">i"), struct.Struct(">q"), struct.Struct(">I"), struct.Struct(">B")
_REQ = struct.Struct(">iiii")
_ENTRY = struct.Struct(">qiiiii")  # transaction id, ReqId, header
_FEED_HEAD = struct.Struct(">qii")  # seq, partition, entry count
_LOCKLESS_APPEND = struct.Struct(">iiiiqiiiii")  # ReqId, high-water mark, three lock counts, header, data length


def lock_hash(name: str, lock_id: int) -> int:
    """The 64-bit hash a client sends for lock (name, id); the server never sees names."""
    digest = hashlib.blake2b(name.encode() + b"\x00" + lock_id.to_bytes(8, "big", signed=True), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class MountStatus(enum.IntEnum):
    READY = 0
    """The feed has delivered everything committed up to the moment of the mount."""
    NOT_READY = 1
    """The partition is not served here (moved, or not open yet): find its server again."""
    CLIENT_AHEAD = 2
    """The client claims a higher high-water mark than the partition has: a configuration error
    (wrong cluster, restored database) that must not be papered over."""
    BEHIND_RETENTION = 3
    """The client's mark is below what the partition still holds: retention deleted the
    transactions after it. The response's high-water mark field carries the first id held."""


class FailureKind(enum.IntEnum):
    INTERNAL = 1
    BAD_REQUEST = 2
    PARTITION_NOT_HERE = 3
    NOT_COMMITTED = 4
    STORE_UNAVAILABLE = 5
    APPEND_REJECTED = 6
    """An append that can never be written (too large, malformed): `seq` is its sequence number."""
    CLIENT_REFUSED = 7
    """A Mount refused: its client id is mounted on this partition by a connection that proved
    another token, or its connection seq is far ahead of the server's clock."""
    TRANSACTIONS_DELETED = 8
    """The transactions asked for were deleted by retention; the message names the range and
    ends with "(the log starts at F)"."""


class LimitExceeded(ProtocolError):
    """A frame a limit refuses before it is buffered or decoded (too large for the peer's state,
    too many locks): the connection is closed like for any bad frame."""


class TooManyLocks(LimitExceeded):
    """An Append declaring more locks than allowed, refused before they are decoded. Its frame is
    taken whole, so the connection can answer APPEND_REJECTED and go on."""

    def __init__(self, message: str, payload: memoryview) -> None:
        super().__init__(message)
        self.req_id: ReqIdTuple = _REQ.unpack_from(payload, 0)  # an Append's payload starts with it


class _Reader:
    def __init__(self, payload: bytes, what: str, max_locks: int | None = None) -> None:
        self.b, self.i, self.what = memoryview(payload), 0, what
        self.locks_left = max_locks
        """Locks the rest of the message may declare (write, read and append together), or None."""

    def _take(self, s: struct.Struct, field: str) -> int:
        if self.i + s.size > len(self.b):
            raise ProtocolError(f"{self.what}: payload ends inside {field}")
        (v,) = s.unpack_from(self.b, self.i)
        self.i += s.size
        return int(v)

    def i32(self, field: str) -> int:
        return self._take(_I32, field)

    def i64(self, field: str) -> int:
        return self._take(_I64, field)

    def u8(self, field: str) -> int:
        return self._take(_U8, field)

    def boolean(self, field: str) -> bool:
        v = self.u8(field)
        if v > 1:
            raise ProtocolError(f"{self.what}: {field} is {v}, not a bool")
        return v == 1

    def req_id(self) -> ReqIdTuple:
        if self.i + _REQ.size > len(self.b):
            raise ProtocolError(f"{self.what}: payload ends inside the ReqId")
        v = _REQ.unpack_from(self.b, self.i)
        self.i += _REQ.size
        return (v[0], v[1], v[2], v[3])

    def count(self, field: str, element_size: int) -> int:
        n = self.i32(field)
        if n < 0 or n * element_size > len(self.b) - self.i:
            raise ProtocolError(f"{self.what}: {field} {n} does not fit in the frame")
        return n

    def raw(self, field: str) -> bytes:
        n = self.count(f"{field} length", 1)
        v = bytes(self.b[self.i : self.i + n])
        self.i += n
        return v

    def text(self, field: str) -> str:
        try:
            return self.raw(field).decode()
        except UnicodeDecodeError as e:
            raise ProtocolError(f"{self.what}: {field} is not UTF-8") from e

    def locks(self, field: str) -> tuple[int, ...]:
        n = self.count(field, 8)
        if self.locks_left is not None:
            # Checked on the declared count, before unpacking: 8 M locks took 0.85 s of the
            # server's event loop to decode only to be refused afterwards (issue 34).
            if n > self.locks_left:
                raise TooManyLocks(f"{self.what}: {field} {n} takes it beyond max_transaction_locks", self.b)
            self.locks_left -= n
        v = struct.unpack_from(f">{n}q", self.b, self.i)
        self.i += 8 * n
        return tuple(v)

    def done(self) -> None:
        if self.i != len(self.b):
            raise ProtocolError(f"{self.what}: {len(self.b) - self.i} trailing bytes")


def _raw(b: bytes) -> bytes:
    return _I32.pack(len(b)) + b


def _locks(v: Sequence[int]) -> bytes:
    return _I32.pack(len(v)) + struct.pack(f">{len(v)}q", *v)


class Message:
    TYPE: ClassVar[int]

    def payload(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def parse(cls, r: _Reader) -> Message:
        raise NotImplementedError

    def frame(self) -> bytes:
        return encode_frame(MAGIC, self.TYPE, self.payload())


class _Fixed(Message):
    """A message whose payload is its fields packed with one struct format, in field order."""

    LAYOUT: ClassVar[struct.Struct]

    def payload(self) -> bytes:
        return self.LAYOUT.pack(*(int(getattr(self, f.name)) for f in dataclasses.fields(self)))  # type: ignore[arg-type]

    @classmethod
    def parse(cls, r: _Reader) -> Message:
        if r.i + cls.LAYOUT.size > len(r.b):
            raise ProtocolError(f"{r.what}: payload shorter than its {cls.LAYOUT.size} bytes")
        values = cls.LAYOUT.unpack_from(r.b, r.i)
        r.i += cls.LAYOUT.size
        return cls(*values)


@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """The versions the client speaks, then its role's secret when it has one (a role string
    and the secret as `bytes`; nothing when `role` is empty)."""

    TYPE = 0x01
    min_version: int = VERSION
    max_version: int = VERSION
    role: str = ""
    secret: bytes = dataclasses.field(default=b"", repr=False)

    def payload(self) -> bytes:
        head = bytes([self.min_version, self.max_version])
        return head + _raw(self.role.encode()) + _raw(self.secret) if self.role else head

    @classmethod
    def parse(cls, r: _Reader) -> Hello:
        lo, hi = r.u8("min version"), r.u8("max version")
        if r.i == len(r.b):
            return cls(lo, hi)
        role = r.text("role")
        if not role:
            raise ProtocolError(f"{r.what}: empty role")
        return cls(lo, hi, role, r.raw("secret"))


@dataclasses.dataclass(frozen=True)
class HelloOk(Message):
    TYPE = 0x82
    version: int

    def payload(self) -> bytes:
        return bytes([self.version])

    @classmethod
    def parse(cls, r: _Reader) -> HelloOk:
        return cls(r.u8("version"))


@dataclasses.dataclass(frozen=True)
class Mount(Message):
    TYPE = 0x30
    LAYOUT: ClassVar[struct.Struct] = struct.Struct(f">qiiqq{TOKEN_BYTES}s")
    seq: int
    partition: int
    client_id: int
    client_high_water_mark: int
    connection_seq: int
    """Grows with every new connection of this client: older connections' messages are dropped."""
    client_token: bytes = bytes(TOKEN_BYTES)
    """The client's secret for this id: while a connection holds a mount of (client id,
    partition), a Mount of it with another token is refused (docs/internals.md, client identity)."""

    def payload(self) -> bytes:
        if len(self.client_token) != TOKEN_BYTES:
            raise ValueError(f"a client token is {TOKEN_BYTES} bytes, not {len(self.client_token)}")
        return self.LAYOUT.pack(
            self.seq,
            self.partition,
            self.client_id,
            self.client_high_water_mark,
            self.connection_seq,
            self.client_token,
        )

    @classmethod
    def parse(cls, r: _Reader) -> Mount:
        if r.i + cls.LAYOUT.size > len(r.b):
            raise ProtocolError(f"{r.what}: payload shorter than its {cls.LAYOUT.size} bytes")
        values = cls.LAYOUT.unpack_from(r.b, r.i)
        r.i += cls.LAYOUT.size
        return cls(*values)


@dataclasses.dataclass(frozen=True)
class MountResponse(Message):
    TYPE = 0xB0
    seq: int
    partition: int
    status: MountStatus
    high_water_mark: int
    generation: int

    def payload(self) -> bytes:
        return struct.pack(">qiBqi", self.seq, self.partition, int(self.status), self.high_water_mark, self.generation)

    @classmethod
    def parse(cls, r: _Reader) -> MountResponse:
        seq, partition, status = r.i64("seq"), r.i32("partition"), r.u8("status")
        if status not in MountStatus._value2member_map_:
            raise ProtocolError(f"mount response: unknown status {status}")
        return cls(seq, partition, MountStatus(status), r.i64("high-water mark"), r.i32("generation"))


@dataclasses.dataclass(frozen=True)
class Append(Message):
    TYPE = 0x31
    req_id: ReqIdTuple
    client_high_water_mark: int
    header: int
    data: bytes
    write_locks: tuple[int, ...] = ()
    read_locks: tuple[int, ...] = ()
    append_locks: tuple[int, ...] = ()

    def payload(self) -> bytes:
        if not (self.write_locks or self.read_locks or self.append_locks):  # a client's hot path
            head = _LOCKLESS_APPEND.pack(
                *self.req_id, self.client_high_water_mark, 0, 0, 0, self.header, len(self.data)
            )
            return b"".join((head, self.data, _U32.pack(zlib.crc32(self.data))))
        return b"".join(
            (
                _REQ.pack(*self.req_id),
                _I64.pack(self.client_high_water_mark),
                _locks(self.write_locks),
                _locks(self.read_locks),
                _locks(self.append_locks),
                _I32.pack(self.header),
                _raw(self.data),
                _U32.pack(zlib.crc32(self.data)),
            )
        )

    @classmethod
    def parse(cls, r: _Reader) -> Append:
        if r.i == 0 and len(r.b) >= _LOCKLESS_APPEND.size + 4:
            # The server's hot path: most appends take no lock. One unpack instead of ten reads
            # (7.6 -> 3.5 µs a message, framing included); anything else, a malformed frame
            # included, takes the general path below, which names what is wrong.
            c, g, p, s, hwm, nw, nr, na, header, n = _LOCKLESS_APPEND.unpack_from(r.b)
            end = _LOCKLESS_APPEND.size + n
            if nw == nr == na == 0 and n >= 0 and end + 4 == len(r.b):
                data = bytes(r.b[_LOCKLESS_APPEND.size : end])
                if zlib.crc32(data) == _U32.unpack_from(r.b, end)[0]:
                    r.i = len(r.b)
                    return cls((c, g, p, s), hwm, header, data)
        req, hwm = r.req_id(), r.i64("client high-water mark")
        w, rd, a = r.locks("write lock count"), r.locks("read lock count"), r.locks("append lock count")
        header, data = r.i32("header"), r.raw("data")
        crc = r._take(_U32, "data checksum")
        if zlib.crc32(data) != crc:
            raise ProtocolError(f"append {req}: data checksum mismatch")
        return cls(req, hwm, header, data, w, rd, a)


@dataclasses.dataclass(frozen=True)
class LockFailure(Message):
    TYPE = 0xB1
    req_id: ReqIdTuple
    transaction_id: int
    """The transaction that made the lock fail."""

    def payload(self) -> bytes:
        return _REQ.pack(*self.req_id) + _I64.pack(self.transaction_id)

    @classmethod
    def parse(cls, r: _Reader) -> LockFailure:
        return cls(r.req_id(), r.i64("transaction id"))


@dataclasses.dataclass(frozen=True)
class FeedRequest(_Fixed):
    TYPE = 0x32
    LAYOUT = struct.Struct(">qiqi")
    seq: int
    partition: int
    after: int
    max_count: int


class _Entry(Protocol):
    @property
    def transaction_id(self) -> int: ...
    @property
    def header(self) -> int: ...
    @property
    def req_id(self) -> Any: ...


def feed_payload(seq: int, partition: int, entries: Sequence[_Entry]) -> bytes:
    """A Feed Data payload straight from entries whose `req_id` is a 4-tuple or a native ReqId
    (the server's feed), without building message objects per entry."""
    parts = [_FEED_HEAD.pack(seq, partition, len(entries))]
    for e in entries:
        r = e.req_id
        c, g, p, s = r if isinstance(r, tuple) else r.as_tuple()
        parts.append(_ENTRY.pack(e.transaction_id, c, g, p, s, e.header))
    return b"".join(parts)


@dataclasses.dataclass(frozen=True)
class FeedEntry:
    transaction_id: int
    req_id: ReqIdTuple
    header: int


@dataclasses.dataclass(frozen=True)
class FeedData(Message):
    """Committed transactions of one partition, in id order (pushed after a Mount, or the answer
    to a FeedRequest with its seq; -1 when pushed)."""

    TYPE = 0xB2
    seq: int
    partition: int
    entries: tuple[FeedEntry, ...]

    def payload(self) -> bytes:
        return feed_payload(self.seq, self.partition, self.entries)

    @classmethod
    def parse(cls, r: _Reader) -> FeedData:
        seq, partition = r.i64("seq"), r.i32("partition")
        n = r.count("entry count", _ENTRY.size)
        entries = []
        for _ in range(n):
            t, c, g, p, s, h = _ENTRY.unpack_from(r.b, r.i)
            r.i += _ENTRY.size
            entries.append(FeedEntry(t, (c, g, p, s), h))
        return cls(seq, partition, tuple(entries))


@dataclasses.dataclass(frozen=True)
class Flush(_Fixed):
    TYPE = 0x33
    LAYOUT = struct.Struct(">qi")
    seq: int
    partition: int


@dataclasses.dataclass(frozen=True)
class FlushResponse(_Fixed):
    """Every append sent on this connection before the Flush has been resolved (committed,
    failed on a lock, or ignored); the partition's high-water mark then."""

    TYPE = 0xB3
    LAYOUT = struct.Struct(">qiq")
    seq: int
    partition: int
    high_water_mark: int


@dataclasses.dataclass(frozen=True)
class TransactionDataRequest(_Fixed):
    TYPE = 0x34
    LAYOUT = struct.Struct(">qiq")
    seq: int
    partition: int
    transaction_id: int


@dataclasses.dataclass(frozen=True)
class TransactionDataResponse(Message):
    TYPE = 0xB4
    seq: int
    partition: int
    transaction_id: int
    data: bytes

    def payload(self) -> bytes:
        return (
            struct.pack(">qiq", self.seq, self.partition, self.transaction_id)
            + _raw(self.data)
            + _U32.pack(zlib.crc32(self.data))
        )

    @classmethod
    def parse(cls, r: _Reader) -> TransactionDataResponse:
        seq, partition, txid, data = r.i64("seq"), r.i32("partition"), r.i64("transaction id"), r.raw("data")
        if zlib.crc32(data) != r._take(_U32, "data checksum"):
            raise ProtocolError(f"transaction {txid} data: checksum mismatch")
        return cls(seq, partition, txid, data)


MAX_DATA_RANGE_COUNT = 10_000
"""The most transactions a Transaction Data Range Request may ask for."""
MAX_DATA_RANGE_BYTES = 16 << 20
"""The largest `max_bytes` a Transaction Data Range Request may give (well under a client's
default `max_frame`, 64 MiB)."""


@dataclasses.dataclass(frozen=True)
class TransactionDataRangeRequest(_Fixed):
    """The data of up to `max_count` committed transactions from `first` on, in one answer of
    at most `max_bytes` of data (its first transaction is sent whatever its size)."""

    TYPE = 0x36
    LAYOUT = struct.Struct(">qiqii")
    seq: int
    partition: int
    first: int
    max_count: int
    max_bytes: int


@dataclasses.dataclass(frozen=True)
class TransactionDataRangeResponse(Message):
    """The data of transactions `first`, `first + 1`, ... (at least one)."""

    TYPE = 0xB6
    seq: int
    partition: int
    first: int
    data: tuple[bytes, ...]

    def payload(self) -> bytes:
        parts = [struct.pack(">qiqi", self.seq, self.partition, self.first, len(self.data))]
        for d in self.data:
            parts += (_raw(d), _U32.pack(zlib.crc32(d)))
        return b"".join(parts)

    @classmethod
    def parse(cls, r: _Reader) -> TransactionDataRangeResponse:
        seq, partition, first = r.i64("seq"), r.i32("partition"), r.i64("first transaction id")
        n = r.count("transaction count", 8)  # each at least a length and a checksum
        data = []
        for i in range(n):
            d = r.raw("data")
            if zlib.crc32(d) != r._take(_U32, "data checksum"):
                raise ProtocolError(f"transaction {first + i} data: checksum mismatch")
            data.append(d)
        return cls(seq, partition, first, tuple(data))


@dataclasses.dataclass(frozen=True)
class HighWaterMarkRequest(_Fixed):
    TYPE = 0x35
    LAYOUT = struct.Struct(">qi")
    seq: int
    partition: int


@dataclasses.dataclass(frozen=True)
class HighWaterMarkResponse(_Fixed):
    TYPE = 0xB5
    LAYOUT = struct.Struct(">qiq")
    seq: int
    partition: int
    high_water_mark: int


@dataclasses.dataclass(frozen=True)
class ClientIdRequest(_Fixed):
    """Asks the server for a new client id, which it takes from the cluster's counter with its
    own metadata credentials: clients never write the metadata (issue 34, ZooKeeper ACLs)."""

    TYPE = 0x37
    LAYOUT = struct.Struct(">q")
    seq: int


@dataclasses.dataclass(frozen=True)
class ClientIdResponse(_Fixed):
    """A client id no one in the cluster was given before."""

    TYPE = 0xB7
    LAYOUT = struct.Struct(">qi")
    seq: int
    client_id: int


@dataclasses.dataclass(frozen=True)
class Failure(Message):
    TYPE = 0x81
    seq: int
    partition: int
    kind: FailureKind
    message: str

    def payload(self) -> bytes:
        return struct.pack(">qiH", self.seq, self.partition, int(self.kind)) + _raw(self.message.encode())

    @classmethod
    def parse(cls, r: _Reader) -> Failure:
        seq, partition = r.i64("seq"), r.i32("partition")
        kind = r._take(struct.Struct(">H"), "kind")
        known = FailureKind(kind) if kind in FailureKind._value2member_map_ else FailureKind.INTERNAL
        return cls(seq, partition, known, r.text("message"))


MESSAGES: dict[int, type[Message]] = {
    m.TYPE: m
    for m in (
        Hello,
        HelloOk,
        Mount,
        MountResponse,
        Append,
        LockFailure,
        FeedRequest,
        FeedData,
        Flush,
        FlushResponse,
        TransactionDataRequest,
        TransactionDataResponse,
        TransactionDataRangeRequest,
        TransactionDataRangeResponse,
        HighWaterMarkRequest,
        HighWaterMarkResponse,
        ClientIdRequest,
        ClientIdResponse,
        Failure,
    )
}


def decode(msg_type: int, payload: bytes, max_locks: int | None = None) -> Message:
    """`max_locks`: an Append declaring more locks in all is refused (`LimitExceeded`) before
    they are decoded."""
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise ProtocolError(f"unknown client-protocol message type 0x{msg_type:02x}")
    r = _Reader(payload, cls.__name__, max_locks)
    msg = cls.parse(r)
    r.done()
    return msg


class MessageReader:
    """Bytes in, decoded messages out (`FrameReader` for the framing, then `decode`)."""

    def __init__(self, max_frame: int = 64 << 20, max_locks: int | None = None) -> None:
        self._frames = FrameReader(MAGIC, max_frame)
        self.max_locks = max_locks

    @property
    def max_frame(self) -> int:
        """The largest frame accepted: a frame declaring more is refused as soon as its length
        arrives, none of it buffered (`LimitExceeded`)."""
        return self._frames.max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._frames.max_frame = value

    def feed(self, data: bytes) -> None:
        self._frames.feed(data)

    def next_message(self) -> Message | None:
        try:
            frame = self._frames.next_frame()
        except ProtocolError as e:
            if "exceeds the maximum" in str(e):  # the framing's TooLarge, raised on the length alone
                raise LimitExceeded(str(e)) from None
            raise
        if frame is None:
            return None
        return decode(*frame, max_locks=self.max_locks)
