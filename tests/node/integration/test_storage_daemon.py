"""`waltz-node storage --config FILE` as a real process: config, HTTP health and metrics, signals."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import uuid

import pytest
from support.processes import get, start, stop, wait_http, write_config
from waltz import errors
from waltz.storage import RecordBatch, ReqId, StorageAdminClient, StorageClient


def test_daemon_serves_reports_and_stops_cleanly(tmp_path):
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)

        async def work():
            async with await StorageAdminClient.connect(
                "127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2
            ) as admin:
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
            async with await StorageAdminClient.connect(
                "127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2
            ) as admin:
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
        ("[storage]\ndirectory = 'DIR'\n[node]\nmax_connections = 0\n", "[node] max_connections must be positive"),
        ("[storage\n", "Expected"),
    ],
    ids=["missing", "unknown-key", "no-directory", "new-dir-without-key", "bad-type", "no-connections", "bad-toml"],
)
def test_a_bad_configuration_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    if content is not None:
        path.write_text(content.replace("DIR", str(tmp_path / "fresh")))
    proc = subprocess.run(
        [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_max_connections_closes_connections_over_it_with_a_warning(tmp_path):
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    config.write_text(config.read_text().replace("[node]\n", "[node]\nmax_connections = 1\n", 1))
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)
        first = socket.create_connection(("127.0.0.1", ports["port"]))
        over = socket.create_connection(("127.0.0.1", ports["port"]))
        over.settimeout(5)
        try:
            assert over.recv(1) == b""
        except ConnectionResetError:
            pass

        first.close()  # its place is given back

        async def served_again():
            deadline = time.monotonic() + 5
            while True:
                try:
                    c = await StorageClient.connect("127.0.0.1", ports["port"], cluster_key=key, partition_count=2)
                    await c.close()  # Hello and Open were answered
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)

        asyncio.run(served_again())
        _, metrics = get(ports["http_port"], "/metrics")
        # At least the one above; a retry of served_again's may have come before `first`'s place was free.
        refused = [line for line in metrics.splitlines() if line.startswith("waltz_storage_refused_connections_total ")]
        assert refused and float(refused[0].split()[1]) >= 1, refused
    finally:
        err = stop(proc)
    messages = [json.loads(line)["message"] for line in err.splitlines() if line.startswith("{")]
    assert any("max_connections" in m for m in messages), messages


def test_the_file_limit_is_raised_for_max_connections_or_the_connections_fitted_to_it(monkeypatch, caplog):
    from waltz import limits as file_limits
    from waltz.storage import daemon

    limits = {"soft": 1024, "hard": 2048}
    monkeypatch.setattr(file_limits.resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))
    monkeypatch.setattr(file_limits.resource, "setrlimit", lambda _, v: limits.update(soft=v[0]))
    with caplog.at_level("WARNING", logger="waltz.storage"):
        assert daemon.fit_file_limit(100) == 100  # needs 656
        assert limits["soft"] == 1024 and not caplog.records
        assert daemon.fit_file_limit(400) == 400  # needs 1856: raised
        assert limits["soft"] == 1856 and not caplog.records
        # Needs 4352, above the hard limit: as many as 2048 descriptors hold.
        assert daemon.fit_file_limit(1024) == (2048 - daemon.FILES_BESIDES_CONNECTIONS) // 4
        assert limits["soft"] == 2048
    assert "max_connections = 1024" in caplog.text and "serving at most 448 connections per port" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="waltz.storage"):
        daemon.check_connections_for_partitions(4096, 100)
        assert not caplog.records
        daemon.check_connections_for_partitions(100, 100)
    assert "at least 264 is advised" in caplog.text


def test_a_refused_open_does_not_log_the_nodes_cluster_key(tmp_path):
    """Issue 34: the warning about an Open with a wrong key carried the node's own key, so anyone
    who could read the log held the cluster's only credential."""
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    proc = start(config)
    try:
        wait_http(ports["http_port"], proc)

        async def wrong_key():
            for connect, port in (
                (StorageClient.connect, ports["port"]),
                (StorageAdminClient.connect, ports["admin_port"]),
            ):
                with pytest.raises(errors.ClusterKeyMismatch):
                    await connect("127.0.0.1", port, cluster_key=uuid.uuid4(), partition_count=2)

        asyncio.run(wrong_key())
    finally:
        err = stop(proc)
    assert "refusing Open" in err
    assert str(key) not in err and key.hex not in err.lower(), err


