"""The HTTP endpoint every daemon serves: `/health` (JSON, 200 or 503) and `/metrics` (Prometheus)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest

from waltz.limits import Refusals

log = logging.getLogger(__name__)

Health = Callable[[], tuple[bool, dict[str, Any]]]


class _CountedRefusals(Refusals):
    """Refusals also counted in the endpoint's own registry."""

    def __init__(self, counter: Counter) -> None:
        super().__init__(log, "HTTP connection")
        self.counter = counter

    def refuse(self, reason: str, detail: str) -> None:
        self.counter.labels(reason).inc()
        super().refuse(reason, detail)


def buckets(hist: Any, bounds: list[int] | list[float], scale: float) -> tuple[list[tuple[str, float]], float]:
    """(counts per bucket, sum) as Prometheus cumulative buckets, bounds scaled to the unit."""
    counts, total = hist
    cumulative, out = 0, []
    for bound, n in zip([*bounds, float("inf")], counts):
        cumulative += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound * scale)), cumulative))
    return out, total * scale


MAX_CONNECTIONS = 64
"""Connections served at once. Scrapers and probes need a few; when all are taken, a new one
takes the slot of the connection that has been reading its request longest (see `_BoundedServer`)."""
REQUEST_TIMEOUT = 5.0
"""The whole request head must arrive within this (not per byte: 64 connections sending a byte
every 8 s held every slot for ever and /health refused the liveness probe, issue 34)."""


class _DeadlineSocketReader(io.RawIOBase):
    """The connection's bytes, each read given only what is left of the request's deadline."""

    def __init__(self, sock: socket.socket, deadline: float, on_timeout: Callable[[], None]) -> None:
        super().__init__()
        self.sock, self.deadline, self.on_timeout = sock, deadline, on_timeout

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request head did not arrive in time")
            self.sock.settimeout(left)
            return self.sock.recv_into(b)
        except TimeoutError:
            self.on_timeout()
            raise


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `MAX_CONNECTIONS`, favouring requests that complete: when
    every slot is taken, a new connection takes over the slot of the one that has been reading
    its request head longest (shut down, its thread ends at once); only when every connection
    is past its head (answering) is the new one closed. A slow peer can hold a slot for at most
    the request deadline, and never against a client that sends its request at once."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (5 by default): a burst of probes must not wait for SYN retries

    def __init__(self, *args: Any, refusals: Refusals, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals = refusals
        self._lock = threading.Lock()
        self._open = 0
        self._reading: dict[Any, float] = {}  # connection -> accepted at, until its request head is read
        self._evicted: set[Any] = set()  # shut down for a newcomer, which took their slot

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if self._open >= MAX_CONNECTIONS:
                victim = min(self._reading, key=self._reading.__getitem__, default=None)
                if victim is None:
                    self.refusals.refuse(
                        "max_connections", f"{client_address}: {MAX_CONNECTIONS} requests are being answered"
                    )
                    self.shutdown_request(request)
                    return
                age = time.monotonic() - self._reading.pop(victim)
                self._evicted.add(victim)
                self.refusals.refuse(
                    "evicted", f"a connection reading its request for {age:.1f} s made way for {client_address}"
                )
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)
            else:
                self._open += 1
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def head_read(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def _release(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)
            if request in self._evicted:
                self._evicted.discard(request)  # its slot went to the newcomer
            else:
                self._open -= 1

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)


def serve_endpoint(
    host: str,
    port: int,
    registry: CollectorRegistry,
    health: Health,
    *,
    timeout: float = REQUEST_TIMEOUT,
) -> ThreadingHTTPServer:
    """Starts the endpoint on a daemon thread; `server.shutdown()` stops it. A connection whose
    request head has not arrived whole within `timeout` seconds is closed. Refusals are counted
    in `waltz_http_refusals_total` (by reason) of `registry` and logged."""
    refused = Counter(
        "waltz_http_refusals", "HTTP connections closed by a limit, by reason", ["reason"], registry=registry
    )
    refusals = _CountedRefusals(refused)

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the socket's own file; ours reads under the request's deadline
            self.rfile = io.BufferedReader(
                _DeadlineSocketReader(self.connection, time.monotonic() + timeout, self._timed_out)
            )

        def _timed_out(self) -> None:
            refusals.refuse("request_timeout", f"{self.client_address}: no whole request within {timeout:g} s")

        def parse_request(self) -> bool:
            ok = super().parse_request()  # the request line and the headers are in
            server.head_read(self.request)
            self.connection.settimeout(timeout)  # for writing the answer
            return ok

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

    server = _BoundedServer((host, port), Handler, refusals=refusals)
    threading.Thread(target=server.serve_forever, name="waltz-http", daemon=True).start()
    return server
