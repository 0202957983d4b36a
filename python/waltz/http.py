"""The HTTP endpoint every daemon serves: `/health` (JSON, 200 or 503) and `/metrics` (Prometheus)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

Health = Callable[[], tuple[bool, dict[str, Any]]]


def buckets(hist: Any, bounds: list[int] | list[float], scale: float) -> tuple[list[tuple[str, float]], float]:
    """(counts per bucket, sum) as Prometheus cumulative buckets, bounds scaled to the unit."""
    counts, total = hist
    cumulative, out = 0, []
    for bound, n in zip([*bounds, float("inf")], counts):
        cumulative += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound * scale)), cumulative))
    return out, total * scale


MAX_CONNECTIONS = 64
"""Requests served at once; more are closed at once. Scrapers and probes need a few."""


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, but at most `MAX_CONNECTIONS`: with the handler's socket timeout,
    connections that send nothing can neither pile up threads nor hold them long."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (5 by default): a burst of probes must not wait for SYN retries

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_endpoint(host: str, port: int, registry: CollectorRegistry, health: Health, *, timeout: float = 10.0) -> ThreadingHTTPServer:
    """Starts the endpoint on a daemon thread; `server.shutdown()` stops it. A connection that
    sends no whole request within `timeout` seconds is closed."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
            elif self.path == "/health":
                ok, checks = health()
                body = json.dumps({"status": "ok" if ok else "failing", "checks": checks}).encode()
                self._send(200 if ok else 503, body, "application/json")
            else:
                self._send(404, b"not found: try /health or /metrics\n", "text/plain")

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    Handler.timeout = timeout  # socketserver puts it on each connection's socket: a silent peer ends
    server = _BoundedServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="waltz-http", daemon=True).start()
    return server
