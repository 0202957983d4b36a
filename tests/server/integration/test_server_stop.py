"""A graceful stop while the metadata store is down (torture seed 89: a stop-server during
kill-zookeeper, and the server outlived its 60 s). Its ephemeral registrations go with its
session; deleting them first retried each for up to twice the session timeout."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import time

import pytest
from support.daemons import start_server
from support.processes import ZooKeeperServer, zookeeper_available
from waltz.cluster import open_store
from waltz.cluster.metadata import ClusterMetadata


def test_a_server_stops_while_zookeeper_is_down(tmp_path: pathlib.Path) -> None:
    if not zookeeper_available():
        pytest.fail("ZooKeeper is not installed: run scripts/setup.sh (apt package `zookeeper`, Java)")
    zk = ZooKeeperServer(tmp_path / "zookeeper")
    zk.start()
    server = None
    try:
        url = zk.url("/stop")
        store = open_store(url)
        store.start(30)
        meta = ClusterMetadata(store, "/waltz/e2e")
        try:
            meta.create("e2e", 1, 1)
            server = start_server(tmp_path, url, "s", session_timeout=10.0)
            deadline = time.monotonic() + 60
            while not meta.servers():
                assert server.poll() is None, (tmp_path / "s.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the server never registered"
                time.sleep(0.1)
        finally:
            store.close()
        zk.kill()
        time.sleep(1)
        server.send_signal(signal.SIGTERM)
        # Well inside a service manager's stop timeout (systemd's default 90 s; the torture's 60).
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 30 s of SIGTERM with ZooKeeper down")
        assert "server stopped" in (tmp_path / "s.log").read_text()
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        zk.stop()
