"""One client connection to the server: the client protocol over the partitions this server
holds (`Partitions`).

Appends are queued into their partition in arrival order, and the connection stops reading
while a partition's queue is full (back pressure reaches the client's socket). A Mount starts a
feed task for that partition: it streams committed transactions after the client's high-water
mark and sends READY once it has delivered everything committed at the moment of the mount.
Feed frames for the same range are encoded once and shared by every connection. Anything from a
connection older than the client's newest Mount of a partition is dropped, as are appends of
another generation (by the partition).

Client identity (issue 34): a (client id, partition) mounted here is bound to the token its
first Mount proved, for as long as any connection holds that mount; a Mount of it with another
token is refused, as is a connection seq far ahead of this server's clock, and an Append is taken
only under the (client id, partition) its own connection mounted. docs/internals.md has why.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, cast

from waltz import client_protocol as cp
from waltz import clock, errors, role_secrets, tls
from waltz._native import ReqId, encode_frame
from waltz.limits import Refusals
from waltz.server.partition import (
    AppendListener,
    AppendRequest,
    AppendResult,
    FeedEntry,
    LockFailed,
    ServerPartition,
)

log = logging.getLogger(__name__)

FEED_BATCH = 1000
REQUESTS_IN_FLIGHT = 8
"""Reads answered by a task of their own (transaction data, feed requests) at once per
connection: the next frame is read once one of them is answered. A client that sends many and
reads nothing holds at most this many answers in the server's memory."""
FLUSHES_IN_FLIGHT = 256
"""The same for Flushes, counted apart: each waits for its partition's appends, and one stuck
behind slow storage must not hold up the reads, appends and mounts of the other partitions
sharing the connection. (A client keeps at most one Flush out per partition.)"""
WRITE_BUFFER_LIMIT = 256 << 10
"""Answers written without waiting (lock failures, rejected appends) may pile up to about this
much for a client that does not read before the connection stops reading its requests."""
READ_CHUNK = 1 << 20
"""The most one read of a mounted connection takes from its stream at once."""
READ_AHEAD = 128 << 10
"""Bytes a mounted connection takes in while its loop is busy (an answer to write, room in a
full queue, a mount) before it stops reading: what a StreamReader holds before it pauses."""
CONNECTION_SEQ_AHEAD = 86_400 * 1_000_000
"""How far a Mount's connection seq may be ahead of this server's clock in microseconds (a
client counts its connections from its clock in µs, one per new connection): a day of skew.
Further ahead is refused: the newest seq would stay there and drop every later mount of the
client (a Mount with seq 2^62 locked a live client out)."""


