"""`waltz.client.sql`: two application instances, each with its own client and engine, share
one database (SQLite file, or a real PostgreSQL): every committed transaction is applied
exactly once between them, in the same database transaction as its high-water mark; an apply
that fails rolls back and is retried."""

from __future__ import annotations

import collections
import pathlib
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from support.client_app import Write
from support.daemons import PARTITIONS, setup  # noqa: F401  (fixture)
from test_client import config, servers  # noqa: F401  (fixture)
from waltz.client import JSON, Transaction, WaltzClient
from waltz.client.sql import SqlCallbacks

PER_INSTANCE = 100


def database_url(kind: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'app.db'}"
    pg = request.getfixturevalue("postgresql")
    name = f"t_{uuid.uuid4().hex[:12]}"
    with sa.create_engine(pg.url(), isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    return str(pg.url(name))


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_two_instances_sharing_a_database_apply_each_transaction_once(
    servers,
    kind: str,
    tmp_path: pathlib.Path,  # noqa: F811
    request: pytest.FixtureRequest,
) -> None:
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    db = database_url(kind, tmp_path, request)
    meta = sa.MetaData()
    ledger = sa.Table(
        "ledger",
        meta,
        sa.Column("partition_id", sa.Integer),
        sa.Column("txid", sa.BigInteger),
        sa.Column("payload", sa.String(50)),
        sa.Column("instance", sa.String(10)),
    )
    engines = [sa.create_engine(db) for _ in range(2)]
    meta.create_all(engines[0])
    failed_once: set[int] = set()

    def applier(name: str) -> Any:
        def apply(conn: sa.Connection, txn: Transaction) -> None:
            conn.execute(
                ledger.insert().values(
                    partition_id=txn.partition, txid=txn.transaction_id, payload=txn.data(JSON)["id"], instance=name
                )
            )
            if txn.partition == 1 and txn.transaction_id == 3 and not failed_once:
                failed_once.add(txn.transaction_id)
                raise RuntimeError("the database hiccuped")  # rolled back with the mark; retried

        return apply

    callbacks = [SqlCallbacks(engines[i], applier(f"i{i}"), stream="bank") for i in range(2)]
    uncaught: list[tuple[int, int]] = []
    callbacks[0].uncaught_exception = lambda p, t, e: uncaught.append((p, t))  # type: ignore[method-assign]
    callbacks[1].uncaught_exception = lambda p, t, e: uncaught.append((p, t))  # type: ignore[method-assign]
    clients = [WaltzClient(cb, config(url)) for cb in callbacks]
    try:

        def run(i: int) -> None:
            futures = [clients[i].submit(Write(f"i{i}-{n}", partition=n)) for n in range(PER_INSTANCE)]
            assert all(f.result(60) for f in futures)
            clients[i].flush()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        marks = {p: clients[0].high_water_mark(p) for p in range(PARTITIONS)}
        deadline = time.monotonic() + 60
        # The database's mark is shared: it reaching the end says that one instance applied everything,
        # not that the other has seen it all yet; each instance's own count says that.
        while any(cb.get_client_high_water_mark(p) < marks[p] for cb in callbacks for p in range(PARTITIONS)) or any(
            cb.applied + cb.skipped < 2 * PER_INSTANCE for cb in callbacks
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for c in clients:
            c.close()
    with engines[0].connect() as conn:
        rows = conn.execute(sa.select(ledger.c.partition_id, ledger.c.txid, ledger.c.payload)).all()
    assert len(rows) == 2 * PER_INSTANCE
    assert collections.Counter(r.payload for r in rows) == collections.Counter(
        f"i{i}-{n}" for i in range(2) for n in range(PER_INSTANCE)
    )
    for p in range(PARTITIONS):
        assert sorted(r.txid for r in rows if r.partition_id == p) == list(range(marks[p] + 1))
    assert sum(cb.applied for cb in callbacks) == 2 * PER_INSTANCE  # exactly once between them
    assert sum(cb.applied + cb.skipped for cb in callbacks) == 4 * PER_INSTANCE  # each saw every one
    assert (1, 3) in uncaught
    for e in engines:
        e.dispose()


def test_a_gap_between_the_database_and_the_feed_is_an_error(tmp_path: pathlib.Path) -> None:
    """Pure database logic: a transaction that does not follow the stored mark is refused."""
    from waltz import errors

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'g.db'}")
    cb = SqlCallbacks(engine, lambda conn, txn: None, stream="s")
    assert cb.get_client_high_water_mark(0) == -1

    def txn(i: int) -> Transaction:
        return Transaction(0, i, 0, (1, 1, 0, i), None, None)  # type: ignore[arg-type]

    cb.apply_transaction(txn(0))
    cb.apply_transaction(txn(0))  # already applied (by "another instance"): skipped
    assert (cb.applied, cb.skipped, cb.get_client_high_water_mark(0)) == (1, 1, 0)
    with pytest.raises(errors.ApplicationStateError, match="cannot follow"):
        cb.apply_transaction(txn(5))
    assert cb.get_client_high_water_mark(0) == 0
