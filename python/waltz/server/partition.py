"""A partition on its server: the append path (generation check, lock check, transaction id,
batching, the store session) and the feed of committed transactions.

One task takes queued appends in arrival order, checks each one's generation and locks and
gives it the next transaction id, packs the accepted ones into one batch and hands it to the
store session without waiting for the commit; up to `max_batches_in_flight` batches are in
flight. Commits come back strictly in id order: each committed transaction is published to
the feed, then its appender is answered. The queue and the in-flight batches are bounded, so
appenders wait (back pressure) instead of growing memory.

A new store session replaces the current one every `checkpoint_interval` commits and when the
replica assignment changes (`request_new_session`) or a replica that lost its files comes back
(`StoreSession.successor_wanted`): the append loop stops taking batches, waits
until every batch in flight committed, opens the next session (whose recovery then finds every
replica at the same mark) and goes on; appenders only wait.

The feed keeps the newest headers within `feed_cache_bytes` in memory; a reader further behind is
served from the storage nodes in bounded batches. Transaction data is served from a byte-bounded
cache of recent commits, or read from a replica.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from waltz import errors
from waltz._native import RecordBatch, ReqId
from waltz.event_loop import tell_listener
from waltz.server.lock_table import LockTable
from waltz.server.store_session import StoreSession

log = logging.getLogger(__name__)


# The per-transaction records below are slotted, not frozen: a frozen dataclass sets each field
# through object.__setattr__ (an AppendRequest cost 2.1 µs to make, 0.45 µs now), once per
# transaction on the server's hot path. Nothing changes them after they are made.
@dataclasses.dataclass(slots=True)
class AppendRequest:
    req_id: ReqId
    client_high_water_mark: int
    header: int
    data: bytes
    write_locks: Sequence[int] = ()
    read_locks: Sequence[int] = ()
    append_locks: Sequence[int] = ()


@dataclasses.dataclass(slots=True)
class Committed:
    transaction_id: int


@dataclasses.dataclass(frozen=True)
class LockFailed:
    transaction_id: int
    """The transaction that made the lock fail (an upper bound when the lock table estimated)."""


@dataclasses.dataclass(frozen=True)
class Ignored:
    reason: str


AppendResult = Committed | LockFailed | Ignored


@dataclasses.dataclass(slots=True)
class FeedEntry:
    transaction_id: int
    req_id: ReqId
    header: int


FEED_ENTRY_BYTES = 200
MAX_TRANSACTION_BYTES = (16 << 20) - 1024
"""Below the storage nodes' default max_record_size (16 MiB, a record's 40 header bytes
included): a larger append would fail the whole batch at the replicas."""
COMMIT_SECONDS_BOUNDS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
MAX_TRANSACTION_LOCKS = 4096
"""Locks (write, read and append together) one append may carry: its lock check runs on the
server's event loop, about 6 µs a lock, and every other client waits meanwhile."""

COMING_WITHIN = 0.01
"""A client answered less than this long ago, or than twice the time it took to come back
after its previous answer (at most `COMING_AT_MOST`), with nothing queued or in flight, may be
on its way with its next append (`_gather`): a closed-loop client's comes a round trip and its
own work after its answer. One quiet for longer is not waited for: a lone client whose peer
stopped appending paid every turn of `gather_turns` on each append for a second
(docs/performance.md)."""
COMING_AT_MOST = 0.1
"""A client that appends every few hundred milliseconds (a heartbeat, a slow producer) would
otherwise count as on its way for all of its quiet time, and every batch of the others would
wait `gather_turns` turns for it."""

AppendListener = Callable[[asyncio.Future[AppendResult]], None]
"""Told of an append's outcome the moment the partition settles it (`ServerPartition.enqueue`)."""


class _Queued:
    """An append queued or in flight: the future of its outcome, and who hears of it in the turn
    that settles it (a done callback costs a loop handle and a turn; there were two per append)."""

    __slots__ = ("request", "client", "future", "listener", "settled")

    def __init__(
        self, request: AppendRequest, future: asyncio.Future[AppendResult], listener: AppendListener | None
    ) -> None:
        self.request = request
        self.client: int = request.req_id.client_id
        self.future = future
        self.listener = listener
        self.settled = False


FeedPush = Callable[[list[FeedEntry]], bool]
"""Takes committed entries in the commit's own turn (True), or declines them (False): see `ServerPartition.feed`."""


