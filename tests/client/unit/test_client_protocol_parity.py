"""The native client-protocol decoder (`cp.MessageReader`, rust/src/client_protocol/) against the
Python reference (`cp.PyMessageReader`, `cp.decode`): for every message type, valid frames give
equal messages (same classes, same field types), and thousands of truncated and mutated frames
give the same message or the same error (class and text), with and without the lock and frame
limits a server sets. A message type the Python side has and the native decoder does not fails
here first: add it to rust/src/client_protocol/ (and its fields to rust/src/python/client_protocol.rs)."""

from __future__ import annotations

import random
import struct

import pytest
from waltz import client_protocol as cp
from waltz._native import encode_frame
from waltz.errors import ProtocolError

R = (7, 3, 1, 42)


def samples() -> dict[type[cp.Message], list[cp.Message]]:
    """A few messages of every type: empty and full variable parts, every enum member."""
    entries = tuple(cp.FeedEntry(t, (t, 2, 3, -t), t - 5) for t in range(4))
    return {
        cp.Hello: [cp.Hello(), cp.Hello(1, 3), cp.Hello(role="client", secret=b"0123456789abcdef")],
        cp.HelloOk: [cp.HelloOk(2), cp.HelloOk(255)],
        cp.Mount: [cp.Mount(1, 2, 3, -1, 1 << 50, bytes(range(16))), cp.Mount(-1, 0, 0, 0, 0)],
        cp.MountResponse: [cp.MountResponse(9, 1, s, 100, 7) for s in cp.MountStatus],
        cp.Append: [
            cp.Append(R, -1, 0, b""),
            cp.Append(R, 40, -3, b"some data" * 5),
            cp.Append(R, 40, 1, b"x", (1, -2), (3,), (2**63 - 1, -(2**63))),
            cp.Append(R, 40, 1, b"y" * 70, append_locks=(5, 6, 7)),
        ],
        cp.LockFailure: [cp.LockFailure(R, 77)],
        cp.FeedRequest: [cp.FeedRequest(1, 2, -1, 1000)],
        cp.FeedData: [cp.FeedData(-1, 0, ()), cp.FeedData(5, 3, entries)],
        cp.Flush: [cp.Flush(1, 2)],
        cp.FlushResponse: [cp.FlushResponse(1, 2, 3)],
        cp.TransactionDataRequest: [cp.TransactionDataRequest(1, 2, 3)],
        cp.TransactionDataResponse: [
            cp.TransactionDataResponse(1, 2, 3, b""),
            cp.TransactionDataResponse(1, 2, 3, b"d" * 40),
        ],
        cp.TransactionDataRangeRequest: [cp.TransactionDataRangeRequest(1, 2, 3, 4, 5)],
        cp.TransactionDataRangeResponse: [
            cp.TransactionDataRangeResponse(1, 2, 2**63 - 2, (b"a", b"", b"ccc")),
            cp.TransactionDataRangeResponse(1, 2, 0, ()),
        ],
        cp.HighWaterMarkRequest: [cp.HighWaterMarkRequest(1, 2)],
        cp.HighWaterMarkResponse: [cp.HighWaterMarkResponse(1, 2, 3)],
        cp.ClientIdRequest: [cp.ClientIdRequest(7)],
        cp.ClientIdResponse: [cp.ClientIdResponse(7, 42)],
        cp.Failure: [cp.Failure(-1, -1, k, f"why {k.name} é") for k in cp.FailureKind],
    }


def outcome(reader: cp.MessageReader | cp.PyMessageReader, stream: bytes, chunk: int) -> list[object]:
    """What a connection sees: each message (as its repr, so an int where an enum belongs or a
    list where a tuple belongs shows), each TooManyLocks, up to the first other error."""
    seen: list[object] = []
    for i in range(0, len(stream), chunk):
        reader.feed(stream[i : i + chunk])
        while True:
            try:
                m = reader.next_message()
            except cp.TooManyLocks as e:
                seen.append(("TooManyLocks", str(e), e.req_id))
                continue
            except ProtocolError as e:
                seen.append((type(e).__name__, str(e)))
                return seen
            if m is None:
                break
            seen.append((type(m).__name__, repr(m)))
    seen.append(("buffered", len(stream)))
    return seen


LIMITS = [{}, {"max_locks": 2}, {"max_locks": 0, "max_frame": 64}]


def assert_same(stream: bytes, chunk: int = 1 << 20) -> None:
    for limits in LIMITS:
        native = outcome(cp.MessageReader(**limits), stream, chunk)
        python = outcome(cp.PyMessageReader(**limits), stream, chunk)
        assert native == python, (limits, stream.hex())


