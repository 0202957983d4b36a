"""The daemons' HTTP endpoint (`waltz.http`), in process on 127.0.0.1: connections that send
nothing are closed after the timeout and cannot pile up threads; requests are still answered."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry

from waltz import http


def test_silent_connections_are_bounded_and_timed_out_and_health_still_answers() -> None:
    server = http.serve_endpoint("127.0.0.1", 0, CollectorRegistry(), lambda: (True, {"disk": "ok"}), timeout=1.0)
    port = server.server_address[1]
    try:
        threads_before = threading.active_count()
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * http.MAX_CONNECTIONS)]
        time.sleep(0.5)
        # One thread per served connection at most, whatever the number of connections.
        assert threading.active_count() <= threads_before + http.MAX_CONNECTIONS
        # Each silent connection is closed by the endpoint: the excess at once, the rest after
        # the timeout.
        for s in silent:
            s.settimeout(10)
            assert s.recv(1) == b""
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["checks"] == {"disk": "ok"}
    finally:
        server.shutdown()
        server.server_close()