MAX_CLIENT_IDS_PER_CONNECTION = 16
"""Client Id Requests one connection may make: each is a metadata write (a client needs one at
start, and one more each time it has used up 2^31 sequence numbers)."""


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may take before and after it mounts ([server] in
    docs/configuration.md). A peer that has not mounted is unauthenticated as far as the client
    protocol goes: it gets small frames and a deadline; a mounted client is never cut for silence."""

    handshake_timeout: float = 10.0
    mount_timeout: float = 60.0
    """Closed when nothing is mounted and no request came for this long."""
    max_frame_before_mount: int = 64 << 10
    max_frame: int = 64 << 20
    max_transaction_locks: int | None = None
    """Appends declaring more are refused while decoding (the partitions check it again)."""


class Partitions:
    """The partitions this server serves now, the newest connection seq of each client's mounts,
    and the shared cache of encoded feed frames."""

    def __init__(self) -> None:
        self.by_id: dict[int, ServerPartition] = {}
        self.newest_mount: dict[tuple[int, int], int] = {}
        self.tokens: dict[tuple[int, int], bytes] = {}
        """The token each mounted (client id, partition) proved, held as long as `newest_mount`."""
        self._mounted_by: collections.Counter[tuple[int, int]] = collections.Counter()
        """Open connections that mounted each (client id, partition): the newest seq is
        forgotten with the last of them (a client crash-looping under new ids grew it for ever).
        No older connection is left then whose requests it would have to drop."""
        self._frames: collections.OrderedDict[tuple[int, int, int, int], bytes] = collections.OrderedDict()

    def mounted(self, key: tuple[int, int]) -> None:
        self._mounted_by[key] += 1

    def unmounted(self, key: tuple[int, int]) -> None:
        self._mounted_by[key] -= 1
        if self._mounted_by[key] <= 0:
            del self._mounted_by[key]
            self.newest_mount.pop(key, None)
            self.tokens.pop(key, None)

    def feed_frame(self, partition: ServerPartition, entries: list[FeedEntry]) -> bytes:
        key = (partition.partition_id, partition.generation, entries[0].transaction_id, entries[-1].transaction_id)
        frame = self._frames.get(key)
        if frame is None:
            frame = encode_frame(cp.MAGIC, cp.FeedData.TYPE, cp.feed_payload(-1, partition.partition_id, entries))
            self._frames[key] = frame
            while len(self._frames) > 256:
                self._frames.popitem(last=False)
        return frame


class _MountTimeout(Exception):
    pass


class ClientIdBindings:
    """Client ids bound to the certificate they were allocated to, kept in the cluster's
    metadata so that every server checks them; bindings read are cached (a binding never
    changes), absent ones are read again on the next Mount (the id may be allocated since)."""

    def __init__(self, bind: Callable[[int, str], None], read: Callable[[int], str | None]) -> None:
        self._bind, self._read = bind, read
        self._known: dict[int, str] = {}

    async def bind(self, client_id: int, certificate: str) -> None:
        await asyncio.to_thread(self._bind, client_id, certificate)
        self._known[client_id] = certificate

    async def bound(self, client_id: int) -> str | None:
        if client_id not in self._known:
            found = await asyncio.to_thread(self._read, client_id)
            if found is None:
                return None
            self._known[client_id] = found
        return self._known[client_id]


def _certificate_digest(writer: asyncio.StreamWriter) -> str | None:
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return hashlib.sha256(der).hexdigest() if der else None


class _InlineReading(asyncio.Protocol):
    """What a mounted connection's transport reads into (`ClientConnection._read_inline`):
    bytes go straight to the connection's decoder, and while its loop waits for more, the
    Appends among them are queued in this callback, where a StreamReader would wake the loop's
    task a step later with a future per read. Write flow control, end of stream and errors stay
    the stream protocol's, which the connection's writer and reader keep using."""

    def __init__(self, conn: ClientConnection, streams: asyncio.BaseProtocol) -> None:
        self._conn, self._streams = conn, streams

    def data_received(self, data: bytes) -> None:
        self._conn._take(data)

    def eof_received(self) -> bool | None:
        keep_open = cast(asyncio.Protocol, self._streams).eof_received()
        self._conn._wake()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self._streams.connection_lost(exc)
        self._conn._wake()

    def pause_writing(self) -> None:
        self._streams.pause_writing()

    def resume_writing(self) -> None:
        self._streams.resume_writing()


_Stashed = tuple[str, Any]
"""What the inline reading left for the connection's loop: ("message", msg) that is not a
plain Append, ("wait", awaitable) an Append's answer or room to wait for, ("error", exc)."""


