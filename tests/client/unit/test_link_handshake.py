"""A server that closes a new connection at once (at its max_connections, or refusing our
certificate) is reported as such by the client's link, also when the close reaches it as a
reset of the Hello it had sent."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
import uvloop
from waltz.client.network import Link


def test_a_server_that_closes_at_once_is_named_for_it_every_time() -> None:
    async def go() -> tuple[list[str], list[dict[str, Any]]]:
        logged: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: logged.append(ctx))

        async def close_at_once(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        messages = []
        for _ in range(50):
            link = Link(f"127.0.0.1:{port}", "stream", lambda *_: None, lambda *_: None)
            with pytest.raises(ConnectionError) as e:
                await link.open(5.0)
            messages.append(str(e.value))
        server.close()
        gc.collect()
        await asyncio.sleep(0)
        return messages, logged

    messages, logged = uvloop.run(go())
    vague = [m for m in messages if "without answering Hello" not in m]
    assert vague == [], f"{len(vague)} of {len(messages)} without the reason, e.g. {vague[0]!r}"
    assert logged == []
