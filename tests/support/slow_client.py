"""A Waltz application that falls far behind (`test_retention_processes.py`): it mounts partition 0
of cluster "e2e" from the start and prints `{"mounted": mark}`; the test then stops it (SIGSTOP)
while retention deletes past where its feed stands. Its socket's receive buffer is 4 KiB (a
client on a slow link), so what holds its unread feed is the server's send buffer (the kernel
grows it to `net.ipv4.tcp_wmem`'s maximum, 4 MiB here: some 100,000 feed entries). Once
continued, it prints its status every 0.2 s, and what refused it: `{"error": ...}`.

    python slow_client.py METADATA_URL
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time

from waltz.client import (
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)


class SmallReceiveBuffer(socket.socket):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.type == socket.SOCK_STREAM:
            self.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)


class App(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.mark = -1

    def get_client_high_water_mark(self, partition: int) -> int:
        return self.mark

    def apply_transaction(self, transaction: Transaction) -> None:
        self.mark = transaction.transaction_id


class Probe(TransactionContext):
    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data(b"probe")
        return True


def main() -> None:
    socket.socket = SmallReceiveBuffer  # type: ignore[misc]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    app = App()
    config = ClientConfig(
        metadata=sys.argv[1], cluster="e2e", partitions=(0,), event_loop="asyncio", mount_timeout=10.0
    )
    with WaltzClient(app, config) as client:
        print(json.dumps({"mounted": app.mark}), flush=True)
        while True:
            time.sleep(0.2)
            st = client.status()[0]
            print(json.dumps({"status": st, "applied": app.mark}), flush=True)
            if st["mounted"]:
                continue
            try:
                client.submit(Probe()).result(timeout=30)
            except Exception as e:  # noqa: BLE001 - reported to the test as it is
                report = {k: getattr(e, k, None) for k in ("partition", "high_water_mark", "first_id")}
                print(json.dumps({"error": type(e).__name__, "message": str(e), "applied": app.mark, **report}))
                return


if __name__ == "__main__":
    main()
