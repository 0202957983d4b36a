"""The demo's application: a bank ledger. Accounts live in partitions (account `a` in partition
`a % partitions`); a transfer moves money between two accounts of one partition, taking write
locks on both, so two transfers that touch the same account after the state they read conflict
and the loser is re-executed on newer balances. Every client applies the committed log to its
own SQLite database, exactly once (`waltz.client.sql`)."""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable, Iterable
from typing import Any

from waltz._extras import require

require("sqlalchemy", "demo", "The demo")

import sqlalchemy as sa

from waltz.client import JSON, PartitionLocalLock, Transaction, TransactionBuilder, TransactionContext

ACCOUNTS_PER_PARTITION = 16
INITIAL_BALANCE = 1_000

_schema = sa.MetaData()
accounts = sa.Table(
    "accounts",
    _schema,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.BigInteger, nullable=False),
)
transfers = sa.Table(
    "transfers",
    _schema,
    sa.Column("transfer", sa.String(64), primary_key=True),
    sa.Column("partition_id", sa.Integer, nullable=False),
    sa.Column("transaction_id", sa.BigInteger, nullable=False),
)


def account_ids(partitions: int) -> list[int]:
    return list(range(partitions * ACCOUNTS_PER_PARTITION))


def open_ledger(url: str, partitions: int) -> sa.Engine:
    """The client's database, created with every account at its initial balance."""
    engine = sa.create_engine(url)
    if engine.dialect.name == "sqlite":
        # Transfers read balances while the feed applies: WAL lets readers run beside the writer.
        sa.event.listen(engine, "connect", lambda dbapi, _record: dbapi.execute("PRAGMA journal_mode=WAL"))
    _schema.create_all(engine)
    with engine.begin() as conn:
        if conn.execute(sa.select(sa.func.count()).select_from(accounts)).scalar() == 0:
            conn.execute(accounts.insert(), [{"id": a, "balance": INITIAL_BALANCE} for a in account_ids(partitions)])
    return engine


def apply_transfer(conn: sa.Connection, txn: Transaction) -> None:
    t = txn.data(JSON)
    conn.execute(accounts.update().where(accounts.c.id == t["from"]).values(balance=accounts.c.balance - t["amount"]))
    conn.execute(accounts.update().where(accounts.c.id == t["to"]).values(balance=accounts.c.balance + t["amount"]))
    conn.execute(
        transfers.insert().values(transfer=t["id"], partition_id=txn.partition, transaction_id=txn.transaction_id)
    )


class Stats:
    """What the contexts of one client saw, shared across its callback threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"executions": 0, "lock_failures": 0, "committed": 0, "declined": 0, "expired": 0, "errors": 0}

    def add(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1


class Transfer(TransactionContext):
    """Moves a random amount (at most the source's balance, as this client's database shows it)
    from one account to another of the same partition."""

    def __init__(
        self,
        transfer: str,
        partition: int,
        source: int,
        target: int,
        engine: sa.Engine,
        stats: Stats,
        completed: Callable[[str, bool], None],
    ) -> None:
        super().__init__()
        self.transfer, self.partition, self.source, self.target = transfer, partition, source, target
        self.engine, self.stats, self.completed = engine, stats, completed
        self.rng = random.Random(transfer)

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    def execute(self, builder: TransactionBuilder) -> bool:
        self.stats.add("executions")
        with self.engine.connect() as conn:
            balance = conn.execute(sa.select(accounts.c.balance).where(accounts.c.id == self.source)).scalar_one()
        if balance <= 0:
            return False
        amount = self.rng.randint(1, min(balance, 200))
        # `seen` lets the verification tell a transfer computed on a stale balance: with the
        # locks working, it is the source's balance where the transfer lands in the log.
        builder.set_data(
            {"id": self.transfer, "from": self.source, "to": self.target, "amount": amount, "seen": balance}, JSON
        )
        builder.add_write_locks(PartitionLocalLock("account", self.source), PartitionLocalLock("account", self.target))
        return True

    def on_completion(self, result: bool) -> None:
        self.stats.add("committed" if result else "declined")
        self.completed(self.transfer, result)

    def on_lock_failure(self, transaction_id: int) -> None:
        self.stats.add("lock_failures")

    def on_exception(self, exc: BaseException) -> None:
        self.stats.add("errors")

    def on_expiration(self) -> None:
        self.stats.add("expired")


def random_transfer(rng: random.Random, partitions: int) -> tuple[int, int, int]:
    """(partition, source, target): two distinct accounts of one partition."""
    p = rng.randrange(partitions)
    source, target = rng.sample(range(ACCOUNTS_PER_PARTITION), 2)
    return p, source * partitions + p, target * partitions + p


def ledger_summary(engine: sa.Engine) -> dict[str, Any]:
    """Total balance, negative balances, transfers applied and a digest of every balance."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(accounts.c.id, accounts.c.balance).order_by(accounts.c.id)).all()
        applied = conn.execute(sa.select(sa.func.count()).select_from(transfers)).scalar_one()
    return {
        "total": sum(b for _, b in rows),
        "negative": sum(1 for _, b in rows if b < 0),
        "applied": applied,
        "digest": balances_digest((a, b) for a, b in rows),
    }


def balances_digest(balances: Iterable[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    for account, balance in sorted(balances):
        h.update(f"{account}:{balance};".encode())
    return h.hexdigest()[:16]
