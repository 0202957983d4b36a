"""The client library against real processes: 3 storage nodes and a server (`waltz-node`),
embedded metadata (one test on ZooKeeper). Sync and async APIs, lock retries, the transaction
monitor settling appends the server dropped, 1,000 transactions through a proxy that keeps
cutting the client's connections, catching up from -1, mount errors."""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import pathlib
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from support.client_app import AsyncMemoryApp, Increment, MemoryApp, Write
from support.daemons import PARTITIONS, Node, setup, wait_served  # noqa: F401  (fixture)
from support.processes import free_port
from support.raw_client import RawConnection
from support.tcp_proxy import Proxy
from waltz import client_protocol as cp
from waltz import errors
from waltz.client import (
    JSON,
    AsyncWaltzClient,
    ClientConfig,
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
)
from waltz.client import sync as sync_module
from waltz.client.partition import ClientPartition
from waltz.cluster.metadata import ClusterMetadata


class Servers:
    """`waltz-node server` processes of the test cluster, optionally behind a proxy each."""

    def __init__(self, tmp_path: pathlib.Path, url: str, meta: ClusterMetadata) -> None:
        self.tmp_path, self.url, self.meta = tmp_path, url, meta
        self.procs: list[subprocess.Popen[str]] = []
        self.proxies: list[Proxy] = []

    def start(self, name: str, *, proxied: bool = False, extra: str = "") -> subprocess.Popen[str]:
        port = free_port()
        advertised = ""
        if proxied:
            proxy = Proxy(port)
            self.proxies.append(proxy)
            advertised = f'advertised_address = "127.0.0.1:{proxy.port}"\n'
        config = self.tmp_path / f"{name}.toml"
        config.write_text(
            f'[server]\nmetadata = "{self.url}"\ncluster = "e2e"\nport = {port}\nhttp_port = 0\nsession_timeout = 2.0\n'
            f'{advertised}{extra}\n[logging]\nlevel = "info"\n'
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "waltz.cli.node", "server", "--config", str(config)],
            stderr=open(self.tmp_path / f"{name}.log", "a"),
            text=True,
        )
        self.procs.append(proc)
        return proc

    def wait_all_served(self) -> None:
        for p in range(PARTITIONS):
            wait_served(self.meta, p)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for proxy in self.proxies:
            proxy.close()


@pytest.fixture
def servers(setup, tmp_path: pathlib.Path) -> Iterator[tuple[Servers, ClusterMetadata, list[Node], str]]:  # noqa: F811
    meta, nodes, url = setup
    s = Servers(tmp_path, url, meta)
    yield s, meta, nodes, url
    s.stop()


def config(url: str, **kw: Any) -> ClientConfig:
    return ClientConfig(metadata=url, cluster="e2e", **kw)


