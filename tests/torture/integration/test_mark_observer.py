"""The torture run's mark observer against a real ZooKeeper that is down when it starts: a
schedule can open with kill-zookeeper, and the observer, whose first metadata read failed, ended
for the rest of the run (seeds 78 and 82), leaving the checker's high-water-mark checks without
observations. It now asks again until the metadata answers."""

from __future__ import annotations

import dataclasses
import pathlib
import time

from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.metadata import ClusterMetadata
from waltz.local.zookeeper import ZooKeeperServer
from waltz.torture.history import HistoryWriter
from waltz.torture.run import _MarkObserver


@dataclasses.dataclass
class _Cluster:
    metadata_url: str
    cluster: str
    partitions: int


def test_the_observer_starts_once_zookeeper_comes_back(tmp_path: pathlib.Path) -> None:
    zk = ZooKeeperServer(tmp_path / "zookeeper")
    zk.start()
    try:
        url = zk.url("/observer")
        store = open_store(url)
        store.start(30)
        try:
            ClusterMetadata(store, cluster_root("obs")).create("obs", partitions=1, replicas=1)
        finally:
            store.close()
        zk.stop()
        observer = _MarkObserver(_Cluster(url, "obs", 1), HistoryWriter(tmp_path / "nemesis.jsonl", "nemesis"))  # type: ignore[arg-type]
        try:
            time.sleep(5)  # two failed starts of 2 s each
            assert observer._thread.is_alive()
            assert not observer.started.is_set()
            zk.start()
            assert observer.started.wait(60), "the observer never started after ZooKeeper came back"
        finally:
            observer.close()
        assert not observer._thread.is_alive()
    finally:
        zk.stop()
