"""The client's side of one partition: mounting it on the server that serves it, sending the
appends of submitted contexts, the transaction monitor that settles them from the feed, retries,
and the ordered application of the feed to the application.

Mounting (spec: "Detection of Failed Append Requests"): appends stop, the partition is located
in the cluster metadata, a Mount goes out on the server's stream link with the feed position
(`received`), the feed replays, and once READY arrives every append still pending has failed
(the server guarantees none of them can commit any more) and is executed again; then appends
flow. A mount that makes no progress for `mount_timeout` fails what waits on the partition with
`MountTimeoutError` and goes on trying in the background.

The partition knows the client only through two narrow protocols (`waltz.client.host`): the
client's services (`ClientHost`) and the owner of each transaction's life (`TransactionOwner`,
`waltz.client.submission.TransactionLife`), to which it reports what became of each append."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from typing import Any

from waltz import client_protocol as cp
from waltz import errors
from waltz.client.context import TransactionBuilder
from waltz.client.host import ClientHost, TransactionOwner
from waltz.client.monitor import TransactionMonitor
from waltz.client.network import Link
from waltz.client.transaction import DataPrefetch, Transaction
from waltz.client.work import Work

log = logging.getLogger("waltz.client")

SEQ_MAX = 2**31 - 1
"""The highest append sequence number (a request id carries it as a signed 32-bit integer)."""
APPLY_BATCH = 1000


_Built = tuple[int, int, bytes, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""An Append's fields after its request id (the id is the send's: generation and sequence)."""


class Unavailable(Exception):
    """The partition cannot be located or mounted right now (retried)."""