class ClientConnection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        partitions: Partitions,
        limits: ConnectionLimits = ConnectionLimits(),
        refusals: Refusals | None = None,
        secrets: Mapping[str, str] | None = None,
        client_ids: Callable[[], Awaitable[int]] | None = None,
        bindings: ClientIdBindings | None = None,
    ) -> None:
        self.reader, self.writer, self.partitions = reader, writer, partitions
        self.client_ids = client_ids
        """Takes a new client id from the cluster's counter (Client Id Request); None: not offered."""
        self._ids_given = 0
        self.bindings = bindings
        self.certificate = _certificate_digest(writer)
        """SHA-256 of the peer's TLS certificate (hex), or None without TLS: what the client
        ids allocated on this connection are bound to."""
        self.secrets = dict(secrets or {})
        """The role secrets this port checks at Hello (`waltz.role_secrets`); empty: none asked."""
        self.peer = writer.get_extra_info("peername")
        self.limits = limits
        self.refusals = refusals if refusals is not None else Refusals(log, "client connection")
        self._messages = cp.MessageReader(limits.max_frame_before_mount, limits.max_transaction_locks)
        self._mounts: dict[int, tuple[int, int]] = {}  # partition -> (client id, connection seq)
        self._mount_keys: set[tuple[int, int]] = set()  # (client id, partition) this connection counts in
        self._feeds: dict[int, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._appends: dict[int, list[asyncio.Future[AppendResult]]] = collections.defaultdict(list)
        self._write_lock = asyncio.Lock()
        self._inline: _InlineReading | None = None
        """Set once mounted: the transport reads into it (`_read_inline`)."""
        self._parked: asyncio.Future[None] | None = None
        """While the loop waits for bytes with `_inline` on: woken by what it must handle."""
        self._stashed: _Stashed | None = None
        self._unread = 0
        """Bytes fed to the decoder while the loop was busy (it takes them when it comes back)."""
        self._reading_paused = False
        self._request_slots = asyncio.Semaphore(REQUESTS_IN_FLIGHT)
        self._flush_slots = asyncio.Semaphore(FLUSHES_IN_FLIGHT)

    @property
    def mounted(self) -> bool:
        """True once a Mount was accepted: the client has said who it is."""
        return bool(self._mounts)

    async def run(self) -> None:
        why = "closed by the client"
        try:
            try:
                async with asyncio.timeout(self.limits.handshake_timeout):
                    handshaken = await self._handshake()
                if not handshaken:
                    return
            except TimeoutError:
                why = f"no Hello within {self.limits.handshake_timeout:g} s"
                self.refusals.refuse("handshake_timeout", f"{self.peer}: {why}")
                return
            last_request = time.monotonic()
            while True:
                stashed = self._stashed
                if stashed is not None and stashed[0] == "wait":
                    self._stashed = None
                    await stashed[1]
                    continue
                try:
                    msg = self._next_message()
                except cp.TooManyLocks as e:
                    self.refusals.refuse("too_many_locks", f"{self.peer}: {e}")
                    await self._send(
                        cp.Failure(
                            e.req_id[3], e.req_id[2], cp.FailureKind.APPEND_REJECTED, f"append {e.req_id}: {e}"
                        ).frame()
                    )
                    continue
                if msg is None:
                    if self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
                        async with self._write_lock:  # the client reads its answers before it sends more
                            await self.writer.drain()
                    if self._inline is not None:
                        if not await self._more():
                            break
                        continue
                    data = await self._read(last_request)
                    if not data:
                        break
                    self._messages.feed(data)
                    if self.mounted and len(data) < READ_CHUNK:
                        self._read_inline()  # the stream holds nothing more: what follows comes straight here
                    continue
                last_request = time.monotonic()
                if type(msg) is cp.Append:  # the hot path: no coroutine unless it has to wait
                    waiting = self._append(msg)
                    if waiting is not None:
                        await waiting
                else:
                    await self._dispatch(msg)
                if self.mounted and self._messages.max_frame < self.limits.max_frame:
                    self._messages.max_frame = self.limits.max_frame  # mounted: appends of any allowed size
        except cp.LimitExceeded as e:
            why = f"refused: {e}"
            limit = "" if self.mounted else " (before a Mount: [server] max_frame_before_mount)"
            self.refusals.refuse("frame_too_large", f"{self.peer}: {e}{limit}")
        except _MountTimeout as e:
            why = str(e)
            self.refusals.refuse("mount_timeout", f"{self.peer}: {e}")
        except errors.ProtocolError as e:
            why = f"protocol error: {e}"
            log.warning("closing client connection %s: %s", self.peer, e)
        except (ConnectionError, OSError) as e:
            why = str(e)
        finally:
            stashed, self._stashed = self._stashed, None
            if stashed is not None and stashed[0] == "wait" and asyncio.iscoroutine(stashed[1]):
                stashed[1].close()  # an answer the ending connection will not write
            for t in list(self._feeds.values()) + list(self._tasks):
                t.cancel()
            for key in self._mount_keys:
                self.partitions.unmounted(key)
            self.writer.close()
            log.debug("client connection %s ended: %s", self.peer, why)

    async def _read(self, last_request: float) -> bytes:
        """The next bytes; before any Mount, within `mount_timeout` of the last request (an idle
        unmounted connection only holds a descriptor)."""
        if self.mounted:
            return await self.reader.read(READ_CHUNK)
        left = last_request + self.limits.mount_timeout - time.monotonic()
        try:
            async with asyncio.timeout(max(left, 0.0)):
                return await self.reader.read(self.limits.max_frame_before_mount)
        except TimeoutError:
            raise _MountTimeout(f"no Mount and no request for {self.limits.mount_timeout:g} s") from None

    # -- reading a mounted connection in the transport's callback -------------------------------
    def _read_inline(self) -> None:
        """From now on the transport reads into `_InlineReading`. Called right after a read that
        took less than `READ_CHUNK`, in the same step: the StreamReader is empty, so no byte is
        left behind in it, and the order of what arrives is kept."""
        transport = self.writer.transport
        self._inline = _InlineReading(self, transport.get_protocol())
        transport.set_protocol(self._inline)

    def _take(self, data: bytes) -> None:
        """Bytes read (`_InlineReading`): with the loop waiting for them, the Appends among them
        are queued here, up to the first thing the loop must handle; else they wait in the
        decoder, and reading stops past `READ_AHEAD` until the loop comes back."""
        self._messages.feed(data)
        parked = self._parked
        if parked is None or parked.done() or self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            # The loop is busy, or answers pile up for a client that does not read them: the loop
            # takes these bytes after it has waited for the client to read.
            self._unread += len(data)
            if self._unread > READ_AHEAD and not self._reading_paused:
                self._reading_paused = True
                cast(asyncio.Transport, self.writer.transport).pause_reading()
            if parked is not None and not parked.done():
                parked.set_result(None)
            return
        self._stashed = self._queue_appends()
        if self._stashed is not None:
            parked.set_result(None)

    def _queue_appends(self) -> _Stashed | None:
        """The loop's own handling of Appends (`_append`), message by message in order; returns
        the first thing it must handle itself, or None when no whole message is left."""
        try:
            while (msg := self._messages.next_message()) is not None:
                if type(msg) is not cp.Append:
                    return ("message", msg)
                waiting = self._append(msg)
                if waiting is not None:
                    return ("wait", waiting)
        except Exception as e:  # raised in the loop, as if it had read the frame itself
            return ("error", e)
        return None

    def _next_message(self) -> cp.Message | None:
        stashed, self._stashed = self._stashed, None
        if stashed is None:
            return self._messages.next_message()
        kind, value = stashed
        if kind == "error":
            raise value
        return cast(cp.Message, value)

    def _wake(self) -> None:
        """The stream ended or failed: the waiting loop finds out from the reader."""
        parked = self._parked
        if parked is not None and not parked.done():
            parked.set_result(None)

    async def _more(self) -> bool:
        """Waits until there is something to handle (the Appends that arrive meanwhile are queued
        as they come); False at the end of the stream."""
        while True:
            if self._unread:
                self._unread = 0
                if self._reading_paused:
                    self._reading_paused = False
                    cast(asyncio.Transport, self.writer.transport).resume_reading()
                return True
            if self._stashed is not None:
                return True
            failed = self.reader.exception()
            if failed is not None:
                raise failed
            if self.reader.at_eof():
                return False
            self._parked = asyncio.get_running_loop().create_future()
            try:
                await self._parked
            finally:
                self._parked = None

    async def _handshake(self) -> bool:
        while (msg := self._messages.next_message()) is None:
            data = await self.reader.read(65536)
            if not data:
                return False
            if tls.looks_like_tls(data) and self.writer.get_extra_info("sslcontext") is None:
                raise errors.ProtocolError("the client speaks TLS but this server has no [tls] configured")
            self._messages.feed(data)
        if isinstance(msg, cp.Hello) and not msg.min_version <= cp.VERSION <= msg.max_version:
            # Said to the peer too: an older client shows the Failure as its handshake's answer.
            why = (
                f"this server speaks client protocol version {cp.VERSION}, the client {msg.min_version} to "
                f"{msg.max_version}: upgrade the client"
            )
            await self._send(cp.Failure(-1, -1, cp.FailureKind.BAD_REQUEST, why).frame())
            raise errors.ProtocolError(why)
        if not isinstance(msg, cp.Hello):
            raise errors.ProtocolError(f"the first frame must be a Hello this server speaks, not {msg}")
        refused = role_secrets.check(self.secrets, (msg.role, msg.secret) if msg.role else None)
        if refused is not None:
            # Said to the peer (its own connection only is closed), counted and logged.
            self.refusals.refuse("role_secret", f"{self.peer}: {refused}")
            await self._send(cp.Failure(-1, -1, cp.FailureKind.CLIENT_REFUSED, refused).frame())
            return False
        await self._send(cp.HelloOk(cp.VERSION).frame())
        return True

    async def _send(self, frame: bytes) -> None:
        async with self._write_lock:
            self.writer.write(frame)
            await self.writer.drain()

    async def _spawn(self, coro: Coroutine[Any, Any, None], slots: asyncio.Semaphore) -> None:
        """Runs the request's answer in a task once one of `slots` is free (the connection reads
        nothing more meanwhile)."""
        try:
            await slots.acquire()
        except BaseException:
            coro.close()
            raise
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._request_done(t, slots))

    def _request_done(self, task: asyncio.Task[None], slots: asyncio.Semaphore) -> None:
        self._tasks.discard(task)
        slots.release()

    def _stale(self, partition: int) -> bool:
        """True when this connection's mount of the partition is older than the client's newest."""
        mount = self._mounts.get(partition)
        return mount is not None and self.partitions.newest_mount.get((mount[0], partition), mount[1]) > mount[1]

    async def _dispatch(self, msg: cp.Message) -> None:
        if isinstance(msg, cp.Append):
            waiting = self._append(msg)
            if waiting is not None:
                await waiting
        elif isinstance(msg, cp.Mount):
            await self._mount(msg)
        elif isinstance(msg, cp.Flush):
            await self._spawn(self._flush(msg), self._flush_slots)
        elif isinstance(msg, cp.HighWaterMarkRequest):
            p = self.partitions.by_id.get(msg.partition)
            if p is None:
                await self._not_here(msg.seq, msg.partition)
            else:
                await self._send(cp.HighWaterMarkResponse(msg.seq, msg.partition, p.high_water_mark).frame())
        elif isinstance(msg, cp.TransactionDataRequest):
            await self._spawn(self._data(msg), self._request_slots)
        elif isinstance(msg, cp.TransactionDataRangeRequest):
            await self._spawn(self._data_range(msg), self._request_slots)
        elif isinstance(msg, cp.FeedRequest):
            await self._spawn(self._feed_request(msg), self._request_slots)
        elif isinstance(msg, cp.ClientIdRequest):
            await self._spawn(self._client_id(msg), self._request_slots)
        else:
            raise errors.ProtocolError(f"a client does not send {type(msg).__name__}")

    async def _client_id(self, msg: cp.ClientIdRequest) -> None:
        """A new client id from the cluster's counter, written with this server's metadata
        credentials. Bounded per connection: each id is a metadata write, and a client needs one
        at start and one each time it uses up a client id's sequence numbers."""
        if self.client_ids is None:
            why = "this server does not allocate client ids"
            await self._send(cp.Failure(msg.seq, -1, cp.FailureKind.BAD_REQUEST, why).frame())
            return
        if self._ids_given >= MAX_CLIENT_IDS_PER_CONNECTION:
            self.refusals.refuse("client_ids", f"{self.peer}: more than {MAX_CLIENT_IDS_PER_CONNECTION} client ids")
            why = f"at most {MAX_CLIENT_IDS_PER_CONNECTION} client ids per connection"
            await self._send(cp.Failure(msg.seq, -1, cp.FailureKind.CLIENT_REFUSED, why).frame())
            return
        self._ids_given += 1
        try:
            client_id = await self.client_ids()
            if self.bindings is not None and self.certificate is not None:
                await self.bindings.bind(client_id, self.certificate)
        except errors.WaltzError as e:
            log.warning("client id for %s not allocated: %s", self.peer, e)
            await self._send(cp.Failure(msg.seq, -1, cp.FailureKind.INTERNAL, f"no client id: {e}").frame())
            return
        await self._send(cp.ClientIdResponse(msg.seq, client_id).frame())

    async def _not_here(self, seq: int, partition: int) -> None:
        await self._send(
            cp.Failure(
                seq, partition, cp.FailureKind.PARTITION_NOT_HERE, f"partition {partition} is not served here"
            ).frame()
        )

    # -- appends ---------------------------------------------------------------------------
    def _append(self, msg: cp.Append) -> Awaitable[None] | None:
        """Queues the append in its partition, or answers why not. Returns what is left to wait
        for (an answer to write, room in a full queue), or None: most appends need no coroutine."""
        partition = msg.req_id[2]
        mount = self._mounts.get(partition)
        if mount is None or mount[0] != msg.req_id[0]:
            # Only under the client id this connection mounted (and so proved the token of).
            return self._send(
                cp.Failure(
                    msg.req_id[3],
                    partition,
                    cp.FailureKind.APPEND_REJECTED,
                    f"append {msg.req_id}: this connection has not mounted partition {partition} "
                    f"as client {msg.req_id[0]}",
                ).frame()
            )
        if self._stale(partition):
            return None  # a newer connection of this client owns the partition now
        p = self.partitions.by_id.get(partition)
        if p is None:
            return self._not_here(-1, partition)
        request = AppendRequest(
            ReqId(*msg.req_id),
            msg.client_high_water_mark,
            msg.header,
            msg.data,
            msg.write_locks,
            msg.read_locks,
            msg.append_locks,
        )
        listener = functools.partial(self._answered, msg)
        try:
            outcome = p.enqueue_nowait(request, listener)
        except errors.WaltzError as e:
            return self._refused(msg, e)
        if outcome is None:
            return self._append_when_room(p, msg, request, listener)  # the partition's queue is full
        self._appends[partition].append(outcome)
        return None

    async def _append_when_room(
        self, p: ServerPartition, msg: cp.Append, request: AppendRequest, listener: AppendListener
    ) -> None:
        """Waits for room in the partition's queue (the connection reads nothing meanwhile)."""
        try:
            outcome = await p.enqueue(request, listener)
        except errors.WaltzError as e:
            waiting = self._refused(msg, e)
            if waiting is not None:
                await waiting
            return
        if not outcome.done():
            self._appends[msg.req_id[2]].append(outcome)

    def _refused(self, msg: cp.Append, e: errors.WaltzError) -> Awaitable[None] | None:
        partition = msg.req_id[2]
        if isinstance(e, errors.StoreSessionError):
            return self._send(cp.Failure(-1, partition, cp.FailureKind.STORE_UNAVAILABLE, str(e)).frame())
        if isinstance(e, errors.InvalidArgumentError):
            return self._send(
                cp.Failure(
                    msg.req_id[3], partition, cp.FailureKind.APPEND_REJECTED, f"append {msg.req_id}: {e}"
                ).frame()
            )
        raise e

    def _answered(self, msg: cp.Append, outcome: asyncio.Future[AppendResult]) -> None:
        """Runs when the partition settles the append, in that turn; a listener, not a task, as
        most appends need no answer (a commit is announced by the feed). Whole frames are written
        at once, so they never interleave with the frames of the feed."""
        pending = self._appends.get(msg.req_id[2])
        if pending is not None and outcome in pending:
            pending.remove(outcome)
        if outcome.cancelled() or self.writer.is_closing():
            return
        exc = outcome.exception()
        if isinstance(exc, errors.StoreSessionError):
            self.writer.write(
                cp.Failure(-1, msg.req_id[2], cp.FailureKind.STORE_UNAVAILABLE, f"append {msg.req_id}: {exc}").frame()
            )
        elif exc is not None:
            self.writer.write(
                cp.Failure(
                    msg.req_id[3], msg.req_id[2], cp.FailureKind.APPEND_REJECTED, f"append {msg.req_id}: {exc}"
                ).frame()
            )
        else:
            result = outcome.result()
            if isinstance(result, LockFailed):
                self.writer.write(cp.LockFailure(msg.req_id, result.transaction_id).frame())
        # Committed: the client learns it from the feed. Ignored: a stale generation, dropped.

    async def _flush(self, msg: cp.Flush) -> None:
        """Answers once every append this connection sent before is decided. An append whose
        store session ended has no decided outcome (the next session's recovery may still
        commit it): then the answer is STORE_UNAVAILABLE, never a mark, since a client runs
        again whatever the feed has not shown by the mark."""
        waiting = list(self._appends.get(msg.partition, ()))
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        p = self.partitions.by_id.get(msg.partition)
        if p is None:
            await self._not_here(msg.seq, msg.partition)
            return
        unknown = next((o for o in outcomes if isinstance(o, errors.StoreSessionError)), None) or p.session.failed
        if unknown is not None:
            await self._send(
                cp.Failure(msg.seq, msg.partition, cp.FailureKind.STORE_UNAVAILABLE, f"flush: {unknown}").frame()
            )
        else:
            await self._send(cp.FlushResponse(msg.seq, msg.partition, p.high_water_mark).frame())

    # -- mounts and feeds ------------------------------------------------------------------
    async def _mount(self, msg: cp.Mount) -> None:
        if msg.client_high_water_mark < -1:
            await self._send(
                cp.Failure(
                    msg.seq,
                    msg.partition,
                    cp.FailureKind.BAD_REQUEST,
                    f"mount from {msg.client_high_water_mark}: a client's high-water mark is -1 or a transaction id",
                ).frame()
            )
            return
        key = (msg.client_id, msg.partition)
        refused = self._refusal(msg, key) or await self._binding_refusal(msg.client_id)
        if refused:
            log.warning("client connection %s: mount refused: %s", self.peer, refused)
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.CLIENT_REFUSED, refused).frame())
            return
        if self.partitions.newest_mount.get(key, msg.connection_seq) > msg.connection_seq:
            return  # from a connection the client has already replaced
        self.partitions.newest_mount[key] = msg.connection_seq
        self.partitions.tokens[key] = msg.client_token
        if key not in self._mount_keys:
            self._mount_keys.add(key)
            self.partitions.mounted(key)
        self._mounts[msg.partition] = (msg.client_id, msg.connection_seq)
        old = self._feeds.pop(msg.partition, None)
        if old is not None:
            old.cancel()
        p = self.partitions.by_id.get(msg.partition)
        if p is None:
            await self._send(cp.MountResponse(msg.seq, msg.partition, cp.MountStatus.NOT_READY, -1, -1).frame())
            return
        if msg.client_high_water_mark > p.high_water_mark:
            await self._send(
                cp.MountResponse(
                    msg.seq, msg.partition, cp.MountStatus.CLIENT_AHEAD, p.high_water_mark, p.generation
                ).frame()
            )
            return
        self._feeds[msg.partition] = asyncio.ensure_future(self._feed(msg, p))

    async def _binding_refusal(self, client_id: int) -> str:
        """Why this connection may not mount `client_id`: the id was allocated over a connection
        with another certificate (issue 34: a client id is bound to its credential)."""
        if self.bindings is None:
            return ""
        try:
            bound = await self.bindings.bound(client_id)
        except errors.WaltzError as e:
            return f"the binding of client id {client_id} cannot be read now ({e}): mount again"
        if bound is None or bound == self.certificate:
            return ""
        return f"client id {client_id} was allocated to another certificate: allocate an id of your own"

    def _refusal(self, msg: cp.Mount, key: tuple[int, int]) -> str:
        """Why the Mount must be refused ("" if it may go on): a connection seq far ahead, or
        a client id held on this partition under another token."""
        ahead = clock.time_ns() // 1000 + CONNECTION_SEQ_AHEAD
        if msg.connection_seq > ahead:
            return (
                f"mount of partition {msg.partition} as client {msg.client_id}: "
                f"connection seq {msg.connection_seq} "
                f"is more than a day ahead of this server's clock (at most {ahead})"
            )
        token = self.partitions.tokens.get(key)
        if token is not None and not hmac.compare_digest(token, msg.client_token):
            return (
                f"mount of partition {msg.partition} as client {msg.client_id}: the client id is mounted by "
                "another client (a different token); a client id belongs to one client at a time"
            )
        return ""

    async def _feed(self, mount: cp.Mount, p: ServerPartition) -> None:
        # The client fails every append it has not seen committed once READY arrives, so READY
        # must mean that none of them can commit any more: wait until this client's earlier
        # appends are resolved, and refuse while the store session is broken (what it had in
        # flight is decided by the next session's recovery, not here).
        await p.settled(mount.client_id)
        if self._stale(mount.partition):
            return
        if self.partitions.by_id.get(mount.partition) is not p or p.session.failed is not None:
            await self._send(cp.MountResponse(mount.seq, mount.partition, cp.MountStatus.NOT_READY, -1, -1).frame())
            return
        target = p.high_water_mark  # READY once everything committed at the mount is delivered
        ready = mount.client_high_water_mark >= target
        if ready:
            await self._send(
                cp.MountResponse(mount.seq, mount.partition, cp.MountStatus.READY, target, p.generation).frame()
            )

        def push(entries: list[FeedEntry]) -> bool:
            """Writes a commit's feed frame in the commit's own turn when nothing else is in the
            way; otherwise the loop below takes it (it does the same checks, and waits for a
            full socket to drain)."""
            if (
                not ready
                or self._write_lock.locked()
                or self.writer.is_closing()
                or self.writer.transport.get_write_buffer_size() > 0
                or self._stale(mount.partition)
                or self.partitions.by_id.get(mount.partition) is not p
            ):
                return False
            self.writer.write(self.partitions.feed_frame(p, entries))
            return True

        try:
            async for entries in p.feed(mount.client_high_water_mark, FEED_BATCH, push):
                if self._stale(mount.partition):
                    return  # the client's newer mount has its own feed
                if self.partitions.by_id.get(mount.partition) is not p:
                    # Replaced (a new store session, the same generation after the metadata
                    # session came back): ending quietly left the client waiting on a feed that
                    # would never move again (found by `waltz torture`); it must mount again.
                    raise errors.StoreSessionError(
                        f"partition {mount.partition}: the store session this mount followed ended"
                    )
                await self._send(self.partitions.feed_frame(p, entries))
                if not ready and entries[-1].transaction_id >= target:
                    ready = True
                    await self._send(
                        cp.MountResponse(mount.seq, mount.partition, cp.MountStatus.READY, target, p.generation).frame()
                    )
        except errors.TransactionsDeletedError as e:
            if not ready:
                # Below what the cluster holds: the client must bootstrap from a snapshot, not wait.
                await self._send(
                    cp.MountResponse(
                        mount.seq, mount.partition, cp.MountStatus.BEHIND_RETENTION, e.first_id, p.generation
                    ).frame()
                )
            else:  # deleted under a mounted reader: it mounts again and is told as above
                await self._send(cp.Failure(-1, mount.partition, cp.FailureKind.TRANSACTIONS_DELETED, str(e)).frame())
        except errors.StoreSessionError as e:
            await self._send(cp.Failure(-1, mount.partition, cp.FailureKind.STORE_UNAVAILABLE, str(e)).frame())

    async def _feed_request(self, msg: cp.FeedRequest) -> None:
        p = self.partitions.by_id.get(msg.partition)
        if p is None:
            await self._not_here(msg.seq, msg.partition)
            return
        if msg.after < -1:
            await self._send(
                cp.Failure(
                    msg.seq,
                    msg.partition,
                    cp.FailureKind.BAD_REQUEST,
                    f"feed request after {msg.after}: transaction ids start at 0 (-1 reads from the first)",
                ).frame()
            )
            return
        entries: list[cp.FeedEntry] = []
        try:
            if msg.after < p.high_water_mark:
                async for batch in p.feed(msg.after, max(1, min(msg.max_count, FEED_BATCH))):
                    entries = [cp.FeedEntry(e.transaction_id, e.req_id.as_tuple(), e.header) for e in batch]
                    break
        except errors.TransactionsDeletedError as e:
            await self._send(
                cp.Failure(msg.seq, msg.partition, cp.FailureKind.TRANSACTIONS_DELETED, f"feed request: {e}").frame()
            )
            return
        except errors.StoreSessionError as e:  # the headers had to come from storage, and it failed
            await self._send(
                cp.Failure(msg.seq, msg.partition, cp.FailureKind.STORE_UNAVAILABLE, f"feed request: {e}").frame()
            )
            return
        except errors.WaltzError as e:  # answered, whatever it is: the client must not wait for its timeout
            log.warning("partition %d: feed request after %d failed: %s", msg.partition, msg.after, e)
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.INTERNAL, f"feed request: {e}").frame())
            return
        await self._send(cp.FeedData(msg.seq, msg.partition, tuple(entries)).frame())

    async def _data(self, msg: cp.TransactionDataRequest) -> None:
        p = self.partitions.by_id.get(msg.partition)
        if p is None:
            await self._not_here(msg.seq, msg.partition)
            return
        try:
            data = await p.transaction_data(msg.transaction_id)
        except errors.InvalidArgumentError as e:
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.NOT_COMMITTED, str(e)).frame())
            return
        except errors.TransactionsDeletedError as e:
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.TRANSACTIONS_DELETED, str(e)).frame())
            return
        except errors.StoreSessionError as e:
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.STORE_UNAVAILABLE, str(e)).frame())
            return
        await self._send(cp.TransactionDataResponse(msg.seq, msg.partition, msg.transaction_id, data).frame())

    async def _data_range(self, msg: cp.TransactionDataRangeRequest) -> None:
        # Out-of-range arguments are answered, not a protocol error: the frame itself was sound,
        # and the connection's other requests go on.
        bad = (
            f"first transaction id {msg.first} is negative"
            if msg.first < 0
            else f"max count {msg.max_count} is outside 1..{cp.MAX_DATA_RANGE_COUNT}"
            if not 1 <= msg.max_count <= cp.MAX_DATA_RANGE_COUNT
            else f"max bytes {msg.max_bytes} is outside 1..{cp.MAX_DATA_RANGE_BYTES}"
            if not 1 <= msg.max_bytes <= cp.MAX_DATA_RANGE_BYTES
            else ""
        )
        if bad:
            await self._send(
                cp.Failure(msg.seq, msg.partition, cp.FailureKind.BAD_REQUEST, f"transaction data range: {bad}").frame()
            )
            return
        p = self.partitions.by_id.get(msg.partition)
        if p is None:
            await self._not_here(msg.seq, msg.partition)
            return
        try:
            data = await p.transaction_data_range(msg.first, msg.max_count, msg.max_bytes)
        except errors.InvalidArgumentError as e:
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.NOT_COMMITTED, str(e)).frame())
            return
        except errors.StoreSessionError as e:
            await self._send(cp.Failure(msg.seq, msg.partition, cp.FailureKind.STORE_UNAVAILABLE, str(e)).frame())
            return
        await self._send(cp.TransactionDataRangeResponse(msg.seq, msg.partition, msg.first, tuple(data)).frame())