def test_the_native_decoder_knows_every_message_type() -> None:
    missing = set(cp.MESSAGES) - set(cp._VOCABULARY.native_types)
    assert not missing, (
        f"decoded in Python only: {sorted(cp.MESSAGES[t].__name__ for t in missing)}: add them to "
        "rust/src/client_protocol/ and their fields to rust/src/python/client_protocol.rs"
    )
    untested = set(cp.MESSAGES.values()) - set(samples())
    assert not untested, f"add samples of {sorted(c.__name__ for c in untested)} to this test"


@pytest.mark.parametrize("cls", list(cp.MESSAGES.values()), ids=lambda c: c.__name__)
def test_valid_frames_decode_to_equal_messages_in_any_split(cls: type[cp.Message]) -> None:
    msgs = samples().get(cls, [])
    assert msgs, f"no sample of {cls.__name__}"
    stream = b"".join(m.frame() for m in msgs)
    for chunk in (1, 3, 17, len(stream)):
        reader, got = cp.MessageReader(), []
        for i in range(0, len(stream), chunk):
            reader.feed(stream[i : i + chunk])
            while (m := reader.next_message()) is not None:
                got.append(m)
        assert got == msgs
        assert [repr(m) for m in got] == [repr(m) for m in msgs]
        assert all(type(a.__dict__[k]) is type(b.__dict__[k]) for a, b in zip(got, msgs) for k in vars(b))
    assert_same(stream, 5)


def mutations(m: cp.Message, rng: random.Random) -> list[bytes]:
    """Frames around m's payload cut, extended, overwritten (counts and lengths included), given
    to other types, and frames whose header or checksum is damaged."""
    p, t = m.payload(), m.TYPE
    out = [encode_frame(cp.MAGIC, t, p[:k]) for k in range(len(p))]
    out += [encode_frame(cp.MAGIC, t, p + bytes(rng.randrange(256) for _ in range(n))) for n in (1, 4, 9)]
    specials = [0, 1, 2, 3, -1, 8, 2**31 - 1, -(2**31), len(p), 1 << 20]
    for _ in range(40):
        b = bytearray(p)
        if not b:
            break
        i = rng.randrange(len(b))
        if rng.random() < 0.5 and len(b) >= 4:
            i = min(i, len(b) - 4)
            b[i : i + 4] = struct.pack(">i", rng.choice(specials))
        else:
            b[i] = rng.randrange(256)
        out.append(encode_frame(cp.MAGIC, t, bytes(b)))
    out += [encode_frame(cp.MAGIC, other, p) for other in cp.MESSAGES if other != t]
    out += [encode_frame(cp.MAGIC, rng.choice([0, 0x37, 0x7F, 0xFF]), p)]
    good = m.frame()
    for i in range(min(len(good), 12)):  # length, magic, version, type
        b = bytearray(good)
        b[i] ^= 1 << rng.randrange(8)
        out.append(bytes(b))
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 0x40
    out += [bytes(bad_crc), struct.pack(">I", 1 << 31) + good[4:], struct.pack(">I", 7) + good[4:]]
    return out


@pytest.mark.parametrize("cls", list(cp.MESSAGES.values()), ids=lambda c: c.__name__)
def test_mutated_and_truncated_frames_give_the_same_message_or_error(cls: type[cp.Message]) -> None:
    rng = random.Random(cls.TYPE)
    before, after = cp.Flush(1, 0).frame(), cp.HighWaterMarkRequest(2, 0).frame()
    count = 0
    for m in samples()[cls]:
        for frame in mutations(m, rng):
            assert_same(before + frame + after, rng.choice([1, 7, 1 << 20]))
            count += 1
    assert count >= 60


def test_random_streams_give_the_same_messages_or_error() -> None:
    """Valid frames of every type cut at random points and spliced, some bytes overwritten."""
    rng = random.Random(33)
    frames = [m.frame() for ms in samples().values() for m in ms]
    for _ in range(1500):
        stream = bytearray(b"".join(rng.choice(frames) for _ in range(rng.randrange(1, 5))))
        for _ in range(rng.randrange(3)):
            stream[rng.randrange(len(stream))] = rng.randrange(256)
        if rng.random() < 0.3:
            stream = stream[: rng.randrange(len(stream))]
        assert_same(bytes(stream), rng.choice([1, 5, 64, 1 << 20]))


def test_the_limits_are_the_ones_the_python_reader_applies() -> None:
    reader = cp.MessageReader(100, 3)
    assert (reader.max_frame, reader.max_locks) == (100, 3)
    reader.max_frame, reader.max_locks = 1 << 20, None
    big = cp.Append(R, 0, 0, b"z" * 500, tuple(range(10)))
    reader.feed(big.frame())
    assert reader.next_message() == big
    reader.max_frame = 64
    reader.feed(big.frame()[:4])
    with pytest.raises(cp.LimitExceeded) as refused:
        reader.next_message()
    assert type(refused.value) is cp.LimitExceeded and reader.buffered() == 4
