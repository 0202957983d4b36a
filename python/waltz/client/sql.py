"""Exactly-once application into a SQL database (SQLAlchemy 2).

`SqlCallbacks` keeps the client high-water mark of each partition in a table of the
application's own database and moves it in the same database transaction as the changes a
committed Waltz transaction makes, so a crash never applies a transaction twice or loses one.
Several application instances (each with its own `WaltzClient`) may share the database: each
receives every transaction, and exactly one of them applies it. The step is one conditional
update, `UPDATE ... SET high_water_mark = id WHERE high_water_mark = id - 1`: the instance whose
update matches applies the transaction in that database transaction; the others, blocked on the
row until it commits, then match nothing and skip it.

    def apply(conn: sqlalchemy.Connection, txn: Transaction) -> None:
        conn.execute(ledger.insert().values(...txn.data(JSON)...))

    callbacks = SqlCallbacks(engine, apply, stream="ledger")
    with WaltzClient(callbacks, config) as client: ...

Install with `pip install 'waltz-log[sql]'` (plus a driver such as psycopg for PostgreSQL)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from waltz._extras import require

require("sqlalchemy", "sql", "waltz.client.sql")

import sqlalchemy as sa

from waltz import errors
from waltz.client.callbacks import WaltzClientCallbacks
from waltz.client.transaction import Transaction

log = logging.getLogger("waltz.client.sql")

DEFAULT_TABLE = "waltz_client_high_water_marks"


def high_water_mark_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """The table: one row per (stream, partition). Add it to your own MetaData to manage it
    with your migrations; `SqlCallbacks` creates it if it is missing."""
    return sa.Table(
        name,
        metadata,
        sa.Column("stream", sa.String(200), primary_key=True),
        sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("high_water_mark", sa.BigInteger, nullable=False),
    )


class SqlCallbacks(WaltzClientCallbacks):
    """`apply(conn, transaction)` makes the transaction's changes on `conn`, inside the database
    transaction that also moves the high-water mark (do not commit it yourself). `stream` names
    this application's position, so that several applications can keep theirs in one table."""

    def __init__(
        self,
        engine: sa.Engine,
        apply: Callable[[sa.Connection, Transaction], None],
        *,
        stream: str = "default",
        table: str = DEFAULT_TABLE,
    ) -> None:
        self.engine, self._apply, self.stream = engine, apply, stream
        self.table = high_water_mark_table(sa.MetaData(), table)
        self.applied = 0
        """Transactions this instance applied (the others it skipped: another instance had)."""
        self.skipped = 0
        self.table.create(engine, checkfirst=True)

    def _row(self, partition: int) -> sa.ColumnElement[bool]:
        return sa.and_(self.table.c.stream == self.stream, self.table.c.partition_id == partition)

    def get_client_high_water_mark(self, partition: int) -> int:
        with self.engine.begin() as conn:
            mark = conn.execute(sa.select(self.table.c.high_water_mark).where(self._row(partition))).scalar()
        if mark is not None:
            return int(mark)
        try:
            with self.engine.begin() as conn:
                conn.execute(self.table.insert().values(stream=self.stream, partition_id=partition, high_water_mark=-1))
        except sa.exc.IntegrityError:
            pass  # another instance created the row first
        return self.get_client_high_water_mark(partition)

    def apply_transaction(self, transaction: Transaction) -> None:
        t, txid = self.table, transaction.transaction_id
        with self.engine.begin() as conn:
            moved = conn.execute(
                t.update()
                .where(self._row(transaction.partition), t.c.high_water_mark == txid - 1)
                .values(high_water_mark=txid)
            ).rowcount
            if moved == 1:
                self._apply(conn, transaction)
                self.applied += 1
                return
            mark = conn.execute(sa.select(t.c.high_water_mark).where(self._row(transaction.partition))).scalar()
        if mark is not None and mark >= txid:
            self.skipped += 1  # another instance applied it
            return
        raise errors.ApplicationStateError(
            f"stream {self.stream!r} partition {transaction.partition}: the database's high-water mark is {mark}, "
            f"transaction {txid} cannot follow it (a restored database, or another cluster's log)"
        )
