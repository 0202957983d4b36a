"""Retention with real processes: three storage node daemons with small segments, a server
daemon, the policy and holds set with `waltz retention`, transactions appended while segments
are deleted (issue 35)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support import script
from support.client_app import MemoryApp, Write
from support.daemons import Cli, Node, nodes_cluster, start_server, wait_served
from support.processes import get, start, stop, wait_http
from test_server_daemon import mounted
from waltz import client_protocol as cp
from waltz import errors
from waltz.client import ClientConfig, Transaction, WaltzClient, WaltzClientCallbacks
from waltz.cluster.metadata import ClusterMetadata

SEGMENT = 8192
PAYLOAD = b"r" * 200


@pytest.fixture
def small_segments(metadata_url: str, tmp_path: pathlib.Path) -> Iterator[tuple[ClusterMetadata, list[Node], str]]:
    """The `setup` cluster with 8 KiB segments and a retention pass every 0.2 s."""
    yield from nodes_cluster(
        metadata_url, tmp_path, storage_keys={"segment_size": SEGMENT}, node_keys={"retention_interval": 0.2}
    )


def status(node: Node, partition: int = 0) -> dict[str, Any]:
    async def ask(c: Any) -> list[dict[str, Any]]:
        return await c.status()

    return next(s for s in node.admin(ask) if s["partition"] == partition)


def settled_first(nodes: list[Node]) -> int:
    """The lowest first id of the replicas once retention has stopped moving it (it runs every
    0.2 s after each new low-water mark)."""
    last = None
    while True:
        now = min(status(n)["first_transaction_id"] for n in nodes)
        if now == last:
            return now
        last = now
        time.sleep(1.0)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


async def append_many(
    endpoint: str, first_seq: int, count: int, hwm: int, connection_seq: int, batch_size: int = 20
) -> int:
    """Appends `count` transactions to partition 0 in batches; returns the last committed id."""
    c, resp, _ = await mounted(endpoint, hwm, connection_seq)
    gen, last = resp.generation, resp.high_water_mark
    for batch in range(0, count, batch_size):
        n = min(batch_size, count - batch)
        for i in range(n):
            c.send(cp.Append((42, gen, 0, first_seq + batch + i), last, 0, PAYLOAD))
        target = last + n
        await c.until(lambda m: isinstance(m, cp.FeedData) and m.entries[-1].transaction_id >= target)
        last = target
    c.close()
    return last


def stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def read_all(node: Node, first: int, last: int) -> list[tuple[int, bytes]]:
    async def read(c: Any) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        nxt = first
        while nxt <= last:
            rs = await c.records(0, nxt, 1000)
            out += [(r.txid, bytes(r.data)) for r in rs if r.txid <= last]
            nxt = rs[-1].txid + 1
        return out

    return node.admin(read)


class Behind(WaltzClientCallbacks):
    def get_client_high_water_mark(self, partition: int) -> int:
        return 5

    def apply_transaction(self, transaction: Transaction) -> None:
        raise AssertionError(f"nothing can be applied after a gap: {transaction}")


def readers_behind_retention(endpoint: str, url: str, first: int) -> None:
    """A mount below the log's start is refused with the range, within the mount timeout; the
    feed and transaction data requests name the range that is gone."""
    started = time.monotonic()
    config = ClientConfig(metadata=url, cluster="e2e", partitions=(0,), mount_timeout=10.0)
    with pytest.raises(errors.ClientBehindRetentionError) as refused:
        with WaltzClient(Behind(), config):
            pass
    assert time.monotonic() - started < 10.0
    e = refused.value
    assert (e.partition, e.high_water_mark, e.first_id) == (0, 5, first), e
    assert f"deleted transactions 6..{first - 1}" in str(e)

    async def ask() -> list[cp.Message]:
        c, _, _ = await mounted(endpoint, 499, 10)
        c.send(cp.TransactionDataRequest(7, 0, 3))
        got = await c.until(lambda m: isinstance(m, cp.Failure) and m.seq == 7)
        c.send(cp.FeedRequest(8, 0, 10, 5))
        got += await c.until(lambda m: isinstance(m, cp.Failure) and m.seq == 8)
        c.close()
        return [m for m in got if isinstance(m, cp.Failure)]

    data, feed = asyncio.run(ask())
    for f, gone in ((data, 3), (feed, 11)):
        assert f.kind == cp.FailureKind.TRANSACTIONS_DELETED, f
        assert f"transactions {gone}..{first - 1} were deleted by retention" in f.message, f
        assert errors.log_start_in(f.message) == first


def test_policy_deletes_under_load_below_the_low_water_mark_and_respects_holds(
    small_segments, tmp_path: pathlib.Path
) -> None:
    meta, nodes, url = small_segments
    cli = Cli(url)
    e2e = ("--cluster", "e2e")
    # Bad input is refused with one line.
    assert "bad duration" in cli(*e2e, "retention", "set", "--max-age", "7 parsecs", ok=False).output
    assert "bad size" in cli(*e2e, "retention", "set", "--max-bytes", "-3", ok=False).output
    assert "does not exist" in cli(*e2e, "retention", "hold", "x", "--partition", "99", "--id", "1", ok=False).output
    assert "no hold named" in cli(*e2e, "retention", "release", "nobody", ok=False).output
    # Nothing is deleted by default.
    shown = cli.json(*e2e, "retention", "show")
    assert shown["default"] == {"max_age_ms": None, "max_bytes": None, "min_kept": 0}
    server = start_server(tmp_path, url, "s1", sections={"partition": {"checkpoint_interval": 50}})
    try:
        endpoint, _ = wait_served(meta, 0)
        cli(*e2e, "retention", "hold", "spark", "--partition", "0", "--id", "150")
        cli(*e2e, "retention", "set", "--max-bytes", "16KiB", "--min-kept", "20")
        cli(*e2e, "retention", "set", "--partition", "1", "--max-bytes", "none")
        shown = cli.json(*e2e, "retention", "show", "--no-replicas")
        assert shown["default"]["max_bytes"] == 16384 and shown["partitions"]["1"]["max_bytes"] is None
        assert [(h["name"], h["txid"], h["active"]) for h in shown["holds"]] == [("spark", 150, True)]
        # Under load: segments go while appends keep committing.
        last = asyncio.run(append_many(endpoint, 0, 400, -1, 1))
        assert last == 399
        wait_for("every replica to delete", lambda: all(status(n)["first_transaction_id"] > 0 for n in nodes))
        for n in nodes:
            st = status(n)
            # never above the hold, never within min_kept of the replica's own low-water mark
            assert 0 < st["first_transaction_id"] <= 150, st
            assert st["first_transaction_id"] <= st["local_low_water_mark"] + 1 - 20, st
            assert st["reclaimed_bytes"] > 0 and st["retention_limit"] == min(150, st["local_low_water_mark"] + 1 - 20)
            # what is left is the whole committed log from the first id on, intact
            got = read_all(n, st["first_transaction_id"], 399)
            assert [t for t, _ in got] == list(range(st["first_transaction_id"], 400))
            assert all(d == PAYLOAD for _, d in got)
        # The hold released, retention moves past it; the floor stays.
        cli(*e2e, "retention", "release", "spark")
        asyncio.run(append_many(endpoint, 400, 100, 399, 2))  # a new checkpoint raises the marks
        wait_for("deletion past the released hold", lambda: all(status(n)["first_transaction_id"] > 150 for n in nodes))
        for n in nodes:
            st = status(n)
            assert st["first_transaction_id"] <= st["local_low_water_mark"] + 1 - 20, st
            assert st["bytes_on_disk"] < 5 * SEGMENT, st
        shown = cli.json(*e2e, "retention", "show")
        rows = [r for r in shown["replicas"] if r.get("partition") == 0]
        assert len(rows) == 3 and all(r["reclaimed_bytes"] > 0 for r in rows), rows
        # A hold below what is already gone is refused, naming where.
        gone = cli(*e2e, "retention", "hold", "late", "--partition", "0", "--id", "3", ok=False).output
        assert "already deleted" in gone
        status_code, metrics = get(nodes[0].ports["http_port"], "/metrics")
        assert status_code == 200
        assert 'waltz_storage_partition_reclaimed_bytes_total{partition="0"}' in metrics
        assert 'waltz_storage_partition_first_transaction_id{partition="0"}' in metrics
        # Partition 1 keeps everything (its override).
        assert all(status(n, 1)["reclaimed_bytes"] == 0 for n in nodes)
        readers_behind_retention(endpoint, url, settled_first(nodes))
    finally:
        stop_server(server)


def test_a_replica_down_past_the_retained_range_restarts_at_the_first_id_the_others_hold(
    small_segments, tmp_path: pathlib.Path
) -> None:
    meta, nodes, url = small_segments
    cli = Cli(url)
    server = start_server(tmp_path, url, "s1", sections={"partition": {"checkpoint_interval": 50}})
    try:
        endpoint, _ = wait_served(meta, 0)
        asyncio.run(append_many(endpoint, 0, 100, -1, 1))
        down = nodes[2]
        wait_for("the third replica to hold 0..99", lambda: status(down)["max_transaction_id"] == 99)
        stop(down.proc)
        cli("--cluster", "e2e", "retention", "set", "--max-bytes", "16KiB")
        asyncio.run(append_many(endpoint, 100, 400, 99, 2))  # two of three replicas commit
        wait_for(
            "the others to delete past 100", lambda: all(status(n)["first_transaction_id"] > 100 for n in nodes[:2])
        )
        down.proc = start(down.config)
        wait_http(down.ports["http_port"], down.proc)
        wait_for("the third replica to catch up", lambda: status(down)["max_transaction_id"] == 499)
        st = status(down)
        # It restarted at an id the others held when it came back: nothing of 0..99 is left, and
        # from its first id on it holds exactly the committed log.
        assert st["first_transaction_id"] > 100, st
        got = read_all(down, st["first_transaction_id"], 499)
        assert [t for t, _ in got] == list(range(st["first_transaction_id"], 500))
        assert all(d == PAYLOAD for _, d in got)
        assert "restarting its log at" in (tmp_path / "s1.log").read_text()
        # Back in the write path: the next appends commit on all three.
        asyncio.run(append_many(endpoint, 500, 20, 499, 3))
        wait_for("the third replica to take new appends", lambda: status(down)["max_transaction_id"] == 519)
    finally:
        stop_server(server)


def test_a_hold_waits_for_every_replica_to_confirm_it_or_names_those_that_did_not(
    small_segments, tmp_path: pathlib.Path
) -> None:
    meta, nodes, url = small_segments
    cli = Cli(url)
    e2e = ("--cluster", "e2e")
    # No server yet: no replica has an order to confirm the hold with (it deletes nothing).
    unserved = cli(
        *e2e, "retention", "hold", "early", "--partition", "0", "--id", "0", "--wait", "0.5", ok=False
    ).output
    assert unserved.count("no retention order stands") == 3, unserved
    cli(*e2e, "retention", "release", "early")
    server = start_server(tmp_path, url, "s1")
    try:
        endpoint, _ = wait_served(meta, 0)
        asyncio.run(append_many(endpoint, 0, 40, -1, 1))
        held = cli.json(*e2e, "retention", "hold", "spark", "--partition", "0", "--id", "10")
        assert held["confirmed"] is True and held["txid"] == 10
        # Confirmed means every replica's standing order carries it now.
        assert [status(n)["retention_hold"] for n in nodes] == [10, 10, 10]
        assert (
            "every replica confirmed" in cli(*e2e, "retention", "hold", "etl", "--partition", "0", "--id", "30").output
        )
        assert [status(n)["retention_hold"] for n in nodes] == [10, 10, 10]  # the lowest hold stands
    finally:
        stop_server(server)
    # No server hands out orders now, and the nodes' last ones (holding from 10) stand for their
    # lease: a hold below 10 cannot be confirmed, and the command says where, within --wait.
    started = time.monotonic()
    failed = cli(*e2e, "retention", "hold", "late", "--partition", "0", "--id", "5", "--wait", "1.5", ok=False).output
    assert time.monotonic() - started < 10
    assert "hold late is in the metadata, but partition 0 has not confirmed it within 1.5s" in failed, failed
    for n in nodes:
        assert f"{n.address}: its retention order still holds only from id 10" in failed, failed
    assert [h["name"] for h in cli.json(*e2e, "retention", "show", "--no-replicas")["holds"]] == [
        "etl",
        "late",
        "spark",
    ]
    # --wait 0 writes the hold without asking the replicas.
    assert (
        cli.json(*e2e, "retention", "hold", "quick", "--partition", "0", "--id", "5", "--wait", "0")["confirmed"]
        is False
    )


@pytest.mark.slow
def test_a_mounted_client_that_retention_overtakes_is_told_the_range_and_refused(
    small_segments, tmp_path: pathlib.Path
) -> None:
    """A mounted application stopped (SIGSTOP) while retention deletes past where its feed
    stands: continued, its feed meets the deletion (failure kind 8, naming the range), it mounts
    again from its mark and is refused with ClientBehindRetentionError naming the range. Slow
    (about 70 s): 200,000 transactions, to get past what the server's socket buffers hold of
    the stopped client's feed (tests/support/slow_client.py)."""
    meta, nodes, url = small_segments
    cli = Cli(url)
    server = start_server(tmp_path, url, "s1", sections={"partition": {"checkpoint_interval": 20_000}})
    client = None
    try:
        endpoint, _ = wait_served(meta, 0)
        asyncio.run(append_many(endpoint, 0, 20, -1, 1))
        client = subprocess.Popen(
            [sys.executable, str(script("slow_client.py")), url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None and client.stderr is not None
        assert json.loads(client.stdout.readline()) == {"mounted": 19}
        client.send_signal(signal.SIGSTOP)
        cli("--cluster", "e2e", "retention", "set", "--max-bytes", "16KiB")
        # Through a client of its own: it retries what a store session's handover leaves unknown.
        writer_app = MemoryApp(fetch_data=False, start={0: 19})
        with WaltzClient(writer_app, ClientConfig(metadata=url, cluster="e2e", partitions=(0,))) as writer:
            for chunk in range(0, 200_000, 10_000):
                for f in [writer.submit(Write(str(i))) for i in range(chunk, chunk + 10_000)]:
                    assert f.result(timeout=120) is True
        # Far past what the stopped client's socket buffers can hold of its feed.
        wait_for(
            "every replica to delete past 170,000",
            lambda: all(status(n)["first_transaction_id"] > 170_000 for n in nodes),
        )
        first = settled_first(nodes)
        client.send_signal(signal.SIGCONT)
        try:
            out, err = client.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            client.kill()
            out, err = client.communicate()
            raise AssertionError(f"the client was never refused: {out[-1500:]} {err[-1500:]}") from None
        lines = out.strip().splitlines()
        report = json.loads(lines[-1])
        assert report["error"] == "ClientBehindRetentionError", report
        mark = report["high_water_mark"]
        assert (report["partition"], report["first_id"]) == (0, first) and 19 <= mark < first - 1, report
        assert (
            f"retention deleted transactions {mark + 1}..{first - 1} and the log starts at {first}" in report["message"]
        )
        # Before the refusal: the feed's failure named the range, and the client mounted again.
        assert "were deleted by retention" in err and "mounting again" in err, err[-3000:]
    finally:
        if client is not None and client.poll() is None:
            client.send_signal(signal.SIGCONT)
            client.kill()
            client.wait()
        stop_server(server)
