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


class Link:
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
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, asyncio.Future[cp.Message]] = {}
        self._next_seq = 0
        self._reader_task: asyncio.Task[None] | None = None
        self._unsent: list[bytes] = []
        """Frames `send` queued in this turn of the loop, written together at its end."""
        self.closed = False

    def __repr__(self) -> str:
        return f"Link({self.kind} {self.endpoint} #{self.connection_seq})"

    async def open(self, timeout: float) -> None:
        """Connects (through mutual TLS when the link has an SSL context) and shakes hands; a
        failed TLS handshake, or a TLS peer of a plaintext link, raises `TlsError`."""
        host, _, port = self.endpoint.rpartition(":")
        reader, writer = await tls.open_connection(
            host, int(port), context=self._ssl, timeout=timeout, peer=f"server {self.endpoint}"
        )
        self._writer = writer
        role, secret = self._credential or ("", b"")
        writer.write(cp.Hello(role=role, secret=secret).frame())
        try:
            async with asyncio.timeout(timeout):
                hello = await self._next(reader)
        except BaseException:
            writer.close()
            raise
        if isinstance(hello, cp.Failure) and hello.kind == cp.FailureKind.CLIENT_REFUSED:
            writer.close()
            raise errors.HelloRefusedError(f"server {self.endpoint} refused our Hello: {hello.message}")
        if not isinstance(hello, cp.HelloOk) or hello.version != cp.VERSION:
            writer.close()
            raise errors.ProtocolError(f"server {self.endpoint} answered the handshake with {hello!r}")
        self._reader_task = asyncio.create_task(self._read(reader), name=f"waltz-client-{self.kind}-{self.endpoint}")

    async def _next(self, reader: asyncio.StreamReader) -> cp.Message:
        """The server's first message (the handshake's answer)."""
        peer, with_tls = f"server {self.endpoint}", self._ssl is not None
        while (m := self._messages.next_message()) is None:
            try:
                data = await reader.read(1 << 20)
            except OSError as e:
                raise tls.first_read_error(peer, e, with_tls) or e
            if not data:
                raise tls.first_read_error(peer, None, with_tls) or ConnectionError(
                    f"{peer} closed the connection without answering Hello: it requires mutual TLS (configure tls_ca, "
                    "tls_cert and tls_key) or it was at its [server] max_connections; its log says which"
                )
            if not with_tls and tls.looks_like_tls(data):
                raise tls.plaintext_refused(peer)
            self._messages.feed(data)
        return m

    async def _read(self, reader: asyncio.StreamReader) -> None:
        why: BaseException | None = None
        try:
            while True:
                msg = self._messages.next_message()
                if msg is None:
                    data = await reader.read(1 << 20)
                    if not data:
                        why = ConnectionError(f"server {self.endpoint} closed the connection")
                        break
                    self._messages.feed(data)
                    continue
                self._dispatch(msg)
        except asyncio.CancelledError:
            why = errors.ClientClosedError("the client is closing")
        except errors.ProtocolError as e:
            log.warning("%s: protocol error, closing: %s", self, e)
            why = e
        except (ConnectionError, OSError) as e:
            why = e
        except Exception as e:  # a bug in a push handler must not leave the link half alive
            log.exception("%s: handling a message failed", self)
            why = e
        self._close(why)

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
        if self.closed or self._writer is None or self._writer.is_closing():
            raise ConnectionError(f"{self} is closed")
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._write_unsent)
        self._unsent.append(msg.frame())

    def _write_unsent(self) -> None:
        frames, self._unsent = self._unsent, []
        if frames and self._writer is not None and not self._writer.is_closing():
            self._writer.write(frames[0] if len(frames) == 1 else b"".join(frames))

    async def request(self, make: Callable[[int], cp.Message], timeout: float) -> cp.Message:
        """Sends `make(seq)` and waits for the reply carrying that seq (a Failure raises
        `RequestFailedError`)."""
        self._next_seq += 1
        seq = self._next_seq
        fut: asyncio.Future[cp.Message] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = fut
        try:
            self.send(make(seq))
            async with asyncio.timeout(timeout):  # not wait_for: see waltz.client.partition's `closed`
                return await fut
        finally:
            self._waiting.pop(seq, None)

    def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._close(errors.ClientClosedError("the client is closing"))

    async def aclose(self) -> None:
        """`close`, then waits for the reader task to end: a loop closed right after (a Spark
        task's) would otherwise destroy it pending ("Task was destroyed but it is pending")."""
        self.close()
        task = self._reader_task
        if task is not None and task is not asyncio.current_task():
            await asyncio.wait([task])

    def _close(self, why: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._write_unsent()  # what was sent before the close goes out ahead of it, as it did unbatched
        if self._writer is not None:
            self._writer.close()
        lost = ConnectionError(f"{self} closed: {why}")
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(lost)
        self._waiting.clear()
        self._on_closed(self, why)
