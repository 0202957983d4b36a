"""sd_notify: a storage node tells the service manager when it serves and when it stops, on an
abstract socket as systemd's own NOTIFY_SOCKET is; without one nothing is sent."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import uuid

import pytest
from support.processes import get, write_config
from waltz.sd_notify import notify


def _receive(listener: socket.socket) -> str:
    return listener.recv(4096).decode()


def test_a_storage_node_notifies_ready_then_stopping(tmp_path: pathlib.Path) -> None:
    name = f"waltz-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(30)
        config, ports = write_config(tmp_path, uuid.uuid4())
        proc = subprocess.Popen(
            [sys.executable, "-m", "waltz.cli.node", "storage", "--config", str(config)],
            env={**os.environ, "NOTIFY_SOCKET": "@" + name},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready = _receive(listener)
            assert ready.split("\n")[0] == "READY=1" and f"127.0.0.1:{ports['port']}" in ready
            assert get(ports["http_port"], "/health")[0] == 200  # serving by the time it said so
            proc.send_signal(signal.SIGTERM)
            assert _receive(listener) == "STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_without_a_service_manager_nothing_is_sent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert notify("READY=1") is False
    assert "cannot notify the service manager" in caplog.text
