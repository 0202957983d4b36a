"""Mutual TLS to ZooKeeper (issue 34, finding 8): a real ZooKeeper 3.8 serving a secure port
with the development CA's certificates. A metadata URL with `tls_ca`, `tls_cert` and `tls_key`
creates and reads a cluster through it; a plaintext client, and a client whose certificate is
of another CA, never get a session there."""

from __future__ import annotations

import pathlib
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest
from support.processes import ZooKeeperServer, zookeeper_available
from waltz import errors
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata
from waltz.tls import DevCertificates, generate_dev_certificates


@pytest.fixture
def certs(tmp_path: pathlib.Path) -> DevCertificates:
    return generate_dev_certificates(tmp_path / "certs")


@pytest.fixture
def secure_zookeeper(tmp_path: pathlib.Path, certs: DevCertificates) -> Iterator[ZooKeeperServer]:
    if not zookeeper_available():
        pytest.fail("ZooKeeper is not installed: run scripts/setup.sh (apt package `zookeeper`, Java)")
    server = ZooKeeperServer(tmp_path / "zookeeper", tls=certs.tls("storage"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tls_url(server: ZooKeeperServer, certs: DevCertificates, role: str = "server", chroot: str = "/tls") -> str:
    t = certs.tls(role)
    query = urllib.parse.urlencode({"tls_ca": t.ca, "tls_cert": t.cert, "tls_key": t.key})
    return f"zk://127.0.0.1:{server.secure_port}{chroot}?{query}"


def test_metadata_over_mutual_tls_to_zookeeper(secure_zookeeper: ZooKeeperServer, certs: DevCertificates) -> None:
    with open_store(tls_url(secure_zookeeper, certs), session_timeout=5.0) as store:
        meta = ClusterMetadata(store, "/waltz/tls")
        info, created = meta.create("tls", 4, 3)
        assert created
    with open_store(tls_url(secure_zookeeper, certs, "admin"), session_timeout=5.0) as store:
        assert ClusterMetadata(store, "/waltz/tls").info().cluster_key == info.cluster_key


def test_plaintext_and_foreign_certificates_get_no_session(
    secure_zookeeper: ZooKeeperServer, certs: DevCertificates, tmp_path: pathlib.Path
) -> None:
    plain = open_store(f"zk://127.0.0.1:{secure_zookeeper.secure_port}/tls", session_timeout=2.0)
    with pytest.raises(errors.MetadataUnavailableError):
        plain.start(timeout=4)
    other = generate_dev_certificates(tmp_path / "other")
    t = other.tls("server")
    query = urllib.parse.urlencode({"tls_ca": certs.ca, "tls_cert": t.cert, "tls_key": t.key})
    foreign = open_store(f"zk://127.0.0.1:{secure_zookeeper.secure_port}/tls?{query}", session_timeout=2.0)
    with pytest.raises(errors.MetadataUnavailableError):
        foreign.start(timeout=4)
    with pytest.raises(errors.MetadataError, match="sets tls_ca but not tls_cert, tls_key"):
        open_store(f"zk://127.0.0.1:1/x?tls_ca={certs.ca}")
    with pytest.raises(errors.MetadataError, match="unknown parameter"):
        open_store(f"zk://127.0.0.1:1/x?tls={uuid.uuid4()}")
