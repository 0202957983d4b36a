"""Issue 36, item 12: `Transaction.data()` in the apply path fetches the data of the batch's later
transactions in range requests (Transaction Data Range, `0x36`), against a real server and three
storage nodes; the round trips per 1,000 applied transactions are counted by the client
(`stats.data_requests`) with and without the prefetch; bad range requests are answered (or, when
malformed, close only their own connection)."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.client_app import MemoryApp
from support.daemons import PARTITIONS, setup, start_server, wait_served  # noqa: F401  (fixture)
from support.processes import stop
from support.raw_client import RawConnection
from waltz import client_protocol as cp
from waltz._native import encode_frame
from waltz.client import ClientConfig, WaltzClient
from waltz.cluster.metadata import ClusterMetadata

N = 1000


@pytest.fixture
def served(setup, tmp_path: pathlib.Path) -> Iterator[tuple[ClusterMetadata, str, Callable[[], None]]]:  # noqa: F811
    """(metadata, url, restart): `restart()` replaces the server by a new one, whose partitions
    hold no transaction data in memory (it is read from the storage nodes)."""
    meta, _, url = setup
    servers = [start_server(tmp_path, url, "s0")]

    def restart() -> None:
        stop(servers[-1])
        servers.append(start_server(tmp_path, url, f"s{len(servers)}"))
        for p in range(PARTITIONS):
            wait_served(meta, p)

    try:
        for p in range(PARTITIONS):
            wait_served(meta, p)
        yield meta, url, restart
    finally:
        stop(servers[-1])


def config(url: str, **kw: Any) -> ClientConfig:
    return ClientConfig(metadata=url, cluster="e2e", **kw)


def payload(i: int) -> bytes:
    return f'{{"i": {i}, "pad": "{"x" * (i % 300)}"}}'.encode()


def apply_all(url: str, **kw: Any) -> tuple[MemoryApp, int]:
    """A new client applies partition 0 from the start, reading every transaction's data: the
    app, and the data round trips it took."""
    app = MemoryApp()
    with WaltzClient(app, config(url, partitions=(0,), **kw)) as c:
        deadline = time.monotonic() + 60
        while app.marks[0] < N - 1:
            assert time.monotonic() < deadline, f"applied {app.marks[0]} of {N}"
            time.sleep(0.02)
        requests = c.stats.data_requests
    assert not app.errors, app.errors
    return app, requests


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_applying_a_thousand_transactions_takes_a_round_trip_per_range_not_per_transaction(served) -> None:
    _, url, restart = served
    with WaltzClient(MemoryApp(fetch_data=False), config(url)) as writer:
        for i in range(N):
            writer.append(0, payload(i))
    restart()  # the ranges come from the storage nodes, not the old server's memory
    expected = [(i, {"i": i, "pad": "x" * (i % 300)}) for i in range(N)]

    alone, before = apply_all(url, data_prefetch_bytes=0)
    assert alone.applied[0] == expected
    assert before == N  # one round trip per transaction, the cost issue 36 named

    prefetched, after = apply_all(url)
    assert prefetched.applied[0] == expected
    # The feed hands the apply loop its backlog in a few batches; each costs one range (4 MiB is
    # far above these 1,000 transactions' ~160 KB).
    assert 1 <= after <= 10, after

    small, ranges = apply_all(url, data_prefetch_bytes=16 << 10)  # 16 KiB ranges: ~10 of them
    assert small.applied[0] == expected
    assert 10 <= ranges <= 30, ranges
    print(f"data round trips per {N} applied transactions: {before} without prefetch, {after} with it")


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_bad_range_requests_are_answered_and_malformed_ones_close_only_their_connection(served) -> None:
    meta, url, _ = served
    with WaltzClient(MemoryApp(fetch_data=False), config(url)) as writer:
        for i in range(5):
            writer.append(0, payload(i))
    endpoint = meta.partition_server(0)[0].endpoint
    conn, bystander = RawConnection(endpoint), RawConnection(endpoint)
    try:
        refused = {
            (-1, 10, 1000): "first transaction id -1 is negative",
            (0, 0, 1000): "max count 0 is outside 1..10000",
            (0, cp.MAX_DATA_RANGE_COUNT + 1, 1000): "max count 10001 is outside 1..10000",
            (0, 10, 0): "max bytes 0 is outside 1..16777216",
            (0, 10, cp.MAX_DATA_RANGE_BYTES + 1): "max bytes 16777217 is outside 1..16777216",
        }
        for seq, ((first, count, size), why) in enumerate(refused.items()):
            conn.send(cp.TransactionDataRangeRequest(seq, 0, first, count, size))
            answer = conn.next()
            assert isinstance(answer, cp.Failure) and answer.kind == cp.FailureKind.BAD_REQUEST, answer
            assert answer.seq == seq and answer.message == f"transaction data range: {why}"
        conn.send(cp.TransactionDataRangeRequest(50, 0, 5, 10, 1000))  # past the high-water mark
        beyond = conn.next()
        assert isinstance(beyond, cp.Failure) and beyond.kind == cp.FailureKind.NOT_COMMITTED, beyond
        assert "no committed transaction 5" in beyond.message

        # The same connection goes on: bounded by count, then by bytes (the first always sent).
        conn.send(cp.TransactionDataRangeRequest(60, 0, 1, 10, 1 << 20))
        assert conn.next() == cp.TransactionDataRangeResponse(60, 0, 1, tuple(payload(i) for i in range(1, 5)))
        conn.send(cp.TransactionDataRangeRequest(61, 0, 1, 10, len(payload(1)) + len(payload(2))))
        assert conn.next() == cp.TransactionDataRangeResponse(61, 0, 1, (payload(1), payload(2)))
        conn.send(cp.TransactionDataRangeRequest(62, 0, 3, 10, 1))
        assert conn.next() == cp.TransactionDataRangeResponse(62, 0, 3, (payload(3),))

        # A malformed range request (its payload two bytes short) closes its own connection only.
        good = cp.TransactionDataRangeRequest(63, 0, 0, 1, 100).payload()
        conn.send_raw(encode_frame(cp.MAGIC, cp.TransactionDataRangeRequest.TYPE, good[:-2]))
        assert conn.closed_by_server()
        bystander.send(cp.TransactionDataRangeRequest(1, 0, 0, 2, 1 << 20))
        assert bystander.next() == cp.TransactionDataRangeResponse(1, 0, 0, (payload(0), payload(1)))
    finally:
        conn.close()
        bystander.close()
