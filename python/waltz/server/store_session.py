"""A partition's store session: the server's replicated, pipelined write path to its storage nodes.

Opening one takes a new session id by compare-and-set in the partition metadata (refused when
the partition has moved to a newer generation), which fences every older session on every replica
it reaches, then runs the recovery of `waltz.server.recovery` against the replicas:

- each reachable replica is prepared (truncated as its metadata state and its last session info
  say) and votes; replicas that cannot be reached count against deciding;
- while the vote is undecidable, replicas of the electorate behind the highest one are filled
  from it in bounded batches and unreachable ones are retried, and the vote runs again, until
  `recovery_timeout` (then `RecoveryNeededError`, and the partition retries with a new session);
- once the closing high-water mark is decided, dirty tails above it are truncated, it becomes
  the low-water mark of every replica holding exactly it, and the metadata records them clean.

Appends get the next ids, are sent at once to every replica in the write path (many batches in
flight, not stop-and-wait) and commit when a majority of the partition's replicas acknowledged
them durably, strictly in id order. An assigned replica outside the write path (unreachable at the
start, behind, failed, or `max_lag` batches behind) has a task of its own: it reconnects with
backoff, is prepared again, is filled with committed records from the write path in bounded
batches while writes go on, is recorded clean in the metadata (before it acknowledges anything:
the recovery's invariant), and rejoins the write path. Losing the majority, or any replica
answering that a newer session exists, ends the session: in-flight appends fail with
`StoreSessionError` (outcome unknown) and later appends are refused.

Metadata and storage connections are passed in (`offload`, `connect`) so that the deterministic
simulation (`tests/simulation/`) runs this very code over simulated nodes and a virtual clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl as _ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from waltz import errors
from waltz._native import RecordBatch
from waltz.cluster.metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.event_loop import tell_listener
from waltz.role_secrets import Credential
from waltz.server import recovery
from waltz.storage.client import StorageClient

log = logging.getLogger(__name__)

CATCH_UP_BATCH = 4000
"""Records per catch-up read (the storage node also bounds a list response in bytes)."""
CATCH_UP_WRITES = 4
"""Catch-up appends in flight to the replica being filled while the next batch is read."""


class Metadata(Protocol):
    """What a store session needs of `ClusterMetadata` (the simulation has its own)."""

    def info(self) -> Any: ...
    def replicas_of(self, partition_id: int) -> list[Any]: ...
    def partition_metadata(self, partition_id: int) -> tuple[PartitionMetadata, int]: ...
    def set_partition_metadata(self, partition_id: int, meta: PartitionMetadata, version: int) -> int: ...


Connect = Callable[[str], Awaitable[Any]]
"""Connects to the storage node at `host:port` and returns a client (`StorageClient` methods)."""
Offload = Callable[..., Awaitable[Any]]
"""Runs a blocking metadata call: `asyncio.to_thread`, or a direct call in the simulation."""
Pack = Callable[[list[Any]], Any]
"""Packs records read from one replica into a batch for another (`RecordBatch`)."""


@dataclasses.dataclass(eq=False)
class _Pending:
    first: int
    last: int
    batch: RecordBatch
    """Kept until committed: a replica that catches up is sent the batches still in flight."""
    future: asyncio.Future[tuple[int, int]]
    listener: Callable[[asyncio.Future[tuple[int, int]]], None] | None = None
    acks: set[str] = dataclasses.field(default_factory=set)

    def settle(self, result: tuple[int, int] | BaseException) -> None:
        """Completes the future and tells the listener at once (see `StoreSession.append`)."""
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
            self.future.exception()  # a caller that dropped the future has nothing to be warned about
        else:
            self.future.set_result(result)
        tell_listener(self.listener, self.future, "store session commit listener")


@dataclasses.dataclass(eq=False)
class _Replica:
    address: str
    assigned: bool = True
    client: Any = None
    in_write_path: bool = False
    in_flight: int = 0
    left_because: str | None = None
    catching_up: bool = False
    broken: bool = False
    """Its connection failed: the replica task reconnects before anything else."""
    prepared: recovery.Preparation | None = None
    served: bool = False
    """It has been in this session's write path, so it holds this session's log (it may have
    left since): reads may fall back to it. One that never was may hold an older session's dirty
    tail at ids this session committed differently."""
    log_start: int = 0
    """Where its log starts when that is above what the recovery keeps of it (see `_prepare`)."""


class _Deleted(Exception):
    """A catch-up source no longer holds the id asked for: retention deleted it (`first` is where
    its log starts)."""

    def __init__(self, first: int) -> None:
        super().__init__(first)
        self.first = first


def _new_session_id(metadata: Metadata, partition: int, generation: int) -> int:
    while True:
        meta, version = metadata.partition_metadata(partition)
        if meta.generation > generation:
            raise errors.StaleGenerationError(
                f"partition {partition} is at generation {meta.generation}; this server holds generation {generation}"
            )
        try:
            metadata.set_partition_metadata(
                partition, dataclasses.replace(meta, generation=generation, session_id=meta.session_id + 1), version
            )
            return meta.session_id + 1
        except errors.MetadataVersionError:
            continue


def _update(
    metadata: Metadata, partition: int, session: int, change: Callable[[PartitionMetadata], PartitionMetadata]
) -> None:
    """Compare-and-set of the partition metadata, only while `session` is still the newest."""
    while True:
        meta, version = metadata.partition_metadata(partition)
        if meta.session_id != session:
            raise errors.StoreSessionError(
                f"partition {partition}: store session {meta.session_id} replaced ours ({session})"
            )
        try:
            metadata.set_partition_metadata(partition, change(meta), version)
            return
        except errors.MetadataVersionError:
            continue


def _upto(records: list[Any], last: int) -> list[Any]:
    """The records of a list read (dense ids) up to `last`, without looking at each one."""
    if not records or records[-1].txid <= last:
        return records
    return records[: max(0, last - records[0].txid + 1)]


def _network_connect(
    info: Any, timeout: float, ssl: _ssl.SSLContext | None, credential: Credential | None = None
) -> Connect:
    async def connect(address: str) -> StorageClient:
        host, port = address.rsplit(":", 1)
        return await StorageClient.connect(
            host,
            int(port),
            cluster_key=info.cluster_key,
            partition_count=info.partitions,
            timeout=timeout,
            ssl=ssl,
            credential=credential,
        )

    return connect


class StoreSession:
    """Use `await StoreSession.open(metadata, partition, generation)`; `append(batch)`; `close()`."""

    def __init__(
        self,
        partition: int,
        session_id: int,
        replicas: list[_Replica],
        *,
        max_lag: int,
        metadata: Metadata,
        connect: Connect,
        offload: Offload,
        pack: Pack = RecordBatch,
    ) -> None:
        self.partition = partition
        self.session_id = session_id
        self._replicas = replicas
        self.replica_count = sum(1 for r in replicas if r.assigned)
        self.quorum = self.replica_count // 2 + 1
        self.high_water_mark = -1
        self.start_high_water_mark = -1
        self.max_lag = max_lag
        self.metadata = metadata
        self._connect = connect
        self._offload = offload
        self._pack = pack
        self._next = 0
        self._pending: deque[_Pending] = deque()
        # Dicts, not sets: insertion order keeps the simulation's schedule reproducible.
        self._tasks: dict[asyncio.Future[Any], None] = {}
        self._closing: dict[asyncio.Future[Any], None] = {}
        self._failed: errors.StoreSessionError | None = None
        self.recovery_log: list[str] = []
        """How the recovery went, one line a step (for logs, errors and tests)."""
        self.successor_wanted: str | None = None
        """Why this session should be replaced by a new one as soon as possible (a replica that
        lost its files can only rejoin through a new session's recovery)."""
        self.on_successor_wanted: Callable[[], None] | None = None
        """Called when `successor_wanted` is set (the partition then opens the next session)."""

    # -- opening: the recovery ---------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        metadata: Metadata,
        partition: int,
        generation: int,
        *,
        timeout: float = 10.0,
        max_lag: int = 256,
        recovery_timeout: float | None = None,
        connect: Connect | None = None,
        offload: Offload = asyncio.to_thread,
        pack: Pack = RecordBatch,
        ssl: _ssl.SSLContext | None = None,
        credential: Credential | None = None,
    ) -> StoreSession:
        """Opens the next session of `partition` and recovers it; waits up to `recovery_timeout`
        (default: three times `timeout`) for the vote to become decidable. Storage nodes are
        reached through mutual TLS with `ssl`, giving the server role's `credential` at Hello
        (unless `connect` says otherwise)."""
        info = await offload(metadata.info)
        assigned = [n.address for n in await offload(metadata.replicas_of, partition)]
        if not assigned:
            raise errors.StoreSessionError(f"partition {partition} has no replicas assigned")
        session = await offload(_new_session_id, metadata, partition, generation)
        meta, _ = await offload(metadata.partition_metadata, partition)
        electors = recovery.electorate(meta, assigned)
        replicas = [_Replica(a, assigned=a in assigned) for a in sorted(set(assigned) | set(electors))]
        opened = cls(
            partition,
            session,
            replicas,
            max_lag=max_lag,
            metadata=metadata,
            connect=connect or _network_connect(info, timeout, ssl, credential),
            offload=offload,
            pack=pack,
        )
        try:
            await opened._recover(meta, electors, timeout * 3 if recovery_timeout is None else recovery_timeout)
        except errors.StaleSessionError as e:
            await opened.close()
            raise errors.StoreSessionError(
                f"partition {partition}: a newer store session than {session} exists: {e}"
            ) from e
        except BaseException:
            await opened.close()
            raise
        return opened

    def _note(self, line: str) -> None:
        self.recovery_log.append(line)
        log.debug("partition %d session %d: %s", self.partition, self.session_id, line)

    def _drop(self, r: _Replica, why: str) -> None:
        """Forgets a replica's connection (closed in the background) after `why` went wrong with it."""
        client, r.client, r.prepared = r.client, None, None
        r.left_because = why
        if client is not None:
            task = asyncio.ensure_future(client.close())
            self._closing[task] = None
            task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def _prepare(self, r: _Replica, meta: PartitionMetadata) -> tuple[recovery.Preparation, int]:
        """Asks a connected replica what it holds and truncates it as the recovery says; returns
        the preparation and the replica's last clean session."""
        lsn, lwm = await r.client.last_session_info(self.partition, self.session_id)
        top = await r.client.max_transaction_id(self.partition, self.session_id)
        prep = recovery.prepare(
            meta.replicas.get(r.address), recovery.ReplicaReport(lsn, lwm, top), recovery.last_session(meta)
        )
        r.log_start = 0
        if prep.truncate_to is not None:
            try:
                await r.client.truncate(self.partition, self.session_id, prep.truncate_to)
            except errors.BelowLogStartError as e:
                # Its log starts above the mark: it restarted at the others' first id (retention
                # had deleted what it lacked) and no session recorded it clean since. Nothing it
                # holds is kept, as the recovery says, and it stays a log starting there: it is
                # filled from there (it votes as before, for nothing above the mark). Found by
                # the simulation with retention and lost disks in one run (seed 48).
                first = getattr(e, "first", None)
                if first is None or first < 0:
                    raise
                await r.client.truncate(self.partition, self.session_id, first - 1)
                r.log_start = first
                prep = dataclasses.replace(prep, why=f"{prep.why}; its log starts at {first}: emptied")
        self._note(f"{r.address}: max {top}; {prep.why}")
        if prep.forgot:
            log.warning("partition %d session %d: %s: %s", self.partition, self.session_id, r.address, prep.why)
        return prep, lsn

    async def _reach(self, r: _Replica, meta: PartitionMetadata) -> None:
        """Connects to a replica and prepares it; one that cannot be reached counts as unreachable."""
        try:
            if r.client is None:
                r.client = await self._connect(r.address)
            r.prepared, _ = await self._prepare(r, meta)
        except errors.StaleSessionError:
            raise
        except errors.RefusedError as e:
            # Refused by the node's own rules (a role secret, a session far above its fence):
            # waiting does not heal it, so it is said at once rather than after the recovery timeout.
            log.warning("partition %d session %d: %s refused us: %s", self.partition, self.session_id, r.address, e)
            self._drop(r, str(e))
        except errors.WaltzError as e:
            self._drop(r, str(e))

    async def _recover(self, meta: PartitionMetadata, electors: list[str], recovery_timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + recovery_timeout
        last = recovery.last_session(meta)
        while True:
            await asyncio.gather(*(self._reach(r, meta) for r in self._replicas if r.prepared is None))
            prepared = {r.address: r.prepared for r in self._replicas if r.prepared is not None}
            outcome = recovery.vote(electors, prepared)
            if outcome.closing is not None:
                break
            # Undecidable (only while an elector is unreachable): fill the electors behind the
            # highest replica, which may decide it, or wait for the unreachable ones.
            if await self._fill_electors(electors):
                continue
            if loop.time() >= deadline:
                down = "; ".join(f"{r.address}: {r.left_because}" for r in self._replicas if r.prepared is None)
                raise errors.RecoveryNeededError(
                    f"partition {self.partition}: the closing high-water mark of "
                    f"{'session ' + str(last) if last is not None else 'the partition'} is undecidable: "
                    f"{outcome.why} ({down}); retrying with a new session"
                )
            await asyncio.sleep(0.2)
        closing = outcome.closing
        self._note(f"closing high-water mark {closing}: {outcome.why}")
        await self._settle(closing, deadline)
        clean = [r.address for r in self._replicas if r.in_write_path]
        assigned = [r.address for r in self._replicas if r.assigned]
        await self._offload(
            _update,
            self.metadata,
            self.partition,
            self.session_id,
            lambda m: recovery.after_recovery(m, self.session_id, closing, clean, assigned),
        )
        self.high_water_mark = self.start_high_water_mark = closing
        self._next = closing + 1
        for r in self._replicas:
            if not r.assigned:
                self._drop(r, "not assigned")
            elif not r.in_write_path:
                self._start_replica_task(r)
        log.info(
            "partition %d: store session %d open at high-water mark %d on %s%s",
            self.partition,
            self.session_id,
            closing,
            ", ".join(clean),
            "".join(
                f"; {r.address} not yet ({r.left_because or 'catching up'})"
                for r in self._replicas
                if r.assigned and not r.in_write_path
            ),
        )

    async def _fill_electors(self, electors: list[str]) -> bool:
        """Copies one bounded batch from the replica holding the most to each elector behind it
        (every prepared replica holds a prefix of one sequence). True if anything was copied."""
        ready = [r for r in self._replicas if r.prepared is not None]
        source = max(ready, key=lambda r: r.prepared.high_water_mark if r.prepared else -1, default=None)
        if source is None or source.prepared is None:
            return False
        top = source.prepared.high_water_mark
        behind = [
            r for r in ready if r.address in electors and r.prepared is not None and r.prepared.high_water_mark < top
        ]
        if not behind:
            return False
        results = await asyncio.gather(*(self._copy(source, r, top) for r in behind))
        return any(results)

    async def _copy(self, source: _Replica, r: _Replica, upto: int) -> bool:
        assert r.prepared is not None
        nxt = r.prepared.high_water_mark + 1
        try:
            got = await source.client.records(self.partition, self.session_id, nxt, CATCH_UP_BATCH)
        except errors.StaleSessionError:
            raise
        except errors.BelowLogStartError as e:
            first = getattr(e, "first", -1)
            if first <= nxt:
                self._drop(source, str(e))
                return False
            # The source's retention deleted past r's end: r restarts where the source holds (as
            # a lagging replica's catch-up does) and is filled from there in the next rounds.
            try:
                await r.client.restart_log(self.partition, self.session_id, first)
            except errors.StaleSessionError:
                raise
            except errors.WaltzError as e2:
                self._drop(r, str(e2))
                return False
            self._note(f"{r.address} ends at {nxt - 1}, below {source.address}'s first id {first}: restarted there")
            r.prepared = dataclasses.replace(r.prepared, high_water_mark=first - 1)
            return True
        records = _upto(got, upto)
        if not records:
            return False
        try:
            await r.client.append(self.partition, self.session_id, nxt, self._pack(records))
        except errors.StaleSessionError:
            raise
        except errors.WaltzError as e:
            self._drop(r, str(e))
            return False
        r.prepared = dataclasses.replace(r.prepared, high_water_mark=records[-1].txid)
        return True

    async def _settle(self, closing: int, deadline: float) -> None:
        """Truncates dirty tails above the closing mark, sets it as the low-water mark of the
        assigned replicas that hold exactly it (the write path), and fills enough others to
        reach the write quorum if need be."""

        async def clean(r: _Replica) -> None:
            assert r.prepared is not None
            try:
                if r.prepared.high_water_mark > closing:
                    await r.client.truncate(self.partition, self.session_id, closing)
                    self._note(f"{r.address}: dirty tail {closing + 1}..{r.prepared.high_water_mark} truncated")
                    r.prepared = dataclasses.replace(r.prepared, high_water_mark=closing)
                if r.assigned and r.prepared.high_water_mark == closing:
                    await r.client.set_low_water_mark(self.partition, self.session_id, closing)
                    self._enter(r)
            except errors.StaleSessionError:
                raise
            except errors.WaltzError as e:
                self._drop(r, str(e))

        while True:
            await asyncio.gather(*(clean(r) for r in self._replicas if r.prepared is not None and not r.in_write_path))
            members = sum(1 for r in self._replicas if r.in_write_path)
            if members >= self.quorum:
                return
            # Too few hold the mark: fill the reachable assigned ones that are behind.
            sources = [r for r in self._replicas if r.prepared is not None and r.prepared.high_water_mark >= closing]
            behind = [
                r
                for r in self._replicas
                if r.assigned and r.prepared is not None and r.prepared.high_water_mark < closing
            ]
            copied = False
            if sources and behind:
                copied = any(await asyncio.gather(*(self._copy(sources[0], r, closing) for r in behind)))
            if copied:
                continue
            if asyncio.get_running_loop().time() >= deadline:
                raise errors.StoreSessionError(
                    f"partition {self.partition}: only {members} of {self.replica_count} replicas hold the closing "
                    "high-water "
                    f"mark {closing}, {self.quorum} needed ("
                    + "; ".join(
                        f"{r.address}: {r.left_because or 'behind'}"
                        for r in self._replicas
                        if r.assigned and not r.in_write_path
                    )
                    + ")"
                )
            await asyncio.sleep(0.2)
            meta, _ = await self._offload(self.metadata.partition_metadata, self.partition)
            await asyncio.gather(*(self._reach(r, meta) for r in self._replicas if r.assigned and r.prepared is None))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks[task] = None
        task.add_done_callback(lambda t: self._tasks.pop(t, None))

    # -- writing ---------------------------------------------------------------------------
    @property
    def assigned_replicas(self) -> list[str]:
        return [r.address for r in self._replicas if r.assigned]

    @property
    def replicas_in_write_path(self) -> list[str]:
        return [r.address for r in self._replicas if r.in_write_path]

    @property
    def failed(self) -> errors.StoreSessionError | None:
        return self._failed

    def append(
        self, batch: RecordBatch, listener: Callable[[asyncio.Future[tuple[int, int]]], None] | None = None
    ) -> asyncio.Future[tuple[int, int]]:
        """Gives the batch the next ids and sends it to every replica in the write path now.
        The future completes with (first, last) once a majority has it durably, in id order.
        `listener(future)` is called as soon as it completes, within the loop turn that read the
        deciding acknowledgement (a done callback would wait a turn more)."""
        if self._failed is not None:
            raise self._failed
        if len(batch) == 0:
            raise errors.InvalidArgumentError("an empty batch has no transaction ids")
        first = self._next
        self._next += len(batch)
        pending = _Pending(first, self._next - 1, batch, asyncio.get_running_loop().create_future(), listener)
        self._pending.append(pending)
        for r in self._replicas:
            if not r.in_write_path:
                continue
            if r.in_flight >= self.max_lag:
                self._leave(r, f"fell {r.in_flight} batches behind", broken=False)
                continue
            try:
                self._send(r, pending)
            except errors.WaltzError as e:
                self._leave(r, str(e))
        return pending.future

    def _send(self, r: _Replica, pending: _Pending) -> None:
        """Sends `pending` to the replica (raises the connection's error) and counts its answer
        when it comes: a listener called from the connection's read loop, not a task per replica
        per batch (the server's hot path)."""

        def answered(f: asyncio.Future[None]) -> None:
            r.in_flight -= 1
            exc = None if f.cancelled() else f.exception()
            if f.cancelled() or self._failed is not None:
                return  # the session is over: nothing in flight can count any more
            if isinstance(exc, errors.StaleSessionError):
                self._fail(f"fenced: {r.address} has seen a newer store session ({exc})")
            elif exc is not None:
                self._leave(r, str(exc) or type(exc).__name__)
            else:
                # Durable in this session on that replica: it counts even if it has left the write path since.
                pending.acks.add(r.address)
                self._advance()

        r.client.send_append(self.partition, self.session_id, pending.first, pending.batch, answered)
        r.in_flight += 1

    def _advance(self) -> None:
        while self._pending and len(self._pending[0].acks) >= self.quorum:
            p = self._pending.popleft()
            self.high_water_mark = p.last
            p.settle((p.first, p.last))

    @staticmethod
    def _enter(r: _Replica) -> None:
        r.in_write_path, r.left_because, r.served = True, None, True

    def _leave(self, r: _Replica, why: str, *, broken: bool = True) -> None:
        if not r.in_write_path:
            return
        r.in_write_path, r.left_because, r.broken = False, why, broken
        log.warning(
            "partition %d session %d: replica %s leaves the write path: %s",
            self.partition,
            self.session_id,
            r.address,
            why,
        )
        alive = sum(1 for x in self._replicas if x.in_write_path)
        if alive < self.quorum:
            self._fail(
                f"lost the quorum: {alive} of {self.replica_count} replicas left in the write path, {self.quorum} "
                "needed"
            )
        else:
            self._start_replica_task(r)

    def _fail(self, why: str, *, level: int = logging.ERROR) -> None:
        if self._failed is not None:
            return
        self._failed = errors.StoreSessionError(
            f"partition {self.partition}: store session {self.session_id} ended ({why}); appends in flight have an "
            "unknown outcome"
        )
        log.log(level, "%s", self._failed)
        while self._pending:
            self._pending.popleft().settle(self._failed)

    # -- replicas outside the write path -------------------------------------------------------
    def _start_replica_task(self, r: _Replica) -> None:
        if r.catching_up or self._failed is not None:
            return
        r.catching_up = True
        self._spawn(self._replica_task(r))

    async def _replica_task(self, r: _Replica) -> None:
        """Brings an assigned replica into the write path: reconnect (with backoff), prepare as
        the recovery says, fill from the write path, set the low-water mark, record it clean,
        fill the rest and join. Ends with the session, or when fenced (which ends the session)."""
        delay = 0.2
        try:
            while self._failed is None and not r.in_write_path:
                try:
                    await self._bring_in(r)
                    return
                except errors.StaleSessionError as e:
                    self._fail(f"fenced: {r.address} has seen a newer store session ({e})")
                    return
                except errors.WaltzError as e:
                    log.info(
                        "partition %d session %d: %s not back yet (retrying in %.1fs): %s",
                        self.partition,
                        self.session_id,
                        r.address,
                        delay,
                        e,
                    )
                    r.broken, r.left_because = True, str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        finally:
            r.catching_up = False

    async def _bring_in(self, r: _Replica) -> None:
        await self._reconnect(r)
        meta, prep, lsn = await self._prepare_to_rejoin(r)
        if prep.forgot:
            self._keep_out_until_successor(r)
            return
        clean = meta.replicas.get(r.address) == ReplicaState(self.session_id, UNRESOLVED) and lsn == self.session_id
        await self._catch_up(r, max(prep.high_water_mark + 1, r.log_start), clean)

    async def _reconnect(self, r: _Replica) -> None:
        while r.in_flight > 0 and self._failed is None:  # what it was sent before leaving settles first
            await asyncio.sleep(0.05)
        if r.broken or r.client is None:
            self._drop(r, r.left_because or "reconnecting")
            r.client = await self._connect(r.address)
            r.broken = False

    async def _prepare_to_rejoin(self, r: _Replica) -> tuple[PartitionMetadata, recovery.Preparation, int]:
        """Prepares the replica as the recovery says, under the metadata of this session (raises
        `StaleSessionError` when the partition has moved on)."""
        meta, _ = await self._offload(self.metadata.partition_metadata, self.partition)
        if meta.session_id != self.session_id:
            raise errors.StaleSessionError(f"the partition metadata is at session {meta.session_id}")
        prep, lsn = await self._prepare(r, meta)
        log.info("partition %d session %d: %s reached: %s", self.partition, self.session_id, r.address, prep.why)
        return meta, prep, lsn

    def _keep_out_until_successor(self, r: _Replica) -> None:
        """It lost its files: what it acknowledged in this session is gone, and caught up here it
        would soon vouch for this session again without it. Only a successor's recovery can count
        it right (it votes for every mark there); until then it stays out."""
        log.info(
            "partition %d session %d: %s rejoins in the next store session", self.partition, self.session_id, r.address
        )
        r.left_because = "lost its files; rejoins in the next store session"
        if self.successor_wanted is None:
            self.successor_wanted = f"{r.address} lost its files"
            if self.on_successor_wanted is not None:
                self.on_successor_wanted()

    async def _catch_up(self, r: _Replica, nxt: int, clean: bool) -> None:
        """Fills the replica from the write path from `nxt` on, records it clean once it holds the
        session's start, and joins it once it holds everything committed."""
        turn = 0  # which write-path member to read from: the next one after a failure or a lag
        deleted: dict[str, int] = {}  # write-path member -> its first id, when it no longer holds `nxt`
        writes: deque[asyncio.Future[None]] = deque()  # catch-up appends in flight, in id order

        async def drain(keep: int = 0) -> None:
            while len(writes) > keep:
                await writes.popleft()

        try:
            while self._failed is None:
                if nxt > self.start_high_water_mark and not clean:
                    await drain()
                    await self._record_clean(r)
                    clean = True
                    continue
                if nxt > self.high_water_mark and clean:
                    await drain()
                    if nxt <= self.high_water_mark:
                        continue  # commits arrived while the last writes landed
                    resend_from = await self._cut_partial_batch(r, nxt)
                    if resend_from is not None:
                        nxt = resend_from
                        continue
                    self._join(r, nxt)
                    return
                sources = [x for x in self._replicas if x.in_write_path]
                if not sources:
                    return
                source = sources[turn % len(sources)]
                try:
                    records = await self._read_for_catch_up(r, source, nxt)
                except _Deleted as gone:
                    if gone.first <= nxt:  # not a start past r's end: the source's trouble
                        turn += 1
                        await asyncio.sleep(0.05)
                        continue
                    deleted[source.address] = gone.first
                    if not {x.address for x in sources} <= deleted.keys():
                        turn += 1
                        continue
                    # Every write-path member deleted what r lacks: it restarts at the lowest id
                    # they still hold, and is filled from there like any lagging replica.
                    await drain()
                    start = min(deleted.values())
                    log.warning(
                        "partition %d session %d: %s ends at %d, below what the others hold (from %d): restarting "
                        "its log at %d",
                        self.partition,
                        self.session_id,
                        r.address,
                        nxt - 1,
                        start,
                        start,
                    )
                    await r.client.restart_log(self.partition, self.session_id, start)
                    nxt, deleted = start, {}
                    continue
                deleted = {}
                if not records:
                    turn += 1
                    await drain()
                    await asyncio.sleep(0.05)
                    continue
                # Pipelined: the next read overlaps these appends (sent in order on one connection).
                writes.append(r.client.send_append(self.partition, self.session_id, nxt, self._pack(records)))
                nxt = records[-1].txid + 1
                await drain(CATCH_UP_WRITES - 1)
        finally:
            for w in writes:
                w.cancel()
            await asyncio.gather(*writes, return_exceptions=True)

    async def _record_clean(self, r: _Replica) -> None:
        """It holds the session's start: that is its low-water mark, and the metadata records it
        clean before it acknowledges anything of this session."""
        await r.client.set_low_water_mark(self.partition, self.session_id, self.start_high_water_mark)
        await self._offload(
            _update,
            self.metadata,
            self.partition,
            self.session_id,
            lambda m: recovery.after_catch_up(m, self.session_id, r.address),
        )

    async def _cut_partial_batch(self, r: _Replica, nxt: int) -> int | None:
        """Part of an in-flight batch survived a crash of the node: it never acknowledged that
        batch, so the part goes and the whole batch is resent (returns where from; None: no cut)."""
        cut = next((p for p in self._pending if p.first < nxt <= p.last), None)
        if cut is None:
            return None
        await r.client.truncate(self.partition, self.session_id, cut.first - 1)
        return cut.first

    async def _read_for_catch_up(self, r: _Replica, source: _Replica, nxt: int) -> list[Any]:
        """Committed records from `nxt` on, read from a write-path member; none when that fails."""
        target = self.high_water_mark
        try:
            got = await source.client.records(self.partition, self.session_id, nxt, CATCH_UP_BATCH)
        except errors.StaleSessionError:
            raise
        except errors.BelowLogStartError as e:
            raise _Deleted(getattr(e, "first", -1)) from e
        except errors.StorageConnectionError as e:
            # The source's connection is gone, so it cannot take appends either: it leaves the
            # write path now rather than at the next append, which may never come while clients
            # wait for this catch-up (found by `waltz torture`).
            log.info(
                "partition %d: catch-up of %s: reading %s failed: %s", self.partition, r.address, source.address, e
            )
            self._leave(source, str(e))
            return []
        except errors.WaltzError as e:  # the source's trouble, not r's: read from another
            log.info(
                "partition %d: catch-up of %s: reading %s failed: %s", self.partition, r.address, source.address, e
            )
            return []
        return _upto(got, target)

    def _join(self, r: _Replica, nxt: int) -> None:
        # Everything committed is on r. Of the batches in flight it is sent those it lacks, and
        # counts for those it holds: durably (its max is what it synced), and from this session's
        # appends (nothing else puts ids above the committed prefix on a replica clean in this
        # session). Its acknowledgement of them may have been lost (a timeout, a dropped
        # connection); two such losses would hold a batch short of a quorum for good.
        if any(p.first < nxt <= p.last for p in self._pending):
            raise errors.InternalError(
                f"partition {self.partition}: {r.address} ends inside an in-flight batch at {nxt - 1}"
            )
        for pending in self._pending:
            if pending.first >= nxt:
                self._send(r, pending)
            else:
                pending.acks.add(r.address)
        self._enter(r)
        log.info(
            "partition %d session %d: %s caught up at %d and joined the write path",
            self.partition,
            self.session_id,
            r.address,
            nxt - 1,
        )
        self._advance()

    # -- retention ---------------------------------------------------------------------------
    async def set_retention(self, policy: Any, hold_from: int, lease_ms: int) -> int | None:
        """Hands the retention order to every replica in the write path (recorded clean in this
        session). Each node caps it by its own low-water mark; a replica that misses an order
        keeps everything once its last one lapses. Returns the lowest first id the replicas that
        answered hold (None when none answered): below it, nothing can be read any more."""
        targets = [r for r in self._replicas if r.client is not None and r.in_write_path]
        answers = await asyncio.gather(
            *(
                r.client.set_retention(
                    self.partition,
                    self.session_id,
                    max_age_ms=policy.max_age_ms,
                    max_bytes=policy.max_bytes,
                    min_kept=policy.min_kept,
                    hold_from=hold_from,
                    lease_ms=lease_ms,
                )
                for r in targets
            ),
            return_exceptions=True,
        )
        firsts = []
        for r, a in zip(targets, answers, strict=True):
            if isinstance(a, BaseException):
                log.debug("partition %d: retention order to %s failed: %s", self.partition, r.address, a)
            else:
                firsts.append(a)
        return min(firsts, default=None)

    # -- reading committed transactions ---------------------------------------------------------
    def _readers(self) -> list[_Replica]:
        # Every replica this session served holds the same committed prefix; those still in the
        # write path are the most complete.
        return sorted(
            (r for r in self._replicas if r.client is not None and r.served), key=lambda r: not r.in_write_path
        )

    def _raise_if_deleted(self, start: int, firsts: list[int], asked: int) -> None:
        """Every replica asked answered that retention deleted `start`: the range is gone for
        good (the lowest first id among them is where the log now starts)."""
        if firsts and len(firsts) == asked and min(firsts) > start:
            raise errors.transactions_deleted(self.partition, start, min(firsts))

    async def read_headers(self, start: int, count: int) -> list[Any]:
        """Headers of committed transactions from `start` (at most `count`; fewer at the end)."""
        end = min(start + count - 1, self.high_water_mark)
        if end < start:
            return []
        problems = []
        deleted: list[int] = []
        for r in self._readers():
            try:
                headers = await r.client.record_headers(self.partition, self.session_id, start, end - start + 1)
            except errors.BelowLogStartError as e:
                deleted.append(getattr(e, "first", -1))
                problems.append(f"{r.address}: {e}")
                continue
            except errors.WaltzError as e:
                problems.append(f"{r.address}: {e}")
                continue
            headers = [h for h in headers if h.txid <= end]
            if headers:
                return headers
            problems.append(f"{r.address}: nothing at {start} yet")
        self._raise_if_deleted(start, deleted, len(problems))
        raise errors.StoreSessionError(
            f"partition {self.partition}: no replica served transactions {start}..{end} ({'; '.join(problems)})"
        )

    async def read_data(self, txid: int) -> bytes:
        """The data of committed transaction `txid`."""
        if not 0 <= txid <= self.high_water_mark:
            raise errors.InvalidArgumentError(f"partition {self.partition}: transaction {txid} is not committed")
        problems = []
        deleted: list[int] = []
        for r in self._readers():
            try:
                record = await r.client.record(self.partition, self.session_id, txid)
            except errors.BelowLogStartError as e:
                deleted.append(getattr(e, "first", -1))
                problems.append(f"{r.address}: {e}")
                continue
            except errors.WaltzError as e:
                problems.append(f"{r.address}: {e}")
                continue
            if record is not None:
                return bytes(record.data)
            problems.append(f"{r.address}: absent")
        self._raise_if_deleted(txid, deleted, len(problems))
        raise errors.StoreSessionError(
            f"partition {self.partition}: no replica served transaction {txid} ({'; '.join(problems)})"
        )

    async def read_data_range(self, start: int, count: int) -> list[bytes]:
        """The data of committed transactions from `start` on, in id order: at least one, at most
        `count` (fewer where a replica's answer ends, bounded by its list size)."""
        end = min(start + count - 1, self.high_water_mark)
        if end < start:
            raise errors.InvalidArgumentError(f"partition {self.partition}: transaction {start} is not committed")
        problems = []
        for r in self._readers():
            try:
                records = await r.client.records(self.partition, self.session_id, start, end - start + 1)
            except errors.WaltzError as e:
                problems.append(f"{r.address}: {e}")
                continue
            data = []
            for i, record in enumerate(records):
                if record.txid != start + i or record.txid > end:
                    break
                data.append(bytes(record.data))
            if data:
                return data
            problems.append(f"{r.address}: nothing at {start}")
        raise errors.StoreSessionError(
            f"partition {self.partition}: no replica served transactions {start}..{end} ({'; '.join(problems)})"
        )

    async def quiesce(self) -> None:
        """Stops the background work (replica tasks) of a session with nothing in flight, so that
        its successor's recovery does not fence it into a failure while the partition switches."""
        if self._pending:
            raise errors.InternalError(
                f"partition {self.partition}: quiesce with {len(self._pending)} batches in flight"
            )
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self, drain_seconds: float = 2.0) -> None:
        """Ends the session. A healthy one first gives the replicas in the write path up to
        `drain_seconds` to answer what they were sent: a commit needs only a majority, and a
        replica cut off mid-stream would have to be caught up by the next session."""
        if self._failed is None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_seconds
            while (
                self._failed is None
                and loop.time() < deadline
                and any(r.in_flight for r in self._replicas if r.in_write_path)
            ):
                await asyncio.sleep(0.002)
        if self._failed is None:
            self._fail("closed", level=logging.INFO)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(
            *self._closing, *(r.client.close() for r in self._replicas if r.client is not None), return_exceptions=True
        )
