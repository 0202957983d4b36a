"""Deterministic simulation of store sessions and recovery.

The real `StoreSession` (recovery vote, truncation, catch-up, fencing, pipelined quorum writes)
runs on top of simulated storage nodes, network and metadata, under one seeded random source and
a virtual clock: an asyncio event loop whose selector never waits but moves the clock to the next
timer. Nothing else is random, so a seed replays exactly (`run(seed).trace` is the same list).

Simulated:
- storage nodes: a log (records are durable once their fsync finished, a crash cuts the records
  written but not yet synced at a random point), a durable fence (the newest session seen) and a
  durable partition info (session, low-water mark), the storage protocol's rules (dense appends,
  truncation, stale sessions refused);
- network: per connection FIFO delivery with random latency, partitions that drop requests and
  replies (the client times out), crashes that break connections;
- metadata: compare-and-set partition metadata;
- servers: writers that open sessions and append pipelined batches; a failover opens a new
  writer while the old one still appends (it must be fenced); a server crash drops a session.

Invariants checked after every event: every acknowledged transaction is durably held, with the
same bytes, by a majority of the replicas; no two acknowledgements of one id differ; a session
starts at or above every acknowledged id. At the end (faults healed, a last session fills every
replica): every replica holds the same log, every acknowledged transaction in it, ids dense.

Run many seeds: `python tests/simulation/sim.py --seeds 1000 [--first 0] [--verbose]`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import selectors
import sys
import time
from collections.abc import Callable
from typing import Any

from waltz import errors
from waltz.cluster.metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.server import recovery
from waltz.server.store_session import StoreSession


class SimulationError(Exception):
    pass


# -- virtual time --------------------------------------------------------------------------------
class _VirtualSelector(selectors.BaseSelector):
    """Nothing is ever ready; waiting for `timeout` just moves the clock."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._map: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._map[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._map.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimulationError("deadlock: nothing scheduled and nothing to wait for")
        self._loop.now += timeout
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self.now


# -- records and batches ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SimRecord:
    txid: int
    req_id: tuple[int, int]
    header: int
    data: bytes


class SimBatch(list):  # type: ignore[type-arg]
    """What `RecordBatch` is to the real code: (req_id, header, data) tuples, or records."""

    @classmethod
    def pack(cls, records: list[Any]) -> SimBatch:
        return cls((r.req_id, r.header, r.data) for r in records)


