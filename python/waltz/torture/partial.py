"""Which connections through a `FaultProxy` belong to one process: the partial partitions of a
torture run (issue 37 item 3) cut one server from one storage node, or one server from the
metadata store (with some of the client processes: the zombie), while every other process still
reaches it through the same proxy.

Every process of a run dials from 127.0.0.1, so the proxy tells them apart by the dialer's
source port; the process that owns a port is found the way `ss -p` finds it: the socket inodes
in /proc/PID/fd, matched against /proc/PID/net/tcp."""

from __future__ import annotations

import os
from collections.abc import Callable


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of `pid`'s sockets (empty when it is gone)."""
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)  # the column names
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def from_process(*pids: int) -> Callable[[int], bool]:
    """For `FaultProxy.set_mode(only=)`: whether a dialer's source port is one of `pids`'. Asked
    once per connection (when the fault starts, and for each new one during it)."""
    return lambda port: any(port in local_ports(pid) for pid in pids)
