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


def test_slowloris_cannot_hold_every_slot_and_health_is_still_answered(caplog) -> None:
    """Issue 34: 64 connections sending a byte every 8 s made /health refuse everyone (a
    liveness probe would have restarted a healthy node). Here every slot is held by a peer
    dripping a byte well within the per-read timeout, and reopened whenever it is closed; a real
    client must still be answered, and the refusals counted and logged."""
    registry = CollectorRegistry()
    server = http.serve_endpoint("127.0.0.1", 0, registry, lambda: (True, {"disk": "ok"}), timeout=1.0)
    port = server.server_address[1]
    stop = threading.Event()

    def drip() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\n")
                    while not stop.wait(0.3):  # a byte every 0.3 s: never silent for the 1 s timeout
                        s.sendall(b"X")
            except OSError:
                time.sleep(0.05)  # closed by the endpoint: come back

    attackers = [threading.Thread(target=drip, daemon=True) for _ in range(http.MAX_CONNECTIONS)]
    try:
        with caplog.at_level("WARNING", logger="waltz.http"):
            for t in attackers:
                t.start()
            time.sleep(1.5)  # every slot taken, and taken again as soon as one is closed
            for _ in range(5):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                    assert r.status == 200 and json.loads(r.read())["checks"] == {"disk": "ok"}
                time.sleep(0.2)
        stop.set()
        for t in attackers:
            t.join(10)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        refused = {
            line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("waltz_http_refusals_total{")
        }
        assert refused.get("request_timeout", 0) + refused.get("evicted", 0) > 0, metrics
        assert "HTTP connection refused" in caplog.text
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
