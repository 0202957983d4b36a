"""The client protocol's codec: every message round-trips through real frames, in any split of
the byte stream; malformed payloads and frames are refused with ProtocolError."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from waltz import client_protocol as cp
from waltz.errors import ProtocolError

i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
req = st.tuples(i32, i32, i32, i32)
locks = st.lists(i64, max_size=5).map(tuple)

messages = st.one_of(
    st.builds(cp.Hello, st.integers(0, 255), st.integers(0, 255)),
    st.builds(cp.HelloOk, st.integers(0, 255)),
    st.builds(cp.Mount, i64, i32, i32, i64, i64, st.binary(min_size=cp.TOKEN_BYTES, max_size=cp.TOKEN_BYTES)),
    st.builds(cp.MountResponse, i64, i32, st.sampled_from(cp.MountStatus), i64, i32),
    st.builds(cp.Append, req, i64, i32, st.binary(max_size=300), locks, locks, locks),
    st.builds(cp.LockFailure, req, i64),
    st.builds(cp.FeedRequest, i64, i32, i64, i32),
    st.builds(cp.FeedData, i64, i32, st.lists(st.builds(cp.FeedEntry, i64, req, i32), max_size=20).map(tuple)),
    st.builds(cp.Flush, i64, i32),
    st.builds(cp.FlushResponse, i64, i32, i64),
    st.builds(cp.TransactionDataRequest, i64, i32, i64),
    st.builds(cp.TransactionDataResponse, i64, i32, i64, st.binary(max_size=300)),
    st.builds(cp.TransactionDataRangeRequest, i64, i32, i64, i32, i32),
    st.builds(cp.TransactionDataRangeResponse, i64, i32, i64, st.lists(st.binary(max_size=100), max_size=5).map(tuple)),
    st.builds(cp.HighWaterMarkRequest, i64, i32),
    st.builds(cp.HighWaterMarkResponse, i64, i32, i64),
    st.builds(cp.ClientIdRequest, i64),
    st.builds(cp.ClientIdResponse, i64, i32),
    st.builds(cp.Failure, i64, i32, st.sampled_from(cp.FailureKind), st.text(max_size=50)),
)


@settings(max_examples=400, deadline=None)
@given(msgs=st.lists(messages, min_size=1, max_size=6), cut=st.integers(1, 64))
def test_round_trip_in_any_split(msgs, cut) -> None:
    stream = b"".join(m.frame() for m in msgs)
    reader = cp.MessageReader()
    out = []
    for i in range(0, len(stream), cut):
        reader.feed(stream[i : i + cut])
        while (m := reader.next_message()) is not None:
            out.append(m)
    assert out == msgs


def test_every_message_type_is_distinct() -> None:
    assert len(cp.MESSAGES) == 19 and all(t == m.TYPE for t, m in cp.MESSAGES.items())


def test_client_id_messages_are_laid_out_as_documented() -> None:
    assert cp.ClientIdRequest.TYPE == 0x37
    assert cp.ClientIdRequest(7).payload() == struct.pack(">q", 7)
    assert cp.ClientIdResponse(7, 42).payload() == struct.pack(">qi", 7, 42)
    assert cp.ClientIdResponse.TYPE == 0xB7
    assert cp.decode(0xB7, struct.pack(">qi", 7, 42)) == cp.ClientIdResponse(7, 42)
    with pytest.raises(ProtocolError, match="payload shorter"):
        cp.decode(0x37, b"\x00" * 7)


def payload_of(m: cp.Message) -> bytes:
    return m.payload()


@pytest.mark.parametrize("locks", [((1,), (), (2, 3)), ((), (), ())], ids=["with-locks", "lockless"])
def test_malformed_payloads_are_refused(locks) -> None:
    # Lockless appends take a fast path of their own: it must refuse the same things.
    good = cp.Append((1, 2, 3, 4), 9, 7, b"data", *locks)
    p = payload_of(good)
    assert cp.decode(cp.Append.TYPE, p) == good
    # docs/protocol.md's layout, field by field, whichever path encoded it
    counted = b"".join(struct.pack(">i", len(v)) + struct.pack(f">{len(v)}q", *v) for v in locks)
    assert p == struct.pack(">iiiiq", 1, 2, 3, 4, 9) + counted + struct.pack(">ii", 7, 4) + b"data" + struct.pack(
        ">I", zlib.crc32(b"data")
    )
    with pytest.raises(ProtocolError, match="ends inside"):
        cp.decode(cp.Append.TYPE, p[:-1])
    with pytest.raises(ProtocolError, match="trailing"):
        cp.decode(cp.Append.TYPE, p + b"\x00")
    bad_crc = p[:-4] + struct.pack(">I", zlib.crc32(b"data") ^ 1)
    with pytest.raises(ProtocolError, match="checksum"):
        cp.decode(cp.Append.TYPE, bad_crc)
    negative = struct.pack(">iiiiqiiiii", 1, 2, 3, 4, 9, 0, 0, 0, 7, -4) + b"data" + p[-4:]
    with pytest.raises(ProtocolError, match="does not fit"):
        cp.decode(cp.Append.TYPE, negative)
    huge = struct.pack(">iiii", 1, 2, 3, 4) + struct.pack(">q", 0) + struct.pack(">i", 1 << 30)
    with pytest.raises(ProtocolError, match="does not fit"):
        cp.decode(cp.Append.TYPE, huge)
    with pytest.raises(ProtocolError, match="unknown client-protocol message type"):
        cp.decode(0x7F, b"")
    with pytest.raises(ProtocolError, match="unknown status"):
        cp.decode(cp.MountResponse.TYPE, struct.pack(">qiBqi", 1, 0, 9, 0, 0))
    with pytest.raises(ProtocolError, match="not UTF-8"):
        cp.decode(cp.Failure.TYPE, struct.pack(">qiH", 0, 0, 1) + struct.pack(">i", 2) + b"\xff\xfe")


def test_a_data_range_response_is_laid_out_as_documented_and_checked() -> None:
    good = cp.TransactionDataRangeResponse(5, 1, 40, (b"ab", b""))
    p = good.payload()
    assert p == struct.pack(">qiqi", 5, 1, 40, 2) + b"".join(
        struct.pack(">i", len(d)) + d + struct.pack(">I", zlib.crc32(d)) for d in (b"ab", b"")
    )
    assert cp.decode(cp.TransactionDataRangeResponse.TYPE, p) == good
    with pytest.raises(ProtocolError, match="transaction 40 data: checksum mismatch"):
        cp.decode(cp.TransactionDataRangeResponse.TYPE, p[:28] + b"aX" + p[30:])
    with pytest.raises(ProtocolError, match="transaction count 1000 does not fit"):
        cp.decode(cp.TransactionDataRangeResponse.TYPE, struct.pack(">qiqi", 5, 1, 40, 1000) + p[24:])
    with pytest.raises(ProtocolError, match="payload shorter"):
        cp.decode(cp.TransactionDataRangeRequest.TYPE, struct.pack(">qiqi", 1, 0, 0, 1))


def test_bad_frames_are_refused() -> None:
    frame = bytearray(cp.Flush(1, 2).frame())
    frame[-1] ^= 1
    r = cp.MessageReader()
    r.feed(bytes(frame))
    with pytest.raises(ProtocolError, match="CRC|checksum"):
        r.next_message()
    r = cp.MessageReader(max_frame=64)
    r.feed(struct.pack(">I", 1 << 20))
    with pytest.raises(ProtocolError, match="large|maximum|exceeds"):
        r.next_message()
    r = cp.MessageReader()
    r.feed(cp.encode_frame(0x5753, cp.Flush.TYPE, cp.Flush(1, 2).payload()))  # a storage-protocol magic
    with pytest.raises(ProtocolError, match="magic"):
        r.next_message()


def test_lock_counts_are_checked_on_the_declared_count_before_decoding() -> None:
    """Issue 34: an Append with 8 M locks was decoded whole (0.85 s of the server's event loop)
    before the partition refused it. With `max_locks`, the declared counts (write, read and
    append together) are refused as they are read; the frame is consumed, so the reader goes on."""
    ok = cp.Append((1, 1, 0, 5), -1, 0, b"x", write_locks=(1, 2), read_locks=(3,), append_locks=(4,))
    too_many = cp.Append((1, 1, 0, 6), -1, 0, b"y", write_locks=(1, 2), read_locks=(3,), append_locks=(4, 5))
    reader = cp.MessageReader(max_locks=4)
    reader.feed(ok.frame() + too_many.frame() + ok.frame())
    assert reader.next_message() == ok
    with pytest.raises(cp.TooManyLocks) as refused:
        reader.next_message()
    assert refused.value.req_id == (1, 1, 0, 6) and "max_transaction_locks" in str(refused.value)
    assert reader.next_message() == ok
    # A count beyond the cap is refused on the count itself: these lock bytes are never unpacked.
    head = struct.pack(">iiiiqi", 1, 1, 0, 7, -1, 8_000_000)
    with pytest.raises(cp.TooManyLocks):
        cp.decode(
            cp.Append.TYPE,
            head + bytes(8 * 8_000_000) + struct.pack(">iiii", 0, 0, 0, 0) + struct.pack(">I", 0),
            max_locks=4096,
        )


def test_a_frame_is_refused_on_its_declared_length_before_it_is_buffered() -> None:
    reader = cp.MessageReader(max_frame=64 << 10)
    reader.feed(struct.pack(">IHBB", 2 << 30, cp.MAGIC, cp.VERSION, cp.Append.TYPE))
    with pytest.raises(cp.LimitExceeded):
        reader.next_message()
    reader = cp.MessageReader(max_frame=64 << 10)
    reader.feed(struct.pack(">I", 1 << 20))  # the length alone
    with pytest.raises(cp.LimitExceeded):
        reader.next_message()
    big = cp.Append((1, 1, 0, 1), -1, 0, bytes(100 << 10))
    reader = cp.MessageReader(max_frame=64 << 10)
    reader.max_frame = 64 << 20  # raised, as the server does once a client has mounted
    reader.feed(big.frame())
    assert reader.next_message() == big