# -- storage nodes ---------------------------------------------------------------------------------
class SimNode:
    def __init__(self, address: str) -> None:
        self.address = address
        self.log: list[SimRecord] = []
        self.synced = 0
        """Records below this index are durable; the rest are written but not yet synced."""
        self.sync_due = 0.0
        """When the sync of the last append accepted so far completes."""
        self.fence = -1
        self.cuts = 0
        self.info = (-1, -1)
        self.up = True
        self.epoch = 0
        self.cut_off = False
        self.slow = 1.0
        self.lost_upto = -1
        """Wiped: it may have held (and acknowledged) every id up to this one before its disk was lost."""
        self.first = 0
        """Retention: ids below this are deleted (their entries stay in `log`, unreadable)."""
        self.local_lwm = -1
        """As the real node's control file: the committed prefix it held when a session set its mark."""

    def crash(self, rng: random.Random) -> None:
        self.up = False
        self.epoch += 1
        # Written but not synced: any prefix of it may have reached the disk.
        keep = rng.randint(self.synced, len(self.log))
        del self.log[keep:]
        self.synced = len(self.log)

    def restart(self) -> None:
        self.up = True

    def wipe(self) -> None:
        """Its disk is replaced (or its files deleted): it comes back empty, with no session info
        and no fence, the way `waltz storage add-partition` leaves a replica."""
        self.up = False
        self.epoch += 1
        self.lost_upto = max(self.lost_upto, self.synced - 1)  # acknowledgements may still be on their way
        self.log, self.synced, self.info, self.fence = [], 0, (-1, -1), -1
        self.first, self.local_lwm = 0, -1

    def retain(self, rng: random.Random) -> int | None:
        """Retention as the real node applies it: never an id above its own local low-water mark."""
        if self.local_lwm + 1 <= self.first:
            return None
        self.first = rng.choice((rng.randint(self.first + 1, self.local_lwm + 1), self.local_lwm + 1))
        return self.first

    def _below_start(self, txid: int) -> errors.BelowLogStartError:
        e = errors.BelowLogStartError(
            f"{self.address}: transaction {txid} is below the partition's first transaction id {self.first}"
        )
        e.first = self.first  # as the storage client reads it from the node's answer
        return e

    def durable(self) -> list[SimRecord]:
        return self.log[: self.synced]

    def handle(self, op: str, session: int, args: tuple[Any, ...]) -> Any:
        if session < self.fence:
            raise errors.StaleSessionError(f"{self.address}: session {session} is older than session {self.fence}")
        self.fence = session
        top = len(self.log) - 1
        if op == "last_session_info":
            return self.info
        if op == "max_transaction_id":
            return top
        if op == "truncate":
            (txid,) = args
            if txid < self.first - 1:
                raise self._below_start(txid + 1)
            if txid < top:
                del self.log[txid + 1 :]
                self.synced = min(self.synced, len(self.log))
                self.cuts += 1
            return None
        if op == "set_low_water_mark":
            (lwm,) = args
            self.info = (session, lwm)
            self.local_lwm = min(self.synced - 1, lwm)
            return None
        if op == "restart_log":
            (first,) = args
            if first <= top + 1:
                raise errors.StorageRequestError(f"{self.address}: a restart at {first} is not past {top}", "refused")
            # Placeholders for the ids it no longer holds: the log stays indexed by id.
            self.log.extend(SimRecord(t, (-1, -1), 0, b"") for t in range(top + 1, first))
            self.synced, self.first = first, first
            return None
        if op == "append":
            first, batch = args
            if first != top + 1:
                raise errors.StorageRequestError(f"{self.address}: append at {first} does not follow {top}")
            for i, (req_id, header, data) in enumerate(batch):
                self.log.append(SimRecord(first + i, req_id, header, data))
            return None
        if op in ("records", "record_headers"):
            txid, count = args
            if txid < self.first and txid <= top:
                raise self._below_start(txid)
            return self.log[max(txid, 0) : max(txid, 0) + count]
        if op == "record":
            (txid,) = args
            if txid < self.first and txid <= top:
                raise self._below_start(txid)
            return self.log[txid] if 0 <= txid <= top else None
        raise SimulationError(f"unknown request {op}")


