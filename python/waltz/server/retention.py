"""Hands the retention policy and holds of the metadata to the replicas of the partitions this
server serves, as orders with a lease (`StoreSession.set_retention`).

Pushed on every change of the metadata entry and every `interval` seconds (which also renews
the lease and lets holds expire). Until the entry has been read once nothing is pushed, and an
order lapses on the node when its lease ends or a newer store session fences it: a server that
stops, or one deposed, leaves replicas that delete nothing more. What is deleted is decided on
the node, capped by its own low-water mark (docs/internals.md, "Retention").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from waltz import clock
from waltz.cluster import retention as policy_store
from waltz.cluster.retention import RetentionConfig

log = logging.getLogger("waltz.server.retention")

PUSH_INTERVAL = 5.0
LEASE = 30.0


class RetentionPusher:
    def __init__(
        self, metadata: Any, partitions: Any, *, interval: float = PUSH_INTERVAL, lease: float = LEASE
    ) -> None:
        self.metadata, self.partitions = metadata, partitions
        self.interval, self.lease = interval, lease
        self.config: RetentionConfig | None = None
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._watch: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._watch = await asyncio.to_thread(policy_store.watch, self.metadata, self._changed)
        self._task = asyncio.ensure_future(self._run())

    def _changed(self, config: RetentionConfig) -> None:
        """From the metadata store's thread."""
        self._loop.call_soon_threadsafe(self._set, config)

    def _set(self, config: RetentionConfig) -> None:
        self.config = config
        self._wake.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):  # wait_for could drop the task's cancellation
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.push_all()
            except Exception as e:  # noqa: BLE001 - the next round tries again
                log.warning("cannot hand out the retention policy: %s", e)

    async def push_all(self) -> None:
        config = self.config
        if config is None:
            return
        now = clock.now_ms()
        lease_ms = int(self.lease * 1000)
        for pid, part in list(self.partitions.by_id.items()):
            policy = config.policy_for(pid)
            first = await part.session.set_retention(policy, config.hold_from(pid, now), lease_ms)
            if first is not None:
                part.note_log_start(first, retention_active=not policy.keeps_everything)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
