"""`WaltzClient`: the thread-based client. It runs an `AsyncWaltzClient` on its own event loop
in a background thread; `submit` blocks the calling thread while the partition has
`max_pending` transactions in flight, runs the context's first `execute` in the calling thread,
and returns a `concurrent.futures.Future` of the completion.

A submission crosses to the loop once: the calling thread takes the partition's slot from a
semaphore of its own, executes the context and hands the result to the loop, which resolves the
returned future itself when the transaction completes (before, admission and the future's copy
were each a round trip through the loop: four thread crossings per transaction instead of two).

    with WaltzClient(callbacks, ClientConfig(metadata="zk://zk1:2181/waltz")) as client:
        ok = client.submit(MyContext(...)).result()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from waltz import errors
from waltz.client.aio import AsyncWaltzClient, in_callback_thread
from waltz.client.callbacks import WaltzClientCallbacks, is_async
from waltz.client.config import ClientConfig
from waltz.client.context import Append, PartitionLocalLock, TransactionContext
from waltz.client.serializers import BYTES, Serializer
from waltz.client.stats import ClientStats
from waltz.client.submission import execute_here
from waltz.client.work import Work
from waltz.event_loop import loop_factory

T = TypeVar("T")


class Slots:
    """A partition's `max_pending` places for submitting threads: a counter under a plain lock,
    with a condition only for a thread that finds none free. The loop frees a place per
    completed transaction; `threading.Semaphore` took its condition's lock and checked its
    waiters in Python each time, a tenth of the loop's time at 32 in flight."""

    def __init__(self, places: int) -> None:
        self._free = places
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._waiting = 0

    def acquire(self) -> None:
        with self._lock:
            while not self._free:
                self._waiting += 1
                try:
                    self._room.wait()
                finally:
                    self._waiting -= 1
            self._free -= 1

    def release(self) -> None:
        with self._lock:
            self._free += 1
            if self._waiting:
                self._room.notify()


