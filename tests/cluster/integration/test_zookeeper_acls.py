"""Per-role ZooKeeper ACLs (issue 34, finding 8), on the session's real ZooKeeper: with the tree's
access lists set from the role secrets, a process logged in as `client` reads the cluster's info,
the servers and the assignment, and can write nothing (not even a client id: servers allocate
them); `server` and `admin` write; entries created later keep the lists; without a login, nothing
is readable."""

from __future__ import annotations

import uuid

import pytest
from waltz import errors
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata, PartitionMetadata

SECRETS = {"server": "server-secret-0123456789", "admin": "admin-secret-0123456789", "client": "client-secret-0123"}
ROOT = "/waltz/acl"


def as_role(url: str, role: str | None, secret: str | None = None, acl_secrets: dict[str, str] | None = None):
    """A store logged in as `role`; servers and admins know every role's secret, as a server's
    `[role_secrets]` and the CLI's environment do."""
    credential = None if role is None else (role, (secret or SECRETS[role]).encode())
    if acl_secrets is None and role in ("server", "admin"):
        acl_secrets = SECRETS
    return open_store(url, session_timeout=5.0, role=credential, acl_secrets=acl_secrets)


@pytest.fixture
def url(zookeeper) -> str:
    url = zookeeper.url(f"/acl-{uuid.uuid4().hex[:12]}")
    with as_role(url, "admin") as store:
        meta = ClusterMetadata(store, ROOT)
        meta.create("acl", 2, 1)
        assert meta.set_role_acls(SECRETS) >= 10
    return url


def test_a_client_reads_what_it_needs_and_writes_nothing(url: str) -> None:
    # Given every secret to build access lists with, so that its creates reach ZooKeeper: what
    # refuses them is its login as `client`.
    with as_role(url, "client", acl_secrets=SECRETS) as store:
        meta = ClusterMetadata(store, ROOT)
        assert meta.info().partitions == 2
        assert meta.servers() == []
        assert set(meta.assignment()[0]) == {0, 1}
        denied = pytest.raises(errors.MetadataError, match="not authorised")
        with denied:
            meta.next_id("client")  # client ids come from a server now
        with denied:
            meta.partition_metadata(0)  # store sessions are not a client's to read
        with denied:
            meta.set_assignment({}, meta.assignment()[1])
        with denied:
            store.create(f"{ROOT}/servers/99", b"{}", ephemeral=True)
        with denied:
            store.set(f"{ROOT}/store", b"{}")
    # A client with a wrong secret, or none, reads nothing either.
    for store in (as_role(url, "client", "not-the-client-secret"), as_role(url, None)):
        with store, pytest.raises(errors.MetadataError, match="not authorised"):
            ClusterMetadata(store, ROOT).info()


def test_servers_and_admins_write_and_new_entries_keep_the_lists(url: str) -> None:
    with as_role(url, "server") as server:
        meta = ClusterMetadata(server, ROOT)
        first = meta.next_id("client")
        assert meta.next_id("client") == first + 1
        meta.set_partition_metadata(0, PartitionMetadata(), meta.partition_metadata(0)[1])
        # Created now, under a parent clients may read (a registration) and one they may not.
        server.create(f"{ROOT}/servers/7", b'{"host":"h","port":1}', ephemeral=True)
        server.create(f"{ROOT}/store/partition/extra", b"{}")
        meta.bind_client_id(first, "ab" * 32)  # its parent made on the way takes the root's list
        with as_role(url, "client") as client:
            assert client.get(f"{ROOT}/servers/7")[0] == b'{"host":"h","port":1}'
            with pytest.raises(errors.MetadataError, match="not authorised"):
                client.get(f"{ROOT}/store/partition/extra")
            with pytest.raises(errors.MetadataError, match="not authorised"):
                client.set(f"{ROOT}/servers/7", b"{}")
            for path in (f"{ROOT}/clients", f"{ROOT}/clients/{first}"):
                with pytest.raises(errors.MetadataError, match="not authorised"):
                    client.set(path, b"{}")
            assert ClusterMetadata(client, ROOT).client_id_binding(first) == "ab" * 32
    with as_role(url, "admin") as admin:
        admin.delete(f"{ROOT}/store/partition/extra")
        assert ClusterMetadata(admin, ROOT).next_id("server") == 1
    # A server that lacks a secret the parent's list names cannot copy the list (ZooKeeper shows
    # the password hashes to admins only): it says so instead of creating an entry nobody reads.
    without_client = {"server": SECRETS["server"], "admin": SECRETS["admin"]}
    with as_role(url, "server", acl_secrets=without_client) as server:
        with pytest.raises(errors.MetadataError, match=r"names the client role.*\[role_secrets\] client"):
            server.create(f"{ROOT}/servers/8", b"{}", ephemeral=True)
    # Only the admin may change access lists.
    with as_role(url, "server") as server, pytest.raises(errors.MetadataError, match="not authorised"):
        ClusterMetadata(server, ROOT).set_role_acls(SECRETS)
