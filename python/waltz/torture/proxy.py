"""A fault-injecting TCP proxy: the network nemesis between Waltz processes on 127.0.0.1.

Every link the torture run breaks goes through one `FaultProxy` (servers to a storage node,
clients to a server); `LocalCluster.advertise` makes the others dial the proxy. A proxy forwards
bytes untouched in `pass` mode and otherwise:

    delay      holds every chunk `delay` seconds each way (a slow link; order kept)
    blackhole  moves no byte either way and connects nothing new until healed (a partition: the
               bytes wait, as TCP would retransmit them, and peers see silence until they time
               out; dropping bytes from the middle of a stream is not something TCP does)
    reset      aborts every connection at once (RST) and refuses new ones until healed

A fault may be narrowed (`set_mode(..., direction=, only=)`): `direction="up"` holds only the
bytes from the dialer to the target, `"down"` only the answers (one-way loss: a new connection
hangs as a lost SYN-ACK would make it), and `only(port)` picks the links it hits by the dialer's
source port (`torture/partial.py` turns a process id into its ports: one server cut from one
storage node while the other server still reaches it).

All proxies of a run share one event-loop thread (`ProxyLoop`), so a fault takes effect
everywhere at once and costs no process.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Literal

Mode = Literal["pass", "delay", "blackhole", "reset"]
MODES: tuple[Mode, ...] = ("pass", "delay", "blackhole", "reset")
Direction = Literal["both", "up", "down"]
_CHUNK = 64 << 10


class ProxyLoop:
    """The thread every proxy of a run lives on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="torture-proxies", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class FaultProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`target`; `set_mode` injects the fault."""

    def __init__(self, loop: ProxyLoop, name: str, target: int) -> None:
        self.name = name
        self.target = target
        self.mode: Mode = "pass"
        self.delay = 0.0
        self.direction: Direction = "both"
        self._only: Callable[[int], bool] | None = None
        self._loop = loop
        self._links: set[asyncio.StreamWriter] = set()
        self._hit: dict[asyncio.StreamWriter, bool] = {}
        """Per accepted connection (its dialer side): whether the current fault applies to it."""
        self._ends: dict[asyncio.StreamWriter, list[asyncio.StreamWriter]] = {}
        """Both ends of each accepted connection, by its dialer side."""
        self._server: asyncio.base_events.Server = loop.call(self._listen())
        self.port: int = self._server.sockets[0].getsockname()[1]

    async def _listen(self) -> asyncio.base_events.Server:
        return await asyncio.start_server(self._accept, "127.0.0.1", 0, reuse_address=True)

    def set_mode(
        self,
        mode: Mode,
        delay: float = 0.0,
        *,
        direction: Direction = "both",
        only: Callable[[int], bool] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode must be one of {MODES}, not {mode!r}")

        async def apply() -> None:
            self.mode, self.delay, self.direction, self._only = mode, delay, direction, only
            for w in self._hit:
                self._hit[w] = self._hits(w)
            if mode == "reset":
                self._abort_all()

        self._loop.call(apply())

    def _hits(self, dialer: asyncio.StreamWriter) -> bool:
        if self._only is None:
            return True
        peer = dialer.get_extra_info("peername")
        return peer is not None and self._only(peer[1])

    def _abort_all(self) -> None:
        if self._only is None:
            doomed = list(self._links)
        else:
            doomed = [w for d, ends in self._ends.items() if self._hit.get(d, True) for w in ends]
        for w in doomed:
            w.transport.abort()
            self._links.discard(w)

    async def _healed(self, dialer: asyncio.StreamWriter, way: Direction = "both") -> None:
        """Until the link of `dialer` moves bytes `way` ("both": a new connection, which a loss
        either way holds up)."""
        while (
            self.mode == "blackhole"
            and self._hit.get(dialer, True)
            and (way == "both" or self.direction in ("both", way))
        ):
            await asyncio.sleep(0.05)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links.add(writer)
        self._hit[writer] = self._hits(writer)
        self._ends[writer] = [writer]
        try:
            await self._serve(reader, writer)
        finally:
            self._hit.pop(writer, None)
            self._ends.pop(writer, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._healed(writer)
        if (self.mode == "reset" and self._hit.get(writer, True)) or writer.transport.is_closing():
            writer.transport.abort()
            self._links.discard(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()  # the process behind is down: the dialer sees a reset
            self._links.discard(writer)
            return
        self._ends[writer].append(up_writer)
        for w in (writer, up_writer):
            with contextlib.suppress(OSError):
                w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._links.update((writer, up_writer))
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, writer, "up"), self._pump(up_reader, writer, writer, "down")
            )
        finally:
            for w in (writer, up_writer):
                self._links.discard(w)
                w.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dialer: asyncio.StreamWriter, way: Direction
    ) -> None:
        try:
            while True:
                await self._healed(dialer, way)
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await self._healed(dialer, way)  # bytes read just before the split wait for the heal too
                if self.mode == "delay" and self.delay > 0 and self._hit.get(dialer, True):
                    await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()  # one side ended: the link is over for both

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            self._only = None  # every link, not only those a partial fault hits
            self._abort_all()

        with contextlib.suppress(Exception):
            self._loop.call(shut())
