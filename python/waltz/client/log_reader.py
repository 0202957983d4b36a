"""Reading a live cluster's committed log without mounting anything: the partitions' high-water
marks from their servers, and committed ranges straight from the storage replicas.

Bulk readers (the Spark source, drains after a torture run) need whole ranges, which the client
feed hands out one transaction at a time. A replica serves them in lists instead, but only some
replicas are safe to read: one recorded clean in the partition's current store session holds a
prefix of the committed log followed by that session's stream, so every id up to the server's
high-water mark it holds is committed (docs/internals.md, "Recovery"). A replica of an older
session may hold a dirty tail at the same ids, so it is never read above its own low-water mark;
this module does not read it at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as _ssl
import time
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Any

from waltz import client_protocol as cp
from waltz import errors
from waltz._native import Record
from waltz.client.network import Link
from waltz.client.retry import Backoff
from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.metadata import UNRESOLVED, ClusterInfo, ClusterMetadata, ReplicaState
from waltz.role_secrets import Credential
from waltz.storage.client import StorageAdminClient

log = logging.getLogger("waltz.client.log_reader")

REFUSALS = (errors.RefusedError, errors.HelloRefusedError)
"""What a reader raises at once instead of retrying: a storage node or a server refused our
credential (the role of our certificate, or our role secret); trying again cannot change that."""

RETRY_BASE, RETRY_CAP = 0.05, 0.5
"""Bounds of the waits between attempts (full jitter, `waltz.client.retry`): short, since a
reader waits for a replica or a server that is usually back within a second."""


class LogReader:
    """Use `async with LogReader(metadata_url, cluster) as r:`; every call retries on other
    servers and replicas until `timeout`."""

    def __init__(
        self,
        metadata: str,
        cluster: str = "default",
        *,
        ssl: _ssl.SSLContext | None = None,
        timeout: float = 30.0,
        session_timeout: float = 10.0,
        credential: Credential | None = None,
    ) -> None:
        self.metadata_url, self.cluster_name = metadata, cluster
        self._ssl, self.timeout = ssl, timeout
        self._credential = credential
        """The admin role's (role, secret) for clusters with role secrets (`waltz.role_secrets`): it
        opens the storage nodes' admin ports and the servers' client ports alike."""
        self._store = open_store(metadata, session_timeout=session_timeout, role=credential)
        self._meta: ClusterMetadata | None = None
        self._info: ClusterInfo | None = None
        self._links: dict[str, Link] = {}
        self._link_locks: dict[str, asyncio.Lock] = {}
        self._admins: dict[str, StorageAdminClient] = {}

    async def __aenter__(self) -> LogReader:
        await self.start()
        return self

    async def __aexit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        await asyncio.to_thread(self._store.start, self.timeout)
        self._meta = ClusterMetadata(self._store, cluster_root(self.cluster_name))
        self._info = await asyncio.to_thread(self._meta.info)

    async def close(self) -> None:
        await asyncio.gather(*(link.aclose() for link in self._links.values()))
        for admin in self._admins.values():
            with contextlib.suppress(Exception):
                await admin.close()
        self._links.clear()
        self._admins.clear()
        await asyncio.to_thread(self._store.close)

    @property
    def info(self) -> ClusterInfo:
        assert self._info is not None, "LogReader.start() first"
        return self._info

    @property
    def metadata(self) -> ClusterMetadata:
        assert self._meta is not None, "LogReader.start() first"
        return self._meta

    # -- high-water marks ----------------------------------------------------------------------
    async def high_water_marks(self, partitions: Iterable[int] | None = None) -> dict[int, int]:
        """Partition → the highest committed id now (-1: empty), asked of each partition's server."""
        wanted = list(range(self.info.partitions) if partitions is None else partitions)
        marks = await asyncio.gather(*(self.high_water_mark(p) for p in wanted))
        return dict(zip(wanted, marks, strict=True))

    async def high_water_mark(self, partition: int) -> int:
        self._check(partition)
        deadline, last = time.monotonic() + self.timeout, "no attempt"
        backoff = Backoff(RETRY_BASE, RETRY_CAP)
        while time.monotonic() < deadline:
            try:
                link = await self._server_link(partition)
                resp = await link.request(lambda seq: cp.HighWaterMarkRequest(seq, partition), self.timeout)
                assert isinstance(resp, cp.HighWaterMarkResponse)
                return resp.high_water_mark
            except REFUSALS:
                raise
            except (OSError, errors.RequestFailedError, errors.ClusterError, errors.ProtocolError, TimeoutError) as e:
                last = str(e)
                await backoff.sleep(deadline - time.monotonic())
        raise errors.RequestTimeoutError(f"partition {partition}: no high-water mark within {self.timeout} s ({last})")

    async def _server_link(self, partition: int) -> Link:
        server, _ = await asyncio.to_thread(self.metadata.partition_server, partition)
        endpoint = server.endpoint
        # Partitions asked at once (`high_water_marks`) share one link: without the lock each
        # opened its own and all but the last were never closed.
        async with self._link_locks.setdefault(endpoint, asyncio.Lock()):
            link = self._links.get(endpoint)
            if link is None or link.closed:
                link = Link(
                    endpoint,
                    "rpc",
                    lambda _l, _m: None,
                    lambda _l, _w: None,
                    ssl=self._ssl,
                    credential=self._credential,
                )
                await link.open(self.timeout)
                self._links[endpoint] = link
            return link

    # -- committed ranges ------------------------------------------------------------------------
    async def read(self, partition: int, start: int, end: int, *, max_count: int = 1000) -> AsyncIterator[list[Record]]:
        """Records `start..=end` of the partition in order, in lists of up to `max_count`. `end`
        must be committed (at most a high-water mark read before); a replica that falls over or
        lags hands over to the next one. `BelowLogStartError` when every readable replica has
        dropped the next id (retention, or a directory replaced by a pruned copy)."""
        self._check(partition)
        nxt, deadline, last = start, time.monotonic() + self.timeout, "no replica tried"
        backoff = Backoff(RETRY_BASE, RETRY_CAP)
        while nxt <= end:
            progressed, gone, firsts = False, [], []
            replicas = await asyncio.to_thread(self._readable_replicas, partition)
            for address in replicas:
                try:
                    admin = await self._admin(address)
                    while nxt <= end:
                        records = await admin.records(partition, nxt, min(max_count, end - nxt + 1))
                        records = [r for r in records if r.txid <= end]
                        if not records:
                            last = f"{address} holds nothing at {nxt}"
                            break
                        if records[0].txid != nxt:
                            raise errors.ProtocolError(
                                f"{address} answered a read at {nxt} with transaction {records[0].txid}"
                            )
                        nxt = records[-1].txid + 1
                        progressed = True
                        yield records
                        # The wait counts from here: a consumer may hold the generator for longer
                        # than the timeout (a Spark task writing downstream), and a connection
                        # closed meanwhile must still get its retry.
                        deadline = time.monotonic() + self.timeout
                except errors.BelowLogStartError as e:
                    last = f"{address}: {e}"
                    gone.append(last)
                    firsts.append(getattr(e, "first", -1))
                except REFUSALS:
                    raise
                except (OSError, errors.StorageError, errors.ProtocolError, TimeoutError) as e:
                    last = f"{address}: {e}"
                    await self._drop_admin(address)
                if nxt > end:
                    return
            if replicas and len(gone) == len(replicas):
                # Every replica that can serve it has dropped it: waiting cannot bring it back.
                held = min(firsts)
                gap = f"transactions {nxt}..{held - 1} are" if held > nxt else f"transaction {nxt} is"
                below = errors.BelowLogStartError(
                    f"partition {partition}: {gap} held by no replica any more (deleted by retention, or a "
                    f"directory replaced by a pruned copy; the log starts at {held}) ({'; '.join(gone)})"
                )
                below.first = held  # type: ignore[attr-defined]
                raise below
            if time.monotonic() > deadline:
                raise errors.RequestTimeoutError(
                    f"partition {partition}: cannot read transaction {nxt} within {self.timeout} s ({last})"
                )
            if progressed:
                backoff.reset()
            else:
                await backoff.sleep()

    async def first_transaction_id(self, partition: int) -> int:
        """The lowest id any of the partition's readable replicas still holds (retention moves
        each one's up on its own, a whole segment at a time): `read` from there finds every id
        some replica holds."""
        return (await self.first_transaction_ids([partition]))[partition]

    async def first_transaction_ids(self, partitions: Iterable[int] | None = None) -> dict[int, int]:
        """Partition → `first_transaction_id`, from one Status of each readable replica, all asked
        at once: an unreachable node costs one connect timeout for every partition together, not
        one per partition in turn. A partition's answer is the lowest first id among its replicas
        that answered and can serve it (a replica that cannot open the partition, or is not
        readable, holds nothing a read could get)."""
        wanted = list(range(self.info.partitions) if partitions is None else partitions)
        for p in wanted:
            self._check(p)
        deadline, last = time.monotonic() + self.timeout, "no readable replica"
        backoff = Backoff(RETRY_BASE, RETRY_CAP)
        while True:
            readable = await asyncio.to_thread(lambda: {p: self._readable_replicas(p) for p in wanted})
            addresses = sorted({a for replicas in readable.values() for a in replicas})
            answers = await asyncio.gather(*(self._status(a) for a in addresses), return_exceptions=True)
            rows: dict[str, dict[int, dict[str, Any]]] = {}
            for address, answer in zip(addresses, answers, strict=True):
                if isinstance(answer, REFUSALS):
                    raise answer
                if isinstance(answer, (OSError, errors.StorageError, errors.ProtocolError, TimeoutError)):
                    last = f"{address}: {answer}"
                    await self._drop_admin(address)
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    rows[address] = answer
            firsts: dict[int, int] = {}
            for p in wanted:
                held = [first for a in readable[p] if (first := _servable_first(rows.get(a, {}).get(p))) is not None]
                if held:
                    firsts[p] = min(held)
                elif any(a in rows for a in readable[p]):
                    last = f"partition {p}: no readable replica that answered holds it"
            if len(firsts) == len(wanted):
                return firsts
            if time.monotonic() > deadline:
                missing = sorted(set(wanted) - set(firsts))
                raise errors.RequestTimeoutError(
                    f"partition {missing[0]}: no replica answered within {self.timeout} s ({last})"
                )
            await backoff.sleep()

    async def _status(self, address: str) -> dict[int, dict[str, Any]]:
        admin = await self._admin(address)
        return {int(row["partition"]): row for row in await admin.status()}

    def _readable_replicas(self, partition: int) -> list[str]:
        """Addresses of the replicas recorded clean in the current store session."""
        meta, _ = self.metadata.partition_metadata(partition)
        current = ReplicaState(meta.session_id, UNRESOLVED)
        return sorted(a for a, state in meta.replicas.items() if state == current)

    async def _admin(self, address: str) -> StorageAdminClient:
        admin = self._admins.get(address)
        if admin is None:
            node = await asyncio.to_thread(self.metadata.storage_node, address)
            if not node.admin_port:
                raise errors.StorageConnectionError(f"storage node {address} has no admin port in the metadata")
            try:
                admin = await StorageAdminClient.connect(
                    node.host,
                    node.admin_port,
                    cluster_key=self.info.cluster_key,
                    partition_count=self.info.partitions,
                    timeout=self.timeout,
                    ssl=self._ssl,
                    credential=self._credential,
                )
            except errors.RefusedError as e:
                raise errors.RefusedError(
                    f"{e} (a log reader reads records from the storage nodes' admin ports, which admit only the "
                    "server and admin roles: give it an admin certificate, or the admin secret)"
                ) from e
            self._admins[address] = admin
        return admin

    async def _drop_admin(self, address: str) -> None:
        admin = self._admins.pop(address, None)
        if admin is not None:
            with contextlib.suppress(Exception):
                await admin.close()

    def _check(self, partition: int) -> None:
        if not 0 <= partition < self.info.partitions:
            raise ValueError(f"no partition {partition}: the cluster has {self.info.partitions}")

    async def sessions(self) -> dict[int, int]:
        """Partition → its current store session id (-1 before its first)."""

        def read() -> dict[int, int]:
            return {p: self.metadata.partition_metadata(p)[0].session_id for p in range(self.info.partitions)}

        return await asyncio.to_thread(read)


def _servable_first(row: dict[str, Any] | None) -> int | None:
    """A Status row's first id, or None when that replica cannot serve reads of the partition:
    no row, set unreadable, or not opened (first id -1)."""
    if row is None or not row["readable"]:
        return None
    first = int(row["first_transaction_id"])
    return first if first >= 0 else None