class _Follower:
    """A feed reader parked until transaction `next` commits."""

    __slots__ = ("next", "max_entries", "push", "woken")

    def __init__(self, nxt: int, max_entries: int, push: FeedPush | None) -> None:
        self.next = nxt
        self.max_entries = max_entries
        self.push = push
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class ServerPartition:
    """Use `ServerPartition(partition_id, generation, session)`, `await start()`, `append()`, `feed()`."""

    def __init__(
        self,
        partition_id: int,
        generation: int,
        session: StoreSession,
        *,
        max_batch_records: int = 1000,
        max_batch_bytes: int = 4 << 20,
        max_batches_in_flight: int = 16,
        queue_limit: int = 10_000,
        lock_budget_bytes: int = 8 << 20,
        feed_cache_bytes: int = 16 << 20,
        data_cache_bytes: int = 64 << 20,
        checkpoint_interval: int = 100_000,
        max_transaction_bytes: int = MAX_TRANSACTION_BYTES,
        max_transaction_locks: int = MAX_TRANSACTION_LOCKS,
        open_session: Callable[[], Awaitable[StoreSession]] | None = None,
        gather_turns: int = 6,
    ) -> None:
        self.partition_id = partition_id
        self.generation = generation
        self.session = session
        self.max_batch_records = max_batch_records
        self.max_batch_bytes = max_batch_bytes
        self.max_transaction_bytes = max_transaction_bytes
        self.max_transaction_locks = max_transaction_locks
        self.gather_turns = gather_turns
        self.high_water_mark = session.high_water_mark
        self.locks = LockTable(session.high_water_mark, lock_budget_bytes)
        self._session_start = session.high_water_mark
        self._next = session.high_water_mark + 1
        self.retention_active = False
        self.log_start = -1
        """The lowest first id the replicas reported holding (`note_log_start`, from their answers
        to retention orders): feeds from below it are refused, whatever the cache still has."""
        # None in the queue only wakes the append loop (`_wake`).
        self._queue: asyncio.Queue[_Queued | None] = asyncio.Queue(queue_limit)
        self._in_flight = asyncio.Semaphore(max_batches_in_flight)
        self._max_in_flight = max_batches_in_flight
        self.checkpoint_interval = checkpoint_interval
        self._open_session = open_session
        self._new_session_wanted: str | None = None
        self._wanted_again: str | None = None
        """Asked for while a switch was under way, which may have read the replicas before the change."""
        session.on_successor_wanted = self._wake
        # An entry (FeedEntry, its ReqId and ints) costs about FEED_ENTRY_BYTES of Python objects.
        self._feed: collections.deque[FeedEntry] = collections.deque(
            maxlen=max(1, feed_cache_bytes // FEED_ENTRY_BYTES)
        )
        self._data: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._data_bytes = 0
        self._data_budget = data_cache_bytes
        self._followers: list[_Follower] = []
        """Feed readers waiting for the next commit (or a failure)."""
        self._signal_due = False
        self._unresolved: dict[int, set[asyncio.Future[AppendResult]]] = {}
        """Client id → its appends queued or in flight (for `settled`)."""
        self._appenders: dict[int, float] = {}
        """Client id → when it last appended or was last answered (pruned every second), for
        `_gather`."""
        self._comes_back: dict[int, float] = {}
        """Client id → how long it took to append again after its last answer (`_coming`)."""
        self._appenders_pruned = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = collections.Counter[str]()
        self.commit_seconds = ([0] * (len(COMMIT_SECONDS_BOUNDS) + 1), 0.0)
        """Commit latency (batch handed to the store session until a majority has it): counts
        per bucket of COMMIT_SECONDS_BOUNDS (+Inf last) and the sum."""

    async def start(self) -> None:
        self._task = asyncio.create_task(self._append_loop(), name=f"waltz-partition-{self.partition_id}")

    def _closed_error(self) -> errors.StoreSessionError:
        return errors.StoreSessionError(f"partition {self.partition_id} closed before this append was written")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():
            q = self._queue.get_nowait()
            if q is not None:
                self._settle(q, exc=self._closed_error())
        await self.session.close()
        self._signal_commit()  # feed readers waiting for a commit learn that the session ended

    # -- appending -------------------------------------------------------------------------
    async def append(self, request: AppendRequest) -> AppendResult:
        """Waits for room in the queue, then for the outcome: Committed, LockFailed, Ignored (a
        stale generation), or `StoreSessionError` (the outcome is unknown)."""
        return await (await self.enqueue(request))

    async def enqueue(
        self, request: AppendRequest, listener: AppendListener | None = None
    ) -> asyncio.Future[AppendResult]:
        """Waits for room in the queue (back pressure: a connection stops reading meanwhile) and
        returns the future of the outcome. Requests are appended in the order they are queued.
        `listener(future)` is called once the outcome is settled, in the turn that settles it."""
        q = self._queued(request, listener)
        try:
            await self._queue.put(q)
        except BaseException:
            # The connection went away while the queue was full: never queued, never written.
            q.future.cancel()
            self._settle(q)
            raise
        if self._closed:  # woken by close()'s draining: nobody reads the queue now
            self._settle(q, exc=self._closed_error())
        return q.future

    def enqueue_nowait(
        self, request: AppendRequest, listener: AppendListener | None = None
    ) -> asyncio.Future[AppendResult] | None:
        """`enqueue` without waiting, the hot path (no coroutine): None, and nothing queued, when
        the queue is full; the caller then waits in `enqueue`."""
        if self._queue.full():
            self._check(request)
            return None
        q = self._queued(request, listener)
        self._queue.put_nowait(q)
        return q.future

    def _check(self, request: AppendRequest) -> None:
        failed = self.session.failed
        if failed is not None:
            raise failed
        if self._closed:
            raise self._closed_error()
        if len(request.data) > self.max_transaction_bytes:
            raise errors.InvalidArgumentError(
                f"transaction data of {len(request.data)} bytes exceeds the partition's max_transaction_bytes "
                f"{self.max_transaction_bytes}"
            )
        locks = len(request.write_locks) + len(request.read_locks) + len(request.append_locks)
        if locks > self.max_transaction_locks:
            raise errors.InvalidArgumentError(
                f"a transaction with {locks} locks exceeds the partition's max_transaction_locks "
                f"{self.max_transaction_locks}"
            )

    def _queued(self, request: AppendRequest, listener: AppendListener | None) -> _Queued:
        """The request checked and registered as its client's, before it waits for room, so that
        `settled` also waits for appends a full queue still holds back."""
        self._check(request)
        q = _Queued(request, asyncio.get_running_loop().create_future(), listener)
        now = time.monotonic()
        unresolved = self._unresolved.get(q.client)
        if unresolved is None:
            answered = self._appenders.get(q.client)  # nothing in flight: when it was last answered
            if answered is not None:
                self._comes_back[q.client] = now - answered
            unresolved = self._unresolved[q.client] = set()
        self._appenders[q.client] = now
        unresolved.add(q.future)
        return q

    def _settle(self, q: _Queued, result: AppendResult | None = None, exc: BaseException | None = None) -> None:
        """Settles an append once: its future (unless its awaiter gave up and cancelled it), its
        client's unresolved appends, then its listener, all in this turn."""
        if q.settled:
            return
        q.settled = True
        f = q.future
        if not f.done():
            if exc is None:
                f.set_result(result)  # type: ignore[arg-type]
            else:
                f.set_exception(exc)
        unresolved = self._unresolved.get(q.client)
        if unresolved is not None:
            unresolved.discard(f)
            if not unresolved:
                del self._unresolved[q.client]
                self._appenders[q.client] = time.monotonic()  # its next append may be on its way
        if q.listener is not None:
            tell_listener(q.listener, f, f"partition {self.partition_id}'s append listener")

    async def settled(self, client_id: int) -> None:
        """Returns once every append of this client queued until now is resolved (committed,
        refused, or failed with the session). A mount waits for this before it answers READY:
        after READY nothing the client sent earlier can still commit."""
        waiting = list(self._unresolved.get(client_id, ()))
        if waiting:
            await asyncio.gather(*waiting, return_exceptions=True)

    def request_new_session(self, why: str) -> None:
        """The next batch goes to a new store session (the replica assignment changed). Asked
        for during a switch, it is another switch after that one: the one under way may have
        read the replica assignment before the change."""
        if self._open_session is None:
            return
        if self._new_session_wanted is None:
            self._new_session_wanted = why
            self._wake()
        else:
            self._wanted_again = why

    async def _new_session(self, why: str) -> None:
        """Waits for every batch in flight to commit, then replaces the store session. A failure
        leaves the old session failed: the partition's host reopens the partition."""
        assert self._open_session is not None
        held = 0
        try:
            for _ in range(self._max_in_flight):
                await self._in_flight.acquire()
                held += 1
            old = self.session
            if old.failed is not None:
                return
            log.info("partition %d: new store session after session %d (%s)", self.partition_id, old.session_id, why)
            try:
                await old.quiesce()
                new = await self._open_session()
            except Exception as e:
                old._fail(f"its successor did not open: {e}")
                return
            if new.high_water_mark != self.high_water_mark:
                # Everything was committed before the switch: the recovery must find exactly that.
                broken = errors.InternalError(
                    f"partition {self.partition_id}: session {new.session_id} recovered to {new.high_water_mark}, "
                    f"the partition committed up to {self.high_water_mark}"
                )
                log.critical("%s", broken)
                await new.close()
                old._fail(str(broken))
                return
            self.session, self._session_start = new, new.high_water_mark
            new.on_successor_wanted = self._wake
            self.stats["store_sessions"] += 1
            await old.close(drain_seconds=0)  # appends wait meanwhile; the new session has every replica
        finally:
            self._new_session_wanted, self._wanted_again = self._wanted_again, None
            if self._new_session_wanted is not None:
                self._wake()
            for _ in range(held):
                self._in_flight.release()

    def note_log_start(self, first: int, *, retention_active: bool | None = None) -> None:
        """The replicas hold nothing below `first` any more (it only rises); `retention_active`
        when their policy may delete more."""
        self.log_start = max(self.log_start, first)
        if retention_active is not None:
            self.retention_active = retention_active

    def _may_be_deleted(self, txid: int) -> bool:
        """Whether a replica may have deleted `txid` since it last said where its log starts: only
        ids at or below this session's starting mark (no replica deletes above its own low-water
        mark, and this session set every replica's), and only once retention ever ran."""
        return txid < self.log_start or ((self.retention_active or self.log_start > 0) and txid <= self._session_start)

    def _wake(self) -> None:
        """Wakes an idle append loop when a new session is due (a replica that lost its files,
        an assignment change), so that it opens without waiting for the partition's next
        append. A full queue needs no wake-up: the loop is busy."""
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)

    async def _append_loop(self) -> None:
        while True:
            first = await self._queue.get()
            items: list[_Queued] = [] if first is None else [first]
            try:
                await self._switch_session_if_due()
                if first is None:
                    continue
                await self._gather()
                size = len(first.request.data)
                while not self._queue.empty() and len(items) < self.max_batch_records and size < self.max_batch_bytes:
                    q = self._queue.get_nowait()
                    if q is not None:
                        items.append(q)
                        size += len(q.request.data)
                await self._in_flight.acquire()
            except (
                BaseException
            ):  # closed meanwhile (a session switch, the gather, waiting for room): these were dequeued, answer them
                for q in items:
                    self._settle(q, exc=self._closed_error())
                raise
            try:
                handed_over = self._write(items)
            except Exception as e:  # never let one batch kill the loop (every later append would hang)
                log.exception("partition %d: writing a batch failed", self.partition_id)
                handed_over = False
                # A bug before the batch reached the session (`_write` handles one while handing
                # it over): nothing was sent, but the partition's state (lock versions, ids) is
                # suspect, so the session ends and the next one starts from what committed.
                self._abandon(items, e)
            if not handed_over:
                self._in_flight.release()

    async def _switch_session_if_due(self) -> None:
        if self._open_session is None:
            return
        if self.high_water_mark - self._session_start >= self.checkpoint_interval:
            self._new_session_wanted = self._new_session_wanted or f"{self.checkpoint_interval} transactions"
        if self.session.successor_wanted is not None:
            self._new_session_wanted = self._new_session_wanted or self.session.successor_wanted
        if self._new_session_wanted is not None:
            await self._new_session(self._new_session_wanted)
            if self.session.successor_wanted is not None and self.session.failed is None:
                self._wake()  # wanted while it opened: the next turn replaces it too

    async def _gather(self) -> None:
        """Lets the appends of the partition's other clients join the batch of the first one: the
        loop turns (up to `gather_turns`, a few microseconds each) while a client answered
        recently (`COMING_WITHIN`) has nothing queued or in flight, i.e. its next append is on its way.
        Closed-loop clients answer a commit together, but their appends reach this process over
        several turns; cut at once, most went into store batches of their own, and a batch costs
        every replica a write, an fsync and an answer (32 clients on 4 partitions: 6,000 → 9,000
        tx/s, p99 10 → 6.5 ms, in `benches/cluster.py`). Waiting only for clients that can
        still come keeps a lone client, or clients all waiting on earlier batches, from paying
        for turns in which nobody can join."""
        if self._sole_appender():
            return  # nobody else to wait for: each turn would only add latency
        for _ in range(self.gather_turns):
            if self._queue.qsize() >= self.max_batch_records or not self._coming():
                return
            await asyncio.sleep(0)

    def _coming(self) -> bool:
        """True while a client answered within `COMING_WITHIN`, or within twice the time it
        took to come back last time (at most `COMING_AT_MOST`), has no append queued or in
        flight: in a closed loop its next one follows its last answer."""
        unresolved = self._unresolved
        now = time.monotonic()
        comes_back = self._comes_back
        return any(
            c not in unresolved and now - t < min(COMING_AT_MOST, max(COMING_WITHIN, 2 * comes_back.get(c, 0.0)))
            for c, t in self._appenders.items()
        )

    def _sole_appender(self) -> bool:
        """True when at most one client appended in the last second (one client pipelining
        sends its appends together; they are queued already)."""
        now = time.monotonic()
        if now - self._appenders_pruned >= 1.0:
            self._appenders = {c: t for c, t in self._appenders.items() if now - t < 1.0}
            self._comes_back = {c: t for c, t in self._comes_back.items() if c in self._appenders}
            self._appenders_pruned = now
        return len(self._appenders) <= 1

    def _write(self, items: list[_Queued]) -> bool:
        """True when the batch went to the session (its in-flight slot is released on commit).
        Appenders may have given up (cancelled futures): `_settle` answers each once, whatever its future."""
        batch = RecordBatch()
        accepted: list[tuple[_Queued, int]] = []
        for q in items:
            r = q.request
            if r.req_id.generation != self.generation:
                self.stats["ignored"] += 1
                self._settle(q, Ignored(f"generation {r.req_id.generation} is not the partition's {self.generation}"))
                continue
            txid = self._next + len(accepted)
            # A client has seen at most what is committed: a mark above it (a broken or hostile
            # client) would pass over this batch's own earlier transactions, which it cannot have seen.
            seen = min(r.client_high_water_mark, self.high_water_mark)
            failure = self.locks.check_and_update(seen, txid, r.write_locks, r.read_locks, r.append_locks)
            if failure is not None:
                self.stats["lock_failures"] += 1
                self._settle(q, LockFailed(failure.transaction_id))
                continue
            try:
                batch.add(r.req_id, r.header, r.data)
            except (OverflowError, ValueError, TypeError, errors.WaltzError) as e:
                # Not written; its lock versions stay raised (upper bounds still) and the next
                # accepted transaction takes this id.
                self._settle(q, exc=errors.InvalidArgumentError(f"append cannot be encoded: {e}"))
                continue
            accepted.append((q, txid))
        if not accepted:
            return False
        handed = time.perf_counter()
        settled = False

        def on_commit(f: asyncio.Future[tuple[int, int]]) -> None:
            nonlocal settled
            settled = True
            self._on_commit(f, accepted, handed)

        try:
            self.session.append(batch, on_commit)
        except errors.StoreSessionError as e:
            for q, _ in accepted:
                self._settle(q, exc=e)
            return False
        except Exception as e:
            # A bug while the batch was handed over: it may be registered and on some replicas,
            # for the next session's recovery to commit. This session ends (no mount answers
            # READY, so no client resubmits, until that recovery decided), which settles the
            # batch as "outcome unknown" if it was registered (and frees its slot then).
            log.exception("partition %d: handing a batch to the store session failed", self.partition_id)
            self._abandon([q for q, _ in accepted], e)
            return settled
        self._next += len(accepted)
        self.stats["appended"] += len(accepted)
        return True

    def _abandon(self, items: list[_Queued], e: Exception) -> None:
        """After a bug while writing a batch: the session ends, and the batch's appenders not yet
        answered hear "outcome unknown" (StoreSessionError), never a rejection."""
        self.session._fail(f"writing a batch failed: {e!r}")
        unknown = errors.StoreSessionError(f"partition {self.partition_id}: append not written: {e!r}")
        for q in items:
            self._settle(q, exc=unknown)

    def _on_commit(
        self, f: asyncio.Future[tuple[int, int]], accepted: list[tuple[_Queued, int]], handed: float
    ) -> None:
        self._in_flight.release()
        waited = time.perf_counter() - handed
        counts, total = self.commit_seconds
        counts[bisect.bisect_left(COMMIT_SECONDS_BOUNDS, waited)] += 1
        self.commit_seconds = (counts, total + waited)
        exc = f.exception()
        if exc is not None:
            for q, _ in accepted:
                self._settle(q, exc=exc)
            self._signal_commit()  # feed readers waiting for a commit must see the failure
            return
        first, last = f.result()
        # Invariant, checked in production too (not an assert, which -O strips): commits arrive
        # in id order with the ids assigned here. Broken, nothing more may be acknowledged.
        if not (first == self.high_water_mark + 1 == accepted[0][1] and last == accepted[-1][1]):
            broken = errors.InternalError(
                f"partition {self.partition_id}: commit ({first}, {last}) does not follow high-water mark "
                f"{self.high_water_mark} and assigned ids {accepted[0][1]}..{accepted[-1][1]}"
            )
            log.critical("%s", broken)
            self.session._fail(str(broken))
            # The batch may be on a majority, for the next session's recovery to commit: its
            # appenders must hear "outcome unknown" (the client waits for a new mount), never a
            # rejection the application would take as final and submit again.
            unknown = errors.StoreSessionError(
                f"{broken}; whether this append commits is decided by the next store session"
            )
            for q, _ in accepted:
                self._settle(q, exc=unknown)
            return
        for q, txid in accepted:
            r = q.request
            self._feed.append(FeedEntry(txid, r.req_id, r.header))
            self._cache_data(txid, r.data)
        self.high_water_mark = last
        self.stats["committed"] += len(accepted)
        # Feed readers first: their steps then run first on the next turn, before the appenders'
        # callbacks (bookkeeping only: a client learns of its commit from the feed).
        self._signal_commit()
        for q, txid in accepted:
            self._settle(q, Committed(txid))

    def _signal_commit(self) -> None:
        """Wakes every feed reader waiting for a commit: on the loop's next turn while other
        batches of the partition are in flight, so that the commits landing in this turn go
        out in one feed frame per connection (woken at once, many clients cost the server more
        feed frames per transaction: docs/performance.md); at once when none is, as nothing
        can join and a turn is latency. A future per reader: an `asyncio.Condition` cost a
        task per commit and a lock hand-over per reader, and a reader cancelled while waiting
        (its client went away) cancels only its own future."""
        if self._next - 1 == self.high_water_mark:
            self._wake_readers()
        elif not self._signal_due:
            self._signal_due = True
            asyncio.get_running_loop().call_soon(self._wake_readers)

    def _wake_readers(self) -> None:
        self._signal_due = False
        followers, self._followers = self._followers, []
        lists: dict[tuple[int, int], list[FeedEntry]] = {}
        for f in followers:
            if f.woken.done():
                continue  # its reader went away
            push = f.push
            if (
                push is not None
                and f.next <= self.high_water_mark
                and self.session.failed is None
                and self._push(f, push, lists)
            ):
                self._followers.append(f)  # handed over: it stays parked
            else:
                f.woken.set_result(None)

    def _push(self, f: _Follower, push: FeedPush, lists: dict[tuple[int, int], list[FeedEntry]]) -> bool:
        """Hands every commit from `f.next` on to `push`, in lists of at most `f.max_entries`;
        False (the reader is woken and goes on from `f.next`) when it declines or fails one, or
        the commits are no longer all cached. `lists`: the lists made in this wake-up, by (next,
        max entries), shared by the readers that are at the same place (most are: one list a
        commit, where there was one a reader, and each connection's frame is then found in the
        shared frame cache by the same list)."""
        while f.next <= self.high_water_mark:
            if f.next < self._cached_from():
                return False
            key = (f.next, f.max_entries)
            entries = lists.get(key)
            if entries is None:
                entries = lists[key] = self._cached(f.next, f.max_entries)
            try:
                taken = push(entries)
            except Exception:  # the reader's own path then meets the problem; this commit goes on
                log.exception("partition %d: handing commits to a feed reader failed", self.partition_id)
                taken = False
            if not taken:
                return False
            f.next = entries[-1].transaction_id + 1
        return True

    def _cached_from(self) -> int:
        """The first transaction id whose header is still in memory."""
        return self._feed[0].transaction_id if self._feed else self.high_water_mark + 1

    def _cached(self, nxt: int, max_entries: int) -> list[FeedEntry]:
        """Up to `max_entries` committed headers from `nxt` on, which must be in memory."""
        start = nxt - self._cached_from()
        return [self._feed[i] for i in range(start, min(start + max_entries, len(self._feed)))]

    def _cache_data(self, txid: int, data: bytes) -> None:
        self._data[txid] = data
        self._data_bytes += len(data)
        while self._data_bytes > self._data_budget and self._data:
            _, old = self._data.popitem(last=False)
            self._data_bytes -= len(old)

    # -- reading ---------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    async def feed(
        self, after: int, max_entries: int = 1000, push: FeedPush | None = None
    ) -> AsyncIterator[list[FeedEntry]]:
        """Committed transactions with ids above `after`, in order, in lists of at most
        `max_entries`, forever (waits for new commits).

        With `push`, a reader that has caught up and waits is handed each commit within the turn
        that commits it, `push(entries)`, instead of being woken to take it from this iterator
        on a later turn (a client's feed frame then leaves a loop turn and a task step sooner).
        The entries `push` takes are not yielded; when it declines (returns False), the iterator
        wakes and yields from there on. It may be called again after a True, never once it has
        declined until the reader waits again."""
        if max_entries < 1:
            raise errors.InvalidArgumentError(f"max_entries must be at least 1, not {max_entries}")
        nxt = after + 1
        if self._may_be_deleted(nxt) and nxt >= self._cached_from():
            # Retention may have deleted them on the replicas: the headers still cached here must
            # not hide that (their data is gone, and so is every other copy). `log_start` may be a
            # push behind: one header from storage says for sure, and names where the log starts.
            try:
                await self.session.read_headers(nxt, 1)
            except errors.TransactionsDeletedError as e:
                self.note_log_start(e.first_id)
                raise
        while True:
            cached_from = self._cached_from()
            if nxt < cached_from:
                entries = await self._read_headers(nxt, min(max_entries, cached_from - nxt))
            elif nxt <= self.high_water_mark:
                entries = self._cached(nxt, max_entries)
            else:
                follower = _Follower(nxt, max_entries, push)
                while self.high_water_mark < follower.next and self.session.failed is None:
                    self._followers.append(follower)
                    await follower.woken
                    follower.woken = asyncio.get_running_loop().create_future()
                nxt = follower.next  # past whatever push took
                if self.session.failed is not None and self.high_water_mark < nxt:
                    raise self.session.failed
                continue
            if entries:
                yield entries
                nxt = entries[-1].transaction_id + 1

    async def _read_headers(self, start: int, count: int) -> list[FeedEntry]:
        headers = await self.session.read_headers(start, count)
        return [FeedEntry(h.txid, h.req_id, h.header) for h in headers]

    async def transaction_data(self, txid: int) -> bytes:
        if not 0 <= txid <= self.high_water_mark:
            raise errors.InvalidArgumentError(f"partition {self.partition_id} has no committed transaction {txid}")
        # As the feed: one answer for what is gone, cached or not (storage names the range).
        data = None if self._may_be_deleted(txid) else self._data.get(txid)
        if data is not None:
            return data
        return await self.session.read_data(txid)

    async def transaction_data_range(self, first: int, max_count: int, max_bytes: int) -> list[bytes]:
        """The data of committed transactions `first`, `first + 1`, ...: at most `max_count`, and
        no more than `max_bytes` in all, except that the first is always there."""
        if not 0 <= first <= self.high_water_mark:
            raise errors.InvalidArgumentError(f"partition {self.partition_id} has no committed transaction {first}")
        last = min(first + max_count - 1, self.high_water_mark)
        out: list[bytes] = []
        size, txid = 0, first
        while txid <= last:
            cached = self._data.get(txid)
            got = [cached] if cached is not None else await self.session.read_data_range(txid, last - txid + 1)
            for data in got:
                if out and size + len(data) > max_bytes:
                    return out
                out.append(data)
                size += len(data)
            txid += len(got)
        return out
