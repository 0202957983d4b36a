"""Mutual TLS on every link, with real processes on 127.0.0.1: three storage nodes and a server
all on TLS, a client and the CLI with the right certificates; and each way of getting it wrong
(another CA, no client certificate, plaintext against TLS, TLS against plaintext) refused with an
error that says so, on both sides. Certificates come from `generate_dev_certificates`, plus a
second, unrelated CA."""

from __future__ import annotations

import asyncio
import pathlib
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from support.client_app import MemoryApp, Write
from support.daemons import PARTITIONS, Cli, Node, start_server, wait_served
from support.processes import stop
from waltz import client_protocol as cp
from waltz import errors
from waltz.client import ClientConfig, WaltzClient
from waltz.client.network import Link
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata
from waltz.storage import StorageAdminClient, StorageClient
from waltz.tls import DevCertificates, generate_dev_certificates

pytestmark = pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)

NO_TLS = "TLS is not configured: every link of this"


@pytest.fixture
def certs(tmp_path: pathlib.Path) -> DevCertificates:
    return generate_dev_certificates(tmp_path / "certs")


@pytest.fixture
def wrong(tmp_path: pathlib.Path) -> DevCertificates:
    """An unrelated CA and its certificates: right in form, trusted by nobody in the cluster."""
    return generate_dev_certificates(tmp_path / "wrong")


def tls_section(ca: pathlib.Path, cert: pathlib.Path, key: pathlib.Path) -> dict[str, Any]:
    return {"tls": {"ca": ca, "cert": cert, "key": key}}


def context(ca: pathlib.Path, cert: pathlib.Path | None = None, key: pathlib.Path | None = None) -> ssl.SSLContext:
    """A client context trusting `ca`, presenting `cert` if given (none: no client certificate)."""
    c = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    c.load_verify_locations(ca)
    if cert is not None:
        c.load_cert_chain(cert, key)
    return c


