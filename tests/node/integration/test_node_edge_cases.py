"""Edge cases of the storage node found by an adversarial review: each failed before its fix."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
from waltz import errors
from waltz.storage import RecordBatch, ReqId, Storage, StorageAdminClient, StorageClient, StorageNode
from waltz.storage.http import serve_http


def batch(first, n, size=100):
    return RecordBatch([(ReqId(3, 1, 0, t), t, bytes([t % 251]) * size) for t in range(first, first + n)])


def test_append_times_out_when_the_node_stops_reading():
    """A node that stops reading (wedged, SIGSTOPped, back pressure): `append` of a large batch
    blocks in writer.drain(), outside asyncio.wait_for, so the 1 s timeout never fires."""
    key = uuid.uuid4()

    async def go():
        async def handle(reader, writer):
            # Answer Hello and Open like a node, then never read again.
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
                buf += await reader.read(65536)
            hello = struct.unpack(">I", buf[:4])[0] + 4

            # HelloOk frame
            import zlib

            inner = struct.pack(">HBB", 0x5753, 1, 0x82) + b"\x01"
            writer.write(struct.pack(">I", len(inner) + 4) + inner + struct.pack(">I", zlib.crc32(inner)))
            buf = buf[hello:]
            while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
                buf += await reader.read(65536)
            seq = struct.unpack(">q", buf[8 + 8 : 8 + 16])[0]
            inner = struct.pack(">HBB", 0x5753, 1, 0x80) + struct.pack(">qqi", -1, seq, -1)
            writer.write(struct.pack(">I", len(inner) + 4) + inner + struct.pack(">I", zlib.crc32(inner)))
            await writer.drain()
            await asyncio.sleep(3600)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        c = await StorageClient.connect("127.0.0.1", port, cluster_key=key, partition_count=1, timeout=1.0)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(c.append(0, 1, 0, batch(0, 16, 1 << 20)), 8)
            outcome = "returned"
        except errors.StorageTimeoutError:
            outcome = "client timeout"
        except TimeoutError:
            outcome = "hung past 8 s (outer guard)"
        took = time.monotonic() - t0
        c._transport.abort()
        server.close()
        return outcome, took

    outcome, took = asyncio.run(go())
    assert outcome == "client timeout" and took < 3, f"{outcome} after {took:.1f}s with timeout=1.0"


@pytest.fixture
def node_with_admin(tmp_path):
    key = uuid.uuid4()
    s = Storage.create(tmp_path / "node", key, 2)
    node = StorageNode.start(s, admin_port=0)
    yield key, s, node
    node.stop()
    s.close()


def test_unassign_without_delete_stops_serving(node_with_admin):
    key, s, node = node_with_admin

    async def go():
        async with await StorageAdminClient.connect(*node.admin_address, cluster_key=key, partition_count=2) as admin:
            await admin.assign(1)
            async with await StorageClient.connect(*node.address, cluster_key=key, partition_count=2) as c:
                await c.append(1, 3, 0, batch(0, 2))
                await admin.unassign(1, delete_files=False)
                # The partition is unassigned from this node; a server still writes to it.
                await c.append(1, 3, 2, batch(2, 2))
                return await c.max_transaction_id(1, 3), await admin.status()

    # The second append must have failed: the partition is parked, not served.
    with pytest.raises(errors.PartitionNotFoundError):
        asyncio.run(go())

    async def restored():
        async with await StorageAdminClient.connect(*node.admin_address, cluster_key=key, partition_count=2) as admin:
            await admin.assign(1)  # brings the parked files back
            async with await StorageClient.connect(*node.address, cluster_key=key, partition_count=2) as c:
                return await c.max_transaction_id(1, 3)

    assert asyncio.run(restored()) == 1


def test_a_fresh_assign_resets_session_info(node_with_admin):
    key, s, node = node_with_admin

    async def go():
        async with await StorageAdminClient.connect(*node.admin_address, cluster_key=key, partition_count=2) as admin:
            await admin.assign(1)
            async with await StorageClient.connect(*node.address, cluster_key=key, partition_count=2) as c:
                await c.set_low_water_mark(1, 4, -1)
                await c.append(1, 4, 0, batch(0, 10))
                await c.set_low_water_mark(1, 4, 9)
                await admin.unassign(1, delete_files=True)
                await admin.assign(1)
                return await c.last_session_info(1, 9), await c.max_transaction_id(1, 9), await admin.status()

    info, mx, status = asyncio.run(go())
    assert mx == -1
    assert info == (-1, -1), f"an empty, freshly assigned replica reports session info {info}"


def test_concurrent_health_probes_agree_the_disk_is_healthy(tmp_path):
    key = uuid.uuid4()
    s = Storage.create(tmp_path / "node", key, 1)
    s.add_partition(0)
    node = StorageNode.start(s)
    http = serve_http(s, node, "127.0.0.1", 0)
    port = http.server_address[1]

    def get(_):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            results = list(ex.map(get, range(200)))
    finally:
        http.shutdown()
        node.stop()
        s.close()
    bad = [b for code, b in results if code != 200]
    print(len(bad), bad[:1])
    assert not bad, f"{len(bad)} of 200 concurrent /health probes failed on a healthy disk: {bad[0]}"


@pytest.mark.parametrize(
    "node_lines",
    ["idle_timeout = inf", "port = 70000", "max_list_count = -1", "[logging]\nlevel = 5"],
)
def test_out_of_range_values_are_one_clear_line(tmp_path, node_lines):
    path = tmp_path / "bad.toml"
    key = uuid.uuid4()
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for x in (a, b, c):
            x.bind(("127.0.0.1", 0))
        ports = [x.getsockname()[1] for x in (a, b, c)]
    extra = "" if node_lines.startswith("port") else f"port = {ports[0]}\n"
    path.write_text(
        f"[storage]\ndirectory = '{tmp_path / 'd'}'\ncluster_key = '{key}'\npartition_count = 1\n"
        f"[node]\n{extra}admin_port = {ports[1]}\nhttp_port = {ports[2]}\n{node_lines}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(proc.returncode, proc.stderr[-600:])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