class ClientPartition:
    def __init__(self, client: ClientHost, owner: TransactionOwner, partition: int, client_id: int) -> None:
        self.client, self.owner, self.pid = client, owner, partition
        cfg = client.config
        self.monitor: TransactionMonitor[Work] = TransactionMonitor()
        self.slots = asyncio.Semaphore(cfg.max_pending)
        self.outbox: collections.deque[tuple[Work, _Built]] = collections.deque()
        self.works: set[Work] = set()
        """Admitted and not finished: what `close` fails, wherever each one is (a retry waiting,
        a hook running)."""
        self.mounted = asyncio.Event()
        self.link: Link | None = None
        self.server: tuple[int, int] | None = None
        """(server id, generation) of the current mount."""
        self.client_id = client_id
        """The client id of this partition's ReqIds: the client's, until every sequence number
        under it was used (`SEQ_MAX`), then a new one from the cluster (`_renew_client_id`)."""
        self.seq = 0
        self._renewing = False
        self._mounted_as: int | None = None
        """The client id the current mount was made under: appends go out only under it, since
        the server tells a client's stale connections from its newest by the mount's id."""
        self.received = -2
        """The feed position (-2 until the first mount reads the application's mark)."""
        self.applied = -2
        self.newest_own = -1
        """The newest transaction of ours the feed delivered."""
        self.error: BaseException | None = None
        """ClientAheadError or ClientBehindRetentionError: the partition is refused for good."""
        self.unavailable: errors.MountTimeoutError | None = None
        self._remount = asyncio.Event()
        self._remount_why = "first mount"
        self._apply_queue: collections.deque[cp.FeedEntry] = collections.deque()
        self._apply_wakeup = asyncio.Event()
        self._to_apply: dict[int, Work] = {}
        self._applied_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._flush: tuple[Link, int, int] | None = None
        """An answered Flush: (its link, the newest sequence sent before it, the high-water mark
        the server reported): pending appends up to that sequence failed once the feed passes it."""
        self._flushing = False
        self.tasks: list[asyncio.Task[None]] = []
        self.last_error = ""
        """Why the last mount attempt failed ("" once mounted)."""
        self.stage = "not mounted yet"
        """The step the current (or last) mount attempt is in, for the errors that report it."""
        self._replay_from = -2
        """Where the feed stood when the current mount was asked (`mount_state`)."""
        self.closed = False
        """Set by `close`. The mount loop ends on it as well as on its cancellation: Python 3.11's
        `asyncio.wait_for` drops a cancellation that arrives in the same turn as the reply it
        waits for (a refused mount then retried for ever while `close` waited for it: a CI hang).
        The project uses `asyncio.timeout` and `asyncio.wait`, which keep it, and this flag guards
        the loop anyway."""

    def start(self) -> None:
        self.request_remount("first mount")
        self.tasks = [
            asyncio.create_task(self._mount_loop(), name=f"waltz-client-mount-{self.pid}"),
            asyncio.create_task(self._apply_loop(), name=f"waltz-client-apply-{self.pid}"),
        ]

    def request_remount(self, why: str) -> None:
        if not self._remount.is_set():
            self._remount_why = why
            self._remount.set()

    # -- mounting --------------------------------------------------------------------------
    async def _mount_loop(self) -> None:
        cfg = self.client.config
        while True:
            await self._remount.wait()
            if self.closed:
                return
            why = self._remount_why
            self.mounted.clear()
            self.link, self.server, self._flush = None, None, None
            log.debug("partition %d: mounting (%s)", self.pid, why)
            started = progress_at = time.monotonic()
            progress = self.received
            backoff = self.client.backoff()
            while True:
                if self.closed:
                    return
                self._remount.clear()
                now = time.monotonic()
                if self.received != progress:
                    progress, progress_at = self.received, now
                if self.unavailable is None and now - max(started, progress_at) > cfg.mount_timeout:
                    self._timed_out()
                try:
                    if await self._mount_once():
                        break
                except (errors.ClientAheadError, errors.ClientBehindRetentionError) as e:
                    self._refuse(e)
                    return
                except errors.ClientClosedError:
                    # Closing: also when close()'s cancellation was lost (see `closed`).
                    return
                except (TimeoutError, Unavailable, errors.WaltzError, ConnectionError, OSError) as e:
                    # A TLS failure is a configuration to fix, not a passing outage: said once, loudly.
                    refused = isinstance(e, errors.RequestFailedError) and e.kind == "client_refused"
                    if (isinstance(e, errors.TlsError) or refused) and str(e) != self.last_error:
                        log.warning("partition %d: %s (retrying)", self.pid, e)
                    self.last_error = str(e) or type(e).__name__
                    log.debug("partition %d: mount failed (retrying): %s", self.pid, self.last_error)
                await backoff.sleep()
            self.unavailable = None
            self.last_error, self.stage = "", "mounted"
            self.mounted.set()
            self._send_outbox()

    async def _mount_once(self) -> bool:
        cfg = self.client.config
        if self.received == -2:
            self.stage = "asking the application for its high-water mark"
            mark = await self.client.call(self.client.callbacks.get_client_high_water_mark, self.pid)
            if not isinstance(mark, int) or mark < -1:
                raise errors.ApplicationStateError(
                    f"get_client_high_water_mark({self.pid}) returned {mark!r}, not an id >= -1"
                )
            self.received = self.applied = mark
        self.stage = "looking up the server that serves it"
        endpoint, server_id, _ = await self.client.locate(self.pid)
        self.stage = f"connecting to server {endpoint}"
        link = await self.client.link(endpoint, "stream")
        self.link = link  # the feed of this mount is accepted from here on
        client_id, token = self.client_id, self.client.client_token
        self.stage = f"waiting for server {endpoint} to answer its mount"
        seen = self._replay_from = self.received

        def replaying() -> bool:
            """The feed moved since the last look and no remount is wanted: the answer comes
            after the replay (asking again would make the server replay from there, the bytes
            already on their way included)."""
            nonlocal seen
            moved, seen = self.received != seen, self.received
            return moved and not self._remount.is_set()

        try:
            resp = await link.request(
                lambda seq: cp.Mount(seq, self.pid, client_id, self.received, link.connection_seq, token),
                cfg.mount_timeout,
                progressing=replaying,
            )
        except TimeoutError:
            if self._remount.is_set():
                return False  # a gap in the feed or a failure of this mount: mount again
            raise Unavailable(f"server {endpoint} did not answer the mount within {cfg.mount_timeout} s") from None
        assert isinstance(resp, cp.MountResponse)
        if self.link is not link or self._remount.is_set():
            return False  # the link died or the partition moved while we waited
        if resp.status == cp.MountStatus.CLIENT_AHEAD:
            raise errors.ClientAheadError(
                f"partition {self.pid}: the application's high-water mark {self.received} is above the cluster's "
                f"{resp.high_water_mark} (a different cluster, or a database restored from a newer backup)"
            )
        if resp.status == cp.MountStatus.BEHIND_RETENTION:
            raise errors.ClientBehindRetentionError(
                f"partition {self.pid}: the application's high-water mark {self.received} is below what the cluster "
                f"holds: retention deleted transactions {self.received + 1}..{resp.high_water_mark - 1} and the log "
                f"starts at {resp.high_water_mark}; restore the application's database from a snapshot taken at a "
                f"high-water mark of at least {resp.high_water_mark - 1} (docs/client.md)",
                partition=self.pid,
                high_water_mark=self.received,
                first_id=resp.high_water_mark,
            )
        if resp.status != cp.MountStatus.READY:
            raise Unavailable(f"server {endpoint} does not serve partition {self.pid} yet")
        self.server, self._mounted_as = (server_id, resp.generation), client_id
        # READY: the server holds none of our earlier appends, and the feed delivered
        # everything committed; whatever is still pending failed.
        for attempt in self.monitor.fail_all():
            self.owner.retry(attempt.work)
        log.debug(
            "partition %d: mounted on %s, generation %d, from %d", self.pid, endpoint, resp.generation, self.received
        )
        return True

    def mount_state(self) -> str:
        """Where an unfinished mount stands: its step, how far the feed replayed, the last error."""
        said = [self.stage]
        if self._replay_from >= -1 and self.received > self._replay_from:
            said.append(f"its feed replayed {self.received - self._replay_from} transactions, up to {self.received}")
        if self.last_error:
            said.append(f"last error: {self.last_error}")
        return "; ".join(said)

    def _timed_out(self) -> None:
        self.unavailable = errors.MountTimeoutError(
            f"partition {self.pid} could not be mounted within {self.client.config.mount_timeout} s: "
            f"{self.mount_state()}"
        )
        for attempt in self.monitor.fail_all():
            self.finish(
                attempt.work,
                errors.MountTimeoutError(
                    f"{self.unavailable}; whether its transaction committed is unknown (if it did, it arrives in the "
                    "feed)",
                    outcome_unknown=True,
                ),
            )
        while self.outbox:
            self.finish(
                self.outbox.popleft()[0], errors.MountTimeoutError(f"{self.unavailable}; the transaction was not sent")
            )

    def _refuse(self, e: BaseException) -> None:
        log.error("%s", e)
        self.error = e
        # Those already sent may still commit (then they arrive in the feed of a later client).
        sent = (
            type(e)(f"{e}; it was sent and may still commit", outcome_unknown=True)
            if isinstance(e, errors.ClientError)
            else e
        )
        for attempt in self.monitor.fail_all():
            self.finish(attempt.work, sent)
        while self.outbox:
            self.finish(self.outbox.popleft()[0], e)
        self.mounted.set()  # wake start() and whoever waits: they find `error`

    # -- sending ---------------------------------------------------------------------------
    def enqueue(self, work: Work, builder: TransactionBuilder) -> None:
        """A built attempt: sent now if the partition is mounted, else when it is."""
        if work.finished:
            return
        refused = self.error or self.unavailable
        if refused is not None:
            self.finish(work, refused)
            return
        self.outbox.append(
            (
                work,
                (
                    builder.client_high_water_mark,
                    builder.header,
                    builder.data,
                    tuple(lk.hash for lk in builder.write_locks),
                    tuple(lk.hash for lk in builder.read_locks),
                    tuple(lk.hash for lk in builder.append_locks),
                ),
            )
        )
        self._send_outbox()

    def _send_outbox(self) -> None:
        link, server = self.link, self.server
        if (
            not self.mounted.is_set()
            or link is None
            or server is None
            or self.error is not None
            or self._mounted_as != self.client_id
        ):
            return
        generation = server[1]
        now = time.monotonic()
        while self.outbox:
            if self.seq >= SEQ_MAX:
                self._renew_client_id()
                return
            work, built = self.outbox.popleft()
            self.seq += 1
            self.monitor.sent(self.seq, work, now)
            try:
                link.send(cp.Append((self.client_id, generation, self.pid, self.seq), *built))
            except ConnectionError:
                return  # the link is closing: the remount settles what the monitor holds

    def _renew_client_id(self) -> None:
        """Every sequence number under this client id was used on this partition (a request id
        holds a signed 32-bit one). Request ids must stay unique and sequences rise under one id,
        so the partition takes a new client id from the cluster once every append it sent is
        settled: none of them can then commit later under the old id, and the monitor, which
        matches the feed by sequence, holds nothing. A fixed `client_id` (the configuration's) is
        kept, its sequences starting again as after a restart: a counter's id could be another
        fixed client's. Then the partition mounts again under the id, so that the server drops
        what this client's older connections still carry (it tells them apart by the mount's
        id). Until then the outbox waits."""
        if self._renewing or len(self.monitor) or self._flushing:
            return
        self._renewing = True
        self.client.spawn(self._take_new_client_id())

    async def _take_new_client_id(self) -> None:
        backoff = self.client.backoff()
        try:
            new = self.client.config.client_id
            while new < 0:
                try:
                    new = await self.client.next_client_id()
                except Exception as e:  # the metadata store away for a while: keep trying, the outbox waits
                    log.warning("partition %d: a new client id could not be taken (retrying): %s", self.pid, e)
                    await backoff.sleep()
            assert not len(self.monitor), "appends were sent while the client id was being renewed"
            log.info(
                "partition %d: every sequence number of client id %d was used; appending as client id %d from 1",
                self.pid,
                self.client_id,
                new,
            )
            self.client_id, self.seq, self._flush, self._mounted_as = new, 0, None, None
            self.request_remount(f"client id {new}")
        finally:
            self._renewing = False

    def _settled_some(self) -> None:
        """Appends were settled: an outbox waiting for a new client id may go now."""
        if self.seq >= SEQ_MAX and self.outbox:
            self._send_outbox()

    def finish(self, work: Work, result: bool | BaseException) -> None:
        """The context is complete: its future is resolved and its slot freed."""
        if work.finished:
            return
        work.finished = True
        # The caller may have cancelled its future (a concurrent one even from another thread):
        # set_* then refuses, and the slot is freed all the same. No done() first: for a
        # concurrent future it takes the future's lock a second time.
        try:
            if isinstance(result, BaseException):
                work.future.set_exception(result)
            else:
                work.future.set_result(result)
        except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
            pass
        work.release()
        self.works.discard(work)
        if not self.works:
            self._idle.set()

    # -- from the stream link --------------------------------------------------------------
    def on_feed(self, link: Link, entries: tuple[cp.FeedEntry, ...]) -> None:
        if link is not self.link:
            return  # an older connection's feed
        me = self.client_id
        for e in entries:
            txid = e.transaction_id
            if txid <= self.received:
                continue
            if txid != self.received + 1:
                log.error("partition %d: the feed jumped from %d to %d; mounting again", self.pid, self.received, txid)
                self.request_remount("a gap in the feed")
                break
            self.received = txid
            if e.req_id[0] == me and e.req_id[2] == self.pid:
                attempt, failed = self.monitor.committed(e.req_id[3])
                for f in failed:
                    self.owner.retry(f.work)
                if attempt is not None:
                    self.newest_own = txid
                    attempt.work.transaction_id = txid
                    self._to_apply[txid] = attempt.work
                    self.owner.committed(attempt.work)
            self._apply_queue.append(e)
        self._apply_wakeup.set()
        self._settle_flushed()
        self._settled_some()

    def on_lock_failure(self, link: Link, msg: cp.LockFailure) -> None:
        if link is not self.link:
            return
        attempt = self.monitor.refused(msg.req_id[3])
        if attempt is not None:
            self.owner.lost_lock_race(attempt.work, msg.transaction_id)
            self._settled_some()

    def on_failure(self, link: Link, msg: cp.Failure) -> None:
        if link is not self.link:
            return
        if msg.kind == cp.FailureKind.APPEND_REJECTED:
            attempt = self.monitor.refused(msg.seq)
            if attempt is not None:
                self.finish(attempt.work, errors.RequestFailedError(msg.message, "append_rejected"))
                self._settled_some()
            return
        # The store session ended (appends in flight have an unknown outcome) or the partition
        # left the server: a new mount settles both, and no Flush answered before may.
        log.info("partition %d: %s; mounting again", self.pid, msg.message)
        self._flush = None
        self.request_remount(msg.message)

    def on_link_closed(self, link: Link) -> None:
        if link is self.link:
            self.request_remount(f"{link} closed")

    # -- settling dropped appends ----------------------------------------------------------
    async def settle_stale(self) -> None:
        """Sends a Flush when an append has waited `settle_after` without an answer: once the
        feed passes the mark the Flush reports, everything sent before it is settled."""
        oldest = self.monitor.oldest()
        link, newest = self.link, self.monitor.newest_seq()
        if (
            self._flushing
            or self._flush is not None
            or oldest is None
            or newest is None
            or link is None
            or not self.mounted.is_set()
            or time.monotonic() - oldest.sent_at < self.client.config.settle_after
        ):
            return
        self._flushing = True
        resp: cp.Message | None = None
        try:
            resp = await link.request(lambda seq: cp.Flush(seq, self.pid), self.client.config.request_timeout)
        except (TimeoutError, errors.WaltzError, ConnectionError) as e:
            log.debug("partition %d: flush failed: %s", self.pid, e)
        finally:
            self._flushing = False
        if resp is not None:
            assert isinstance(resp, cp.FlushResponse)
            if link is self.link and not self._remount.is_set():
                self._flush = (link, newest, resp.high_water_mark)
                self._settle_flushed()
        self._settled_some()  # a renewal of the client id may have waited for this flush

    def _settle_flushed(self) -> None:
        if self._flush is None:
            return
        link, newest, mark = self._flush
        if link is not self.link or self._remount.is_set():
            # A remount is due (the link closed, the store session ended): the outcome of what
            # is pending is the next READY's to settle; failing it here could run again an
            # append that the next session's recovery commits.
            self._flush = None
        elif self.received >= mark:
            self._flush = None
            for attempt in self.monitor.failed_through(newest):
                log.debug("partition %d: append %d was dropped by the server; executing again", self.pid, attempt.seq)
                self.owner.retry(attempt.work)

    # -- applying --------------------------------------------------------------------------
    async def _apply_loop(self) -> None:
        backoff = self.client.backoff()
        while True:
            await self._apply_wakeup.wait()
            self._apply_wakeup.clear()
            while self._apply_queue:
                batch = [self._apply_queue.popleft() for _ in range(min(APPLY_BATCH, len(self._apply_queue)))]
                fetch = DataPrefetch(self.client, batch[-1].transaction_id).fetch
                txns = [
                    Transaction(self.pid, e.transaction_id, e.header, e.req_id, fetch, self.client.loop) for e in batch
                ]
                i = 0
                while i < len(txns):
                    done, exc = await self.client.apply(txns[i:])
                    if done:
                        # Our own contexts' `on_application` hooks, before the transactions count
                        # as applied (so `flush` returns after them).
                        await self.owner.applied(
                            [
                                w
                                for t in txns[i : i + done]
                                if (w := self._to_apply.pop(t.transaction_id, None)) is not None
                            ]
                        )
                        self._applied_through(txns[i + done - 1].transaction_id)
                        i += done
                        backoff.reset()
                    if exc is not None:
                        try:
                            await self.client.call(
                                self.client.callbacks.uncaught_exception, self.pid, txns[i].transaction_id, exc
                            )
                        except Exception:  # the handler's own failure must not end applying for good
                            log.exception(
                                "partition %d: uncaught_exception raised for transaction %d (applying it again)",
                                self.pid,
                                txns[i].transaction_id,
                            )
                        await backoff.sleep()

    def _applied_through(self, txid: int) -> None:
        self.applied = txid
        if self._applied_waiters:
            still = []
            for mark, fut in self._applied_waiters:
                if mark <= txid:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    still.append((mark, fut))
            self._applied_waiters = still

    async def applied_through(self, txid: int) -> None:
        """Returns once the application has applied `txid` (or the partition is refused)."""
        if self.applied >= txid or self.error is not None:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._applied_waiters.append((txid, fut))
        await fut

    async def idle(self) -> None:
        """Every context submitted so far completed, and our own commits are applied."""
        await self._idle.wait()
        await self.applied_through(self.newest_own)

    def admit(self, work: Work) -> None:
        self.works.add(work)
        self._idle.clear()

    def close(self, why: BaseException) -> None:
        self.closed = True
        self._remount.set()  # a mount loop that missed its cancellation wakes and ends
        for t in self.tasks:
            t.cancel()
        sent = errors.ClientClosedError(
            f"{why}; it was sent and may still commit (if it did, it arrives in the feed)", outcome_unknown=True
        )
        for attempt in self.monitor.fail_all():
            self.finish(attempt.work, sent)
        self.outbox.clear()
        for work in list(self.works):  # queued, or in a task the close cancels (a retry, a hook)
            # One the feed delivered is committed, even if its on_completion hook is still running.
            self.finish(work, True if work.transaction_id >= 0 else why)
        for _, fut in self._applied_waiters:
            if not fut.done():
                fut.set_exception(why)

    def describe(self) -> dict[str, Any]:
        return {
            "partition": self.pid,
            "mounted": self.mounted.is_set() and self.error is None,
            "received": self.received,
            "applied": self.applied,
            "in_flight": len(self.works),
            "pending": len(self.monitor),
            "queued": len(self.outbox),
            "error": self.last_error or ("" if self.mounted.is_set() else self.mount_state()),
        }
