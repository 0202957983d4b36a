"""`TransactionLife`: the one owner of a submitted transaction's life. It executes the context,
checks what was built, hands the append to its partition to send, takes the outcome the
partition reports (committed, lost a lock race, failed and to be retried), executes again
until the deadline, runs the context's hooks, and resolves the submission with the result.

    submit ─ admit ─ execute ─ built ─ partition sends ─┬─ committed ─ on_completion ─ True
                        ▲                                ├─ lost lock race ─ on_lock_failure ─┐
                        └──────────── retry ◄────────────┴─ failed (remount, flush) ◄─────────┘
    declined (execute returned False) ─ on_completion ─ False
    execute raised ─ on_exception ─ its error;   deadline passed ─ on_expiration ─ TransactionExpiredError

The partition (`waltz.client.partition`) sends, settles from the feed and resolves; it reports
back through the `TransactionOwner` protocol and never calls into this module."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from waltz import errors
from waltz.client.callbacks import WaltzClientCallbacks
from waltz.client.context import TransactionBuilder, TransactionContext
from waltz.client.host import ClientHost
from waltz.client.partition import ClientPartition
from waltz.client.work import Work

log = logging.getLogger("waltz.client")

FRAME_OVERHEAD = 4096
"""Room for an Append's fields and locks besides the data within one frame."""

Executed = tuple[TransactionBuilder, object] | BaseException | None
"""A first execution run outside the loop: what it built and returned, what it raised, or None
when the context expired before it could run."""


def execute_here(work: Work, callbacks: WaltzClientCallbacks, call: Callable[..., Any]) -> Executed:
    """The first execution of a context in the submitting thread (`WaltzClient`); `call` runs
    application code there. The loop goes on from the result with `TransactionLife.submitted`."""
    if time.monotonic() > work.deadline:
        return None
    try:
        builder = TransactionBuilder(work.pid, call(callbacks.get_client_high_water_mark, work.pid))
        work.executions += 1
        return builder, call(work.context.execute, builder)
    except Exception as e:
        return e


def has_hook(context: TransactionContext, name: str) -> bool:
    """The context overrides the hook (the default does nothing: not calling it saves a task)."""
    return getattr(type(context), name, None) is not getattr(TransactionContext, name)


class TransactionLife:
    def __init__(self, host: ClientHost, parts: Mapping[int, ClientPartition]) -> None:
        self.host = host
        self.parts = parts
        """The client's partitions, by id (filled when the client starts)."""

    # -- from the client -------------------------------------------------------------------
    async def submit(self, work: Work) -> None:
        """Admitted: executes the context once and queues its append."""
        self.parts[work.pid].admit(work)
        await self.execute(work)

    def submitted(self, work: Work, executed: Executed, closed: bool) -> None:
        """A context `WaltzClient` executed in the submitting thread (`execute_here`), on the
        loop now; `closed`: the client closed meanwhile."""
        part = self.parts[work.pid]
        part.admit(work)
        if closed:  # close() failed what it knew of; this one came after
            part.finish(work, errors.ClientClosedError("the client is closed"))
        elif executed is None:
            self.host.spawn(self._expire(work))
        elif isinstance(executed, BaseException):
            self.host.spawn(self._execution_failed(work, executed))
        else:
            self._built(work, *executed)

    # -- executing -------------------------------------------------------------------------
    async def execute(self, work: Work) -> None:
        """(Re-)executes a context and queues its append."""
        if work.finished:
            return
        if time.monotonic() > work.deadline:
            await self._expire(work)
            return
        try:
            mark = await self.host.call(self.host.callbacks.get_client_high_water_mark, work.pid)
            builder = TransactionBuilder(work.pid, mark)
            work.executions += 1
            ok = await self.host.call(work.context.execute, builder)
        except Exception as e:
            await self._execution_failed(work, e)
            return
        self._built(work, builder, ok)

    def _built(self, work: Work, builder: TransactionBuilder, ok: object) -> None:
        if not isinstance(ok, bool):
            self.host.spawn(
                self._execution_failed(
                    work,
                    TypeError(
                        f"{type(work.context).__name__}.execute must return True (submit) or False (drop), not {ok!r}"
                    ),
                )
            )
        elif not ok:
            self.host.spawn(self._declined(work))
        elif len(builder.data) > self.host.config.max_frame - FRAME_OVERHEAD:
            self.host.spawn(
                self._execution_failed(
                    work,
                    ValueError(
                        f"transaction data of {len(builder.data)} bytes does not fit in a frame (max_frame "
                        f"{self.host.config.max_frame})"
                    ),
                )
            )
        else:
            self.parts[work.pid].enqueue(work, builder)

    # -- outcomes (the partition reports them: `TransactionOwner`) -------------------------
    def retry(self, work: Work) -> None:
        self.host.stats.retries += 1
        self.host.spawn(self.execute(work))

    def committed(self, work: Work) -> None:
        self.host.stats.commits += 1
        work.context.committed_transaction_id = work.transaction_id
        if has_hook(work.context, "on_completion"):
            work.completing = self.host.spawn(self._completed(work))
        else:
            self.parts[work.pid].finish(work, True)

    def lost_lock_race(self, work: Work, transaction_id: int) -> None:
        self.host.stats.lock_failures += 1
        self.host.stats.retries += 1
        self.host.spawn(self._after_lock_failure(work, transaction_id))

    async def applied(self, works: list[Work]) -> None:
        """Our own contexts' `on_application` hooks, each after its `on_completion`."""
        hooked = [w for w in works if has_hook(w.context, "on_application")]
        if hooked:
            await asyncio.gather(*(w.completing for w in hooked if w.completing is not None), return_exceptions=True)
            await asyncio.gather(*(self._hook(w.context, "on_application") for w in hooked))

    async def _completed(self, work: Work) -> None:
        await self._hook(work.context, "on_completion", True)
        self.parts[work.pid].finish(work, True)

    async def _declined(self, work: Work) -> None:
        await self._hook(work.context, "on_completion", False)
        self.parts[work.pid].finish(work, False)

    async def _execution_failed(self, work: Work, exc: BaseException) -> None:
        await self._hook(work.context, "on_exception", exc)
        self.parts[work.pid].finish(work, exc)

    async def _expire(self, work: Work) -> None:
        await self._hook(work.context, "on_expiration")
        self.parts[work.pid].finish(
            work,
            errors.TransactionExpiredError(
                f"{type(work.context).__name__} expired after {work.executions} execution(s) without committing"
            ),
        )

    async def _after_lock_failure(self, work: Work, transaction_id: int) -> None:
        """Lost a lock race to `transaction_id`: re-execute once the application has seen it."""
        await self._hook(work.context, "on_lock_failure", transaction_id)
        # The winner's id can be one that never commits (its batch died with a store session and
        # nothing has taken the id since): the wait is bounded, a retry then simply tries again.
        wait = min(work.deadline - time.monotonic(), max(5.0, 4 * self.host.config.settle_after))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, wait)):
                await self.parts[work.pid].applied_through(transaction_id)
        await self.execute(work)  # expires it if the deadline passed

    # -- hooks -----------------------------------------------------------------------------
    async def _hook(self, context: TransactionContext, name: str, *args: Any) -> None:
        """Calls a context's hook if it overrides the default; an exception is logged, never
        allowed to break the client."""
        if not has_hook(context, name):
            return
        try:
            await self.host.call(getattr(context, name), *args)
        except Exception:
            log.exception("%s.%s raised", type(context).__name__, name)
