"""Requests a storage node refuses although they carry the cluster key: destructive ones its own
state shows no server ever needs (issue 34: with the key alone, a Truncate to -1 on every replica
destroyed acknowledged data, and Last Session Info with session 2^62 fenced every server out for
good). Each test runs a real storage node process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from support.processes import start, stop, wait_http, write_config
from waltz import errors
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient


@pytest.fixture
def node(tmp_path):
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)
        yield key, ports
    finally:
        stop(proc)


def batch(first: int, n: int) -> RecordBatch:
    return RecordBatch([(ReqId(1, 1, 0, t), t, b"r%d" % t) for t in range(first, first + n)])


async def committed_log(key, ports) -> StorageClient:
    """Session 1 wrote records 0..9 and set the low-water mark 5 (records 0..5 committed), as a
    server's store session does; returns the connection, opened with the cluster key."""
    async with await StorageAdminClient.connect(
        "127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2
    ) as admin:
        await admin.assign(0)
    c = await StorageClient.connect("127.0.0.1", ports["port"], cluster_key=key, partition_count=2)
    await c.set_low_water_mark(0, 1, -1)
    await c.append(0, 1, 0, batch(0, 10))
    await c.set_low_water_mark(0, 1, 5)
    return c


def test_truncate_below_the_low_water_mark_is_refused_and_the_data_stays(node):
    key, ports = node

    async def go():
        c = await committed_log(key, ports)
        try:
            for session, txid in ((1, -1), (2, -1), (2, 4)):
                with pytest.raises(errors.RefusedError, match="low-water mark is 5"):
                    await c.truncate(0, session, txid)
            assert await c.max_transaction_id(0, 2) == 9
            records = await c.records(0, 2, 0, 100)
            assert [r.txid for r in records] == list(range(10))
            # What recovery does: cut the uncommitted tail above the mark, down to the mark itself.
            await c.truncate(0, 2, 7)
            await c.truncate(0, 2, 5)
            assert await c.max_transaction_id(0, 2) == 5
        finally:
            await c.close()

    asyncio.run(go())


def test_a_session_far_above_the_fence_is_refused(node):
    key, ports = node

    async def go():
        c = await committed_log(key, ports)
        try:
            for request in (c.last_session_info(0, 1 << 62), c.max_transaction_id(0, (1 << 32) + 2)):
                with pytest.raises(errors.RefusedError, match="above this replica's fence 1"):
                    await request
            # The fence did not move: the next session (one up, as servers number them) is served.
            assert await c.last_session_info(0, 2) == (1, 5)
            assert await c.max_transaction_id(0, (1 << 32) + 2) == 9  # within the bound of fence 2
        finally:
            await c.close()

    asyncio.run(go())