def wait_for_line(path: pathlib.Path, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if text in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line with {text!r} in {path}:\n{path.read_text()[-3000:]}")


class Cluster:
    def __init__(
        self, meta: ClusterMetadata, nodes: list[Node], url: str, server: subprocess.Popen[str], log: pathlib.Path
    ):
        self.meta, self.nodes, self.url, self.server, self.server_log = meta, nodes, url, server, log

    @property
    def endpoint(self) -> str:
        return wait_served(self.meta, 0)[0]


@pytest.fixture
def tls_cluster(metadata_url: str, tmp_path: pathlib.Path, certs: DevCertificates) -> Iterator[Cluster]:
    """Three storage nodes and one server, every port on mutual TLS."""
    store = open_store(metadata_url)
    store.start()
    meta = ClusterMetadata(store, "/waltz/e2e")
    info, _ = meta.create("e2e", PARTITIONS, 3)
    storage_tls = tls_section(certs.ca, certs.storage_cert, certs.storage_key)
    admin = context(certs.ca, certs.admin_cert, certs.admin_key)
    nodes = [Node(tmp_path / f"n{i}", info.cluster_key, sections=storage_tls, ssl=admin) for i in range(3)]
    server = None
    try:
        for i, n in enumerate(nodes):
            meta.add_storage_node(n.address, n.ports["admin_port"], i)
            meta.auto_assign(i)

            async def assign_all(c: Any) -> None:
                for p in range(PARTITIONS):
                    await c.assign(p)

            n.admin(assign_all)
        server = start_server(
            tmp_path, metadata_url, "server", sections=tls_section(certs.ca, certs.server_cert, certs.server_key)
        )
        for p in range(PARTITIONS):
            wait_served(meta, p)
        yield Cluster(meta, nodes, metadata_url, server, tmp_path / "server.log")
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        for n in nodes:
            if n.proc.poll() is None:
                stop(n.proc)
        store.close()


def test_a_cluster_on_mutual_tls_commits_and_is_administered(tls_cluster: Cluster, certs: DevCertificates) -> None:
    c = tls_cluster
    config = ClientConfig(
        metadata=c.url, cluster="e2e", tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key
    )
    app = MemoryApp()
    with WaltzClient(app, config) as client:
        futures = [client.submit(Write(f"tx{i}", partition=i)) for i in range(20)]
        assert [f.result(30) for f in futures] == [True] * 20
        client.flush()
        assert sum(len(v) for v in app.applied.values()) == 20
        assert client.high_water_mark(0) >= 0  # the RPC link is on TLS too (as are the data fetches of apply)
    # A client certificate may fetch data in ranges (Transaction Data Range), as it may one by one:
    # a new client catching up from the start reads the 20 transactions' data in fewer round trips.
    again = MemoryApp()
    with WaltzClient(again, config) as reader:
        reader.flush()
        deadline = time.monotonic() + 30
        while sum(len(v) for v in again.applied.values()) < 20:
            assert time.monotonic() < deadline, again.applied
            time.sleep(0.05)
        assert again.applied == app.applied and not again.errors
        assert reader.stats.data_requests < 20, reader.stats.data_requests
    assert NO_TLS not in c.server_log.read_text()
    assert "through mutual TLS" in c.server_log.read_text()

    cli = Cli(c.url)
    cli.env.update(
        {
            "WALTZ_CLUSTER": "e2e",
            "WALTZ_TLS_CA": str(certs.ca),
            "WALTZ_TLS_CERT": str(certs.admin_cert),
            "WALTZ_TLS_KEY": str(certs.admin_key),
        }
    )
    nodes = cli.json("storage", "list", "--status")
    assert len(nodes) == 3, nodes
    verify = cli.json("cluster", "verify")
    assert verify["ok"], verify
    assert any(ch["check"].startswith("server") and ch["status"] == "PASS" for ch in verify["checks"])

    # The same CLI without certificates cannot reach any admin port, and says why.
    for k in ("WALTZ_TLS_CA", "WALTZ_TLS_CERT", "WALTZ_TLS_KEY"):
        del cli.env[k]
    verify = cli.json("cluster", "verify", ok=False)
    details = [
        ch["detail"]
        for ch in verify["checks"]
        if ch["check"].startswith("storage 127.0.0.1") and ch["status"] == "FAIL"
    ]
    assert len(details) == 3 and all("answered with TLS: it requires mutual TLS" in d for d in details), verify


def test_wrong_ca_missing_client_certificate_and_plaintext_are_refused(
    tls_cluster: Cluster, certs: DevCertificates, wrong: DevCertificates
) -> None:
    c = tls_cluster
    endpoint = c.endpoint
    node = c.nodes[0]
    host, port, admin_port = "127.0.0.1", node.ports["port"], node.ports["admin_port"]
    key = node.key

    async def server_link(ssl_context: ssl.SSLContext | None) -> None:
        link = Link(endpoint, "stream", lambda *_: None, lambda *_: None, ssl=ssl_context)
        await link.open(5.0)
        link.close()

    async def storage(ssl_context: ssl.SSLContext | None, cls: Any = StorageClient, p: int = port) -> None:
        async with await cls.connect(
            host, p, cluster_key=key, partition_count=PARTITIONS, ssl=ssl_context, timeout=5.0
        ):
            pass

    def refused(coro: Any, match: str) -> str:
        with pytest.raises(errors.TlsError, match=match) as e:
            asyncio.run(asyncio.wait_for(coro, 20))
        return str(e.value)

    # The right certificates work against each port: what follows fails for its own reason.
    asyncio.run(server_link(context(certs.ca, certs.client_cert, certs.client_key)))
    asyncio.run(storage(context(certs.ca, certs.server_cert, certs.server_key)))

    # A client that trusts another CA: it refuses the peer's certificate.
    wrong_ca = context(wrong.ca, wrong.client_cert, wrong.client_key)
    msg = refused(server_link(wrong_ca), "certificate verify failed")
    assert msg.startswith(f"TLS with server {endpoint} failed") and "not signed by our CA" in msg
    msg = refused(storage(wrong_ca), "certificate verify failed")
    assert f"storage node {host}:{port}" in msg

    # Trusting the right CA but presenting a certificate of another one: the peer refuses it.
    # (A Python peer closes without a TLS alert, a storage node sends one that names the cause.)
    foreign = context(certs.ca, wrong.client_cert, wrong.client_key)
    refused(server_link(foreign), "right after the handshake: it refused our certificate")
    refused(storage(foreign), "the peer refused our certificate: it is not signed by a CA the peer trusts")

    # No client certificate: with TLS 1.3 the refusal only arrives at the first read, and is
    # still a TlsError saying so, not a hang or a bare EOF.
    bare = context(certs.ca)
    refused(server_link(bare), "it refused our certificate \\(none, one not signed")
    refused(storage(bare), "requires a client certificate and we presented none")
    refused(storage(bare, StorageAdminClient, admin_port), "requires a client certificate and we presented none")

    # Plaintext against TLS ports. A storage node answers with a TLS alert, so the client knows;
    # the server (Python's TLS) just closes, so the client can only point at TLS.
    with pytest.raises(
        ConnectionError,
        match=f"server {endpoint} closed the connection without answering Hello: it requires mutual TLS",
    ):
        asyncio.run(asyncio.wait_for(server_link(None), 20))
    refused(storage(None), "answered with TLS: it requires mutual TLS")
    refused(storage(None, StorageAdminClient, admin_port), "answered with TLS: it requires mutual TLS")

    # A client configured with another CA does not hang: its mount times out naming the cause.
    bad_config = ClientConfig(
        metadata=c.url,
        cluster="e2e",
        mount_timeout=2.0,
        tls_ca=wrong.ca,
        tls_cert=wrong.client_cert,
        tls_key=wrong.client_key,
    )
    with pytest.raises(errors.MountTimeoutError, match="certificate verify failed"):
        WaltzClient(MemoryApp(), bad_config)

    # Each refusal is one warning line on the refusing side, naming the peer and the reason.
    wait_for_line(c.server_log, "failed: the client presented no certificate")
    wait_for_line(c.server_log, "failed: the client does not speak TLS")
    wait_for_line(c.server_log, "failed: certificate verify failed")
    # The cluster is unharmed: the server still commits through its TLS links to the nodes.
    good = ClientConfig(
        metadata=c.url, cluster="e2e", tls_ca=certs.ca, tls_cert=certs.client_cert, tls_key=certs.client_key
    )
    with WaltzClient(MemoryApp(), good) as client:
        assert client.submit(Write("after", partition=0)).result(30)

    c.server.terminate()
    c.server.wait(30)
    log = stop(node.proc)
    assert "TLS handshake with storage client 127.0.0.1:" in log
    assert "the client presented no certificate" in log
    assert "TLS handshake with admin client 127.0.0.1:" in log
    assert "it does not speak TLS" in log
    assert "not signed by this node's CA" in log
    assert NO_TLS not in log


def test_plaintext_nodes_warn_and_refuse_tls_clients(
    metadata_url: str, tmp_path: pathlib.Path, certs: DevCertificates
) -> None:
    store = open_store(metadata_url)
    store.start()
    try:
        meta = ClusterMetadata(store, "/waltz/e2e")
        info, _ = meta.create("e2e", PARTITIONS, 1)
        node = Node(tmp_path / "plain", info.cluster_key)
        server = start_server(tmp_path, metadata_url, "plain-server")
        line = wait_for_line(tmp_path / "plain-server.log", NO_TLS)
        assert "WARNING" in line and "[tls] in docs/configuration.md" in line
        endpoint = next(iter(_servers(meta))).endpoint
        client_ssl = context(certs.ca, certs.client_cert, certs.client_key)

        async def tls_to_server() -> None:
            link = Link(endpoint, "stream", lambda *_: None, lambda *_: None, ssl=client_ssl)
            await link.open(5.0)

        async def tls_to_node() -> None:
            await StorageClient.connect(
                "127.0.0.1",
                node.ports["port"],
                cluster_key=info.cluster_key,
                partition_count=PARTITIONS,
                ssl=client_ssl,
                timeout=5.0,
            )

        for coro in (tls_to_server(), tls_to_node()):
            with pytest.raises(errors.TlsError, match="closed the connection during the handshake: a plaintext port"):
                asyncio.run(asyncio.wait_for(coro, 20))
        wait_for_line(tmp_path / "plain-server.log", "the client speaks TLS but this server has no [tls] configured")
        server.terminate()
        server.wait(30)
        log = stop(node.proc)
        warning = next(line for line in log.splitlines() if NO_TLS in line)
        assert '"level": "WARNING"' in warning and "plaintext and unauthenticated" in warning
        assert "the client speaks TLS but this node has no [tls] configured" in log
    finally:
        store.close()


def _servers(meta: ClusterMetadata, timeout: float = 30.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if servers := meta.servers():
            return servers
        time.sleep(0.1)
    raise AssertionError("no server registered")


def test_cluster_keys_stay_checked_inside_tls(tls_cluster: Cluster, certs: DevCertificates) -> None:
    """TLS authenticates the peer; the protocol's own checks still apply inside it."""
    node = tls_cluster.nodes[1]

    async def go() -> None:
        with pytest.raises(errors.ClusterKeyMismatch):
            await StorageClient.connect(
                "127.0.0.1",
                node.ports["port"],
                cluster_key=uuid.uuid4(),
                partition_count=PARTITIONS,
                ssl=certs.tls("server").client_context(),
                timeout=5.0,
            )
        # A server's certificate also serves as a client one (servers connect to the nodes).
        async with await StorageAdminClient.connect(
            "127.0.0.1",
            node.ports["admin_port"],
            cluster_key=node.key,
            partition_count=PARTITIONS,
            ssl=certs.tls("server").client_context(),
        ) as a:
            assert {s["partition"] for s in await a.status()} == set(range(PARTITIONS))

    asyncio.run(go())


def test_each_port_admits_only_its_roles(tls_cluster: Cluster, certs: DevCertificates) -> None:
    """Issue 34, finding 2: any certificate of the CA used to pass everywhere, so an
    application's certificate could set a partition's availability on a storage node's admin
    port. Storage and admin ports admit servers and admins; a server's client port admits
    clients and admins."""
    c = tls_cluster
    node = c.nodes[0]
    host, port, admin_port = "127.0.0.1", node.ports["port"], node.ports["admin_port"]
    endpoint = c.endpoint

    async def storage(role: str, cls: Any = StorageClient, p: int = port) -> None:
        async with await cls.connect(
            host, p, cluster_key=node.key, partition_count=PARTITIONS, ssl=certs.tls(role).client_context(), timeout=5.0
        ):
            pass

    async def make_unwritable(role: str) -> None:
        async with await StorageAdminClient.connect(
            host,
            admin_port,
            cluster_key=node.key,
            partition_count=PARTITIONS,
            ssl=certs.tls(role).client_context(),
            timeout=5.0,
        ) as a:
            await a.set_availability(0, readable=True, writable=False)

    async def server_link(role: str) -> None:
        link = Link(endpoint, "stream", lambda *_: None, lambda *_: None, ssl=certs.tls(role).client_context())
        await link.open(5.0)
        link.close()

    def refused(coro: Any, role: str, error: type[Exception] = errors.RefusedError) -> None:
        # The port answers the Hello with why (a bare close read like a connection limit).
        with pytest.raises(error, match=f"refused our Hello: the client's certificate has role {role}; this port"):
            asyncio.run(asyncio.wait_for(coro, 20))

    # An application's certificate (and another storage node's) gets into neither node port,
    # so no state-changing admin request (Set Availability here) can be sent with it.
    for role in ("client", "storage"):
        refused(storage(role), role)
        refused(storage(role, StorageAdminClient, admin_port), role)
    refused(make_unwritable("client"), "client")
    availability = {s["partition"]: s for s in node.admin(lambda a: a.status())}
    assert availability[0]["writable"], availability[0]
    # Servers and admins get in, to both.
    for role in ("server", "admin"):
        asyncio.run(storage(role))
        asyncio.run(storage(role, StorageAdminClient, admin_port))
    # The client port: applications and admins, not a server's or a storage node's certificate.
    for role in ("client", "admin"):
        asyncio.run(server_link(role))
    for role in ("server", "storage"):
        refused(server_link(role), role, errors.HelloRefusedError)
    wait_for_line(c.server_log, "this port admits only admin, client")
    # The cluster still commits, with an application's certificate.
    app_tls = certs.tls("client")
    config = ClientConfig(metadata=c.url, cluster="e2e", tls_ca=app_tls.ca, tls_cert=app_tls.cert, tls_key=app_tls.key)
    with WaltzClient(MemoryApp(), config) as client:
        assert client.submit(Write("roles", partition=0)).result(30)

    log = stop(node.proc)
    assert "the client's certificate has role client; this port admits only server, admin" in log
    assert "the client's certificate has role storage; this port admits only server, admin" in log
    assert "admin connection from 127.0.0.1:" in log


def test_a_client_id_is_bound_to_the_certificate_it_was_allocated_to(
    tls_cluster: Cluster, certs: DevCertificates
) -> None:
    """Issue 34: a client id a server allocated over a connection with one certificate cannot be
    mounted over a connection with another (here the admin's, which the client port admits too),
    even once the client is gone; the same certificate mounts it again (a restart)."""
    c = tls_cluster
    app_tls = certs.tls("client")
    config = ClientConfig(metadata=c.url, cluster="e2e", tls_ca=app_tls.ca, tls_cert=app_tls.cert, tls_key=app_tls.key)
    with WaltzClient(MemoryApp(), config) as client:
        assert client.submit(Write("bound", partition=0)).result(30)
        client_id = client.client_id

    async def mount(role: str) -> cp.Message:
        link = Link(c.endpoint, "rpc", lambda *_: None, lambda *_: None, ssl=certs.tls(role).client_context())
        await link.open(10.0)
        try:
            return await link.request(
                lambda seq: cp.Mount(seq, 0, client_id, -1, time.time_ns() // 1000, b"t" * 16), 30
            )
        finally:
            link.close()

    with pytest.raises(errors.RequestFailedError, match=f"client id {client_id} was allocated to another certificate"):
        asyncio.run(mount("admin"))
    mounted = asyncio.run(mount("client"))
    assert isinstance(mounted, cp.MountResponse) and mounted.status == cp.MountStatus.READY, mounted
