"""Atheris target: the client protocol (client <-> server) as both ends read it, plus the
storage and admin responses as the server and the admin tools read them through the bindings.

Every path takes bytes a peer controls and must either return messages or raise
`ProtocolError` (which closes that connection); any other exception, a native panic
(`PanicException`) or a broken round trip is a finding. Input: a mode byte, an argument byte,
then the mode's bytes:

- 0: `decode(type=arg, payload)` directly (what `MessageReader` does after the framing); a
  decoded message must re-encode to the same payload (except a Failure of an unknown kind,
  which decodes as INTERNAL) and decode again to an equal message.
- 1: a list of (type u8, length u16, payload) turned into valid frames (`encode_frame`), the
  stream fed to a `MessageReader` in chunks of arg + 1 bytes: it must yield exactly what
  `decode` yields for each frame, up to the first ProtocolError.
- 2: raw bytes fed to a `MessageReader` in chunks (frame maximum 64 bytes when arg is odd).
- 3, 4: like 1, but storage-protocol (3) or admin-protocol (4) frames fed to the native
  `ResponseReader` the server's StorageClient and StorageAdminClient use.

Run: python fuzz/client_protocol.py [libFuzzer flags] [corpus dir] (scripts/fuzz.sh does).
"""

from __future__ import annotations

import struct
import sys

import atheris

with atheris.instrument_imports(include=["waltz.client_protocol"]):
    from waltz import client_protocol as cp

from waltz._native import ProtocolError, ResponseReader, encode_frame

MAGIC_STORAGE, MAGIC_ADMIN = 0x5753, 0x5741


def check_decode(msg_type: int, payload: bytes) -> cp.Message | None:
    try:
        m = cp.decode(msg_type, payload)
    except ProtocolError:
        return None
    assert m.TYPE == msg_type, (m, msg_type)
    again = m.payload()
    if not (
        isinstance(m, cp.Failure) and int.from_bytes(payload[12:14], "big") not in cp.FailureKind._value2member_map_
    ):
        assert again == payload, (m, payload, again)
    assert cp.decode(msg_type, again) == m, m
    return m


def frames_of(spec: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i + 3 <= len(spec):
        t, n = spec[i], struct.unpack_from(">H", spec, i + 1)[0]
        out.append((t, spec[i + 3 : i + 3 + n]))
        i += 3 + n
    return out


def chunks(stream: bytes, size: int) -> list[bytes]:
    return [stream[i : i + size] for i in range(0, len(stream), size)] or [b""]


def feed_client(stream: bytes, chunk: int, max_frame: int) -> list[cp.Message]:
    reader, got = cp.MessageReader(max_frame), []
    try:
        for c in chunks(stream, chunk):
            reader.feed(c)
            while (m := reader.next_message()) is not None:
                got.append(m)
    except ProtocolError:
        pass
    return got


def feed_storage(stream: bytes, chunk: int, admin: bool) -> None:
    reader = ResponseReader(admin=admin)
    try:
        for c in chunks(stream, chunk):
            reader.feed(c)
            while reader.next_response() is not None:
                pass
    except ProtocolError:
        pass


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    mode, arg, rest = data[0] % 5, data[1], data[2:]
    if mode == 0:
        check_decode(arg, rest)
    elif mode == 1:
        frames = frames_of(rest)
        stream = b"".join(encode_frame(cp.MAGIC, t, p) for t, p in frames)
        got = feed_client(stream, arg + 1, 64 << 20)
        expected = []
        for t, p in frames:
            m = check_decode(t, p)
            if m is None:
                break
            expected.append(m)
        assert got == expected, (got, expected)
    elif mode == 2:
        feed_client(rest, arg + 1, 64 if arg & 1 else 64 << 20)
    else:
        magic = MAGIC_STORAGE if mode == 3 else MAGIC_ADMIN
        stream = b"".join(encode_frame(magic, t, p) for t, p in frames_of(rest))
        feed_storage(stream, arg + 1, admin=mode == 4)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
