"""Per-role ZooKeeper ACLs end to end (issue 34, finding 8): the real ZooKeeper of the test
session, three storage nodes, a server and clients as real processes. The cluster's tree gets its
per-role access lists from `waltz cluster set-acls`; the server logs in as `server` and writes
registrations, assignments and store sessions; a client with only the client secret gets its id
through the server (clients no longer write the metadata) and commits; the metadata refuses its
writes."""

from __future__ import annotations

import pathlib
import uuid

import pytest
from support.client_app import MemoryApp, Write
from support.daemons import PARTITIONS, Node, start_server, wait_served
from support.dev_cluster import waltz
from support.processes import stop
from waltz import errors
from waltz.client import ClientConfig, WaltzClient
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata

SECRETS = {"server": "server-secret-0123456789", "admin": "admin-secret-0123456789", "client": "client-secret-0123456"}
ENV = {"WALTZ_SERVER_SECRET": SECRETS["server"], "WALTZ_ADMIN_SECRET": SECRETS["admin"]}


def test_a_cluster_under_per_role_acls_serves_a_client_that_only_reads_the_metadata(
    zookeeper, tmp_path: pathlib.Path
) -> None:
    url = zookeeper.url(f"/roles-{uuid.uuid4().hex[:12]}")
    env = {**ENV, "WALTZ_CLIENT_SECRET": SECRETS["client"], "WALTZ_METADATA": url, "WALTZ_CLUSTER": "e2e"}
    waltz("cluster", "create", "--partitions", str(PARTITIONS), "--replicas", "3", env=env)
    admin = open_store(url, role=("admin", SECRETS["admin"].encode()), acl_secrets=SECRETS)
    admin.start()
    meta = ClusterMetadata(admin, "/waltz/e2e")
    nodes: list[Node] = []
    server = None
    try:
        for i in range(3):
            n = Node(tmp_path / f"n{i}", meta.info().cluster_key)
            nodes.append(n)
            meta.add_storage_node(n.address, n.ports["admin_port"], i)
            meta.auto_assign(i)

            async def assign_all(c) -> None:
                for p in range(PARTITIONS):
                    await c.assign(p)

            n.admin(assign_all)
        # Set on the tree as it now stands (cluster create set them too; entries added since
        # took their parents' lists): a one-time migration of an existing cluster.
        assert "per-role access lists set on" in waltz("cluster", "set-acls", env=env).stdout.decode()
        with open_store(url, role=("client", SECRETS["client"].encode())) as c:
            with pytest.raises(errors.MetadataError, match="not authorised"):
                ClusterMetadata(c, "/waltz/e2e").next_id("client")

        server = start_server(tmp_path, url, "s1", sections={"role_secrets": SECRETS})
        wait_served(meta, 0)
        config = ClientConfig(metadata=url, cluster="e2e", role_secret=SECRETS["client"])
        with WaltzClient(MemoryApp(), config) as client:
            assert client.client_id >= 1
            assert client.submit(Write("acl", partition=0)).result(30)
            assert client.submit(Write("acl", partition=1)).result(30)
        with WaltzClient(MemoryApp(), config) as other:
            assert other.client_id > client.client_id  # each allocated by the server
        # A client with the wrong secret cannot even read the cluster's info.
        wrong = ClientConfig(metadata=url, cluster="e2e", role_secret="not-the-client-secret", mount_timeout=5.0)
        with pytest.raises(errors.MetadataError, match="not authorised"):
            WaltzClient(MemoryApp(), wrong)
    finally:
        if server is not None:
            stop(server)
            log = (tmp_path / "s1.log").read_text()
            assert "Traceback" not in log and "not authorised" not in log, log
        for n in nodes:
            stop(n.proc)
        admin.close()