def submit_from_threads(client: WaltzClient, contexts: list[Any], threads: int = 4, pause: float = 0.0) -> list[Any]:
    """Submits the contexts from `threads` threads at once (each a slice); their futures."""
    futures: list[Any] = []

    def submit(chunk: list[Any]) -> None:
        for c in chunk:
            futures.append(client.submit(c))
            time.sleep(pause)

    workers = [threading.Thread(target=submit, args=(contexts[i::threads],)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return futures


def read_log(url: str) -> dict[int, list[tuple[int, Any]]]:
    """Every partition's committed transactions, read by a new client from -1."""
    app = MemoryApp()
    with WaltzClient(app, config(url)) as c:
        for p in range(c.partitions):
            top = c.high_water_mark(p)
            deadline = time.monotonic() + 60
            while app.marks[p] < top:
                assert time.monotonic() < deadline, f"partition {p} applied {app.marks[p]} of {top}"
                time.sleep(0.02)
    assert not app.errors, app.errors
    return app.applied


@pytest.mark.parametrize("metadata_url", ["embedded", "zookeeper"], indirect=True)
def test_sync_client_commits_applies_in_order_and_fetches_data(servers) -> None:
    s, meta, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = MemoryApp()
    with WaltzClient(app, config(url)) as client:
        assert client.partitions == PARTITIONS
        contexts = [Write(f"tx{i}", partition=i, header=i) for i in range(40)]
        futures = [client.submit(ctx) for ctx in contexts]
        assert [f.result(30) for f in futures] == [True] * 40
        client.flush()
        for ctx in contexts:
            assert ctx.events == ["completion:True", "application"], ctx.events
            assert ctx.executions == 1
        for p in range(PARTITIONS):
            ids = [t for t, _ in app.applied[p]]
            assert ids == list(range(10)), ids  # dense, in order, from 0
            assert sorted(d["id"] for _, d in app.applied[p]) == sorted(
                f"tx{i}" for i in range(40) if i % PARTITIONS == p
            )
            assert client.high_water_mark(p) == 9
    assert not app.errors, app.errors
    # A new client catches up from -1 and sees the same log; one resuming from 5 sees the rest.
    assert read_log(url) == app.applied
    later = MemoryApp(start={p: 5 for p in range(PARTITIONS)})
    with WaltzClient(later, config(url, event_loop="asyncio")) as client:  # the standard loop works as well
        deadline = time.monotonic() + 30
        while any(later.marks[p] < 9 for p in range(PARTITIONS)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert {p: later.applied[p] for p in range(PARTITIONS)} == {p: app.applied[p][6:] for p in range(PARTITIONS)}


class AsyncWrite(TransactionContext):
    def __init__(self, n: int, decline: bool = False) -> None:
        super().__init__()
        self.n, self.decline = n, decline
        self.completed: list[bool] = []

    async def execute(self, builder: TransactionBuilder) -> bool:
        await asyncio.sleep(0)
        builder.set_data({"id": f"a{self.n}"}, JSON)
        return not self.decline

    async def on_completion(self, result: bool) -> None:
        self.completed.append(result)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_async_client(servers) -> None:
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()

    async def go() -> None:
        app = AsyncMemoryApp()
        async with AsyncWaltzClient(app, config(url)) as client:
            contexts = [AsyncWrite(i, decline=(i == 3)) for i in range(20)]
            done = [await client.submit(ctx) for ctx in contexts]
            results = await asyncio.gather(*done)
            assert results == [i != 3 for i in range(20)]
            await client.flush()
            assert [c.completed for c in contexts] == [[i != 3] for i in range(20)]
            assert [d["id"] for _, d in app.applied[0]] == [
                f"a{i}" for i in range(20) if i != 3
            ]  # one by one, in order
            assert await client.high_water_mark(0) == 18
            assert await client.transaction_data(0, 2) == JSON.serialize({"id": "a2"})
            with pytest.raises(errors.RequestFailedError, match="no committed transaction") as e:
                await client.transaction_data(0, 1000)
            assert e.value.kind == "not_committed"
        assert not app.errors
        with pytest.raises(errors.ClientClosedError):
            await client.submit(AsyncWrite(99))

    asyncio.run(go())


class FetchWhenTold(MemoryApp):
    """Holds each apply until `go` is set, then fetches the data (from the callback thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.fetching = threading.Event(), threading.Event()
        self.outcomes: list[BaseException | None] = []

    def apply_transaction(self, transaction: Any) -> None:
        self.go.wait(60)
        self.fetching.set()
        try:
            transaction.data(JSON)
            self.outcomes.append(None)
        except BaseException as e:
            self.outcomes.append(e)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_closing_cancels_a_data_fetch_in_flight(servers) -> None:
    """A callback's data fetch, retrying while no server answers, when the client closes: the
    fetch is cancelled on the loop and its caller told the client closed. The loop used to stop
    with the fetch pending; the garbage collector finalized it later and its cleanup ran on the
    closed loop (an unraisable RuntimeError at some unrelated test)."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = FetchWhenTold()
    client = WaltzClient(app, config(url))
    try:
        assert client.submit(Write("t", partition=0)).result(30)
        s.stop()  # the fetch now retries until request_timeout (30 s)
        app.go.set()
        assert app.fetching.wait(30)
        time.sleep(0.3)
    finally:
        client.close()
    assert asyncio.all_tasks(client._loop) == set()  # nothing left for the collector to finalize
    deadline = time.monotonic() + 10
    while not app.outcomes:
        assert time.monotonic() < deadline, "the fetch's caller is still waiting"
        time.sleep(0.02)
    assert isinstance(app.outcomes[0], errors.ClientClosedError), app.outcomes


class KeepsTransactions(MemoryApp):
    """Applies without fetching, keeping each Transaction for a later `data()`."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []

    def apply_transaction(self, transaction: Any) -> None:
        self.kept.append(transaction)
        self.marks[transaction.partition] = transaction.transaction_id


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_work_that_reaches_the_loop_after_the_close_swept_it_is_not_left_pending(servers, monkeypatch, caplog) -> None:
    """Another thread's call can reach the client's loop after `close()` cancelled what was left
    there and before the loop stopped (a callback thread's `Transaction.data()`): its task stayed
    on the stopped loop, never run, and the collector destroyed it later (asyncio: "Task was
    destroyed but it is pending!", once in CI at a Spark test's teardown). Such a task is now
    cancelled and run to its end before the loop closes. The late arrival is made certain here
    by starting it right after the sweep."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    client = WaltzClient(MemoryApp(), config(url))
    sweep = sync_module._cancel_the_rest
    late: list[asyncio.Task[None]] = []

    async def sweep_then_late_work() -> None:
        await sweep()
        late.append(asyncio.ensure_future(asyncio.sleep(3600)))

    monkeypatch.setattr(sync_module, "_cancel_the_rest", sweep_then_late_work)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        client.close()
        gc.collect()
    assert late[0].cancelled()
    assert asyncio.all_tasks(client._loop) == set()
    assert "Task was destroyed but it is pending" not in caplog.text


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_data_of_a_closed_clients_transaction_says_the_client_closed(servers) -> None:
    """`Transaction.data()` after its client closed: ClientClosedError, not the event loop's
    RuntimeError, and no coroutine left never awaited."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = KeepsTransactions()
    with WaltzClient(app, config(url)) as client:
        assert client.submit(Write("t", partition=0)).result(30)
        client.flush()
    (txn,) = app.kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be a RuntimeWarning
        with pytest.raises(errors.ClientClosedError):
            txn.data(JSON)
        gc.collect()


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_closing_settles_every_context_and_wakes_threads_waiting_for_room(servers, caplog) -> None:
    """`max_pending = 1`: a context whose `execute` raised a BaseException (the exception reaches
    the caller, nothing is sent) and a context whose future was cancelled each free their slot,
    with no error on the loop; a context held by its own hook (inside a task the close cancels) fails
    with ClientClosedError, and so does a thread waiting for the partition's slot behind it.
    Before, the held context's future was never resolved (its caller waited for ever) and the
    waiting thread got a bare CancelledError."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    hold = threading.Event()

    class Held(Write):
        def execute(self, builder: TransactionBuilder) -> bool:
            raise KeyError("held")

        async def on_exception(self, exc: BaseException) -> None:
            hold.set()
            await asyncio.Event().wait()  # until the close cancels it

    class Interrupt(BaseException):
        pass

    class Interrupted(Write):
        def execute(self, builder: TransactionBuilder) -> bool:
            raise Interrupt()

    app = MemoryApp()
    client = WaltzClient(app, config(url, max_pending=1))
    try:
        with pytest.raises(Interrupt):
            client.submit(Interrupted("never sent"))
        first = client.submit(Write("cancelled"))
        first.cancel()  # pending: the caller no longer wants it; the append still goes
        assert client.submit(Write("after")).result(30) is True  # the slot was freed
        deadline = time.monotonic() + 30
        while app.marks[0] < 1:
            assert time.monotonic() < deadline, app.marks
            time.sleep(0.02)
        held = client.submit(Held("held"))
        assert hold.wait(30)
        outcome: list[BaseException | bool] = []

        def waiter() -> None:
            try:
                outcome.append(client.submit(Write("waits")).result(30))
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        assert not outcome, "the partition has one slot and the held context has it"
    finally:
        client.close()
    t.join(30)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.ClientClosedError), outcome
    assert not outcome[0].outcome_unknown, "never sent: it certainly did not commit"
    with pytest.raises(errors.ClientClosedError) as closed:
        held.result(10)
    assert not closed.value.outcome_unknown
    assert [d["id"] for _, d in app.applied[0]] == ["cancelled", "after"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


class FailsOnceAndSoDoesItsHandler(MemoryApp):
    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def apply_transaction(self, transaction: Transaction) -> None:
        if transaction.transaction_id == 2 and not self.failed:
            self.failed = True
            raise RuntimeError("the database hiccuped")
        super().apply_transaction(transaction)

    def uncaught_exception(self, partition: int, transaction_id: int, exc: BaseException) -> None:
        raise RuntimeError("and so did the error handler")


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_an_error_handler_that_raises_does_not_stop_applying(servers) -> None:
    """Before, the handler's exception ended the partition's apply task silently: commits still
    resolved, nothing more was applied, and `flush()` waited for ever."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = FailsOnceAndSoDoesItsHandler()
    with WaltzClient(app, config(url)) as client:
        futures = [client.submit(Write(f"tx{i}", partition=0)) for i in range(5)]
        assert [f.result(30) for f in futures] == [True] * 5
        flushed = threading.Event()
        threading.Thread(target=lambda: (client.flush(), flushed.set()), daemon=True).start()
        assert flushed.wait(60), "flush() never returned: applying stopped"  # a liveness bound, not a speed check
        assert app.failed and [t for t, _ in app.applied[0]] == [0, 1, 2, 3, 4]
    assert not app.errors, app.errors


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_client_restarted_with_its_fixed_id_mounts_again(servers) -> None:
    """A server drops mounts from a client's older connections (a lower connection seq). A
    client restarted with the same fixed `client_id` counted its connections from 1 again, so
    its mounts were dropped without an answer until the server restarted."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    for run in range(2):
        app = MemoryApp()
        with WaltzClient(app, config(url, client_id=4242, mount_timeout=10.0)) as client:
            futures = [client.submit(Write(f"run{run}-{i}", partition=i)) for i in range(2 * PARTITIONS)]
            assert [f.result(30) for f in futures] == [True] * (2 * PARTITIONS)
            client.flush()
            if run == 0:
                # Connections lost and made again: the server's newest connection seq rises.
                core = client._core
                for link in list(core._links.values()):
                    core.loop.call_soon_threadsafe(link.close)
                more = [client.submit(Write(f"again-{i}", partition=i)) for i in range(PARTITIONS)]
                assert [f.result(30) for f in more] == [True] * PARTITIONS


class ReqIdApp(MemoryApp):
    """Also records each applied transaction's request id."""

    def __init__(self) -> None:
        super().__init__()
        self.req_ids: dict[int, list[tuple[int, int, int, int]]] = collections.defaultdict(list)

    def apply_transaction(self, transaction: Transaction) -> None:
        super().apply_transaction(transaction)
        with self.lock:
            self.req_ids[transaction.partition].append(tuple(transaction.req_id))


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_the_last_sequence_number_renews_the_partitions_client_id(servers) -> None:
    """A request id carries the append sequence as a signed 32-bit integer. Once a partition has
    used them all, it waits until every append it sent is settled and goes on under a new client
    id from the cluster (request ids stay unique, sequences rise under each id). Before, the
    partition refused every later transaction until the client was closed. Here the last
    sequence's append is dropped on the way (a Flush must settle it before the renewal) while
    contexts on one lock keep failing and retrying across the change."""
    s, _, _, url = servers
    s.start("s1", proxied=True)
    s.wait_all_served()
    proxy = s.proxies[0]
    app = ReqIdApp()
    with WaltzClient(app, config(url, settle_after=0.3)) as client:
        assert client.submit(Write("first", partition=0)).result(30)
        part = client._core._parts[0]
        original = part.client_id
        assert original == client.client_id
        part.seq = 2**31 - 3
        proxy.drop(lambda m: isinstance(m, cp.Append) and m.req_id[3] == 2**31 - 1)
        contexts = [Increment(app, partition=0) for _ in range(30)]
        futures = submit_from_threads(client, contexts)
        assert all(f.result(60) for f in futures)
        assert client.submit(Write("other partitions are untouched", partition=1)).result(30)
        client.flush()
        assert len(proxy.dropped) == 1
        renewed = part.client_id
        assert renewed != original and client._core._parts[1].client_id == original
        # Mounted again under the new id: the server tells this client's stale connections from
        # its newest by the mount's id, so appends under an id never mounted would escape that.
        assert part._mounted_as == renewed
    assert not app.errors, app.errors
    assert app.counters[0] == 30
    ids = app.req_ids[0]
    assert len(set(ids)) == len(ids), "a request id was used twice"
    old = [r for r in ids if r[0] == original]
    assert ids[: len(old)] == old and all(r[0] == renewed for r in ids[len(old) :]) and len(old) < len(ids)
    for under in (old, ids[len(old) :]):
        assert [r[3] for r in under] == sorted({r[3] for r in under}), "sequences must rise under one client id"
    assert old[0][3] == 1 and old[-1][3] <= 2**31 - 1 and ids[len(old)][3] >= 1 and ids[-1][3] < 1000
    # The renewed partition mounts and commits after a reconnect, under its new id.
    assert read_log(url)[0] == app.applied[0]


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_fixed_client_id_is_kept_when_its_sequence_numbers_run_out(servers) -> None:
    """A configured `client_id` is not swapped for one from the cluster's counter (it could be
    another fixed client's): the partition mounts again under it and counts from 1, as after a
    restart."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = ReqIdApp()
    with WaltzClient(app, config(url, client_id=4242)) as client:
        part = client._core._parts[0]
        part.seq = 2**31 - 2
        futures = [client.submit(Write(f"w{i}", partition=0)) for i in range(5)]
        assert [f.result(30) for f in futures] == [True] * 5
        assert (part.client_id, part._mounted_as) == (4242, 4242) and part.seq < 10
        client.flush()
    assert [r[0] for r in app.req_ids[0]] == [4242] * 5
    assert [d["id"] for _, d in app.applied[0]] == sorted(d["id"] for _, d in app.applied[0])


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_closing_with_a_sent_transaction_says_its_outcome_is_unknown(servers) -> None:
    """A transaction sent and not yet seen in the feed may still commit: the error closing the
    client gives it says so in `outcome_unknown`, which tells the application not to submit it
    again on its own (the message alone did before)."""
    import os
    import signal

    s, _, _, url = servers
    server = s.start("s1")
    s.wait_all_served()
    client = WaltzClient(MemoryApp(), config(url))
    try:
        assert client.submit(Write("mounted", partition=0)).result(30)
        os.kill(server.pid, signal.SIGSTOP)  # the append reaches its socket and gets no answer
        sent = client.submit(Write("in flight", partition=0))
        part = client._core._parts[0]
        deadline = time.monotonic() + 30
        while len(part.monitor) == 0:
            assert time.monotonic() < deadline, "the append was never sent"
            time.sleep(0.01)
    finally:
        client.close()
        os.kill(server.pid, signal.SIGCONT)
    with pytest.raises(errors.ClientClosedError) as closed:
        sent.result(10)
    assert closed.value.outcome_unknown and "may still commit" in str(closed.value)


class SlowCompletion(Write):
    started = threading.Event()

    async def on_completion(self, result: bool) -> None:  # type: ignore[override]
        SlowCompletion.started.set()
        await asyncio.Event().wait()  # until the close cancels it


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_closing_while_on_completion_runs_reports_the_commit(servers) -> None:
    """The feed delivered the transaction, and its on_completion hook still ran when the client
    closed: the close told it ClientClosedError (outcome certain: not committed), and an
    application trusting that would submit it again."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    client = WaltzClient(MemoryApp(), config(url))
    try:
        committed = client.submit(SlowCompletion("committed"))
        assert SlowCompletion.started.wait(30)
    finally:
        client.close()
    assert committed.result(10) is True


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_contexts_on_one_lock_all_succeed_by_retrying(servers) -> None:
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = MemoryApp()
    with WaltzClient(app, config(url)) as client:
        contexts = [Increment(app, partition=1) for _ in range(60)]
        futures = submit_from_threads(client, contexts)
        assert all(f.result(60) for f in futures)
        client.flush()
    assert not app.errors, app.errors  # every applied increment saw the state before it
    assert app.counters[1] == 60
    assert sum(c.executions for c in contexts) > 60  # some lost the race and ran again
    assert sum(c.lock_failures for c in contexts) == sum(c.executions for c in contexts) - 60


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_appends_the_server_drops_are_detected_and_retried(servers) -> None:
    s, _, _, url = servers
    s.start("s1", proxied=True)
    s.wait_all_served()
    proxy = s.proxies[0]
    app = MemoryApp()
    with WaltzClient(app, config(url, settle_after=0.3)) as client:
        # 1. The only append in flight vanishes: a Flush settles it, and it is sent again.
        proxy.drop(lambda m: isinstance(m, cp.Append) and m.req_id[3] == 1)
        lone = Write("lone", partition=2)
        assert client.submit(lone).result(30)
        assert lone.executions == 2 and len(proxy.dropped) == 1
        # 2. An append vanishes and a later one commits first: the feed shows the first failed.
        proxy.drop(lambda m: isinstance(m, cp.Append) and m.req_id[2] == 3 and m.req_id[3] == 1)
        first, second = Write("first", partition=3), Write("second", partition=3)
        f1, f2 = client.submit(first), client.submit(second)
        assert f1.result(30) and f2.result(30)
        assert first.executions == 2 and second.executions == 1 and len(proxy.dropped) == 2
        client.flush()
    assert [d["id"] for _, d in app.applied[2]] == ["lone"]
    assert [d["id"] for _, d in app.applied[3]] == ["second", "first"]


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_thousand_transactions_through_a_proxy_that_keeps_cutting(servers) -> None:
    s, _, _, url = servers
    s.start("s1", proxied=True)
    s.wait_all_served()
    proxy = s.proxies[0]
    app = MemoryApp()
    stop = threading.Event()

    def cutter() -> None:
        while not stop.wait(0.1):
            proxy.cut()

    contexts = [
        Write(f"p{i}", partition=i, locks=(PartitionLocalLock("k", i % 7),) if i % 3 == 0 else ()) for i in range(1000)
    ]
    with WaltzClient(app, config(url, settle_after=0.5, mount_timeout=60)) as client:
        cutting = threading.Thread(target=cutter)
        cutting.start()
        try:
            futures = submit_from_threads(
                client, contexts, pause=0.01
            )  # spread over seconds: many cuts land mid-stream
            assert all(f.result(120) for f in futures)
            client.flush()
        finally:
            stop.set()
            cutting.join()
    assert proxy.cuts >= 10
    assert not app.errors, app.errors
    log = read_log(url)
    assert log == {p: app.applied[p] for p in range(PARTITIONS)}  # the applier saw exactly the log
    committed = collections.Counter(d["id"] for p in log for _, d in log[p])
    assert committed == collections.Counter(c.payload for c in contexts)  # each exactly once
    for p in log:
        assert [t for t, _ in log[p]] == list(range(len(log[p])))
    print(f"\n{proxy.cuts} cuts, {sum(c.executions for c in contexts)} executions for 1000 transactions")


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_spoofed_mount_under_a_live_clients_id_is_refused(servers) -> None:
    """Issue 34, finding 3: a Mount under a live client's (guessable) id with connection seq
    2^62 made every later transaction of that client expire, silently, until all its
    connections closed. Now it is refused (another token, a seq far ahead), as are appends
    under an id the connection did not mount, and the client goes on committing."""
    s, meta, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = MemoryApp()
    with WaltzClient(app, config(url, transaction_timeout=5.0, mount_timeout=5.0)) as client:
        before = [client.submit(Write(f"before-{p}", partition=p)) for p in range(PARTITIONS)]
        assert [f.result(30) for f in before] == [True] * PARTITIONS
        victim = client.client_id
        endpoint = meta.partition_server(0)[0].endpoint
        attacker = RawConnection(endpoint)
        try:
            replies = []
            for p in range(PARTITIONS):
                for seq in (2**62, time.time_ns() // 1000):  # far ahead; near the victim's own
                    attacker.send(cp.Mount(p, p, victim, -1, seq))
                    replies.append(attacker.next())
            assert all(isinstance(r, cp.Failure) and r.kind == cp.FailureKind.CLIENT_REFUSED for r in replies), replies
            assert "ahead" in replies[0].message and "another client" in replies[1].message  # type: ignore[union-attr]
            attacker.send(cp.Append((victim, 1, 0, 10**6), -1, 0, b"forged"))
            forged = attacker.next()
            assert isinstance(forged, cp.Failure) and forged.kind == cp.FailureKind.APPEND_REJECTED, forged
            after = [client.submit(Write(f"after-{p}", partition=p)) for p in range(PARTITIONS)]
            assert [f.result(30) for f in after] == [True] * PARTITIONS
        finally:
            attacker.close()


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_fixed_client_id_with_its_secret_takes_over_at_once(servers) -> None:
    """A fixed `client_id` with a `client_secret` proves the same token on every run: a new run
    mounts while the old one still holds the partitions (a crashed host's connections the
    server has not seen die), and a process without the secret is refused."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    secret = "correct horse battery staple"
    with WaltzClient(MemoryApp(), config(url, client_id=4343, client_secret=secret)) as first:
        assert first.submit(Write("first", partition=0)).result(30)
        with WaltzClient(MemoryApp(), config(url, client_id=4343, client_secret=secret, mount_timeout=10.0)) as second:
            assert second.submit(Write("second", partition=0)).result(30)
        with pytest.raises(errors.MountTimeoutError, match="another client"):
            WaltzClient(MemoryApp(), config(url, client_id=4343, client_secret="another secret 16+", mount_timeout=2))
    with pytest.raises(errors.ConfigError, match="client_secret needs a fixed client_id"):
        config(url, client_secret=secret)


async def _refused_start(url: str, client_id: int) -> tuple[AsyncWaltzClient, asyncio.Future[None]]:
    """A client starting with a fixed id that another client (already started, same id, another
    secret) holds: every mount is refused; returns it once a refusal has come back."""
    client = AsyncWaltzClient(
        AsyncMemoryApp(),
        config(url, client_id=client_id, client_secret="another secret 16+", mount_timeout=30, reconnect_backoff=0.01),
    )
    starting = asyncio.ensure_future(client.start())
    deadline = time.monotonic() + 30
    while not any("another client" in p.last_error for p in client._parts.values()):
        assert time.monotonic() < deadline, "the mount was never refused"
        await asyncio.sleep(0.02)
    return client, starting


def _holder(url: str, client_id: int) -> AsyncWaltzClient:
    return AsyncWaltzClient(AsyncMemoryApp(), config(url, client_id=client_id, client_secret="correct horse battery"))


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_close_ends_a_refused_mount_whose_cancellation_was_lost(servers, monkeypatch) -> None:
    """Python 3.11's `asyncio.wait_for` drops a cancellation that arrives in the same turn as
    the reply it waits for. A client closing while its mounts were being refused then saw its
    mount loop retry for ever on the still-open link, and `close` (and the failing start of a
    `WaltzClient`) waited for it without end: CI's hang of the test above. Here the mount loops'
    cancellations are lost on purpose; `close` must still return."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    losing = ClientPartition.close

    def close_losing_the_mount_cancellation(part: ClientPartition, why: BaseException) -> None:
        tasks = part.tasks
        part.tasks = tasks[1:]  # [mount loop, apply loop]: the mount loop is not cancelled
        try:
            losing(part, why)
        finally:
            part.tasks = tasks

    monkeypatch.setattr(ClientPartition, "close", close_losing_the_mount_cancellation)

    async def go() -> None:
        async with _holder(url, 4344) as first:
            assert await (await first.submit(Write("first", partition=0)))
            refused, starting = await _refused_start(url, 4344)
            async with asyncio.timeout(60):  # before the fix: never returned
                await refused.close()
            assert all(t.done() for p in refused._parts.values() for t in p.tasks)
            await asyncio.gather(starting, return_exceptions=True)

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_start_closed_by_another_task_raises_client_closed(servers) -> None:
    """`close` from another task while `start` waits for its first mounts: the mount loops end,
    so nothing will ever mount; `start` must say the client was closed, not wait for ever."""
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()

    async def go() -> None:
        async with _holder(url, 4345):
            refused, starting = await _refused_start(url, 4345)
            await refused.close()
            with pytest.raises(errors.ClientClosedError, match="closed while it was starting"):
                async with asyncio.timeout(60):  # before the fix: spun for ever
                    await starting

    asyncio.run(go())


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_mount_far_ahead_is_refused_and_a_sane_one_then_mounts(servers) -> None:
    s, meta, _, url = servers
    s.start("s1")
    s.wait_all_served()
    c = RawConnection(meta.partition_server(0)[0].endpoint)
    try:
        c.send(cp.Mount(1, 0, 777, -1, time.time_ns() // 1000 + 2 * 86_400 * 1_000_000))
        refused = c.next()
        assert isinstance(refused, cp.Failure) and refused.kind == cp.FailureKind.CLIENT_REFUSED, refused
        assert "ahead of this server's clock" in refused.message
        deadline = time.monotonic() + 30
        for seq in range(2, 10**6):  # NOT_READY while the server is still opening the partition
            c.send(cp.Mount(seq, 0, 777, -1, time.time_ns() // 1000))
            while not isinstance(m := c.next(), cp.MountResponse):
                assert m is not None and not isinstance(m, cp.Failure), m
            if m.status == cp.MountStatus.READY or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert m.status == cp.MountStatus.READY
    finally:
        c.close()


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_client_starts_and_commits_with_one_partition_stuck(servers) -> None:
    """Issue 34, finding 7: start mounted every partition, so one whose server never answered
    kept `WaltzClient` from starting at all. Now start returns after `mount_timeout` with the
    others mounted; only what waits on the stuck partition fails, and it mounts once it can."""
    s, _, _, url = servers
    s.start("s1", proxied=True)
    s.wait_all_served()
    proxy = s.proxies[0]
    proxy.drop(lambda m: isinstance(m, cp.Mount) and m.partition == 1)  # its server never answers
    app = MemoryApp()
    began = time.monotonic()
    with WaltzClient(app, config(url, mount_timeout=2.0, request_timeout=2.0)) as client:
        assert time.monotonic() - began < 20
        healthy = [p for p in range(PARTITIONS) if p != 1]
        assert [client.submit(Write(f"ok-{p}", partition=p)).result(30) for p in healthy] == [True] * len(healthy)
        with pytest.raises(errors.MountTimeoutError, match="partition 1 could not be mounted"):
            client.submit(Write("stuck", partition=1)).result(30)
        proxy.drop(None)  # the partition comes back: its mount goes on in the background
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.submit(Write("late", partition=1)).result(30)
                break
            except errors.MountTimeoutError:
                assert time.monotonic() < deadline, "partition 1 never mounted"
                time.sleep(0.2)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_a_start_that_replays_for_longer_than_mount_timeout_is_not_a_timeout(servers, caplog) -> None:
    """A client far behind replays the feed before its mount is READY. `start` judged that by the
    wall clock and failed with "no partition could be mounted within 30 s: not mounted yet" while
    the feed was still coming (a torture run's drain, 73,000 transactions a partition on a busy
    machine). A mount that makes progress is not timed out; one that makes none still is."""
    s, _, _, url = servers
    s.start("s1", proxied=True)
    s.wait_all_served()
    proxy = s.proxies[0]
    n = 6000  # 28 bytes a feed entry: 168 KB of feed
    with WaltzClient(MemoryApp(fetch_data=False), config(url, partitions=[0])) as writer:
        assert all(f.result(120) for f in submit_from_threads(writer, [Write(f"w{i}") for i in range(n)]))
    # 56 KB/s: a frame of 1,000 entries every half second, the whole replay in about 3 s.
    proxy.throttle(56_000)
    app = MemoryApp(fetch_data=False)
    slow = config(url, partitions=[0], mount_timeout=1.5, data_prefetch_bytes=0)
    caplog.set_level(logging.INFO, logger="waltz.client")
    with WaltzClient(app, slow) as reader:
        # A long start says what it waits for, and that the feed moves.
        assert any("still mounting" in r.message and "its feed replayed" in r.message for r in caplog.records)
        assert reader.high_water_mark(0) == n - 1
        deadline = time.monotonic() + 60
        while app.marks[0] < n - 1:
            assert time.monotonic() < deadline, f"applied {app.marks[0]} of {n - 1}"
            time.sleep(0.05)
    assert not app.errors, app.errors
    # No progress at all is still a timeout, and says where the mount stood.
    proxy.throttle(None)
    proxy.drop(lambda m: isinstance(m, cp.Mount))
    # (Raised by the start's clock or by the partition's mount loop, whichever comes first.)
    no_answer = "partition 0: (waiting for server .* to answer its mount|.*did not answer the mount within 1.5 s)"
    with pytest.raises(errors.MountTimeoutError, match=no_answer):
        WaltzClient(MemoryApp(fetch_data=False), slow)


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_client_ahead_is_an_error_not_a_hang(servers) -> None:
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    with pytest.raises(errors.ClientAheadError, match="above the cluster's"):
        WaltzClient(MemoryApp(start={2: 1000}), config(url, mount_timeout=10))


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_mount_timeout_without_a_server(servers) -> None:
    _, _, _, url = servers
    t = time.monotonic()
    with pytest.raises(errors.MountTimeoutError, match="not assigned|not registered|could not be mounted"):
        WaltzClient(MemoryApp(), config(url, mount_timeout=1.0))
    assert time.monotonic() - t < 30


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_oversized_and_failing_contexts(servers) -> None:
    s, _, _, url = servers
    s.start("s1", extra="\n[partition]\nmax_transaction_bytes = 1000\n")
    s.wait_all_served()

    class Big(Write):
        def execute(self, builder: TransactionBuilder) -> bool:
            self.executions += 1
            builder.set_data(b"x" * 5000)
            return True

    class Broken(Write):
        def execute(self, builder: TransactionBuilder) -> bool:
            raise KeyError("no such account")

    class Nowhere(Write):
        def partition_id(self, num_partitions: int) -> int:
            return num_partitions

    app = MemoryApp(fetch_data=False)
    with WaltzClient(app, config(url)) as client:
        with pytest.raises(errors.RequestFailedError, match="max_transaction_bytes") as e:
            client.submit(Big("big")).result(30)
        assert e.value.kind == "append_rejected"
        with pytest.raises(KeyError, match="no such account"):
            client.submit(Broken("broken")).result(30)
        with pytest.raises(ValueError, match="not a partition id"):
            client.submit(Nowhere("w"))
        assert client.submit(Write("fine")).result(30)
        client.flush()
        assert client.high_water_mark(0) == 0  # only the fine one


@pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)
def test_the_server_is_killed_under_load_and_another_takes_over(servers) -> None:
    s, meta, _, url = servers
    first = s.start("s1")
    s.wait_all_served()
    s.start("s2")
    app = MemoryApp()
    contexts = [Write(f"f{i}", partition=i) for i in range(300)]
    with WaltzClient(app, config(url, settle_after=0.5)) as client:
        futures: list[Any] = []

        def submit() -> None:
            for c in contexts:
                futures.append(client.submit(c))
                time.sleep(0.01)

        t = threading.Thread(target=submit)
        t.start()
        time.sleep(1.0)
        first.kill()  # SIGKILL: its partitions move to s2 after its metadata session expires
        first.wait()
        t.join()
        assert all(f.result(120) for f in futures)
        client.flush()
    assert not app.errors, app.errors
    log = read_log(url)
    assert log == {p: app.applied[p] for p in range(PARTITIONS)}
    assert collections.Counter(d["id"] for p in log for _, d in log[p]) == collections.Counter(
        c.payload for c in contexts
    )
