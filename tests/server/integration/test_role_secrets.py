"""Per-role shared secrets in plaintext mode (issue 34), with real processes on 127.0.0.1: three
storage nodes that check the server and admin secrets, a server that gives its server secret to
them and checks the client and admin secrets on its client port, and a client with its secret.
A peer without its role's secret, with a wrong one, or of a role the port does not admit is
refused at Hello with a reason, and only its own connection is closed; no secret reaches a log."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import random
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from support.client_app import MemoryApp, Write
from support.daemons import PARTITIONS, Node, start_server, wait_served
from support.processes import free_port, get, stop
from test_server_connection import RawClient
from waltz import client_protocol as cp
from waltz import errors
from waltz.client import ClientConfig, WaltzClient
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata
from waltz.storage import StorageAdminClient, StorageClient

pytestmark = pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)

SERVER, ADMIN, CLIENT = "server-secret-0123456789", "admin-secret-0123456789", "client-secret-0123456789"
SECRETS = {"server": SERVER, "admin": ADMIN, "client": CLIENT}


async def hello(port: int, role: str, secret: bytes) -> RawClient:
    c = RawClient(*await asyncio.open_connection("127.0.0.1", port))
    c.send(cp.Hello(role=role, secret=secret))
    assert await c.next() == cp.HelloOk(cp.VERSION)
    return c


def node_status(node: Node, partition: int) -> dict[str, Any]:
    return {s["partition"]: s for s in node.admin(lambda c: c.status())}[partition]


class Cluster:
    def __init__(
        self, meta: ClusterMetadata, nodes: list[Node], url: str, server: Any, server_log: pathlib.Path, http_port: int
    ):
        self.meta, self.nodes, self.url, self.server, self.server_log = meta, nodes, url, server, server_log
        self.http_port = http_port


@pytest.fixture
def cluster(metadata_url: str, tmp_path: pathlib.Path) -> Iterator[Cluster]:
    store = open_store(metadata_url)
    store.start()
    meta = ClusterMetadata(store, "/waltz/e2e")
    info, _ = meta.create("e2e", PARTITIONS, 3)
    node_secrets = {"role_secrets": {"server": SERVER, "admin": ADMIN}}
    nodes = [
        Node(tmp_path / f"n{i}", info.cluster_key, sections=node_secrets, credential=("admin", ADMIN.encode()))
        for i in range(3)
    ]
    server = None
    try:
        for i, n in enumerate(nodes):
            meta.add_storage_node(n.address, n.ports["admin_port"], i)
            meta.auto_assign(i)

            async def assign_all(c: Any) -> None:
                for p in range(PARTITIONS):
                    await c.assign(p)

            n.admin(assign_all)
        http_port = free_port()
        server = start_server(tmp_path, metadata_url, "s1", http_port=http_port, sections={"role_secrets": SECRETS})
        yield Cluster(meta, nodes, metadata_url, server, tmp_path / "s1.log", http_port)
    finally:
        if server is not None and server.poll() is None:
            stop(server)
        for n in nodes:
            if n.proc.poll() is None:
                stop(n.proc)
        store.close()


def test_each_port_admits_only_the_secrets_of_its_roles(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    endpoint, _ = wait_served(cluster.meta, 0)
    port = int(endpoint.rsplit(":", 1)[1])

    def storage(credential: Any, cls: Any = StorageClient, p: int = node.ports["port"]) -> Any:
        async def go() -> Any:
            c = await cls.connect(
                "127.0.0.1", p, cluster_key=node.key, partition_count=PARTITIONS, credential=credential, timeout=5.0
            )
            await c.close()

        return asyncio.run(go())

    # Storage and admin ports: server and admin secrets only.
    for credential, why in (
        (None, "requires a role secret"),
        (("server", b"not-the-server-secret"), "wrong secret for role server"),
        (("client", CLIENT.encode()), "not admitted"),
        (("admin", SERVER.encode()), "wrong secret for role admin"),
    ):
        for cls, p in ((StorageClient, node.ports["port"]), (StorageAdminClient, node.ports["admin_port"])):
            with pytest.raises(errors.RefusedError, match=why):
                storage(credential, cls, p)
    storage(("server", SERVER.encode()))
    storage(("admin", ADMIN.encode()), StorageAdminClient, node.ports["admin_port"])

    # A force needs the admin role: the admin secret proves it, the server's does not.
    async def force(credential: Any) -> None:
        async with await StorageAdminClient.connect(
            "127.0.0.1",
            node.ports["admin_port"],
            cluster_key=node.key,
            partition_count=PARTITIONS,
            credential=credential,
        ) as a:
            await a.raise_fence(1, 1 << 40, force=True)

    with pytest.raises(errors.RefusedError, match="needs the admin role"):
        asyncio.run(force(("server", SERVER.encode())))
    asyncio.run(force(("admin", ADMIN.encode())))

    # Client port: client and admin secrets only; a refusal closes only its own connection.
    async def client_port() -> None:
        good = await hello(port, "client", CLIENT.encode())
        for role, secret, why in (
            ("", b"", "requires a role secret"),
            ("client", b"wrong-client-secret-000", "wrong secret for role client"),
            ("server", SERVER.encode(), "not admitted"),
        ):
            raw = RawClient(*await asyncio.open_connection("127.0.0.1", port))
            raw.send(cp.Hello(role=role, secret=secret))
            answer = await raw.next()
            assert isinstance(answer, cp.Failure) and answer.kind == cp.FailureKind.CLIENT_REFUSED, answer
            assert why in answer.message and (not secret or secret.decode() not in answer.message), answer
            assert await raw.next() is None  # closed after the answer
        admin = await hello(port, "admin", ADMIN.encode())
        # Both are served: each mounts partition 0 (under a client id of its own).
        for client_id, c in ((501, good), (502, admin)):
            c.send(cp.Mount(1, 0, client_id, -1, 1, bytes([client_id % 256]) * 16))
            got = await c.until(lambda m: isinstance(m, cp.MountResponse), timeout=30)
            assert isinstance(got[-1], cp.MountResponse), got
            c.close()

    asyncio.run(client_port())

    # The whole path: a client with its secret commits through a server that proves its own.
    config = ClientConfig(metadata=cluster.url, cluster="e2e", role_secret=CLIENT)
    with WaltzClient(MemoryApp(), config) as client:
        assert client.submit(Write("secrets", partition=0)).result(30)

    server_log = cluster.server_log.read_text()
    assert "client connection refused (role_secret)" in server_log, server_log
    _, metrics = get(cluster.http_port, "/metrics")
    assert 'waltz_server_limit_refusals_total{reason="role_secret"} 3.0' in metrics
    _, node_metrics = get(node.ports["http_port"], "/metrics")
    assert "waltz_storage_secret_refusals_total 8.0" in node_metrics, node_metrics
    logs = [server_log] + [stop(n.proc) for n in cluster.nodes]
    assert "refused at Hello: wrong secret for role server" in logs[1], logs[1]
    assert "FORCED by an admin" in logs[1]
    for text in logs:
        for secret in (SERVER, ADMIN, CLIENT, "not-the-server-secret", "wrong-client-secret-000"):
            assert secret not in text


def test_a_server_without_the_nodes_server_secret_cannot_open_a_store_session(
    cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    """Servers are peers of the storage nodes like any other: one with a wrong server secret is
    refused at every node (its log says why) and serves nothing."""
    wait_served(cluster.meta, 0)
    stop(cluster.server)
    wrong = start_server(tmp_path, cluster.url, "s2", sections={"role_secrets": {"server": "x" * 16}})
    try:
        deadline = time.monotonic() + 30
        while "wrong secret for role server" not in (tmp_path / "s2.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "s2.log").read_text()
            time.sleep(0.2)
    finally:
        stop(wrong)
    for n in cluster.nodes:
        assert node_status(n, 0)["max_transaction_id"] == -1


def mutated(rng: random.Random, frame: bytes) -> bytes:
    """`frame` with a few bytes flipped, cut short, or extended; the CRC fixed up half the time
    so that the mutation reaches the decoder rather than the framing's CRC check."""
    b = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(4, len(b))
        b[i] = rng.randrange(256)
    if rng.random() < 0.2:
        b = b[: rng.randrange(4, len(b))]
    elif rng.random() < 0.2:
        b += rng.randbytes(rng.randint(1, 16))
    if rng.random() < 0.5 and len(b) >= 12:
        b[0:4] = struct.pack(">I", len(b) - 4)
        b[-4:] = struct.pack(">I", zlib.crc32(bytes(b[4:-4])))
    return bytes(b)


