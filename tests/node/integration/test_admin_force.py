"""An admin may force what a storage node refuses (a Truncate below the low-water mark, a session
far above the fence), through admin requests with `force`, only with the admin role; without
`force`, or from a server's certificate, the refusals stay. A real storage node process on mutual
TLS (roles come from the certificates) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import pytest
from support.processes import start, stop, wait_http, write_config
from waltz import errors
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient
from waltz.tls import generate_dev_certificates

PARTITIONS = 2


@contextlib.contextmanager
def tls_node(tmp_path):
    """A storage node on mutual TLS; `log` gets its log messages once it stopped."""
    certs = generate_dev_certificates(tmp_path / "certs")
    key = uuid.uuid4()
    tls = certs.tls("storage")
    config, ports = write_config(
        tmp_path, key, PARTITIONS, sections={"tls": {"ca": tls.ca, "cert": tls.cert, "key": tls.key}}
    )
    proc = start(config)
    log: list[str] = []
    try:
        wait_http(ports["http_port"], proc)
        yield key, ports, certs, log
    finally:
        err = stop(proc)
        log.extend(json.loads(line)["message"] for line in err.splitlines() if line.startswith("{"))


@pytest.fixture
def node(tmp_path):
    with tls_node(tmp_path) as n:
        yield n


def admin(key, ports, certs, role: str = "admin"):
    return StorageAdminClient.connect(
        "127.0.0.1",
        ports["admin_port"],
        cluster_key=key,
        partition_count=PARTITIONS,
        ssl=certs.tls(role).client_context(),
    )


async def committed_log(key, ports, certs) -> StorageClient:
    """Session 1 wrote records 0..9 and set the low-water mark 5, as a server's store session does."""
    async with await admin(key, ports, certs) as a:
        await a.assign(0)
    c = await StorageClient.connect(
        "127.0.0.1",
        ports["port"],
        cluster_key=key,
        partition_count=PARTITIONS,
        ssl=certs.tls("server").client_context(),
    )
    await c.set_low_water_mark(0, 1, -1)
    await c.append(0, 1, 0, RecordBatch([(ReqId(1, 1, 0, t), t, b"r%d" % t) for t in range(10)]))
    await c.set_low_water_mark(0, 1, 5)
    return c


def test_a_truncate_below_the_low_water_mark_is_forced_only_by_an_admin(node):
    key, ports, certs, log = node

    async def go():
        c = await committed_log(key, ports, certs)
        try:
            async with await admin(key, ports, certs) as a, await admin(key, ports, certs, "server") as s:
                with pytest.raises(errors.StorageRequestError, match="mark it unwritable"):
                    await a.truncate(0, 2, force=True)
                await a.set_availability(0, readable=True, writable=False)
                # Above the mark: no force needed.
                await a.truncate(0, 8)
                with pytest.raises(errors.RefusedError, match="low-water mark is 5.*may force it"):
                    await a.truncate(0, 2)
                with pytest.raises(errors.RefusedError, match="needs the admin role"):
                    await s.truncate(0, 2, force=True)
                assert [r.txid for r in await a.records(0, 0, 100)] == list(range(9))
                await a.truncate(0, 2, force=True)
                assert [r.txid for r in await a.records(0, 0, 100)] == [0, 1, 2]
        finally:
            await c.close()

    asyncio.run(go())


def test_a_session_jump_is_forced_only_by_an_admin_and_lets_that_session_in(node):
    key, ports, certs, log = node
    far = (1 << 40) + 7

    async def go():
        c = await committed_log(key, ports, certs)
        try:
            with pytest.raises(errors.RefusedError, match="above this replica's fence 1"):
                await c.max_transaction_id(0, far)
            async with await admin(key, ports, certs) as a, await admin(key, ports, certs, "server") as s:
                with pytest.raises(errors.RefusedError, match="may force it"):
                    await a.raise_fence(0, far)
                with pytest.raises(errors.RefusedError, match="needs the admin role"):
                    await s.raise_fence(0, far, force=True)
                assert {p["partition"]: p["newest_session"] for p in await a.status()}[0] == 1
                await a.raise_fence(0, 3)  # within the bound: no force needed
                await a.raise_fence(0, far, force=True)
                assert {p["partition"]: p["newest_session"] for p in await a.status()}[0] == far
            # The server's session the fence was raised for is served; older ones are stale.
            assert await c.max_transaction_id(0, far) == 9
            with pytest.raises(errors.StaleSessionError):
                await c.max_transaction_id(0, 3)
        finally:
            await c.close()

    asyncio.run(go())


def test_forcing_is_logged_as_an_error(tmp_path):
    with tls_node(tmp_path) as (key, ports, certs, log):

        async def go():
            c = await committed_log(key, ports, certs)
            await c.close()
            async with await admin(key, ports, certs) as a:
                await a.raise_fence(0, 1 << 40, force=True)

        asyncio.run(go())
    assert any(m.startswith("FORCED by an admin from") and "fence raise of partition 0" in m for m in log), log