class WaltzClient:
    def __init__(self, callbacks: WaltzClientCallbacks, config: ClientConfig) -> None:
        self._core = self._make_core(callbacks, config)
        self._loop = loop_factory(config.event_loop, "the client's event_loop")()
        self._thread = threading.Thread(target=self._loop.run_forever, name="waltz-client", daemon=True)
        self._thread.start()
        # Set under `_handing_over` once the loop is about to stop: a submission either reached
        # the loop before its stop (and close() settles it) or is refused, never lost between.
        self._stopping = False
        self._handing_over = threading.Lock()
        try:
            self._run(self._core.start())
        except BaseException:
            self._stop_loop()
            raise
        self._slots = {p: Slots(config.max_pending) for p in self._core.mounted_partitions}

    def _make_core(self, callbacks: WaltzClientCallbacks, config: ClientConfig) -> AsyncWaltzClient:
        """The asyncio client this one runs (`waltz.client.mock` gives an in-memory one)."""
        return AsyncWaltzClient(callbacks, config)

    def __enter__(self) -> WaltzClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking WaltzClient call from the client's own event loop would deadlock")
        if not self._thread.is_alive():
            coro.close()
            raise errors.ClientClosedError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _call_here(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Application code from the calling thread (an `async def` goes to the client's loop)."""
        if is_async(fn):
            return self._run(fn(*args))
        return fn(*args)

    @property
    def client_id(self) -> int:
        return self._core.client_id

    @property
    def partitions(self) -> int:
        return self._core.partitions

    def submit(self, context: TransactionContext) -> concurrent.futures.Future[bool]:
        """Blocks while the partition is full, executes the context here, queues its append and
        returns the future of its completion (see `AsyncWaltzClient.submit`)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking WaltzClient call from the client's own event loop would deadlock")
        core = self._core
        part = core.route(context)
        slots = self._slots[part.pid]
        slots.acquire()
        if core._closed or self._stopping:
            slots.release()  # wakes the next thread waiting here, which finds the same
            raise errors.ClientClosedError("the client is closed")
        result: concurrent.futures.Future[bool] = concurrent.futures.Future()
        work = Work(part.pid, context, result, core.deadline_of(context), slots.release)
        handed_over = False
        try:
            executed = execute_here(work, core.callbacks, self._call_here)
            with self._handing_over:
                if not self._stopping:
                    self._loop.call_soon_threadsafe(core.submitted, work, executed)
                    handed_over = True
                    return result
            raise errors.ClientClosedError("the client was closed while this context executed (nothing was sent)")
        finally:
            if not handed_over:  # the loop never saw it (closed, or a KeyboardInterrupt in execute)
                slots.release()

    @property
    def mounted_partitions(self) -> tuple[int, ...]:
        return self._core.mounted_partitions

    @property
    def stats(self) -> ClientStats:
        return self._core.stats

    def append(
        self,
        partition: int,
        data: Any,
        *,
        locks: Iterable[PartitionLocalLock] = (),
        read_locks: Iterable[PartitionLocalLock] = (),
        append_locks: Iterable[PartitionLocalLock] = (),
        header: int = 0,
        serializer: Serializer[Any] = BYTES,
        timeout: float | None = None,
    ) -> int:
        """Appends `data` to the partition with these locks and blocks until it committed;
        returns the transaction's id (see `AsyncWaltzClient.append`)."""
        context = Append(
            partition,
            data,
            serializer=serializer,
            header=header,
            locks=locks,
            read_locks=read_locks,
            append_locks=append_locks,
            timeout=timeout,
        )
        self.submit(context).result()
        return context.committed_transaction_id

    def flush(self) -> None:
        """Blocks until every context submitted so far has completed and this client has applied
        its own committed transactions. Not from `apply_transaction` (it would wait for itself)."""
        if in_callback_thread():
            raise RuntimeError("flush() from a callback would wait for that callback: call it from application threads")
        self._run(self._core.flush())

    def high_water_mark(self, partition: int) -> int:
        return self._run(self._core.high_water_mark(partition))

    def status(self) -> list[dict[str, Any]]:
        return self._run(self._status())

    async def _status(self) -> list[dict[str, Any]]:
        return self._core.status()

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._run(self._core.close())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            if not self._core._closed:
                asyncio.run_coroutine_threadsafe(self._core.close(), self._loop).result()
            with self._handing_over:
                self._stopping = True
            # Submissions handed over before this point are settled by this turn's callbacks
            # (closed: ClientClosedError) ahead of the stop, which is queued after them.
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            # On a thread of its own: the caller may be running an event loop of its own.
            late = threading.Thread(target=_finish_late_work, args=(self._loop,), name="waltz-client-close")
            late.start()
            late.join()
        else:
            self._stopping = True
        for slots in getattr(self, "_slots", {}).values():
            slots.release()  # a thread still waiting for room wakes, finds the client closed
        self._loop.close()


LATE_WORK_ROUNDS = 3
"""Rounds of `_finish_late_work`: other threads can keep calling in until the loop is closed."""


def _finish_late_work(loop: asyncio.AbstractEventLoop) -> None:
    """Finishes, on the stopped loop, what other threads put on it after `_cancel_the_rest` (a
    callback thread's `Transaction.data()` in the loop's last turns): its callbacks run, its
    tasks are cancelled and run to their end, as `asyncio.run` ends its tasks. Left there, a task
    stayed pending for ever and the collector destroyed it ("Task was destroyed but it is
    pending!", seen in CI)."""
    for _ in range(LATE_WORK_ROUNDS):
        loop.call_soon(loop.stop)
        loop.run_forever()  # one turn: the callbacks queued meanwhile (they may start tasks)
        rest = asyncio.all_tasks(loop)
        if not rest:
            return
        for t in rest:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))


async def _cancel_the_rest() -> None:
    """Cancels what other threads left running on the loop (a `Transaction.data()` fetch of an
    apply callback) and waits for it, as `asyncio.run` does: a task the closed loop dropped
    was finalized later by the garbage collector, and its cleanup ran on a closed loop."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for t in rest:
        t.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
