"""A storage port's Restart Log (issue 35) replaces a replica's whole log: only a server may send
it (issue 34). With mutual TLS the role comes from the certificate, with role secrets from the
Hello; anyone else (an admin included: it has the admin port's Restart Log) gets a Failure naming
why, counted in /metrics and logged. Real storage node processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from support.processes import get, start, stop, wait_http, write_config
from test_admin_force import PARTITIONS, admin, tls_node
from waltz import errors
from waltz.storage import StorageAdminClient, StorageClient

SERVER, ADMIN = "server-secret-0123456789", "admin-secret-0123456789"


def refusals(http_port: int) -> float:
    _, body = get(http_port, "/metrics")
    line = next(x for x in body.splitlines() if x.startswith("waltz_storage_role_request_refusals_total "))
    return float(line.split()[1])


async def restart(port: int, key: uuid.UUID, partition: int, first_txid: int, **connect) -> None:
    async with await StorageClient.connect(
        "127.0.0.1", port, cluster_key=key, partition_count=PARTITIONS, timeout=5.0, **connect
    ) as c:
        await c.set_low_water_mark(partition, 1, -1)  # the session's fence, as a store session does
        await c.restart_log(partition, 1, first_txid)


def test_only_a_server_certificate_restarts_a_log_on_the_storage_port(tmp_path):
    with tls_node(tmp_path) as (key, ports, certs, log):

        async def go():
            async with await admin(key, ports, certs) as a:
                await a.assign(0)
            with pytest.raises(errors.RefusedError, match="needs the server role.*proved role admin"):
                await restart(ports["port"], key, 0, 100, ssl=certs.tls("admin").client_context())
            assert refusals(ports["http_port"]) == 1
            await restart(ports["port"], key, 0, 100, ssl=certs.tls("server").client_context())
            async with await admin(key, ports, certs) as a:
                assert {p["partition"]: p for p in await a.status()}[0]["first_transaction_id"] == 100

        asyncio.run(go())
    assert any(m.startswith("refused Restart Log of partition 0 from") for m in log), log


def test_only_the_server_secret_restarts_a_log_on_the_storage_port(tmp_path):
    key = uuid.uuid4()
    config, ports = write_config(
        tmp_path, key, PARTITIONS, sections={"role_secrets": {"server": SERVER, "admin": ADMIN}}
    )
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)

        async def go():
            async with await StorageAdminClient.connect(
                "127.0.0.1",
                ports["admin_port"],
                cluster_key=key,
                partition_count=PARTITIONS,
                credential=("admin", ADMIN.encode()),
            ) as a:
                await a.assign(1)
            with pytest.raises(errors.RefusedError, match="needs the server role.*proved role admin"):
                await restart(ports["port"], key, 1, 50, credential=("admin", ADMIN.encode()))
            await restart(ports["port"], key, 1, 50, credential=("server", SERVER.encode()))

        asyncio.run(go())
        assert refusals(ports["http_port"]) == 1
    finally:
        err = stop(proc)
    messages = [json.loads(x)["message"] for x in err.splitlines() if x.startswith("{")]
    assert not any(SERVER in m or ADMIN in m for m in messages)