def test_hostile_peers_on_the_client_port_disturb_nobody(cluster: Cluster) -> None:
    """A hostile-peer run of the client port with its role checks in place: 300 connections send
    random bytes, mutated valid frames (Hello with and without secrets, Mount, Append, Feed,
    Flush, data and mark requests) before and after a Hello, a thousand frames or more in all.
    Each is answered or closed; the server stays up, logs no error, and a mounted client with its
    secret is served throughout and still commits."""
    endpoint, _ = wait_served(cluster.meta, 0)
    port = int(endpoint.rsplit(":", 1)[1])
    rng = random.Random(34)
    valid = [
        cp.Hello(),
        cp.Hello(role="client", secret=CLIENT.encode()),
        cp.Hello(role="client", secret=b"wrong-client-secret-000"),
        cp.Mount(1, 0, 77, -1, 1, b"t" * 16),
        cp.Append((77, 1, 0, 1), -1, 0, b"payload", (1, 2), (3,), ()),
        cp.FeedRequest(2, 0, -1, 100),
        cp.Flush(3, 0),
        cp.TransactionDataRequest(4, 0, 0),
        cp.HighWaterMarkRequest(5, 0),
    ]
    frames = [m.frame() for m in valid]
    sent = 0

    async def hostile(i: int) -> None:
        nonlocal sent
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            if i % 3 == 0:
                writer.write(frames[1])  # authenticated first: the garbage reaches the message decoders
            for _ in range(rng.randint(1, 8)):
                choice = rng.random()
                if choice < 0.2:
                    writer.write(rng.randbytes(rng.randint(1, 200)))
                elif choice < 0.8:
                    writer.write(mutated(rng, rng.choice(frames)))
                else:
                    writer.write(rng.choice(frames))
                sent += 1
            await writer.drain()
            with contextlib.suppress(TimeoutError, ConnectionError):
                while await asyncio.wait_for(reader.read(65536), 0.5):
                    pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def run() -> None:
        good = await hello(port, "client", CLIENT.encode())
        # The metadata names this server before it has opened the partition's store session:
        # until then a Mount is answered NOT_READY and a mark request "not served here" (a
        # fast first batch once asked before the partition opened and waited for an answer
        # that was never coming). Mount again until READY, as the client library does.
        for seq in range(1, 200):
            good.send(cp.Mount(seq, 0, 4242, -1, 1, b"g" * 16))
            mounted = await good.until(lambda m: isinstance(m, cp.MountResponse))
            if mounted[-1].status == cp.MountStatus.READY:
                break
            await asyncio.sleep(0.05)
        assert mounted[-1].status == cp.MountStatus.READY, mounted
        for batch in range(30):
            await asyncio.gather(*(hostile(batch * 10 + i) for i in range(10)))
            good.send(cp.HighWaterMarkRequest(1000 + batch, 0))
            # Generous: the hostile appends commit through fsyncs, slow on a loaded machine; what
            # is asserted is that the answer comes, not how fast. A Failure ends the wait at once.
            got = await good.until(lambda m: isinstance(m, (cp.HighWaterMarkResponse, cp.Failure)), timeout=60)
            assert isinstance(got[-1], cp.HighWaterMarkResponse), got[-1]
        good.close()

    asyncio.run(run())
    assert sent >= 1000, sent
    assert cluster.server.poll() is None
    config = ClientConfig(metadata=cluster.url, cluster="e2e", role_secret=CLIENT)
    with WaltzClient(MemoryApp(), config) as client:
        assert client.submit(Write("after-hostile-peers", partition=0)).result(30)
    log = cluster.server_log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