class SimClient:
    """One connection to a node: requests are delivered in order, each after a random latency;
    a partition drops requests and replies (the caller times out); a crash breaks the connection."""

    def __init__(self, world: World, node: SimNode) -> None:
        self.world, self.node = world, node
        self.epoch = node.epoch
        self.closed = False
        self._arrives = 0.0
        self.timeout = world.request_timeout

    def _send(self, op: str, session: int, *args: Any) -> asyncio.Future[Any]:
        w, node = self.world, self.node
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self.closed or node.epoch != self.epoch:
            fut.set_exception(errors.StorageConnectionError(f"connection to {node.address} is closed"))
            return fut
        # FIFO, like TCP: strictly after the previous request (timers due at the same instant
        # may run in any order, which reordered appends on one connection).
        at = max(loop.time() + w.latency(node), self._arrives + 1e-7)
        self._arrives = at
        if node.cut_off:
            return fut  # dropped: only the timeout ends the wait

        def arrive() -> None:
            if node.epoch != self.epoch or not node.up:
                loop.call_later(
                    w.latency(node), _fail, fut, errors.StorageConnectionError(f"{node.address} closed the connection")
                )
                return
            try:
                result = node.handle(op, session, args)
            except errors.WaltzError as e:
                loop.call_later(w.latency(node), _fail, fut, e)
                return
            if op == "restart_log":
                w.log(f"{node.address} restarts its log at {args[0]}")
            if op == "truncate":
                try:
                    w.check(f"truncate on {node.address}")
                except SimulationError as e:
                    w.fail(e)
            if op == "max_transaction_id":
                # Like the real node's: answered once every append accepted before it is synced
                # (or cut), with what is durable then. The session counts a rejoining replica
                # for the batches below this answer.
                loop.call_later(max(node.sync_due - loop.time(), 0.0) + 1e-7, lambda: reply(node.synced - 1))
                return
            if op == "append":
                # Replies after the fsync; a crash before it may cut what was written.
                written, cuts = len(node.log), node.cuts
                sync_at = w.latency(node) * 2
                node.sync_due = max(node.sync_due, loop.time() + sync_at)

                def synced() -> None:
                    if node.epoch != self.epoch:
                        return
                    if node.cuts != cuts:
                        # A truncation came first: like the real node, it fails the appends it cut
                        # (the simulation fails every append it overtook).
                        loop.call_later(
                            w.latency(node), _fail, fut, errors.StorageRequestError(f"{node.address}: append truncated")
                        )
                        return
                    node.synced = max(node.synced, written)
                    reply()

                loop.call_later(sync_at, synced)
            else:
                reply(result)

        def reply(result: Any = None) -> None:
            if node.cut_off:
                return
            loop.call_later(w.latency(node), _done, fut, result, node, self.epoch)

        loop.call_at(at, arrive)
        return fut

    async def _wait(self, fut: asyncio.Future[Any]) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await asyncio.shield(fut)
        except TimeoutError as e:
            raise errors.StorageTimeoutError(f"{self.node.address} did not answer in {self.timeout}s") from e

    async def _call(self, op: str, session: int, *args: Any) -> Any:
        return await self._wait(self._send(op, session, *args))

    async def last_session_info(self, partition: int, session: int) -> tuple[int, int]:
        return await self._call("last_session_info", session)  # type: ignore[no-any-return]

    async def max_transaction_id(self, partition: int, session: int) -> int:
        return await self._call("max_transaction_id", session)  # type: ignore[no-any-return]

    async def truncate(self, partition: int, session: int, txid: int) -> None:
        await self._call("truncate", session, txid)

    async def set_low_water_mark(self, partition: int, session: int, lwm: int) -> None:
        await self._call("set_low_water_mark", session, lwm)

    async def append(self, partition: int, session: int, first: int, batch: SimBatch) -> None:
        await self._call("append", session, first, list(batch))

    def send_append(
        self,
        partition: int,
        session: int,
        first: int,
        batch: SimBatch,
        listener: Callable[[asyncio.Future[None]], None] | None = None,
    ) -> asyncio.Future[None]:
        acked = asyncio.ensure_future(self._wait(self._send("append", session, first, list(batch))))
        if listener is not None:
            acked.add_done_callback(listener)
        return acked

    async def records(self, partition: int, session: int, txid: int, count: int = 1000) -> list[SimRecord]:
        return await self._call("records", session, txid, count)  # type: ignore[no-any-return]

    async def record_headers(self, partition: int, session: int, txid: int, count: int = 1000) -> list[SimRecord]:
        return await self._call("record_headers", session, txid, count)  # type: ignore[no-any-return]

    async def record(self, partition: int, session: int, txid: int) -> SimRecord | None:
        return await self._call("record", session, txid)  # type: ignore[no-any-return]

    async def restart_log(self, partition: int, session: int, first: int) -> None:
        await self._call("restart_log", session, first)

    async def close(self) -> None:
        self.closed = True


def _fail(fut: asyncio.Future[Any], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)


def _done(fut: asyncio.Future[Any], result: Any, node: SimNode, epoch: int) -> None:
    if fut.done():
        return
    if node.epoch != epoch:
        fut.set_exception(errors.StorageConnectionError(f"{node.address} closed the connection"))
    else:
        fut.set_result(result)


# -- metadata ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _NodeInfo:
    address: str


@dataclasses.dataclass(frozen=True)
class _Info:
    cluster_key: str = "sim"
    partitions: int = 1


