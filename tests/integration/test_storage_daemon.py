"""`waltz-node storage --config FILE` as a real process: config, HTTP health and metrics, signals."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient

from processes import get, start, stop, wait_http, write_config


def test_daemon_serves_reports_and_stops_cleanly(tmp_path):
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)

        async def work():
            async with await StorageAdminClient.connect("127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2) as admin:
                await admin.assign(0)
                await admin.assign(1)
            async with await StorageClient.connect("127.0.0.1", ports["port"], cluster_key=key, partition_count=2) as c:
                batch = RecordBatch([(ReqId(1, 1, 0, i), 0, b"m" * 64) for i in range(5)])
                await asyncio.gather(*(c.append(0, 1, i * 5, batch) for i in range(4)))
                with pytest.raises(Exception):
                    await c.append(0, 1, 99, batch)  # non-dense: counted as a failure

        asyncio.run(work())
        status, body = get(ports["http_port"], "/health")
        assert status == 200, body
        assert json.loads(body)["checks"]["partitions"] == {"0": True, "1": True}
        status, metrics = get(ports["http_port"], "/metrics")
        assert status == 200
        assert 'waltz_storage_partition_max_transaction_id{partition="0"} 19.0' in metrics
        assert 'waltz_storage_failures_by_kind_total{kind="non_dense_append"} 1.0' in metrics
        assert 'waltz_storage_fsync_seconds_count{partition="0"}' in metrics
        assert 'waltz_storage_append_batch_records_bucket{le="5.0",partition="0"} 4.0' in metrics
        assert get(ports["http_port"], "/nope")[0] == 404
    finally:
        err = stop(proc)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    messages = [line["message"] for line in lines]
    assert any("TLS is not configured" in m for m in messages)
    assert messages[-1] == "storage node stopped"

    # Restarted with the same configuration: the data is there.
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)

        async def check():
            async with await StorageClient.connect("127.0.0.1", ports["port"], cluster_key=key, partition_count=2) as c:
                assert await c.max_transaction_id(0, 1) == 19

        asyncio.run(check())
    finally:
        stop(proc)


def test_health_fails_when_a_partition_cannot_open(tmp_path):
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)

        async def assign():
            async with await StorageAdminClient.connect("127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2) as admin:
                await admin.assign(1)

        asyncio.run(assign())
    finally:
        stop(proc)
    ctl = tmp_path / "data" / "waltz-storage.ctl"
    raw = bytearray(ctl.read_bytes())
    entry = 128 + 60 * 1
    raw[entry + 4 + 3] ^= 0xFF  # both info structs of partition 1
    raw[entry + 32 + 3] ^= 0xFF
    ctl.write_bytes(bytes(raw))
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)
        status, body = get(ports["http_port"], "/health")
        assert status == 503
        assert "both info structs of partition 1" in json.loads(body)["checks"]["partitions"]["1"]
    finally:
        stop(proc)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such configuration file"),
        ("[storage]\ndirectory = '/x'\nbogus = 1\n", "unknown key(s) bogus"),
        ("[storage]\n", "directory is required"),
        ("[storage]\ndirectory = 'DIR'\n", "set [storage] cluster_key and partition_count"),
        ("[storage]\ndirectory = 'DIR'\n[node]\nport = 'x'\n", "expected an integer"),
        ("[storage\n", "Expected"),
    ],
    ids=["missing", "unknown-key", "no-directory", "new-dir-without-key", "bad-type", "bad-toml"],
)
def test_a_bad_configuration_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    if content is not None:
        path.write_text(content.replace("DIR", str(tmp_path / "fresh")))
    proc = subprocess.run(
        [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
