"""The bank workload (`waltz torture --workload bank`): every client process is one instance of
the same service; they share one SQLite database (`bank.db` in the run's directory) through
`waltz.client.sql.SqlCallbacks`, which applies each committed transaction exactly once among them.

A transfer moves money between two accounts of one partition under write locks on both. Its
execution reads both balances from the database and moves at most what the source holds, and its
bytes (payload "x") carry `{"from", "to", "amount", "seen": [from's balance, to's balance]}`. The
database applies the logged amount as it is: if the locks let a stale read through, a balance goes
negative or a replay disagrees, which is what the checker looks for.

The checker (`check_bank`) replays the committed log in id order from the opening balances and
compares with the database at the end: the total conserved, no balance ever negative (replayed
after each transfer, and in the database), each transfer saw the balances the replay had just
before it, each committed transfer applied exactly once and nothing else applied.
"""

from __future__ import annotations

import pathlib
import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from waltz.client.sql import SqlCallbacks
from waltz.client.transaction import Transaction
from waltz.torture.drain import Record, record_from_bytes
from waltz.torture.feed import FeedRecorder
from waltz.torture.op import Op
from waltz.torture.report import Anomaly
from waltz.torture.workload import Workload

STREAM = "bank"
ACCOUNT_LOCK = "acct"
_meta = sa.MetaData()
accounts = sa.Table(
    "bank_accounts",
    _meta,
    sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("account", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.BigInteger, nullable=False),
)
# No unique key on purpose: a transfer applied twice must show up as two rows, not as an error.
applied = sa.Table(
    "bank_applied",
    _meta,
    sa.Column("partition_id", sa.Integer, nullable=False),
    sa.Column("txid", sa.BigInteger, nullable=False),
    sa.Column("payload", sa.String(40), nullable=False),
    sa.Column("instance", sa.Integer, nullable=False),
)


def database(directory: pathlib.Path) -> sa.Engine:
    # Several processes share the file: WAL lets readers run beside the one writer, and a writer
    # waits (up to 60 s) for the lock instead of failing at once.
    engine = sa.create_engine(
        f"sqlite:///{directory / 'bank.db'}", connect_args={"timeout": 60, "check_same_thread": False}
    )
    return engine


def create_bank(directory: pathlib.Path, partitions: int, n_accounts: int, balance: int) -> None:
    engine = database(directory)
    with engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    _meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(
            accounts.insert(),
            [
                {"partition_id": p, "account": a, "balance": balance}
                for p in range(partitions)
                for a in range(n_accounts)
            ],
        )
    sql = SqlCallbacks(engine, lambda conn, txn: None, stream=STREAM)
    for p in range(partitions):
        sql.get_client_high_water_mark(p)  # the rows the instances' conditional updates move
    engine.dispose()


def _balances(conn: sa.Connection, partition: int, ids: Sequence[int]) -> list[int]:
    rows = dict(
        conn.execute(
            sa.select(accounts.c.account, accounts.c.balance).where(
                accounts.c.partition_id == partition, accounts.c.account.in_(ids)
            )
        ).all()
    )
    return [int(rows[i]) for i in ids]


class Transfer(Op):
    lock = ACCOUNT_LOCK

    def __init__(self, engine: sa.Engine, source: int, target: int, want: int, *args: Any) -> None:
        super().__init__(*args)
        self.engine, self.source, self.target, self.want = engine, source, target, want

    def extra(self, client_high_water_mark: int) -> Any:
        # The database may be ahead of this client's mark (another instance applied more): the
        # write locks are checked against the mark, so what is read must only be at least that new.
        with self.engine.connect() as conn:
            seen = _balances(conn, self.partition, [self.source, self.target])
        return {"from": self.source, "to": self.target, "amount": min(self.want, seen[0]), "seen": seen}


class BankFeed(FeedRecorder):
    """The worker's feed: the database first (exactly once among the instances), then the
    torture's own record of the read (so a failed apply, retried by the client, records nothing)."""

    def __init__(self, sql: SqlCallbacks, on_record: Callable[[int, Record], None]) -> None:
        super().__init__(on_record)
        self.sql = sql

    def apply_transaction(self, transaction: Transaction) -> None:
        self.sql.apply_transaction(transaction)
        super().apply_transaction(transaction)


