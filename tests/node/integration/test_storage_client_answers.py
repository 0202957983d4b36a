"""The storage client against a node that answers wrongly (a bug, or a peer that is not a Waltz
node): an answer of the wrong kind, for another partition, or a list that does not run from the
id asked for must fail the request and end the connection, never pass for the right answer. An
append taken as acknowledged on such an answer would count a replica for a batch it may not hold."""

from __future__ import annotations

import asyncio
import struct
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from test_storage_node import frame
from waltz import errors
from waltz.storage import RecordBatch, ReqId, StorageClient

KEY = uuid.UUID(int=5)
SUCCESS, HELLO_OK, MAX_TXID, RECORD_HEADER, RECORD, RECORD_LIST = 0x80, 0x82, 0x92, 0x96, 0x97, 0x99


def answer(msg_type: int, session: int, seq: int, partition: int, extra: bytes = b"") -> bytes:
    return frame(struct.pack(">qqi", session, seq, partition) + extra, msg_type=msg_type)


def wire_record(txid: int, data: bytes) -> bytes:
    return struct.pack(">qiiiiii", txid, 1, 1, 0, 0, 0, len(data)) + data + struct.pack(">I", zlib.crc32(data))


Answerer = Callable[[int, int, int], bytes]
"""(session, seq, partition) of a request after Open → the bytes the fake node sends back."""


async def against(
    answerer: Answerer, call: Callable[[StorageClient], Awaitable[Any]], *, closes: bool = False
) -> tuple[Any, bool]:
    """Runs `call` on a client of a fake node that greets and opens properly, then answers every
    request with `answerer`; returns what the call returned (or raised) and whether the client
    closed the connection afterwards (waited for when `closes`)."""
    closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buf = b""
        while data := await reader.read(65536):
            buf += data
            while len(buf) >= 4 and len(buf) >= 4 + (n := struct.unpack(">I", buf[:4])[0]):
                body, buf = buf[4 : 4 + n], buf[4 + n :]
                msg_type, payload = body[3], body[4:-4]
                if msg_type == 0x01:  # Hello
                    writer.write(frame(b"\x01", msg_type=HELLO_OK))
                    continue
                session, seq, partition = struct.unpack(">qqi", payload[:20])
                writer.write(
                    answer(SUCCESS, session, seq, partition) if msg_type == 0x10 else answerer(session, seq, partition)
                )
            await writer.drain()
        closed.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = await StorageClient.connect("127.0.0.1", port, cluster_key=KEY, partition_count=4, timeout=5)
        try:
            try:
                result: Any = await call(client)
            except errors.WaltzError as e:
                result = e
            if closes:
                try:
                    await asyncio.wait_for(closed.wait(), 5)
                except TimeoutError:
                    pass
            return result, closed.is_set()
        finally:
            await client.close()
    finally:
        server.close()


BATCH = RecordBatch([(ReqId(1, 1, 0, 0), 0, b"x")])


def append(c: StorageClient) -> Any:
    return c.send_append(0, 7, 0, BATCH)


@pytest.mark.parametrize(
    ("answerer", "call", "message"),
    [
        (
            lambda s, q, p: answer(MAX_TXID, s, q, p, struct.pack(">q", 5)),
            append,
            "answered an append to partition 0 with max_transaction_id",
        ),
        (
            lambda s, q, p: answer(SUCCESS, s, q, 3),
            append,
            "answered an append to partition 0 with success for partition 3",
        ),
        (
            lambda s, q, p: answer(RECORD_LIST, s, q, p, struct.pack(">i", 0)),
            lambda c: c.append(0, 7, 0, BATCH),
            "with record_list for partition 0, not success",
        ),
        (
            lambda s, q, p: answer(SUCCESS, s, q, p),
            lambda c: c.max_transaction_id(0, 7),
            "with success for partition 0, not max_transaction_id",
        ),
        (
            lambda s, q, p: answer(SUCCESS, s, q, 2),
            lambda c: c.truncate(0, 7, 5),
            "with success for partition 2, not success for partition 0",
        ),
        (
            lambda s, q, p: answer(MAX_TXID, s, q, p, struct.pack(">q", 5)),
            lambda c: c.last_session_info(0, 7),
            "not last_session_info",
        ),
        (
            lambda s, q, p: answer(RECORD_HEADER, s, q, p, b"\x00"),
            lambda c: c.record(0, 7, 3),
            "with record_header for partition 0, not record",
        ),
        (
            lambda s, q, p: answer(RECORD_LIST, s, q, p, struct.pack(">i", 1) + wire_record(555, b"z")),
            lambda c: c.records(0, 7, 100, 10),
            "answered a list from 100 with ids ..., 555",
        ),
        (
            lambda s, q, p: answer(
                RECORD_LIST, s, q, p, struct.pack(">i", 2) + wire_record(100, b"a") + wire_record(102, b"b")
            ),
            lambda c: c.records(0, 7, 100, 10),
            "answered a list from 100 with ids ..., 100, 102",
        ),
        (
            lambda s, q, p: answer(RECORD, s, q, p, b"\x01" + wire_record(9, b"z")),
            lambda c: c.record(0, 7, 3),
            "answered a read of 3 with transaction 9",
        ),
    ],
    ids=[
        "append-max-txid",
        "append-other-partition",
        "append-list",
        "max-txid-success",
        "truncate-other-partition",
        "session-info-max-txid",
        "record-header",
        "list-wrong-start",
        "list-gap",
        "record-wrong-id",
    ],
)
def test_a_wrong_answer_fails_the_request_clearly(
    answerer: Answerer, call: Callable[[StorageClient], Any], message: str
) -> None:
    out_of_step = "list" not in message and "read of" not in message
    result, closed = asyncio.run(against(answerer, call, closes=out_of_step))
    assert isinstance(result, errors.ProtocolError), result
    assert message in str(result)
    if out_of_step:
        assert closed, "an answer out of step with its request must end the connection"


def test_right_answers_still_pass() -> None:
    result, closed = asyncio.run(against(lambda s, q, p: answer(SUCCESS, s, q, p), append))
    assert result is None and not closed
    listed = struct.pack(">i", 2) + wire_record(100, b"a") + wire_record(101, b"b")
    result, _ = asyncio.run(
        against(lambda s, q, p: answer(RECORD_LIST, s, q, p, listed), lambda c: c.records(0, 7, 100, 10))
    )
    assert [r.txid for r in result] == [100, 101]
