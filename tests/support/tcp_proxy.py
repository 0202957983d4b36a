"""A TCP proxy for client tests, on its own thread: forwards 127.0.0.1:port to a server, can cut
every connection at once (`cut`), can drop chosen client-protocol messages on their way to
the server (`drop`): frames are decoded and re-encoded, so a drop is exact, and can slow what
the server sends to a steady rate (`throttle`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from waltz import client_protocol as cp

from support.processes import free_port


class Proxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.cuts = 0
        self.dropped: list[cp.Message] = []
        self._drop: Callable[[cp.Message], bool] | None = None
        self._rate: float | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    def drop(self, predicate: Callable[[cp.Message], bool] | None) -> None:
        """Messages from clients for which `predicate` is true are not forwarded."""
        self._drop = predicate

    def throttle(self, bytes_per_second: float | None) -> None:
        """What the server sends goes on at most this rate, in small steps (None: at once)."""
        self._rate = bytes_per_second

    def cut(self) -> None:
        """Closes every connection through the proxy (new ones are accepted)."""

        def go() -> None:
            self.cuts += 1
            for w in list(self._writers):
                w.transport.abort()

        self._loop.call_soon_threadsafe(go)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(
                self._upstream(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        messages = cp.MessageReader()
        try:
            while data := await reader.read(1 << 16):
                messages.feed(data)
                while (m := messages.next_message()) is not None:
                    if self._drop is not None and self._drop(m):
                        self.dropped.append(m)
                        continue
                    writer.write(m.frame())
                await writer.drain()
        finally:
            writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                rest = memoryview(data)
                while rest:
                    rate = self._rate
                    chunk, rest = (rest[:1024], rest[1024:]) if rate else (rest, rest[len(rest) :])
                    writer.write(chunk)
                    await writer.drain()
                    if rate:
                        await asyncio.sleep(len(chunk) / rate)
        finally:
            writer.transport.abort()

    def close(self) -> None:
        def go() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            self._loop.stop()

        self._loop.call_soon_threadsafe(go)
        self._thread.join(10)
