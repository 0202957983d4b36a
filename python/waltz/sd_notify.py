"""sd_notify(3) without libsystemd: tells the service manager of a `Type=notify` unit when a
daemon serves (so that `systemctl start` and units ordered after it wait for that, not for the
process to exist) and when it stops. Outside systemd (no NOTIFY_SOCKET) it does nothing."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("waltz.sd_notify")


def notify(state: str) -> bool:
    """Sends `state` ("READY=1", "STOPPING=1", "STATUS=...", newline-separated) to
    $NOTIFY_SOCKET; False when there is none or it cannot be reached (logged: the unit would
    then time out waiting, which the log line explains)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
    except OSError as e:
        log.warning(
            "cannot notify the service manager at %s (%s): %s", os.environ["NOTIFY_SOCKET"], state.split("\n")[0], e
        )
        return False
    return True
