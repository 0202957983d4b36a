"""The torture run's fault-injecting proxy, against a real echo server on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time

import pytest
from waltz.torture.proxy import FaultProxy, ProxyLoop


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def proxy():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    loop = ProxyLoop()
    p = FaultProxy(loop, "echo", server.server_address[1])
    yield p
    p.close()
    loop.close()
    server.shutdown()


def _connect(p: FaultProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", p.port), timeout=5)


def test_pass_and_delay_forward_every_byte_in_order(proxy):
    with _connect(proxy) as s:
        s.sendall(b"hello")
        assert s.recv(100) == b"hello"
        proxy.set_mode("delay", 0.2)
        started = time.monotonic()
        s.sendall(b"slow")
        assert s.recv(100) == b"slow"
        assert time.monotonic() - started >= 0.2  # a chunk waits the delay (at least once)


def test_blackhole_holds_bytes_until_healed(proxy):
    with _connect(proxy) as s:
        proxy.set_mode("blackhole")
        s.sendall(b"held")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(100)
        proxy.set_mode("pass")
        s.settimeout(5)
        assert s.recv(100) == b"held"  # delayed, never dropped: TCP does not lose stream bytes


def _ended(s: socket.socket) -> bool:
    """The peer reset or closed the connection."""
    try:
        return s.recv(10) == b""
    except ConnectionResetError:
        return True


def test_reset_aborts_links_and_refuses_until_healed(proxy):
    with _connect(proxy) as s:
        s.sendall(b"x")
        assert s.recv(10) == b"x"
        proxy.set_mode("reset")
        assert _ended(s)
    with _connect(proxy) as s2:  # accepted, then reset at once
        assert _ended(s2)
    proxy.set_mode("pass")
    with _connect(proxy) as s3:
        s3.sendall(b"z")
        assert s3.recv(10) == b"z"


def test_unknown_mode_is_refused(proxy):
    with pytest.raises(ValueError, match="proxy mode"):
        proxy.set_mode("drop")  # type: ignore[arg-type]


def test_a_one_way_loss_holds_one_direction_only(proxy):
    with _connect(proxy) as s:
        proxy.set_mode("blackhole", direction="down")
        s.sendall(b"ping")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(100)  # the request went up; the echo is held on the way down
        proxy.set_mode("pass")
        s.settimeout(5)
        assert s.recv(100) == b"ping"


def test_a_partial_partition_cuts_only_the_connections_of_one_process(proxy):
    from waltz.torture.partial import from_process, local_ports

    with _connect(proxy) as mine, _connect(proxy) as other:
        assert mine.getsockname()[1] in local_ports(os.getpid())
        cut = mine.getsockname()[1]
        proxy.set_mode("blackhole", only=lambda port: port == cut)
        other.sendall(b"free")
        assert other.recv(100) == b"free"
        mine.sendall(b"held")
        mine.settimeout(0.5)
        with pytest.raises(socket.timeout):
            mine.recv(100)
        proxy.set_mode("blackhole", only=from_process(os.getpid() + 10_000_000))  # no such process
        mine.settimeout(5)
        assert mine.recv(100) == b"held"
        proxy.set_mode("pass")


def test_a_cut_of_several_processes_takes_the_connections_of_each(proxy):
    from waltz.torture.partial import from_process

    with _connect(proxy) as mine:
        # The zombie: the server and some clients; a gone process among them takes nothing.
        proxy.set_mode("blackhole", only=from_process(os.getpid() + 10_000_000, os.getpid()))
        mine.sendall(b"held")
        mine.settimeout(0.5)
        with pytest.raises(socket.timeout):
            mine.recv(100)
        proxy.set_mode("pass")
        mine.settimeout(5)
        assert mine.recv(100) == b"held"
