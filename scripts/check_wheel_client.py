"""What an application gets from the core install (`pip install waltz-log`, no extra): run by
scripts/check_wheel.sh with the wheel's venv, outside the source tree.

Checks that no optional dependency came with the install, that `waltz.__version__` is
Cargo.toml's, that the engine appends, reopens and reads back, and that a client commits
transactions through a local cluster of `waltz-node` processes (embedded metadata) and applies
them in order.

    python check_wheel_client.py VENV EXPECTED_VERSION
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile
import threading
import uuid

import waltz
from waltz.client import JSON, Transaction, TransactionBuilder, TransactionContext, WaltzClient, WaltzClientCallbacks
from waltz.local import LocalCluster
from waltz.storage import ReqId, Storage

OPTIONAL = ("kazoo", "sqlalchemy", "cryptography", "rich", "pyarrow", "pyspark")
TRANSACTIONS = 20


def check_install(venv: str, expected: str) -> pathlib.Path:
    where = pathlib.Path(waltz.__file__).parent
    assert where.is_relative_to(venv), f"waltz imported from {where}, not from the venv"
    assert waltz.__version__ == expected, f"waltz.__version__ {waltz.__version__}, Cargo.toml {expected}"
    extras = [m for m in OPTIONAL if importlib.util.find_spec(m)]
    assert not extras, f"the core install pulled in {extras}"
    return where


def check_engine(directory: pathlib.Path) -> None:
    storage = Storage.create(directory, uuid.uuid4(), partition_count=1)
    storage.add_partition(0)
    log = storage.partition(0)
    log.append(0, [(ReqId(client_id=1, generation=1, partition_id=0, sequence=1), 0, b"debit 10")])
    log.append(1, [(ReqId(client_id=1, generation=1, partition_id=0, sequence=2), 0, b"credit 10")])
    storage.close()
    with Storage.open(directory) as storage:
        data = [r.data for r in storage.partition(0).read_records(0, max_count=10)]
    assert data == [b"debit 10", b"credit 10"], data


class Note(TransactionContext):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def partition_id(self, num_partitions: int) -> int:
        return self.n % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data({"n": self.n}, JSON)
        return True


class Applied(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.marks: dict[int, int] = {}
        self.seen: list[int] = []
        self.all_applied = threading.Event()

    def get_client_high_water_mark(self, partition: int) -> int:
        return self.marks.get(partition, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        p = transaction.partition
        assert transaction.transaction_id == self.marks.get(p, -1) + 1, "applied out of order"
        self.marks[p] = transaction.transaction_id
        self.seen.append(transaction.data(JSON)["n"])
        if len(self.seen) == TRANSACTIONS:
            self.all_applied.set()


def check_client(directory: pathlib.Path) -> None:
    cluster = LocalCluster.create(directory, partitions=2, servers=1)
    cluster.start()
    try:
        app = Applied()
        with WaltzClient(app, cluster.client_config()) as client:
            done = [client.submit(Note(n)) for n in range(TRANSACTIONS)]
            assert all(f.result(timeout=60) for f in done), "a transaction did not commit"
            assert app.all_applied.wait(60), f"applied {len(app.seen)} of {TRANSACTIONS}"
        assert sorted(app.seen) == list(range(TRANSACTIONS)), app.seen
    finally:
        cluster.stop()


def main() -> None:
    venv, expected = sys.argv[1:]
    where = check_install(venv, expected)
    with tempfile.TemporaryDirectory() as d:
        check_engine(pathlib.Path(d) / "engine")
        check_client(pathlib.Path(d) / "cluster")
    print(
        f"check_wheel: waltz {waltz.__version__} from {where} without extras: the engine appends, reopens and "
        f"reads back; a client committed and applied {TRANSACTIONS} transactions through a local cluster"
    )


if __name__ == "__main__":
    main()
