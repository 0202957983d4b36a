"""A storage node that closes a new connection at once (at its max_connections, or refusing our
certificate) is reported as such: the close reaches the storage client before its Hello is
written, and the reason comes from the handshake's answer, not a bare "connection is closed"
(with a "Future exception was never retrieved" logged for the reason nobody read)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop
from waltz import errors
from waltz.storage import StorageClient


@contextlib.contextmanager
def closing_at_once() -> Iterator[int]:
    """A port whose every connection is closed as soon as it is accepted, from a thread of its
    own (sooner than an event loop would), so that the close often beats the client's Hello."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


def test_a_node_that_closes_at_once_is_named_for_it_every_time() -> None:
    async def go(port: int) -> tuple[list[str], list[dict[str, Any]]]:
        logged: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: logged.append(ctx))
        messages = []
        for _ in range(100):
            with pytest.raises(errors.StorageConnectionError) as e:
                await StorageClient.connect("127.0.0.1", port, cluster_key=uuid.uuid4(), partition_count=1, timeout=5.0)
            messages.append(str(e.value))
        gc.collect()
        await asyncio.sleep(0)
        return messages, logged

    with closing_at_once() as port:
        messages, logged = uvloop.run(go(port))
    vague = [m for m in messages if "max_connections" not in m]
    assert vague == [], f"{len(vague)} of {len(messages)} without the reason, e.g. {vague[0]!r}"
    assert logged == []