def test_silent_connections_are_bounded_and_do_not_starve_clients(tmp_path):
    """Issue 34: connections that send nothing filled max_connections without any key, each
    held 10 s on a thread. Now they wait at most 2 s for their Hello, and only an eighth of
    max_connections may be waiting at once: opened connections keep their room, and a new client
    gets in as soon as the silent ones are gone."""
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    config.write_text(config.read_text().replace("[node]\n", "[node]\nmax_connections = 16\n", 1))
    proc = start(config)
    silent: list[socket.socket] = []
    try:
        wait_http(ports["http_port"], proc)

        async def flood():
            async with await StorageAdminClient.connect(
                "127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2
            ) as admin:
                await admin.assign(0)
            opened = await StorageClient.connect("127.0.0.1", ports["port"], cluster_key=key, partition_count=2)
            t0 = time.monotonic()
            for _ in range(40):
                silent.append(socket.create_connection(("127.0.0.1", ports["port"])))
            # The connection opened before the flood is served through it.
            assert await opened.max_transaction_id(0, 1) == -1
            await opened.close()
            # A new client gets in once the silent ones are closed, long before their old 10 s.
            while True:
                try:
                    c = await StorageClient.connect(
                        "127.0.0.1", ports["port"], cluster_key=key, partition_count=2, timeout=1.0
                    )
                    break
                except (errors.WaltzError, OSError):
                    assert time.monotonic() - t0 < 5, "no new client served 5 s into the flood"
                    await asyncio.sleep(0.2)
            assert await c.max_transaction_id(0, 1) == -1
            await c.close()

        asyncio.run(flood())
        # Every silent connection was closed by the node, within its Hello deadline.
        for s in silent:
            s.settimeout(3)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        _, metrics = get(ports["http_port"], "/metrics")
        refused = [line for line in metrics.splitlines() if line.startswith("waltz_storage_refused_connections_total ")]
        assert refused and float(refused[0].split()[1]) >= 30, refused
    finally:
        for s in silent:
            s.close()
        err = stop(proc)
    messages = [json.loads(line)["message"] for line in err.splitlines() if line.startswith("{")]
    assert any("waiting for their Hello and Open" in m for m in messages), messages
    assert any("no Hello" in m for m in messages), messages


def test_silent_admin_connections_are_capped_like_storage_ones(tmp_path):
    """The admin port bounds its connections not opened yet as the storage port does (an eighth of
    max_connections): a flood of silent admin connections is refused beyond that cap, logged and
    counted, and an admin connection opened before it keeps being served."""
    key = uuid.uuid4()
    config, ports = write_config(tmp_path, key)
    config.write_text(config.read_text().replace("[node]\n", "[node]\nmax_connections = 16\n", 1))
    proc = start(config)
    silent: list[socket.socket] = []
    try:
        wait_http(ports["http_port"], proc)

        async def flood():
            admin = await StorageAdminClient.connect(
                "127.0.0.1", ports["admin_port"], cluster_key=key, partition_count=2
            )
            for _ in range(40):
                silent.append(socket.create_connection(("127.0.0.1", ports["admin_port"])))
            await admin.assign(0)
            assert [p["partition"] for p in await admin.status()] == [0]
            await admin.close()

        asyncio.run(flood())
        # Two (16 / 8) silent connections wait for their Hello; the 38 others are closed at once,
        # long before the 2 s Hello deadline.
        t0 = time.monotonic()
        closed = 0
        for s in silent:
            s.settimeout(max(0.05, 1.0 - (time.monotonic() - t0)))
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        assert closed == 38, closed
        _, metrics = get(ports["http_port"], "/metrics")
        refused = [line for line in metrics.splitlines() if line.startswith("waltz_storage_refused_connections_total ")]
        assert refused and float(refused[0].split()[1]) == 38, refused
    finally:
        for s in silent:
            s.close()
        err = stop(proc)
    messages = [json.loads(line)["message"] for line in err.splitlines() if line.startswith("{")]
    assert any(m.startswith("admin connection from") and "waiting for their Hello and Open" in m for m in messages), (
        messages
    )
