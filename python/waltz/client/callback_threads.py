"""`CallbackThreads`: the `callback_threads` worker threads that run the application's plain
functions (apply_transaction, execute, hooks) off the client's event loop, so that a blocking
database call never stalls the feed.

A call crosses to a worker once (a put on a queue) and back once (`call_soon_threadsafe`
resolving the loop's future). `loop.run_in_executor` on a `ThreadPoolExecutor` did the same
with a concurrent future, a lock and a condition per call and a second future chained to it:
a fifth of the loop's time per transaction at one in flight (docs/performance.md)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_callback_thread = threading.local()

_IDLE_CHECK = 0.5
"""How often an idle worker checks whether the interpreter is exiting (it then ends, as a
`ThreadPoolExecutor`'s workers do, instead of holding the exit up)."""


def in_callback_thread() -> bool:
    return getattr(_callback_thread, "active", False)


_Item = tuple["asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class CallbackThreads:
    """Up to `threads` workers, started as calls need them. Used from the loop only (`run`,
    `shutdown`); the workers only touch the loop through `call_soon_threadsafe`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threads: int, name: str = "waltz-callback") -> None:
        self._loop, self._max, self._name = loop, threads, name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._busy = 0
        """Calls queued or running (counted on the loop): a new worker starts while it exceeds
        the workers started."""
        self._shut = False

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """`fn(*args)` in a worker; the future resolves on the loop with its result or error
        (cancelling it before the call starts skips the call)."""
        if self._shut:
            raise RuntimeError("the client's callback threads are shut down")
        fut = self._loop.create_future()
        self._busy += 1
        self._queue.put((fut, fn, args))
        if self._busy > len(self._workers) and len(self._workers) < self._max:
            t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._workers)}")
            self._workers.append(t)
            t.start()
        return fut

    def _resolve(self, fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        self._busy -= 1
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def shutdown(self) -> None:
        """Cancels the calls not started; the workers end after the calls they are running
        (not waited for, as `ThreadPoolExecutor.shutdown(wait=False, cancel_futures=True)`)."""
        self._shut = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._busy -= 1
                item[0].cancel()
        for _ in self._workers:
            self._queue.put(None)

    def _work(self) -> None:
        _callback_thread.active = True
        loop, get = self._loop, self._queue.get
        main = threading.main_thread()
        while True:
            try:
                item = get(timeout=_IDLE_CHECK)
            except queue.Empty:
                if not main.is_alive():
                    return
                continue
            if item is None:
                return
            fut, fn, args = item
            result, error = None, None
            if not fut.cancelled():  # a read of its state; cancelled before the call started: skipped
                try:
                    result = fn(*args)
                except BaseException as e:  # handed to the awaiting coroutine, which decides
                    error = e
            try:
                loop.call_soon_threadsafe(self._resolve, fut, result, error)
            except RuntimeError:  # the loop is closed: nobody awaits the call any more
                pass
            del item, fut, result, error  # nothing of the call outlives it in an idle worker