def test_hostile_peers_on_the_storage_and_admin_ports_disturb_nobody(cluster: Cluster) -> None:
    """The same hostile-peer run against a storage node's two ports with their secrets checked:
    random bytes and mutated frames (Hello with and without secrets, Open, every request), a third
    of the connections after a Hello with the right secret so the garbage reaches the request
    decoders. The node stays up and logs no panic, and the cluster still commits through it."""
    wait_served(cluster.meta, 0)
    node = cluster.nodes[0]
    rng = random.Random(3434)
    key = node.key.bytes
    h = struct.pack(">qqi", 1 << 20, 1, PARTITIONS - 1)  # authenticated garbage stays off partition 0

    def frame(magic: int, msg_type: int, payload: bytes) -> bytes:
        body = struct.pack(">HBB", magic, 1, msg_type) + payload
        body += struct.pack(">I", zlib.crc32(body))
        return struct.pack(">I", len(body)) + body

    def hello(magic: int, role: bytes, secret: bytes) -> bytes:
        return frame(
            magic, 0x01, bytes([1, 1]) + struct.pack(">i", len(role)) + role + struct.pack(">i", len(secret)) + secret
        )

    ports = {
        0x5753: (
            node.ports["port"],
            b"server",
            SERVER.encode(),
            [0x10, 0x11, 0x12, 0x13, 0x14, 0x16, 0x17, 0x18, 0x19],
        ),
        0x5741: (
            node.ports["admin_port"],
            b"admin",
            ADMIN.encode(),
            [0x20, 0x21, 0x22, 0x23, 0x24, 0x25, 0x27, 0x28, 0x29, 0x2A],
        ),
    }
    sent = 0

    async def hostile(i: int, magic: int) -> None:
        nonlocal sent
        port, role, secret, types = ports[magic]
        good_hello = hello(magic, role, secret)
        frames = [
            frame(magic, 0x01, bytes([1, 1])),
            hello(magic, role, b"wrong-secret-0123456789"),
            hello(magic, b"client", CLIENT.encode()),
            frame(magic, types[0], h + key + struct.pack(">i", PARTITIONS)),
            *(frame(magic, t, h + rng.randbytes(rng.choice((0, 1, 2, 8, 9, 12, 16)))) for t in types[1:]),
        ]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            if i % 3 == 0:
                writer.write(good_hello)
            for _ in range(rng.randint(1, 8)):
                choice = rng.random()
                if choice < 0.2:
                    writer.write(rng.randbytes(rng.randint(1, 200)))
                elif choice < 0.8:
                    writer.write(mutated(rng, rng.choice(frames)))
                else:
                    writer.write(rng.choice(frames))
                sent += 1
            await writer.drain()
            with contextlib.suppress(TimeoutError, ConnectionError):
                while await asyncio.wait_for(reader.read(65536), 0.5):
                    pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def run() -> None:
        for batch in range(30):
            await asyncio.gather(*(hostile(batch * 10 + i, (0x5753, 0x5741)[i % 2]) for i in range(10)))

    asyncio.run(run())
    assert sent >= 1000, sent
    assert node.proc.poll() is None
    config = ClientConfig(metadata=cluster.url, cluster="e2e", role_secret=CLIENT)
    with WaltzClient(MemoryApp(), config) as client:
        assert client.submit(Write("after-hostile-storage-peers", partition=0)).result(30)
    log = stop(node.proc)
    assert "panicked" not in log and "Traceback" not in log, log[-4000:]
