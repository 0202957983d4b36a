"""A partition's store session: the server's replicated, pipelined write path to its storage nodes.

Opening one takes a new session id by compare-and-set in the partition metadata (refused when
the partition has moved to a newer generation), connects to the partition's replicas (which
fences every older session on them), settles the starting high-water mark, sets it as every
reachable replica's low-water mark and records those replicas as clean in the metadata.

Until recovery (issue 6) exists, the starting point is settled only where the vote needs no
truncation: a majority of the last session's replicas is reachable, a majority of the assigned
replicas holds the same highest transaction, and every reachable replica agrees with them as far
as it goes (a lower one is behind, not dirty). That highest id is then what the vote decides:
every committed transaction is on a majority of the last session's replicas, which meets the
reachable ones, and the unreachable ones are too few to make a higher mark decidable. Replicas
behind it stay out of the session until catch-up exists. Otherwise opening fails with
`RecoveryNeededError`.

Appends get the next ids, are sent at once to every replica in the write path (many batches in
flight, not stop-and-wait) and commit when a majority of the partition's replicas acknowledged
them durably, strictly in id order. A replica that errs or falls `max_lag` batches behind leaves
the write path (catch-up is issue 6's work); losing the majority, or any replica answering that a
newer session exists, ends the session: in-flight appends fail with `StoreSessionError` (outcome
unknown) and later appends are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from typing import Any
from waltz import errors
from waltz._native import RecordBatch
from waltz.cluster.metadata import UNRESOLVED, ClusterMetadata, PartitionMetadata, ReplicaState
from waltz.storage.client import StorageClient

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Pending:
    first: int
    last: int
    batch: RecordBatch
    """Kept until committed: a replica that catches up is sent the batches still in flight."""
    future: asyncio.Future[tuple[int, int]]
    acks: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class _Replica:
    address: str
    client: StorageClient
    in_write_path: bool = True
    in_flight: int = 0
    left_because: str | None = None
    catching_up: bool = False


def _new_session_id(metadata: ClusterMetadata, partition: int, generation: int) -> int:
    while True:
        meta, version = metadata.partition_metadata(partition)
        if meta.generation > generation:
            raise errors.StaleGenerationError(
                f"partition {partition} is at generation {meta.generation}; this server holds generation {generation}"
            )
        try:
            metadata.set_partition_metadata(partition, PartitionMetadata(generation, meta.session_id + 1, meta.replicas), version)
            return meta.session_id + 1
        except errors.MetadataVersionError:
            continue


def _record_clean(metadata: ClusterMetadata, partition: int, session: int, clean: list[str]) -> None:
    while True:
        meta, version = metadata.partition_metadata(partition)
        if meta.session_id != session:
            raise errors.StoreSessionError(f"partition {partition}: store session {meta.session_id} replaced ours ({session})")
        replicas = dict(meta.replicas)
        replicas.update({a: ReplicaState(session, UNRESOLVED) for a in clean})
        try:
            metadata.set_partition_metadata(partition, PartitionMetadata(meta.generation, session, replicas), version)
            return
        except errors.MetadataVersionError:
            continue


class StoreSession:
    """Use `await StoreSession.open(metadata, partition, generation)`; `append(batch)`; `close()`."""

    def __init__(self, partition: int, session_id: int, replicas: list[_Replica], total: int, high_water_mark: int, max_lag: int) -> None:
        self.partition = partition
        self.session_id = session_id
        self.quorum = total // 2 + 1
        self.replica_count = total
        self.high_water_mark = high_water_mark
        self.max_lag = max_lag
        self._replicas = replicas
        self.start_high_water_mark = high_water_mark
        self.metadata: ClusterMetadata | None = None
        self._next = high_water_mark + 1
        self._pending: deque[_Pending] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: errors.StoreSessionError | None = None

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    async def open(
        cls, metadata: ClusterMetadata, partition: int, generation: int, *, timeout: float = 10.0, max_lag: int = 256
    ) -> StoreSession:
        info = await asyncio.to_thread(metadata.info)
        nodes = await asyncio.to_thread(metadata.replicas_of, partition)
        if not nodes:
            raise errors.StoreSessionError(f"partition {partition} has no replicas assigned")
        quorum = len(nodes) // 2 + 1
        session = await asyncio.to_thread(_new_session_id, metadata, partition, generation)
        # Who may hold the last session's commits: the replicas recorded clean in it. A replica
        # the metadata does not place in that session (new, replaced, or only clean earlier) can
        # lack them while agreeing with the others, so it cannot make up the agreeing majority.
        meta, _ = await asyncio.to_thread(metadata.partition_metadata, partition)
        last = max((st.session_id for st in meta.replicas.values()), default=None)
        holders = {a for a, st in meta.replicas.items() if st.session_id == last} if last is not None else None
        connected = await asyncio.gather(
            *(StorageClient.connect(n.host, int(n.address.rsplit(":", 1)[1]), cluster_key=info.cluster_key,
                                    partition_count=info.partitions, timeout=timeout) for n in nodes),
            return_exceptions=True,
        )
        replicas = [_Replica(n.address, c) for n, c in zip(nodes, connected) if isinstance(c, StorageClient)]
        down = {n.address: str(c) for n, c in zip(nodes, connected) if not isinstance(c, StorageClient)}
        try:
            hwm, members = await cls._settle(partition, session, replicas, down, quorum, holders)
            behind = [r for r in replicas if r not in members]
            for r in behind:
                r.in_write_path, r.catching_up = False, True
            # The low-water mark is this session's starting point on every member.
            await asyncio.gather(*(r.client.set_low_water_mark(partition, session, hwm) for r in members))
            await asyncio.to_thread(_record_clean, metadata, partition, session, [r.address for r in members])
        except BaseException:
            await asyncio.gather(*(r.client.close() for r in replicas), return_exceptions=True)
            raise
        log.info(
            "partition %d: store session %d open at high-water mark %d on %s%s%s", partition, session, hwm,
            ", ".join(r.address for r in members),
            f" (catching up: {', '.join(r.address for r in behind)})" if behind else "",
            f" (unreachable: {'; '.join(f'{a}: {w}' for a, w in down.items())})" if down else "",
        )
        opened = cls(partition, session, replicas, len(nodes), hwm, max_lag)
        opened.metadata = metadata
        for r in behind:
            opened._start_catch_up(r)
        return opened

    @staticmethod
    async def _settle(
        partition: int, session: int, replicas: list[_Replica], down: dict[str, str], quorum: int, holders: set[str] | None = None
    ) -> tuple[int, list[_Replica]]:
        """The starting high-water mark and the replicas that hold exactly up to it, or an error."""
        try:
            infos = await asyncio.gather(*(r.client.last_session_info(partition, session) for r in replicas))
            maxes = await asyncio.gather(*(r.client.max_transaction_id(partition, session) for r in replicas))
        except errors.StaleSessionError as e:
            raise errors.StoreSessionError(f"partition {partition}: a newer store session than {session} exists: {e}") from e
        if len(replicas) < quorum:
            raise errors.StoreSessionError(
                f"partition {partition}: only {len(replicas)} of {len(replicas) + len(down)} replicas reachable, "
                f"{quorum} needed ({'; '.join(f'{a}: {why}' for a, why in down.items())})"
            )
        state = ", ".join(f"{r.address} max {m}" for r, m in zip(replicas, maxes))
        if holders is not None:
            reached = holders & {r.address for r in replicas}
            if len(reached) < len(holders) // 2 + 1:
                raise errors.RecoveryNeededError(
                    f"partition {partition}: only {sorted(reached)} of the last session's replicas {sorted(holders)} are "
                    f"reachable ({state}); the recovery vote is needed"
                )
        # The highest mark a majority of the assigned replicas holds is what the vote decides, if
        # every reachable replica agrees with it as far as it goes (the lower ones are prefixes:
        # behind, not dirty). Lower replicas stay out of the session until catch-up (issue 6).
        top = max(maxes)
        at_top = [r for r, m in zip(replicas, maxes) if m == top]
        if len(at_top) < quorum:
            raise errors.RecoveryNeededError(
                f"partition {partition}: only {len(at_top)} replicas reach transaction {top}, {quorum} needed ({state}); "
                f"the recovery vote is needed"
            )
        ref = at_top[0]
        start = min(lwm for _, lwm in infos) + 1
        for r, m in zip(replicas, maxes):
            if r is not ref:
                await StoreSession._same_prefix(partition, session, ref, r, start, m, state)
        return top, at_top

    @staticmethod
    async def _same_prefix(partition: int, session: int, ref: _Replica, other: _Replica, start: int, end: int, state: str) -> None:
        """Raises RecoveryNeededError unless both replicas hold the same transactions start..end."""
        while start <= end:
            a, b = await asyncio.gather(
                ref.client.record_headers(partition, session, start, min(1000, end - start + 1)),
                other.client.record_headers(partition, session, start, min(1000, end - start + 1)),
            )
            n = min(len(a), len(b))
            if n == 0:
                raise errors.RecoveryNeededError(f"partition {partition}: no header at {start} on {ref.address} or {other.address} ({state})")
            if [(x.txid, x.req_id, x.header) for x in a[:n]] != [(x.txid, x.req_id, x.header) for x in b[:n]]:
                raise errors.RecoveryNeededError(
                    f"partition {partition}: {other.address} differs from {ref.address} after transaction {start - 1} "
                    f"({state}); the recovery vote is needed"
                )
            start = a[n - 1].txid + 1

    # -- writing ---------------------------------------------------------------------------
    @property
    def replicas_in_write_path(self) -> list[str]:
        return [r.address for r in self._replicas if r.in_write_path]

    @property
    def failed(self) -> errors.StoreSessionError | None:
        return self._failed

    def append(self, batch: RecordBatch) -> asyncio.Future[tuple[int, int]]:
        """Gives the batch the next ids and sends it to every replica in the write path now.
        The future completes with (first, last) once a majority has it durably, in id order."""
        if self._failed is not None:
            raise self._failed
        if len(batch) == 0:
            raise errors.InvalidArgumentError("an empty batch has no transaction ids")
        first = self._next
        self._next += len(batch)
        pending = _Pending(first, self._next - 1, batch, asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        for r in self._replicas:
            if not r.in_write_path:
                continue
            if r.in_flight >= self.max_lag:
                self._leave(r, f"fell {r.in_flight} batches behind")
                self._start_catch_up(r)
                continue
            try:
                acked = r.client.send_append(self.partition, self.session_id, first, batch)
            except errors.WaltzError as e:
                self._leave(r, str(e))
                continue
            r.in_flight += 1
            task = asyncio.ensure_future(self._await_ack(r, pending, acked))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return pending.future

    async def _await_ack(self, r: _Replica, pending: _Pending, acked: asyncio.Task[None]) -> None:
        try:
            await acked
        except asyncio.CancelledError:
            acked.cancel()
            raise
        except errors.StaleSessionError as e:
            self._fail(f"fenced: {r.address} has seen a newer store session ({e})")
            return
        except errors.WaltzError as e:
            self._leave(r, str(e))
            return
        finally:
            r.in_flight -= 1
        # Durable in this session on that replica: it counts even if it has left the write path since.
        pending.acks.add(r.address)
        self._advance()

    def _advance(self) -> None:
        while self._pending and len(self._pending[0].acks) >= self.quorum:
            p = self._pending.popleft()
            self.high_water_mark = p.last
            if not p.future.done():
                p.future.set_result((p.first, p.last))

    def _leave(self, r: _Replica, why: str) -> None:
        if not r.in_write_path:
            return
        r.in_write_path, r.left_because = False, why
        log.warning("partition %d session %d: replica %s leaves the write path: %s", self.partition, self.session_id, r.address, why)
        alive = sum(1 for x in self._replicas if x.in_write_path)
        if alive < self.quorum:
            self._fail(f"lost the quorum: {alive} of {self.replica_count} replicas left in the write path, {self.quorum} needed")

    def _fail(self, why: str, *, level: int = logging.ERROR) -> None:
        if self._failed is not None:
            return
        self._failed = errors.StoreSessionError(
            f"partition {self.partition}: store session {self.session_id} ended ({why}); appends in flight have an unknown outcome"
        )
        log.log(level, "%s", self._failed)
        while self._pending:
            p = self._pending.popleft()
            if not p.future.done():
                p.future.set_exception(self._failed)
                p.future.exception()  # a caller that dropped the future has nothing to be warned about

    # -- catch-up --------------------------------------------------------------------------
    def _start_catch_up(self, r: _Replica) -> None:
        r.catching_up = True
        task = asyncio.ensure_future(self._catch_up(r))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _catch_up(self, r: _Replica) -> None:
        """Fills a replica that is behind from one in the write path, in bounded batches of
        committed records, while writes go on; then, with no await between the check and the
        join, sends it the batches still in flight and puts it back in the write path."""
        try:
            while r.in_flight > 0 and self._failed is None:  # what it was sent before leaving settles first
                await asyncio.sleep(0.05)
            nxt = await r.client.max_transaction_id(self.partition, self.session_id) + 1
            low_water_mark_set = False
            turn = 0  # which write-path member to read from: the next one after a failure or a lag
            while self._failed is None:
                if nxt > self.start_high_water_mark and not low_water_mark_set:
                    await r.client.set_low_water_mark(self.partition, self.session_id, self.start_high_water_mark)
                    low_water_mark_set = True
                    continue
                if nxt > self.high_water_mark and low_water_mark_set:
                    self._join(r, nxt)
                    break
                sources = [x for x in self._replicas if x.in_write_path]
                if not sources:
                    return
                target = self.high_water_mark
                source = sources[turn % len(sources)]
                try:
                    got = await source.client.records(self.partition, self.session_id, nxt, 1000)
                except errors.StaleSessionError:
                    raise
                except errors.WaltzError as e:  # the source's trouble, not r's: read from another
                    log.info("partition %d: catch-up of %s: reading %s failed: %s", self.partition, r.address, source.address, e)
                    got = []
                records = [x for x in got if x.txid <= target]
                if not records:
                    turn += 1
                    await asyncio.sleep(0.05)
                    continue
                await r.client.append(self.partition, self.session_id, nxt, RecordBatch(records))
                nxt = records[-1].txid + 1
        except errors.StaleSessionError as e:
            self._fail(f"fenced: a newer store session exists ({e})")
            return
        except errors.WaltzError as e:
            r.catching_up = False
            r.left_because = f"catch-up failed: {e}"
            log.warning("partition %d session %d: catching up %s failed: %s", self.partition, self.session_id, r.address, e)
            return
        if r.in_write_path and self.metadata is not None:
            try:
                await asyncio.to_thread(_record_clean, self.metadata, self.partition, self.session_id, [r.address])
            except errors.WaltzError as e:
                log.warning("partition %d: %s caught up but not recorded clean: %s", self.partition, r.address, e)

    def _join(self, r: _Replica, nxt: int) -> None:
        # Everything committed is on r. Of the batches in flight it is sent those it lacks; the
        # ones it has it acknowledged before leaving (acks cover whole batches).
        if any(p.first < nxt <= p.last for p in self._pending):
            raise errors.InternalError(f"partition {self.partition}: {r.address} ends inside an in-flight batch at {nxt - 1}")
        for pending in (p for p in self._pending if p.first >= nxt):
            acked = r.client.send_append(self.partition, self.session_id, pending.first, pending.batch)
            r.in_flight += 1
            task = asyncio.ensure_future(self._await_ack(r, pending, acked))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        r.in_write_path, r.catching_up, r.left_because = True, False, None
        log.info("partition %d session %d: %s caught up at %d and rejoined the write path", self.partition, self.session_id, r.address, nxt - 1)

    # -- reading committed transactions ---------------------------------------------------------
    def _readers(self) -> list[_Replica]:
        # Every replica of this session holds the same committed prefix; those still in the write
        # path are the most complete.
        return sorted(self._replicas, key=lambda r: not r.in_write_path)

    async def read_headers(self, start: int, count: int) -> list[Any]:
        """Headers of committed transactions from `start` (at most `count`; fewer at the end)."""
        end = min(start + count - 1, self.high_water_mark)
        if end < start:
            return []
        problems = []
        for r in self._readers():
            try:
                headers = await r.client.record_headers(self.partition, self.session_id, start, end - start + 1)
            except errors.WaltzError as e:
                problems.append(f"{r.address}: {e}")
                continue
            headers = [h for h in headers if h.txid <= end]
            if headers:
                return headers
            problems.append(f"{r.address}: nothing at {start} yet")
        raise errors.StoreSessionError(f"partition {self.partition}: no replica served transactions {start}..{end} ({'; '.join(problems)})")

    async def read_data(self, txid: int) -> bytes:
        """The data of committed transaction `txid`."""
        if not 0 <= txid <= self.high_water_mark:
            raise errors.InvalidArgumentError(f"partition {self.partition}: transaction {txid} is not committed")
        problems = []
        for r in self._readers():
            try:
                record = await r.client.record(self.partition, self.session_id, txid)
            except errors.WaltzError as e:
                problems.append(f"{r.address}: {e}")
                continue
            if record is not None:
                return bytes(record.data)
            problems.append(f"{r.address}: absent")
        raise errors.StoreSessionError(f"partition {self.partition}: no replica served transaction {txid} ({'; '.join(problems)})")

    async def close(self) -> None:
        if self._failed is None:
            self._fail("closed", level=logging.INFO)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self._replicas), return_exceptions=True)
