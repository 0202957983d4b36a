"""One connection from the client to one server (`Link`): the handshake, frames out, and
messages in. Replies to a request come back to its awaiting caller by sequence number;
everything else (feed data, lock failures, failures of appends) goes to `on_push`.

A client keeps two links per server: the stream link (mounts, appends, feeds, flushes) and the
RPC link (transaction data, high-water marks), so a large data reply never holds up the feed.
A link is never reused after an error: it closes, tells its owner, and a new one is opened."""

from __future__ import annotations

import asyncio
import logging
import ssl as _ssl
from collections.abc import Callable

from waltz import client_protocol as cp
from waltz import errors, tls

log = logging.getLogger("waltz.client")

_FAILURE_KINDS = {k: k.name.lower() for k in cp.FailureKind}


CLOSE_WAIT = 1.0
"""How long `aclose` waits for the transport to go (a TLS close waits for the server's
close_notify) before it drops the connection."""


class Link(asyncio.Protocol):
    """The transport's protocol: messages are dispatched in the callback that read them (no
    reading task, which a read wakes one loop turn later)."""

    def __init__(
        self,
        endpoint: str,
        kind: str,
        on_push: Callable[[Link, cp.Message], None],
        on_closed: Callable[[Link, BaseException | None], None],
        *,
        connection_seq: int = 0,
        max_frame: int = 64 << 20,
        ssl: _ssl.SSLContext | None = None,
        credential: tuple[str, bytes] | None = None,
    ) -> None:
        self.endpoint, self.kind, self.connection_seq = endpoint, kind, connection_seq
        self._ssl = ssl
        self._credential = credential
        """(role, secret) given in the Hello (`waltz.role_secrets`), or None."""
        self._on_push, self._on_closed = on_push, on_closed
        self._messages = cp.MessageReader(max_frame)
        self._transport: asyncio.Transport | None = None
        self._waiting: dict[int, asyncio.Future[cp.Message]] = {}
        self._next_seq = 0
        self._hello: asyncio.Future[cp.Message] | None = None
        """The server's answer to our Hello; until `open` has it, what arrives is the handshake's."""
        self._opened = False
        self._lost: asyncio.Future[None] | None = None
        """Done once the transport is gone (`connection_lost`)."""
        self._unsent: list[bytes] = []
        """Frames `send` queued in this turn of the loop, written together at its end."""
        self.closed = False

    def __repr__(self) -> str:
        return f"Link({self.kind} {self.endpoint} #{self.connection_seq})"

    async def open(self, timeout: float) -> None:
        """Connects (through mutual TLS when the link has an SSL context) and shakes hands; a
        failed TLS handshake, or a TLS peer of a plaintext link, raises `TlsError`."""
        host, _, port = self.endpoint.rpartition(":")
        loop = asyncio.get_running_loop()
        self._hello, self._lost = loop.create_future(), loop.create_future()
        transport = await tls.create_connection(
            lambda: self, host, int(port), context=self._ssl, timeout=timeout, peer=f"server {self.endpoint}"
        )
        role, secret = self._credential or ("", b"")
        if not transport.is_closing():  # else the handshake's answer says why it closed
            transport.write(cp.Hello(role=role, secret=secret).frame())
        try:
            async with asyncio.timeout(timeout):
                hello = await self._hello
        except BaseException:
            transport.close()
            raise
        if isinstance(hello, cp.Failure) and hello.kind == cp.FailureKind.CLIENT_REFUSED:
            transport.close()
            raise errors.HelloRefusedError(f"server {self.endpoint} refused our Hello: {hello.message}")
        if not isinstance(hello, cp.HelloOk) or hello.version != cp.VERSION:
            transport.close()
            raise errors.ProtocolError(f"server {self.endpoint} answered the handshake with {hello!r}")
        if transport.is_closing():  # gone right after its answer: a link that never opened
            raise ConnectionError(f"server {self.endpoint} closed the connection after the handshake")
        self._opened = True
        self._received()  # whatever followed the answer in its read

    # -- asyncio.Protocol: called by the transport ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self._opened:
            self._handshake_data(data)
        elif not self.closed:
            self._messages.feed(data)
            self._received()

    def _handshake_data(self, data: bytes) -> None:
        hello = self._hello
        if hello is None:
            return
        if hello.done():
            if not hello.cancelled() and hello.exception() is None:
                self._messages.feed(data)  # after the answer, before `open` went on: `open` takes it
            return  # else the handshake failed or timed out: the transport is being closed
        if self._ssl is None and tls.looks_like_tls(data):
            hello.set_exception(tls.plaintext_refused(f"server {self.endpoint}"))
            return
        try:
            self._messages.feed(data)
            m = self._messages.next_message()
        except Exception as e:
            hello.set_exception(e)
            return
        if m is not None:
            hello.set_result(m)

    def _received(self) -> None:
        """Dispatches every whole message read so far."""
        try:
            while not self.closed and (msg := self._messages.next_message()) is not None:
                self._dispatch(msg)
        except errors.ProtocolError as e:
            log.warning("%s: protocol error, closing: %s", self, e)
            self._close(e)
        except (ConnectionError, OSError) as e:
            self._close(e)
        except Exception as e:  # a bug in a push handler must not leave the link half alive
            log.exception("%s: handling a message failed", self)
            self._close(e)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if not self._opened:
            self.closed = True  # never opened: `open` raises, nobody is told of a close
            hello = self._hello
            if hello is not None and not hello.done():
                hello.set_exception(self._hello_lost(exc))
            return
        self._close(exc if exc is not None else ConnectionError(f"server {self.endpoint} closed the connection"))

    def _hello_lost(self, exc: BaseException | None) -> BaseException:
        """Why the connection ended before the server answered Hello (`exc`: the read's error,
        None for a close)."""
        peer, with_tls = f"server {self.endpoint}", self._ssl is not None
        if exc is None or isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            # A reset is how a close looks when our Hello reached a server that had closed.
            closed = tls.first_read_error(peer, exc, with_tls) or ConnectionError(
                f"{peer} closed the connection without answering Hello: it requires mutual TLS (configure tls_ca, "
                "tls_cert and tls_key) or it was at its [server] max_connections; its log says which"
            )
            closed.__cause__ = closed.__cause__ or exc
            return closed
        return tls.first_read_error(peer, exc, with_tls) or exc

    def _dispatch(self, msg: cp.Message) -> None:
        seq = getattr(msg, "seq", -1)
        if isinstance(msg, cp.Failure) and msg.kind == cp.FailureKind.APPEND_REJECTED:
            # Its seq is the append's sequence (per partition), not a request's on this link: a
            # Mount or Flush waiting with the same number must not take it, and the partition
            # must learn its append was refused.
            seq = -1
        waiter = self._waiting.pop(seq, None) if seq >= 0 else None
        if waiter is None:
            self._on_push(self, msg)
        elif not waiter.done():
            if isinstance(msg, cp.Failure):
                waiter.set_exception(errors.RequestFailedError(msg.message, _FAILURE_KINDS.get(msg.kind, "internal")))
            else:
                waiter.set_result(msg)

    def send(self, msg: cp.Message) -> None:
        """Queues the message's frame; the frames queued in one turn of the loop go out in one
        write at its end (32 appends in flight were 32 send calls, and as many reads on the server)."""
        if self.closed or self._transport is None or self._transport.is_closing():
            raise ConnectionError(f"{self} is closed")
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._write_unsent)
        self._unsent.append(msg.frame())

    def _write_unsent(self) -> None:
        frames, self._unsent = self._unsent, []
        if frames and self._transport is not None and not self._transport.is_closing():
            self._transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    async def request(
        self, make: Callable[[int], cp.Message], timeout: float, *, progressing: Callable[[], bool] | None = None
    ) -> cp.Message:
        """Sends `make(seq)` and waits for the reply carrying that seq (a Failure raises
        `RequestFailedError`); `TimeoutError` after `timeout`, or, with `progressing`, once a
        whole `timeout` passed in which it said no (a Mount's answer follows the feed's replay,
        which may take long but keeps moving)."""
        self._next_seq += 1
        seq = self._next_seq
        fut: asyncio.Future[cp.Message] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = fut
        try:
            self.send(make(seq))
            while True:
                # asyncio.wait, not wait_for: wait_for can drop a cancellation that arrives in the
                # same turn as the reply (see waltz.client.partition's `closed`); and it leaves
                # the future waiting on when the time is up.
                await asyncio.wait((fut,), timeout=timeout)
                if fut.done():
                    return fut.result()
                if progressing is None or not progressing():
                    raise TimeoutError(f"{self}: no answer within {timeout:g} s")
        finally:
            self._waiting.pop(seq, None)

    def close(self) -> None:
        self._close(errors.ClientClosedError("the client is closing"))

    async def aclose(self) -> None:
        """`close`, then waits (at most `CLOSE_WAIT`) for the transport to go: a loop closed right
        after (a Spark task's) would otherwise be left an open transport."""
        self.close()
        lost = self._lost
        if lost is not None and self._transport is not None:
            try:
                async with asyncio.timeout(CLOSE_WAIT):
                    await asyncio.shield(lost)
            except TimeoutError:
                self._transport.abort()

    def _close(self, why: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._write_unsent()  # what was sent before the close goes out ahead of it, as it did unbatched
        if self._transport is not None:
            self._transport.close()
        lost = ConnectionError(f"{self} closed: {why}")
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(lost)
        self._waiting.clear()
        self._on_closed(self, why)
