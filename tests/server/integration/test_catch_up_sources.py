"""A regression found by `waltz torture`: a returning replica's catch-up reads from the write
path's other members; when their connections had closed while the partition was idle (the
nodes restarted between appends), nothing noticed, and the catch-up read the closed
connections forever, so the replica never rejoined."""

from __future__ import annotations

from waltz.client import TransactionBuilder, TransactionContext, WaltzClient
from waltz.local import LocalCluster
from waltz.torture.feed import FeedRecorder
from waltz.torture.payload import digest


class Put(TransactionContext):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data(b"put-%d" % self.n)
        return True


def commit(cluster: LocalCluster, numbers: range) -> FeedRecorder:
    feed = FeedRecorder(keep=True)
    with WaltzClient(feed, cluster.client_config(mount_timeout=60.0)) as client:
        for f in [client.submit(Put(n)) for n in numbers]:
            assert f.result(60) is True
        client.flush()
    return feed


def test_a_replica_rejoins_when_the_write_paths_connections_closed_while_idle(tmp_path):
    cluster = LocalCluster.create(tmp_path / "c", partitions=1, storage_nodes=3, servers=1)
    cluster.start()
    try:
        commit(cluster, range(20))
        cluster.kill("storage-2")
        commit(cluster, range(20, 40))  # storage-2 misses these
        for name in ("storage-0", "storage-1"):  # idle: the session learns of it from no append
            cluster.kill(name)
            cluster.start_member(name)
            cluster.wait_member(name)
        cluster.start_member("storage-2")
        cluster.wait_member("storage-2")
        cluster.wait_replicas(timeout=90)  # before the fix: never, storage-2's catch-up spun
        feed = commit(cluster, range(40, 41))
        assert [(r.txid, r.digest) for r in feed.records[0]] == [(n, digest(b"put-%d" % n)) for n in range(41)]
    finally:
        cluster.stop()
