"""A bare client-protocol connection for tests that speak to a server frame by frame."""

from __future__ import annotations

import socket

from waltz import client_protocol as cp


class RawConnection:
    """A bare client-protocol connection, as an attacker on the network would open one."""

    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.messages = cp.MessageReader()
        self.sock.sendall(cp.Hello().frame())
        assert isinstance(self.next(), cp.HelloOk)

    def next(self, timeout: float = 10.0) -> cp.Message | None:
        """The next message; None if none came within `timeout`."""
        self.sock.settimeout(timeout)
        while (m := self.messages.next_message()) is None:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            assert data, "the server closed the connection"
            self.messages.feed(data)
        return m

    def send(self, msg: cp.Message) -> None:
        self.sock.sendall(msg.frame())

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def closed_by_server(self, timeout: float = 10.0) -> bool:
        """True once the server has closed the connection (within `timeout`)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True