class BankWorkload(Workload):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.engine = database(self.directory)

    def _apply(self, conn: sa.Connection, txn: Transaction) -> None:
        record = record_from_bytes(txn.transaction_id, txn.data(), txn.header)
        x = record.extra
        if not isinstance(x, dict):
            return  # not a transfer (the plain checker reports foreign bytes)
        p = txn.partition
        for account, delta in ((x["from"], -x["amount"]), (x["to"], x["amount"])):
            conn.execute(
                accounts.update()
                .where(accounts.c.partition_id == p, accounts.c.account == account)
                .values(balance=accounts.c.balance + delta)
            )
        conn.execute(
            applied.insert().values(
                partition_id=p, txid=txn.transaction_id, payload=record.payload, instance=self.index
            )
        )

    def feed(self, on_record: Callable[[int, Record], None]) -> FeedRecorder:
        return BankFeed(SqlCallbacks(self.engine, self._apply, stream=STREAM), on_record)

    def op(self, rng: random.Random, payload: str, partition: int, on_applied: Callable[[Any], None]) -> Any:
        source, target = rng.sample(range(self.settings.accounts), 2)
        locks = {"w": sorted((source, target)), "r": [], "a": []}
        want = rng.randint(1, self.settings.balance // 2)
        return Transfer(
            self.engine, source, target, want, payload, partition, locks, 64, self.spec["op_timeout"], on_applied
        )


BankState = dict[str, Any]
"""`{"balances": {(partition, account): balance}, "applied": [(partition, txid, payload)],
"marks": {partition: mark}}`"""


def read_bank(directory: pathlib.Path) -> BankState:
    engine = database(directory)
    try:
        with engine.connect() as conn:
            balances = {(int(p), int(a)): int(b) for p, a, b in conn.execute(sa.select(accounts)).all()}
            rows = [(int(p), int(t), str(x)) for p, t, x, _ in conn.execute(sa.select(applied)).all()]
        sql = SqlCallbacks(engine, lambda conn, txn: None, stream=STREAM)
        marks = {p: sql.get_client_high_water_mark(p) for p in sorted({p for p, _ in balances})}
    finally:
        engine.dispose()
    return {"balances": balances, "applied": rows, "marks": marks}


def check_bank(log: Mapping[int, Sequence[Record]], db: BankState, n_accounts: int, opening: int) -> list[Anomaly]:
    """The bank's invariants: `log` is the committed log per partition, `db` the database at the end."""
    out: list[Anomaly] = []
    balances: Mapping[tuple[int, int], int] = db["balances"]
    applied_at: dict[tuple[int, str], list[int]] = defaultdict(list)
    for p, txid, payload in db["applied"]:
        applied_at[(p, payload)].append(txid)
    partitions = sorted(set(log) | {p for p, _ in balances})
    for p in partitions:
        db_here = {a: b for (q, a), b in balances.items() if q == p}
        total = sum(db_here.values())
        if total != opening * n_accounts or len(db_here) != n_accounts:
            out.append(
                Anomaly("bank-total", p, f"the accounts hold {total} in all, not the {opening * n_accounts} opened")
            )
        for a, b in sorted(db_here.items()):
            if b < 0:
                out.append(Anomaly("bank-negative", p, f"account {a} holds {b} in the database at the end"))
        replay = dict.fromkeys(range(n_accounts), opening)
        in_log: set[str] = set()
        last = -1
        for r in log.get(p, ()):
            last = max(last, r.txid)
            x = r.extra
            if r.payload is None or not isinstance(x, dict):
                continue  # foreign or damaged bytes: the plain checker reports them
            in_log.add(r.payload)
            seen = [replay.get(x["from"]), replay.get(x["to"])]
            if seen != x["seen"]:
                out.append(
                    Anomaly(
                        "bank-stale-read",
                        p,
                        f"transfer {r.payload} (txid {r.txid}, client hwm {r.client_hwm}) saw balances {x['seen']} of "
                        f"accounts {x['from']},{x['to']}; the log had {seen} just before it",
                        records=(("cluster", r),),
                    )
                )
            replay[x["from"]] = replay.get(x["from"], 0) - x["amount"]
            replay[x["to"]] = replay.get(x["to"], 0) + x["amount"]
            if replay[x["from"]] < 0:
                out.append(
                    Anomaly(
                        "bank-negative",
                        p,
                        f"replaying the log, account {x['from']} holds {replay[x['from']]} after transfer {r.payload} "
                        f"(txid {r.txid}) of {x['amount']}",
                        records=(("cluster", r),),
                    )
                )
            ids = applied_at.get((p, r.payload), [])
            if len(ids) > 1:
                out.append(
                    Anomaly(
                        "bank-applied-twice",
                        p,
                        f"transfer {r.payload} (txid {r.txid}) was applied {len(ids)} times (at {sorted(ids)})",
                        records=(("cluster", r),),
                    )
                )
            elif ids != [r.txid]:
                out.append(
                    Anomaly(
                        "bank-not-applied",
                        p,
                        f"committed transfer {r.payload} (txid {r.txid}) was "
                        + (f"applied as txid {ids[0]}" if ids else "never applied to the database"),
                        records=(("cluster", r),),
                    )
                )
        for (q, payload), ids in sorted(applied_at.items()):
            if q == p and payload not in in_log:
                out.append(
                    Anomaly(
                        "bank-phantom-apply", p, f"the database applied {payload} (at {ids}), which is not in the log"
                    )
                )
        mark = db["marks"].get(p, -1)
        if mark != last:
            out.append(
                Anomaly("bank-not-applied", p, f"the database's high-water mark is {mark}, the log ends at {last}")
            )
        if replay != db_here and len(db_here) == n_accounts:
            diff = {
                a: (replay.get(a), db_here.get(a))
                for a in sorted(set(replay) | set(db_here))
                if replay.get(a) != db_here.get(a)
            }
            out.append(
                Anomaly("bank-balance-mismatch", p, f"account: (replayed from the log, in the database): {diff}")
            )
    return out
