"""`CallbackThreads`: application code off the loop, at most `callback_threads` workers, results
and errors back on the loop, calls not started cancelled at shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest
from waltz.client.callback_threads import CallbackThreads, in_callback_thread


def _where() -> tuple[str, bool]:
    return threading.current_thread().name, in_callback_thread()


async def _calls_run_in_marked_workers_and_resolve_on_the_loop() -> None:
    pool = CallbackThreads(asyncio.get_running_loop(), 2)
    name, marked = await pool.run(_where)
    assert name.startswith("waltz-callback") and marked
    assert not in_callback_thread()
    assert await pool.run(lambda a, b: a + b, 2, 3) == 5

    def boom() -> None:
        raise KeyError("from the application")

    with pytest.raises(KeyError, match="from the application"):
        await pool.run(boom)
    pool.shutdown()


async def _at_most_the_configured_workers_run_at_once() -> None:
    pool = CallbackThreads(asyncio.get_running_loop(), 2)
    gate = threading.Event()
    running: set[str] = set()
    lock = threading.Lock()

    def hold() -> None:
        with lock:
            running.add(threading.current_thread().name)
        gate.wait(5)

    calls = [pool.run(hold) for _ in range(5)]
    await asyncio.sleep(0.2)
    assert len(running) == 2  # three wait in the queue
    gate.set()
    await asyncio.gather(*calls)
    assert len(running) == 2
    pool.shutdown()


async def _shutdown_cancels_calls_not_started_and_refuses_new_ones() -> None:
    pool = CallbackThreads(asyncio.get_running_loop(), 1)
    gate = threading.Event()
    ran: list[int] = []
    first = pool.run(gate.wait, 5)
    later = [pool.run(ran.append, i) for i in range(3)]
    await asyncio.sleep(0.1)
    pool.shutdown()
    gate.set()
    assert await first is True  # the running call completes
    assert all(f.cancelled() for f in later)
    assert ran == []
    with pytest.raises(RuntimeError, match="shut down"):
        pool.run(ran.append, 9)


async def _a_call_cancelled_before_it_starts_is_skipped() -> None:
    pool = CallbackThreads(asyncio.get_running_loop(), 1)
    gate = threading.Event()
    ran: list[int] = []
    first = pool.run(gate.wait, 5)
    skipped = pool.run(ran.append, 1)
    skipped.cancel()
    gate.set()
    await first
    assert await pool.run(ran.append, 2) is None
    assert ran == [2]
    pool.shutdown()


def test_calls_run_in_marked_workers_and_resolve_on_the_loop() -> None:
    asyncio.run(_calls_run_in_marked_workers_and_resolve_on_the_loop())


def test_at_most_the_configured_workers_run_at_once() -> None:
    asyncio.run(_at_most_the_configured_workers_run_at_once())


def test_shutdown_cancels_calls_not_started_and_refuses_new_ones() -> None:
    asyncio.run(_shutdown_cancels_calls_not_started_and_refuses_new_ones())


def test_a_call_cancelled_before_it_starts_is_skipped() -> None:
    asyncio.run(_a_call_cancelled_before_it_starts_is_skipped())
