"""Asyncio client of the storage protocol (server ↔ storage node).

Requests are pipelined: each gets a sequence number, many may be in flight on one connection,
and responses are matched by sequence number. Frames are encoded and decoded by the native codec,
the same one the node uses. Every request has a timeout; a Failure from the node raises the
matching `waltz.errors` class with the node's message.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import ssl as _ssl
import struct
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from waltz import errors, tls
from waltz._native import (
    AdminRequestKind,
    Record,
    RecordBatch,
    RequestKind,
    ResponseReader,
    encode_admin_append,
    encode_admin_request,
    encode_append,
    encode_request,
    encode_set_retention,
)
from waltz.event_loop import tell_listener
from waltz.role_secrets import Credential

_FAILURES: dict[str, type[errors.StorageError]] = {
    "cluster_key_mismatch": errors.ClusterKeyMismatch,
    "partition_count_mismatch": errors.PartitionCountMismatch,
    "partition_not_assigned": errors.PartitionNotFoundError,
    "stale_session": errors.StaleSessionError,
    "non_dense_append": errors.NonDenseAppendError,
    "record_too_large": errors.RecordTooLargeError,
    "below_log_start": errors.BelowLogStartError,
    "partition_failed": errors.PartitionFailedError,
    "append_truncated": errors.AppendTruncatedError,
    "refused": errors.RefusedError,
    "corruption": errors.CorruptionError,
    "io": errors.StorageIOError,
}


_PARTITION_AT = struct.Struct(">i")


_FIRST_HELD = re.compile(r"first transaction id (-?\d+)")


def _failure(address: str, kind: str, message: str) -> errors.StorageError:
    cls = _FAILURES.get(kind, errors.StorageRequestError)
    text = f"storage node {address}: {message}"
    if issubclass(cls, errors.StorageRequestError):
        return cls(text, kind)
    err = cls(text)
    err.kind = kind  # type: ignore[attr-defined]
    if kind == "below_log_start":
        # The node's message names where its log starts (the engine's BelowLogStart).
        m = _FIRST_HELD.search(message)
        err.first = int(m.group(1)) if m else -1  # type: ignore[attr-defined]
    return err


class _AppendWait:
    """An Append in flight: its future, settled straight from the read loop (see `send_append`),
    and when it times out (the connection's `_sweep`)."""

    __slots__ = ("address", "partition", "acked", "listener", "deadline")

    def __init__(
        self,
        address: str,
        partition: int,
        acked: asyncio.Future[None],
        listener: Callable[[asyncio.Future[None]], None] | None,
        deadline: float,
    ) -> None:
        self.address = address
        self.partition = partition
        self.acked = acked
        self.listener = listener
        self.deadline = deadline

    def answer(self, kind: str, partition: int, value: Any) -> BaseException | None:
        """Settles the append from its answer; returns the protocol error when the answer is not
        one an append can have (the connection is then out of step and must end)."""
        if kind == "failure":
            self.settle(_failure(self.address, *value))
            return None
        if kind != "success" or partition != self.partition:
            # Only a Success for this partition acknowledges: anything else taken for one would
            # count a replica for a batch it may not hold.
            wrong = errors.ProtocolError(
                f"storage node {self.address} answered an append to partition {self.partition} "
                f"with {kind} for partition {partition}"
            )
            self.settle(wrong)
            return wrong
        self.settle(None)
        return None

    def settle(self, exc: BaseException | None) -> None:
        """Acknowledged (`None`) or failed with `exc`; tells the listener at once."""
        acked = self.acked
        if acked.done():  # cancelled by whoever waited for it
            return
        if exc is None:
            acked.set_result(None)
        else:
            acked.set_exception(exc)
        tell_listener(self.listener, acked, f"storage append listener of {self.address}")


C = TypeVar("C", bound="_Connection")


class _Connection(asyncio.Protocol):
    """A pipelined request/response connection: handshake, sequence numbers, and answers read in
    the transport's own callback. No reading task: a task is woken one loop turn after the
    bytes arrive, and an acknowledgement settles its append (the server's commit path) in the
    turn that read it."""

    ADMIN = False

    def __init__(self, address: str, timeout: float, tls: bool = False):
        self.address = address
        self.timeout = timeout
        self.tls = tls
        self._transport: asyncio.Transport | None = None
        self._decoder = ResponseReader(admin=self.ADMIN)
        self._pending: dict[int, asyncio.Future[tuple[str, Any]] | _AppendWait] = {}
        self._expected: dict[int, tuple[str, int]] = {}
        """Sequence number → the kind of answer its request takes, and its partition (every answer
        repeats its request's message header; appends: see `_AppendWait`)."""
        self._seq = itertools.count(1)
        self._closed: BaseException | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        self._hello_answer: asyncio.Future[Any] = loop.create_future()
        """The node's answer to Hello; until it is done, what arrives is the handshake's."""
        self._lost: asyncio.Future[None] = loop.create_future()
        """Done once the transport is gone (`connection_lost`)."""
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []

    @classmethod
    async def connect(
        cls: type[C],
        host: str,
        port: int,
        *,
        cluster_key: uuid.UUID | str,
        partition_count: int,
        timeout: float = 10.0,
        ssl: _ssl.SSLContext | None = None,
        credential: Credential | None = None,
    ) -> C:
        """Connects (through mutual TLS with `ssl`, a `TlsSection.client_context()`), agrees on a
        protocol version, giving `credential` (role, secret: `waltz.role_secrets`) in the Hello, and
        sends Open (cluster key, partition count). A failed TLS handshake raises `TlsError`; a
        node that refuses the credential, `RefusedError`."""
        address = f"{host}:{port}"
        client = cls(address, timeout, tls=ssl is not None)
        try:
            await tls.create_connection(
                lambda: client, host, port, context=ssl, timeout=timeout, peer=f"storage node {address}"
            )
        except errors.TlsError:
            raise
        except (TimeoutError, OSError) as e:
            raise errors.StorageConnectionError(f"cannot connect to storage node {address}: {e}") from e
        try:
            transport = client._transport
            if transport is not None and not transport.is_closing():
                transport.write(cls._hello(credential))
            # Closed at once (a node at its max_connections, or refusing our certificate): the
            # handshake's answer says why, from `connection_lost`.
            await client._read_hello()
            await client._call(lambda seq: cls._open_frame(seq, str(cluster_key), partition_count))
        except BaseException:
            await client.close()
            raise
        return client

    @staticmethod
    def _hello(credential: Credential | None) -> bytes:
        raise NotImplementedError

    @staticmethod
    def _open_frame(seq: int, cluster_key: str, partition_count: int) -> bytes:
        raise NotImplementedError

    async def _read_hello(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                resp = await self._hello_answer
        except TimeoutError as e:
            raise errors.StorageTimeoutError(f"storage node {self.address} did not answer Hello") from e
        if resp[0] == "failure":
            kind, message = cast("tuple[str, str]", resp[4])
            raise _failure(self.address, kind, f"refused our Hello: {message}")
        if resp[0] != "hello_ok":
            raise errors.ProtocolError(f"storage node {self.address} answered Hello with {resp[0]}")

    def _hello_failed(self, exc: BaseException | None) -> BaseException:
        """Why the connection ended before the node answered Hello (`exc`: the read's error, None
        for a close)."""
        peer = f"storage node {self.address}"
        if exc is None:
            return tls.first_read_error(peer, None, self.tls) or errors.StorageConnectionError(
                f"{peer} closed the connection during Hello: it requires mutual TLS (configure the CA, certificate "
                "and key), "
                "or it is at its [node] max_connections (its log says which)"
            )
        hint = (
            " (a node at its [node] max_connections closes new connections so; its log says)"
            if isinstance(exc, ConnectionResetError)
            else ""
        )
        return tls.first_read_error(peer, exc, self.tls) or errors.StorageConnectionError(f"{peer}: {exc}{hint}")

    # -- asyncio.Protocol: called by the transport ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        hello = self._hello_answer
        if not hello.done():
            if not self.tls and tls.looks_like_tls(data):
                hello.set_exception(tls.plaintext_refused(f"storage node {self.address}"))
                return
            try:
                self._decoder.feed(data)
                resp = self._decoder.next_response()
            except errors.WaltzError as e:
                hello.set_exception(e)
                return
            if resp is not None:
                hello.set_result(resp)
            return
        if self._closed is not None:
            return  # failed already (out of step): nothing more is read
        try:
            self._decoder.feed(data)
            self._answers()
        except Exception as e:  # out of step, or a bug: every request in flight hears of it
            failure = (
                e
                if isinstance(e, errors.WaltzError)
                else errors.StorageConnectionError(f"storage node {self.address}: reading its answers failed: {e!r}")
            )
            self._fail_all(failure)
            self._close_transport()  # nothing more may be sent on it

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._hello_answer.done():
            self._hello_answer.set_exception(self._hello_failed(exc))
        if exc is None:
            self._fail_all(errors.StorageConnectionError(f"storage node {self.address} closed the connection"))
        else:
            self._fail_all(errors.StorageConnectionError(f"storage node {self.address}: {exc}"))
        self._resume_writers()
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._resume_writers()

    def _resume_writers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _drain(self) -> None:
        """Waits while the transport's buffer is over its high-water mark (a node that stops
        reading): requests then wait here, within their deadline."""
        if self._paused and not self._lost.done():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def _answers(self) -> None:
        """Settles the requests whose answers were read."""
        while (resp := self._decoder.next_response()) is not None:
            kind, seq, _session, partition, value = resp
            waiting = self._pending.pop(seq, None)
            if isinstance(waiting, _AppendWait):
                wrong = waiting.answer(kind, partition, value)
                if wrong is not None:
                    raise wrong
                continue
            expected = self._expected.pop(seq, None)
            if expected is not None and kind != "failure" and (kind, partition) != expected:
                wrong = errors.ProtocolError(
                    f"storage node {self.address} answered request {seq} with {kind} for partition "
                    f"{partition}, not {expected[0]} for partition {expected[1]}"
                )
                if waiting is not None and not waiting.done():
                    waiting.set_exception(wrong)
                raise wrong
            if waiting is not None and not waiting.done():
                waiting.set_result((kind, value))

    def _fail_all(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        waiting, self._pending = list(self._pending.values()), {}
        self._expected.clear()
        for w in waiting:
            if isinstance(w, _AppendWait):
                w.settle(exc)
            elif not w.done():
                w.set_exception(exc)

    def _close_transport(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _write_raw(self, frame: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            raise errors.StorageConnectionError(f"connection to {self.address} is closed")
        self._transport.write(frame)

    def _send(self, encode: Any, expect: str) -> tuple[int, asyncio.Future[tuple[str, Any]]]:
        """Writes a request now (requests go out in call order) and returns its response future;
        an answer of another kind than `expect` (or a Failure) ends the connection."""
        fut: asyncio.Future[tuple[str, Any]] = asyncio.get_running_loop().create_future()
        seq, frame = self._write(encode, fut)
        # The message header's partition id, after length, magic, version and type (8 bytes)
        # and the session id and seq (16).
        self._expected[seq] = (expect, _PARTITION_AT.unpack_from(frame, 24)[0])
        return seq, fut

    def _write(self, encode: Any, waiting: asyncio.Future[tuple[str, Any]] | _AppendWait) -> tuple[int, bytes]:
        """Sends the request `encode(seq)` builds; its seq and frame."""
        if self._closed is not None:
            raise errors.StorageConnectionError(f"connection to {self.address} is closed: {self._closed}")
        seq = next(self._seq)
        frame = encode(seq)
        self._pending[seq] = waiting
        try:
            self._write_raw(frame)
        except (ConnectionError, OSError, errors.StorageConnectionError) as e:
            self._pending.pop(seq, None)
            raise errors.StorageConnectionError(f"storage node {self.address}: {e}") from e
        return seq, frame

    async def _wait(self, seq: int, fut: asyncio.Future[tuple[str, Any]]) -> Any:
        try:
            # One deadline over flushing and waiting: a node that stops reading must not stall
            # us past the timeout either (asyncio.timeout, unlike wait_for, adds no task).
            async with asyncio.timeout(self.timeout):
                await self._drain()
                kind, value = await fut
        except TimeoutError as e:
            raise errors.StorageTimeoutError(
                f"storage node {self.address} did not answer request {seq} in {self.timeout}s"
            ) from e
        except (ConnectionError, OSError) as e:
            raise errors.StorageConnectionError(f"storage node {self.address}: {e}") from e
        finally:
            # Whatever ended the wait (answer, timeout, cancellation), the entries go.
            self._pending.pop(seq, None)
            self._expected.pop(seq, None)
        if kind == "failure":
            raise _failure(self.address, *value)
        return value

    async def _call(self, encode: Any, expect: str = "success") -> Any:
        seq, fut = self._send(encode, expect)
        return await self._wait(seq, fut)

    def _listed(self, items: list[Any], txid: int) -> list[Any]:
        """A list answer must run densely from the id asked for: callers count on it (catch-up
        copies what it gets at the ids it asked for)."""
        for i, item in enumerate(items):
            if item.txid != txid + i:
                got = ", ".join(str(x.txid) for x in items[: i + 1][-3:])
                raise errors.ProtocolError(
                    f"storage node {self.address} answered a list from {txid} with ids ..., {got}"
                )
        return items

    def _single(self, item: Any, txid: int) -> Any:
        if item is not None and item.txid != txid:
            raise errors.ProtocolError(
                f"storage node {self.address} answered a read of {txid} with transaction {item.txid}"
            )
        return item

    async def close(self) -> None:
        """Fails what is in flight and closes; a node that stopped reading cannot hold the close
        up: after `timeout` the connection is dropped with whatever it still had to send."""
        self._fail_all(errors.StorageConnectionError(f"connection to {self.address} closed"))
        transport = self._transport
        if transport is None:
            return
        self._close_transport()
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.shield(self._lost)
        except TimeoutError:
            transport.abort()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class StorageClient(_Connection):
    """One connection to one storage node (storage protocol). Use `await StorageClient.connect()`."""

    @staticmethod
    def _hello(credential: Credential | None) -> bytes:
        role, secret = credential or (None, None)
        return encode_request(RequestKind.HELLO, min_version=1, max_version=1, role=role, secret=secret)

    @staticmethod
    def _open_frame(seq: int, cluster_key: str, partition_count: int) -> bytes:
        return encode_request(RequestKind.OPEN, -1, seq, -1, cluster_key=cluster_key, partition_count=partition_count)

    async def last_session_info(self, partition: int, session: int) -> tuple[int, int]:
        """(session id, low-water mark) of the partition's last store session on this node."""
        return await self._call(
            lambda seq: encode_request(RequestKind.LAST_SESSION_INFO, session, seq, partition), "last_session_info"
        )

    async def max_transaction_id(self, partition: int, session: int) -> int:
        return await self._call(
            lambda seq: encode_request(RequestKind.MAX_TRANSACTION_ID, session, seq, partition), "max_transaction_id"
        )

    async def truncate(self, partition: int, session: int, txid: int) -> None:
        await self._call(lambda seq: encode_request(RequestKind.TRUNCATE, session, seq, partition, txid=txid))

    async def restart_log(self, partition: int, session: int, first_txid: int) -> None:
        """Replaces the replica's log with an empty one starting at `first_txid` (past its end)."""
        await self._call(lambda seq: encode_request(RequestKind.RESTART_LOG, session, seq, partition, txid=first_txid))

    async def set_low_water_mark(self, partition: int, session: int, low_water_mark: int) -> None:
        await self._call(
            lambda seq: encode_request(
                RequestKind.SET_LOW_WATER_MARK, session, seq, partition, low_water_mark=low_water_mark
            )
        )

    async def set_retention(
        self,
        partition: int,
        session: int,
        *,
        max_age_ms: int | None,
        max_bytes: int | None,
        min_kept: int,
        hold_from: int,
        lease_ms: int,
    ) -> int:
        """Hands the node the partition's retention order for `lease_ms` (docs/protocol.md);
        returns the first id the replica holds now."""
        return await self._call(
            lambda seq: encode_set_retention(
                session,
                seq,
                partition,
                max_age_ms=-1 if max_age_ms is None else max_age_ms,
                max_bytes=-1 if max_bytes is None else max_bytes,
                min_kept=min_kept,
                hold_from=hold_from,
                lease_ms=lease_ms,
            ),
            "retention",
        )

    async def append(self, partition: int, session: int, first_txid: int, batch: RecordBatch) -> None:
        """Returns once the node has the batch durably (fdatasync returned)."""
        await self._call(lambda seq: encode_append(session, seq, partition, first_txid, batch))

    def send_append(
        self,
        partition: int,
        session: int,
        first_txid: int,
        batch: RecordBatch,
        listener: Callable[[asyncio.Future[None]], None] | None = None,
    ) -> asyncio.Future[None]:
        """Sends the Append now, so that appends leave in call order, and returns a future that
        completes once the node has the batch durably, or fails with the node's error, or with
        `StorageTimeoutError` when no answer came within `timeout`. `listener(future)` is called
        as soon as it completes, in the same loop turn as the answer was read, where a done
        callback would wait for the next turn: the server's commit path runs there (three
        appends per batch). No task per append: a plain future and a deadline."""
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[None] = loop.create_future()
        wait = _AppendWait(self.address, partition, acked, listener, loop.time() + self.timeout)
        self._write(lambda s: encode_append(session, s, partition, first_txid, batch), wait)
        if self._sweep_timer is None:
            self._sweep_timer = loop.call_at(wait.deadline, self._sweep)
        return acked

    def _sweep(self) -> None:
        """Fails the appends whose deadline has passed, then waits for the next one's. One timer
        per connection, not one per append: a uvloop timer costs 2-4 µs to arm and cancel, three
        times per batch on the server's commit path. Appends are sent in deadline order and
        `_pending` keeps send order, so the first append not yet due ends the scan."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        due: list[tuple[int, _AppendWait]] = []
        for seq, wait in self._pending.items():
            if isinstance(wait, _AppendWait):
                if wait.deadline > now:
                    break
                due.append((seq, wait))
        for seq, wait in due:
            if self._pending.pop(seq, None) is wait:
                wait.settle(
                    errors.StorageTimeoutError(
                        f"storage node {self.address} did not answer request {seq} in {self.timeout}s"
                    )
                )
        # Until here the fired timer still counts as armed, so that an append a listener above sent
        # waits behind the older ones: the timer goes to the oldest deadline left.
        self._sweep_timer = None
        if self._closed is None:
            oldest = next((w for w in self._pending.values() if isinstance(w, _AppendWait)), None)
            if oldest is not None:
                self._sweep_timer = loop.call_at(oldest.deadline, self._sweep)

    async def record_header(self, partition: int, session: int, txid: int) -> Any:
        return self._single(
            await self._call(
                lambda seq: encode_request(RequestKind.RECORD_HEADER, session, seq, partition, txid=txid),
                "record_header",
            ),
            txid,
        )

    async def record(self, partition: int, session: int, txid: int) -> Any:
        return self._single(
            await self._call(
                lambda seq: encode_request(RequestKind.RECORD, session, seq, partition, txid=txid), "record"
            ),
            txid,
        )

    async def record_headers(self, partition: int, session: int, txid: int, max_count: int = 1000) -> list[Any]:
        return self._listed(
            await self._call(
                lambda seq: encode_request(
                    RequestKind.RECORD_HEADER_LIST, session, seq, partition, txid=txid, max_count=max_count
                ),
                "record_header_list",
            ),
            txid,
        )

    async def records(self, partition: int, session: int, txid: int, max_count: int = 1000) -> list[Any]:
        return self._listed(
            await self._call(
                lambda seq: encode_request(
                    RequestKind.RECORD_LIST, session, seq, partition, txid=txid, max_count=max_count
                ),
                "record_list",
            ),
            txid,
        )


class StorageAdminClient(_Connection):
    """One connection to a storage node's admin port. Use `await StorageAdminClient.connect()`."""

    ADMIN = True

    @staticmethod
    def _hello(credential: Credential | None) -> bytes:
        role, secret = credential or (None, None)
        return encode_admin_request(AdminRequestKind.HELLO, role=role, secret=secret)

    @staticmethod
    def _open_frame(seq: int, cluster_key: str, partition_count: int) -> bytes:
        return encode_admin_request(
            AdminRequestKind.OPEN, seq, cluster_key=cluster_key, partition_count=partition_count
        )

    async def assign(self, partition: int) -> None:
        """Assigns the partition to the node, creating its files if needed (idempotent)."""
        await self._call(lambda seq: encode_admin_request(AdminRequestKind.ASSIGN, seq, partition))

    async def unassign(self, partition: int, *, delete_files: bool = False) -> None:
        await self._call(
            lambda seq: encode_admin_request(AdminRequestKind.UNASSIGN, seq, partition, delete_files=delete_files)
        )

    async def set_availability(self, partition: int, *, readable: bool, writable: bool) -> None:
        await self._call(
            lambda seq: encode_admin_request(
                AdminRequestKind.SET_AVAILABILITY, seq, partition, readable=readable, writable=writable
            )
        )

    async def records(self, partition: int, txid: int, max_count: int = 1000) -> list[Record]:
        """Records from `txid` on (at most the node's list bounds), read without a store session."""
        return self._listed(
            await self._call(
                lambda seq: encode_admin_request(
                    AdminRequestKind.RECORD_LIST, seq, partition, txid=txid, max_count=max_count
                ),
                "record_list",
            ),
            txid,
        )

    async def append(self, partition: int, records: Sequence[Record]) -> None:
        """Appends records (with their own ids) durably, without a store session. The node
        refuses unless the partition is marked unwritable (no server writes it meanwhile)."""
        await self._call(lambda seq: encode_admin_append(seq, partition, records))

    async def reset_fence(self, partition: int, session_id: int) -> None:
        """Lowers the partition's fence (newest session seen) to `session_id`: the repair of a fence
        a request no server sent raised out of every server's reach. `waltz storage reset-fence`
        checks the cluster metadata first; the node refuses below the session that set its
        low-water mark."""
        await self._call(
            lambda seq: encode_admin_request(AdminRequestKind.RESET_FENCE, seq, partition, session_id=session_id)
        )

    async def truncate(self, partition: int, txid: int, *, force: bool = False) -> None:
        """Truncates the partition after `txid`, only while it is marked unwritable. Below the
        replica's low-water mark (committed records) the node refuses (`RefusedError`) unless
        `force`, which only a connection that proved the admin role may use."""
        await self._call(
            lambda seq: encode_admin_request(AdminRequestKind.TRUNCATE, seq, partition, txid=txid, force=force)
        )

    async def raise_fence(self, partition: int, session_id: int, *, force: bool = False) -> None:
        """Raises the partition's fence to `session_id` (nothing when already there). More than
        2^32 above the fence the node refuses (`RefusedError`) unless `force`, which only a
        connection that proved the admin role may use."""
        await self._call(
            lambda seq: encode_admin_request(
                AdminRequestKind.RAISE_FENCE, seq, partition, session_id=session_id, force=force
            )
        )

    async def set_partition_info(self, partition: int, session_id: int, low_water_mark: int) -> None:
        """Sets the last session info recovery compares with the metadata; only while unwritable."""
        await self._call(
            lambda seq: encode_admin_request(
                AdminRequestKind.SET_PARTITION_INFO,
                seq,
                partition,
                session_id=session_id,
                low_water_mark=low_water_mark,
            )
        )

    async def restart_log(self, partition: int, first_txid: int) -> None:
        """Replaces the replica's log with an empty one starting at `first_txid` (past its end);
        refused unless the partition is marked unwritable (maintenance)."""
        await self._call(
            lambda seq: encode_admin_request(AdminRequestKind.RESTART_LOG, seq, partition, txid=first_txid)
        )

    async def status(self) -> list[dict[str, Any]]:
        """Per partition: first and max transaction id, last session and low-water marks, the
        newest session seen (the fence), readable, writable, and why it failed (or None)."""
        return await self._call(lambda seq: encode_admin_request(AdminRequestKind.STATUS, seq), "status")
