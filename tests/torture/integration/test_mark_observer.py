"""The torture run's mark observer against a real ZooKeeper that is down when it starts: a
schedule can open with kill-zookeeper, and the observer, whose first metadata read failed, ended
for the rest of the run (seeds 78 and 82), leaving the checker's high-water-mark checks without
observations. It now asks again until the metadata answers."""

from __future__ import annotations

import dataclasses
import pathlib
import time

import pytest
from support.processes import ZooKeeperServer, zookeeper_available
from waltz.cluster import open_store
from waltz.cluster.layout import cluster_root
from waltz.cluster.metadata import ClusterMetadata
from waltz.torture.history import HistoryWriter
from waltz.torture.run import _MarkObserver


@dataclasses.dataclass
class _Cluster:
    metadata_url: str
    cluster: str
    partitions: int


def test_the_observer_starts_once_zookeeper_comes_back(tmp_path: pathlib.Path) -> None:
    if not zookeeper_available():
        pytest.fail("ZooKeeper is not installed: run scripts/setup.sh (apt package `zookeeper`, Java)")
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
        said: list[str] = []
        history = HistoryWriter(tmp_path / "nemesis.jsonl", "nemesis")
        observer = _MarkObserver(_Cluster(url, "obs", 1), history, said.append)  # type: ignore[arg-type]
        try:
            time.sleep(5)  # two attempts or so (2 s each, a second apart)
            assert observer._thread.is_alive()
            assert not observer.started.is_set()
            assert len(said) == 1 and "cannot start yet" in said[0], said  # said once, not per attempt
            zk.start()
            assert observer.started.wait(60), "the observer never started after ZooKeeper came back"
            assert said[-1] == "  mark observer: started"
        finally:
            observer.close()
        assert not observer._thread.is_alive()
    finally:
        zk.stop()
