"""A cluster member process for tests: a ServerMembership whose "server" only records, as JSON
lines in a shared file, the set of partitions it serves each time that set changes. It runs
until SIGTERM (a clean leave) or SIGKILL (a crash).

With PORT 0 it listens on a free port and registers that one (so `cluster verify` can reach it).

usage: cluster_member.py METADATA_URL ROOT PORT LOG [PREFERRED,...]"""

import json
import os
import signal
import socket
import sys
import threading
import time

from waltz.cluster import open_store
from waltz.cluster.manager import ServerMembership
from waltz.cluster.metadata import ClusterMetadata

url, root, port, log_path = sys.argv[1:5]
preferred = tuple(int(p) for p in sys.argv[5].split(",")) if len(sys.argv) > 5 and sys.argv[5] else ()
store = open_store(url, session_timeout=2.0)
store.start()
metadata = ClusterMetadata(store, root)
fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
member: ServerMembership | None = None


def deliver(partitions: dict[int, int]) -> None:
    # Logged when the change is complete: stops are logged after stopping, starts after starting.
    line = {
        "t": time.monotonic(),
        "pid": os.getpid(),
        "server": member.server_id if member else None,
        "serving": {str(k): v for k, v in partitions.items()},
    }
    os.write(fd, (json.dumps(line) + "\n").encode())


listener = None
if int(port) == 0:
    listener = socket.create_server(("127.0.0.1", 0))
    port = str(listener.getsockname()[1])
member = ServerMembership(metadata, "127.0.0.1", int(port), deliver, preferred=preferred)
member.start()
print(member.server_id, flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
done.wait()
member.close()
store.close()