class SimMetadata:
    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.meta = PartitionMetadata()
        self.version = 0

    def info(self) -> _Info:
        return _Info()

    def replicas_of(self, partition_id: int) -> list[_NodeInfo]:
        return [_NodeInfo(a) for a in self.addresses]

    def partition_metadata(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        return self.meta, self.version

    def set_partition_metadata(self, partition_id: int, meta: PartitionMetadata, version: int) -> int:
        if version != self.version:
            raise errors.MetadataVersionError(f"version {version} is not {self.version}")
        self.meta, self.version = meta, self.version + 1
        return self.version


# -- the world ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    seed: int
    replicas: int
    acknowledged: int
    sessions: int
    faults: dict[str, int]
    virtual_seconds: float
    trace: list[str]


class World:
    def __init__(
        self,
        seed: int,
        *,
        replicas: int | None = None,
        duration: float = 6.0,
        faults: tuple[str, ...] | None = None,
        max_lag: int = 6,
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.n = replicas or self.rng.choice((3, 3, 5))
        self.nodes = [SimNode(f"10.0.0.{i + 1}:4000") for i in range(self.n)]
        self.by_address = {n.address: n for n in self.nodes}
        self.metadata = SimMetadata([n.address for n in self.nodes])
        self.quorum = self.n // 2 + 1
        self.duration = duration
        self.max_lag = max_lag
        self.kinds = faults or (
            "crash",
            "crash",
            "partition",
            "slow",
            "failover",
            "server-crash",
            "majority-crash",
            "wipe",
            "retention",
        )
        self.request_timeout = 0.25
        self.acked: dict[int, bytes] = {}
        self.trace: list[str] = []
        self.faults: dict[str, int] = {}
        self.sessions = 0
        self.writers: list[asyncio.Task[None]] = []
        self.published_lwm = -1
        """The highest low-water mark a session has told a replica (see `retention`)."""
        self.running = True
        self.next_writer = 0
        self.failure: SimulationError | None = None
        """The first broken invariant: raised in a task or a callback, it ends the run."""

    def fail(self, e: SimulationError) -> None:
        if self.failure is None:
            self.failure = e
            self.log(f"FAILED: {e}")

    # randomness, all from the one seeded source
    def latency(self, node: SimNode) -> float:
        return self.rng.uniform(0.0002, 0.002) * node.slow

    def log(self, line: str) -> None:
        self.trace.append(f"{asyncio.get_running_loop().time():9.4f} {line}")

    async def connect(self, address: str) -> SimClient:
        node = self.by_address[address]
        await asyncio.sleep(self.latency(node) * 2)
        if not node.up or node.cut_off:
            await asyncio.sleep(self.request_timeout)
            raise errors.StorageConnectionError(f"cannot connect to storage node {address}")
        return SimClient(self, node)

    async def offload(self, fn: Any, *args: Any) -> Any:
        await asyncio.sleep(self.rng.uniform(0.0001, 0.003))
        return fn(*args)

    # invariants
    def check(self, where: str, txids: range | None = None) -> None:
        """Every acknowledged transaction (or those of `txids`) is durable on a majority."""
        for txid in self.acked if txids is None else txids:
            data = self.acked[txid]
            # A wiped replica is counted for what it may have held: the loss of its copies is the
            # fault injected, not the system's doing (the nemesis keeps every id on a majority but one).
            # Retention deleted an id only at or below the replica's own local low-water mark
            # (`SimNode.retain`): its copy counts, as on every replica that deleted it legitimately.
            holders = sum(
                1
                for n in self.nodes
                if (txid < n.synced and (n.log[txid].data == data or txid < n.first)) or txid <= n.lost_upto
            )
            if holders < self.quorum:
                raise SimulationError(
                    f"seed {self.seed} ({where}): acknowledged transaction {txid} is durable on {holders} replicas "
                    "only, "
                    f"{self.quorum} needed"
                )

    def acknowledge(self, first: int, batch: SimBatch, writer: int, session: int) -> None:
        for i, (_, _, data) in enumerate(batch):
            txid = first + i
            old = self.acked.get(txid)
            if old is not None and old != data:
                raise SimulationError(
                    f"seed {self.seed}: transaction {txid} acknowledged as {old!r} and as {data!r}: two writers"
                )
            self.acked[txid] = data
        self.log(f"writer {writer} session {session}: acknowledged {first}..{first + len(batch) - 1}")
        # Only what was just acknowledged: the rest was checked then, and every event that can
        # take copies away (crash, wipe, truncation) checks everything.
        self.check(f"ack {first}", range(first, first + len(batch)))

    # servers
    async def open(self, writer: int) -> StoreSession | None:
        try:
            s = await StoreSession.open(
                self.metadata,
                0,
                1,
                timeout=self.request_timeout,
                max_lag=self.max_lag,
                recovery_timeout=1.0,
                connect=self.connect,
                offload=self.offload,
                pack=SimBatch.pack,
            )
        except errors.StoreSessionError as e:
            self.log(f"writer {writer}: open failed: {e}")
            return None
        self.sessions += 1
        top = max(self.acked, default=-1)
        if s.high_water_mark < top:
            raise SimulationError(
                f"seed {self.seed}: session {s.session_id} starts at {s.high_water_mark} below acknowledged {top}"
            )
        self.log(f"writer {writer}: session {s.session_id} open at {s.high_water_mark} on {s.replicas_in_write_path}")
        return s

    async def writer(self, wid: int) -> None:
        seq = 0
        while self.running and self.failure is None:
            s = await self.open(wid)
            if s is None:
                await asyncio.sleep(0.1)
                continue
            in_flight: list[asyncio.Future[Any]] = []
            try:
                while self.running and s.failed is None and s.successor_wanted is None and self.failure is None:
                    batch = SimBatch(
                        ((wid, seq + i), 0, f"w{wid}-{seq + i}".encode()) for i in range(self.rng.randint(1, 4))
                    )
                    seq += len(batch)
                    try:
                        fut = s.append(batch)
                    except errors.StoreSessionError:
                        break
                    fut.add_done_callback(lambda f, b=batch, sid=s.session_id: self._on_ack(f, b, wid, sid))
                    in_flight.append(fut)
                    in_flight = [f for f in in_flight if not f.done()]
                    if len(in_flight) >= 4:
                        await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    await asyncio.sleep(self.rng.uniform(0, 0.004))
            finally:
                if s.successor_wanted is not None and s.failed is None:
                    self.log(f"writer {wid}: session {s.session_id} hands over: {s.successor_wanted}")
                await s.close()
            self.log(f"writer {wid}: session {s.session_id} ended: {s.failed}")

    def _on_ack(self, f: asyncio.Future[Any], batch: SimBatch, wid: int, sid: int) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        try:
            self.acknowledge(f.result()[0], batch, wid, sid)
        except SimulationError as e:
            self.fail(e)

    async def guarded_writer(self, wid: int) -> None:
        try:
            await self.writer(wid)
        except SimulationError as e:
            self.fail(e)

    async def nemesis(self) -> None:
        loop = asyncio.get_running_loop()
        rng = self.rng
        while loop.time() < self.duration and self.failure is None:
            await asyncio.sleep(rng.uniform(0.05, 0.4))
            kind = rng.choice(self.kinds)
            if kind == "wipe" and not self.wipeable():
                continue
            self.faults[kind] = self.faults.get(kind, 0) + 1
            if kind in ("crash", "majority-crash"):
                count = self.quorum if kind == "majority-crash" else rng.randint(1, self.n - self.quorum)
                await self.outage(kind, rng.sample(self.nodes, count), lambda v: v.crash(rng))
            elif kind == "long-crash":
                # Down for long enough that the others' sessions move on, and their retention past it.
                await self.outage(kind, [rng.choice(self.nodes)], lambda v: v.crash(rng), down=rng.uniform(0.8, 2.0))
            elif kind == "wipe":
                await self.outage(kind, [rng.choice(self.wipeable())], SimNode.wipe)
            elif kind == "partition":
                victims = rng.sample(self.nodes, rng.randint(1, self.n - self.quorum + 1))
                for v in victims:
                    v.cut_off = True
                self.log(f"nemesis: cut off {[v.address for v in victims]}")
                await asyncio.sleep(rng.uniform(0.05, 0.6))
                for v in victims:
                    v.cut_off = False
                self.log(f"nemesis: healed {[v.address for v in victims]}")
            elif kind == "slow":
                v = rng.choice(self.nodes)
                v.slow = rng.choice((10.0, 50.0))
                self.log(f"nemesis: slow {v.address} x{v.slow}")
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                v.slow = 1.0
            elif kind == "failover":
                # A new server takes over while the old one still appends (it must be fenced).
                self.start_writer()
                self.log("nemesis: failover to a new writer")
            elif kind == "retention":
                self.retention()
            elif kind == "server-crash":
                for t in self.writers:
                    if not t.done():
                        t.cancel()
                        break
                self.log("nemesis: server crash")
                self.start_writer()

    def retention(self) -> None:
        """A policy deletes on every replica that is up, each by its own local low-water mark.
        Only committed transactions may go: never an id above the highest low-water mark a
        session has published (what the servers know is committed), whatever the node's own
        bookkeeping says."""
        self.published_lwm = max([self.published_lwm] + [n.info[1] for n in self.nodes])
        for v in self.nodes:
            cut = v.retain(self.rng) if v.up else None
            if cut is not None:
                self.log(f"nemesis: retention on {v.address} deletes below {cut}")
                if cut - 1 > self.published_lwm:
                    self.fail(
                        SimulationError(
                            f"seed {self.seed}: retention on {v.address} deleted up to {cut - 1}, above the highest "
                            f"low-water mark any session published ({self.published_lwm}): uncommitted ids went"
                        )
                    )

    async def outage(self, kind: str, victims: list[SimNode], stop: Any, down: float | None = None) -> None:
        """`stop` each victim (a crash, a lost disk), check the invariants, restart them a little later."""
        for v in victims:
            stop(v)
        self.log(f"nemesis: {kind} {[v.address for v in victims]}")
        try:
            self.check(kind)
        except SimulationError as e:
            self.fail(e)
        await asyncio.sleep(self.rng.uniform(0.02, 0.6) if down is None else down)
        if kind == "long-crash" and "retention" in self.kinds:
            self.retention()  # the others delete past where the victim stopped
        for v in victims:
            v.restart()
        self.log(f"nemesis: restart {[v.address for v in victims]}")

    def wipeable(self) -> list[SimNode]:
        """The nodes whose disk may be lost without losing what was acknowledged: every id stays
        durable on a majority but one, and fewer than a majority of the last session's clean replicas
        will have forgotten it (beyond that no recovery can know what was committed)."""
        meta = self.metadata.meta
        last = recovery.last_session(meta)

        def forgot(n: SimNode) -> bool:
            st = meta.replicas.get(n.address)
            return (
                st is not None
                and st == ReplicaState(st.session_id, UNRESOLVED)
                and st.session_id == last
                and n.info[0] < st.session_id
            )

        out = []
        for v in self.nodes:
            if not v.up or sum(1 for n in self.nodes if n is v or forgot(n)) >= self.quorum:
                continue
            others = [n for n in self.nodes if n is not v]
            if all(
                sum(1 for n in others if txid < n.synced and n.log[txid].data == d) >= self.quorum - 1
                for txid, d in self.acked.items()
            ):
                out.append(v)
        return out

    def start_writer(self) -> None:
        wid = self.next_writer
        self.next_writer += 1
        self.writers.append(asyncio.ensure_future(self.guarded_writer(wid)))

    async def main(self) -> None:
        self.start_writer()
        await self.nemesis()
        # Heal everything, stop the writers, then a last session fills every replica.
        for n in self.nodes:
            n.cut_off, n.slow = False, 1.0
            if not n.up:
                n.restart()
        self.running = False
        await asyncio.gather(*self.writers, return_exceptions=True)
        if self.failure is not None:
            raise self.failure
        self.check("healed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while True:
            s = await self.open(-1)
            if s is not None:
                break
            if loop.time() > deadline:
                raise SimulationError(f"seed {self.seed}: no session opens after healing")
            await asyncio.sleep(0.1)
        try:
            while len(s.replicas_in_write_path) < self.n:
                if s.failed is not None or loop.time() > deadline:
                    raise SimulationError(
                        f"seed {self.seed}: replicas never all joined after healing: {s.replicas_in_write_path} "
                        f"({s.failed})"
                    )
                await asyncio.sleep(0.05)
            final = await s.append(SimBatch([((-1, 0), 0, b"final")]))
            self.acknowledge(final[0], SimBatch([((-1, 0), 0, b"final")]), -1, s.session_id)
        finally:
            await s.close()
        await asyncio.sleep(0.1)  # let the last replies land
        # Ids below every replica's retained start may legitimately be gone; all the rest is checked.
        start = max(n.first for n in self.nodes)
        logs = [n.durable()[start:] for n in self.nodes]
        for n, lg in zip(self.nodes, logs):
            if lg != logs[0]:
                raise SimulationError(
                    f"seed {self.seed}: {n.address} differs from {self.nodes[0].address} after healing"
                )
            if [r.txid for r in lg] != list(range(start, start + len(lg))):
                raise SimulationError(f"seed {self.seed}: {n.address} has ids that are not dense")
        for txid, data in self.acked.items():
            if txid < start:
                continue
            if txid - start >= len(logs[0]) or logs[0][txid - start].data != data:
                raise SimulationError(f"seed {self.seed}: acknowledged transaction {txid} is not in the final log")
        if start + len(logs[0]) != final[1] + 1:
            raise SimulationError(
                f"seed {self.seed}: the log ends at {start + len(logs[0]) - 1}, the last commit was {final[1]}"
            )


def run(seed: int, **kw: Any) -> Result:
    """One seeded run; raises SimulationError with the seed when an invariant breaks."""
    world = World(seed, **kw)
    loop = VirtualLoop()
    try:
        loop.run_until_complete(world.main())
    except SimulationError as e:
        e.trace = world.trace  # type: ignore[attr-defined]
        raise
    finally:
        # Every task ends here, inside the run: none is left for the garbage collector to log.
        for _ in range(10):
            tasks = asyncio.all_tasks(loop)
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
    return Result(seed, world.n, len(world.acked), world.sessions, world.faults, loop.now, world.trace)


def _guessing_vote() -> None:
    """A vote that ignores unreachable replicas (decides from the reachable ones alone)."""
    from waltz.server import recovery

    real = recovery.vote

    def guessing(electorate: Any, prepared: Any) -> Any:
        voters = {a: p for a, p in prepared.items() if a in set(electorate)}
        return real(list(voters), voters)

    recovery.vote = guessing  # type: ignore[assignment]


def _no_fence() -> None:
    """Storage nodes that never refuse an older session."""
    real = SimNode.handle

    def unfenced(self: SimNode, op: str, session: int, args: tuple[Any, ...]) -> Any:
        self.fence = -1
        return real(self, op, session, args)

    SimNode.handle = unfenced  # type: ignore[method-assign]


def _trusting_lost_files() -> None:
    """A recovery that takes a replica which lost its files at its word (votes only for what it holds)."""
    from waltz.server import recovery

    real = recovery.prepare

    def trusting(*args: Any) -> Any:
        return dataclasses.replace(real(*args), forgot=False)

    recovery.prepare = trusting  # type: ignore[assignment]


def _retention_past_the_mark() -> None:
    """A node whose retention ignores its low-water mark: it deletes up to its tail."""

    def greedy(self: SimNode, rng: random.Random) -> int | None:
        if len(self.log) <= self.first:
            return None
        self.first = rng.randint(self.first + 1, len(self.log))
        return self.first

    SimNode.retain = greedy  # type: ignore[method-assign]


MUTANTS = {
    "guessing-vote": _guessing_vote,
    "no-fence": _no_fence,
    "trusting-lost-files": _trusting_lost_files,
    "retention-past-the-mark": _retention_past_the_mark,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    ap.add_argument("--first", type=int, default=0, help="the first seed")
    ap.add_argument("--verbose", action="store_true", help="print the trace of each run")
    ap.add_argument("--duration", type=float, default=6.0, help="virtual seconds of faults per seed")
    ap.add_argument("--mutant", choices=sorted(MUTANTS), help="break the system on purpose: the run must fail")
    args = ap.parse_args(argv)
    if args.mutant:
        MUTANTS[args.mutant]()
    import logging

    logging.disable(logging.CRITICAL)
    started = time.perf_counter()
    acked = sessions = 0
    faults: dict[str, int] = {}
    for seed in range(args.first, args.first + args.seeds):
        try:
            r = run(seed, duration=args.duration)
        except SimulationError as e:
            if args.verbose:
                print("\n".join(getattr(e, "trace", [])))
            print(
                f"FAILED: {e}\nreplay: python tests/simulation/sim.py --seeds 1 --first {seed} --verbose",
                file=sys.stderr,
            )
            return 1
        acked += r.acknowledged
        sessions += r.sessions
        for k, v in r.faults.items():
            faults[k] = faults.get(k, 0) + v
        if args.verbose:
            print("\n".join(r.trace))
    took = time.perf_counter() - started
    print(
        f"{args.seeds} seeds ({args.first}..{args.first + args.seeds - 1}) passed in {took:.1f}s: "
        f"{acked} acknowledged transactions, {sessions} sessions, faults {dict(sorted(faults.items()))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
