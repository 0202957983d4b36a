"""`waltz.client.mock`: the real client on an in-memory cluster (issue 36, item 9). Lock
semantics of docs/locking.md, exact; forced failures and lock failures; several clients sharing
one cluster; the sync and the async API; `append` and `ClientConfig.partitions` on it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.client_app import AsyncMemoryApp, Increment, MemoryApp, Write
from waltz import errors
from waltz.client import JSON, PartitionLocalLock, TransactionBuilder, TransactionContext
from waltz.client.metrics import ClientCollector
from waltz.client.mock import AsyncMockWaltzClient, MockCluster, MockWaltzClient, mock_config


def wait_applied(app: MemoryApp, partition: int, mark: int) -> None:
    deadline = threading.Event()
    for _ in range(3000):
        if app.marks[partition] >= mark:
            return
        deadline.wait(0.01)
    raise AssertionError(f"partition {partition} applied {app.marks[partition]}, not {mark}")


def test_commits_apply_in_order_with_hooks_and_marks() -> None:
    cluster, app = MockCluster(partitions=2), MemoryApp()
    with MockWaltzClient(app, cluster) as client:
        assert client.partitions == 2
        contexts = [Write(f"t{i}", partition=i, header=i) for i in range(10)]
        assert [client.submit(c).result(10) for c in contexts] == [True] * 10
        client.flush()
        assert [c.events for c in contexts] == [["completion:True", "application"]] * 10
        assert [c.committed_transaction_id for c in contexts] == [i // 2 for i in range(10)]
        assert client.high_water_mark(0) == client.high_water_mark(1) == 4
        assert [d["id"] for _, d in app.applied[1]] == ["t1", "t3", "t5", "t7", "t9"]
    assert [(t, h) for t, h, _ in cluster.transactions(0)] == [(i, 2 * i) for i in range(5)]
    assert not app.errors
    # A new client on the same cluster catches up from -1: the log is the cluster's, not the client's.
    later = MemoryApp()
    with MockWaltzClient(later, cluster):
        wait_applied(later, 1, 4)
    assert later.applied == app.applied


class Locked(TransactionContext):
    """One attempt with the given locks, checked against a fixed client high-water mark (the
    mark the application reports is overridden by `mark`)."""

    def __init__(self, write: tuple[str, ...] = (), read: tuple[str, ...] = (), append: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.locks = write, read, append
        self.lock_failures: list[int] = []
        self.timeout = 0.5

    def execute(self, builder: TransactionBuilder) -> bool:
        if self.lock_failures:  # one attempt only: the test wants to see the first outcome
            return False
        w, r, a = ([PartitionLocalLock(n, 0) for n in names] for names in self.locks)
        builder.add_write_locks(*w)
        builder.add_read_locks(*r)
        builder.add_append_locks(*a)
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.lock_failures.append(transaction_id)


class Frozen(MemoryApp):
    """Reports a fixed high-water mark: the client's contexts are built on that old state."""

    def __init__(self) -> None:
        super().__init__(fetch_data=False)
        self.frozen: int | None = None

    def get_client_high_water_mark(self, partition: int) -> int:
        return self.frozen if self.frozen is not None else super().get_client_high_water_mark(partition)


def test_lock_semantics_are_the_servers_and_exact() -> None:
    cluster, app = MockCluster(), Frozen()
    with MockWaltzClient(app, cluster) as client:

        def outcome(**locks: tuple[str, ...]) -> str:
            ctx = Locked(**locks)
            committed = client.submit(ctx).result(10)
            client.flush()
            return f"lock_failure:{ctx.lock_failures[0]}" if ctx.lock_failures else f"committed:{committed}"

        assert outcome(write=("a",)) == "committed:True"  # 0: a's version 0
        app.frozen = -1  # from here on, built on the state before 0
        assert outcome(write=("a",)) == "lock_failure:0"  # written after the mark
        assert outcome(read=("a",)) == "lock_failure:0"  # read locks fail the same way
        assert outcome(append=("a",)) == "committed:True"  # 1: append locks never fail, and write
        assert outcome(write=("b",)) == "committed:True"  # 2: another lock: no false positive
        app.frozen = 0
        assert outcome(read=("a",)) == "lock_failure:1"  # the append lock wrote a at 1
        assert outcome(write=("b",), read=("c",)) == "lock_failure:2"
        app.frozen = 2
        assert outcome(write=("a",), read=("b",)) == "committed:True"  # 3
        # A failed check moves nothing: c was never written, so c still passes at mark -1.
        app.frozen = -1
        assert outcome(write=("c",)) == "committed:True"
        # Exact, not hashed: thousands of locks written after the mark, none of them fails another.
        app.frozen = None
        for i in range(300):
            client.submit(Write(f"w{i}", locks=(PartitionLocalLock("hot", i),)))
        client.flush()
        app.frozen = 5
        ctx = Locked(write=("cold",))
        assert client.submit(ctx).result(10) is True and not ctx.lock_failures
    assert cluster.lock_failures == 4


def test_two_clients_race_on_one_lock_without_a_lost_update() -> None:
    cluster = MockCluster()
    apps = [MemoryApp(), MemoryApp()]
    with MockWaltzClient(apps[0], cluster) as a, MockWaltzClient(apps[1], cluster) as b:
        incs = [Increment(apps[i % 2]) for i in range(60)]
        clients = [a, b]

        def run(i: int) -> None:
            for ctx in incs[i::2]:
                assert clients[i].submit(ctx).result(30) is True

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        a.flush()
        b.flush()
        wait_applied(apps[0], 0, 59)
        wait_applied(apps[1], 0, 59)
    assert apps[0].counters[0] == apps[1].counters[0] == 60
    assert not apps[0].errors and not apps[1].errors  # no increment computed on stale state
    assert sum(c.lock_failures for c in incs) == cluster.lock_failures > 0


def test_forced_failures_retry_and_commit_once() -> None:
    cluster, app = MockCluster(partitions=2, failure_rate=0.3, seed=11), MemoryApp()
    with MockWaltzClient(app, cluster) as client:
        contexts = [Write(f"t{i}", partition=i) for i in range(100)]
        futures = [client.submit(c) for c in contexts]
        assert [f.result(30) for f in futures] == [True] * 100
        client.flush()
        stats = client.stats
    assert cluster.forced_failures > 10
    assert sum(c.executions for c in contexts) > 100 and stats.retries >= cluster.forced_failures
    committed = sorted(d["id"] for p in (0, 1) for _, d in app.applied[p])
    assert committed == sorted(f"t{i}" for i in range(100))  # every one exactly once


def test_force_next_lock_fail() -> None:
    cluster, app = MockCluster(), MemoryApp(fetch_data=False)
    with MockWaltzClient(app, cluster) as client:
        client.append(0, b"first")
        client.force_next_lock_fail()
        ctx = Write("forced")
        assert client.submit(ctx).result(10) is True
        assert ctx.events[:2] == ["lock_failure:0", "completion:True"] and ctx.executions == 2
        assert client.stats.lock_failures == 1
        client.flush()
        assert [t for t, _ in app.applied[0]] == [0, 1] and not app.errors


def test_append_and_partition_subsets() -> None:
    cluster = MockCluster(partitions=4)
    apps = [MemoryApp(fetch_data=False), MemoryApp(fetch_data=False)]
    with (
        MockWaltzClient(apps[0], cluster, mock_config(partitions=(0, 1))) as a,
        MockWaltzClient(apps[1], cluster, mock_config(partitions=[3, 2])) as b,
    ):
        assert a.mounted_partitions == (0, 1) and b.mounted_partitions == (2, 3) and a.partitions == 4
        assert [a.append(p % 2, b"x%d" % p) for p in range(4)] == [0, 0, 1, 1]
        assert b.append(2, {"k": 1}, serializer=JSON, header=7, locks=[PartitionLocalLock("k", 1)]) == 0
        with pytest.raises(errors.PartitionNotMountedError, match="partition 2 is not mounted by this client"):
            a.append(2, b"no")
        with pytest.raises(errors.PartitionNotMountedError):
            b.submit(Write("no", partition=0))
        with pytest.raises(ValueError, match="no partition 9"):
            a.append(9, b"no")
        a.flush()
        b.flush()
        assert b.high_water_mark(0) == 1  # requests about other partitions still work
    assert set(apps[0].applied) == {0, 1} and set(apps[1].applied) == {2}
    assert cluster.transactions(2) == [(0, 7, b'{"k":1}')]
    with pytest.raises(errors.ConfigError, match=r"partitions \[4\] do not exist"):
        MockWaltzClient(MemoryApp(), cluster, mock_config(partitions=(4,)))


def test_async_mock_client() -> None:
    async def go() -> None:
        cluster, app = MockCluster(), AsyncMemoryApp()
        async with AsyncMockWaltzClient(app, cluster) as client:
            done = await client.submit(Write("a"))
            assert await done is True
            assert await client.append(0, {"id": "b"}, serializer=JSON) == 1
            client.force_next_lock_fail()
            assert await client.append(0, {"id": "c"}, serializer=JSON) == 2
            await client.flush()
            assert [d["id"] for _, d in app.applied[0]] == ["a", "b", "c"]
            assert await client.transaction_data(0, 1) == b'{"id":"b"}'
            with pytest.raises(errors.RequestFailedError, match="no committed transaction") as e:
                await client.transaction_data(0, 7)
            assert e.value.kind == "not_committed"
            assert client.stats.lock_failures == 1 and client.stats.commits == 3
            families = {m.name: m for m in ClientCollector(client).collect()}
            # Scraped on the client's own loop: the lag is measured against the feed (0: applied all).
            assert [s.value for s in families["waltz_client_feed_lag"].samples] == [0]

    asyncio.run(go())


def test_client_ahead_of_the_mock_cluster_is_refused() -> None:
    with pytest.raises(errors.ClientAheadError):
        MockWaltzClient(MemoryApp(start={0: 5}), MockCluster())


class Hooked(TransactionContext):
    def __init__(self, *, fail: bool = False, slow: float = 0.0, timeout: float | None = None) -> None:
        super().__init__()
        self.fail, self.slow, self.timeout = fail, slow, timeout
        self.events: list[str] = []

    def execute(self, builder: TransactionBuilder) -> bool:
        self.events.append("execute")
        if self.fail:
            raise KeyError("the application's own error")
        threading.Event().wait(self.slow)
        return True

    def on_exception(self, exc: BaseException) -> None:
        self.events.append(f"exception:{type(exc).__name__}")

    def on_lock_failure(self, transaction_id: int) -> None:
        self.events.append(f"lock_failure:{transaction_id}")

    def on_expiration(self) -> None:
        self.events.append("expiration")


def test_exception_and_expiration_hooks() -> None:
    cluster = MockCluster()
    with MockWaltzClient(MemoryApp(), cluster) as client:
        raising = Hooked(fail=True)
        with pytest.raises(KeyError):
            client.submit(raising).result(10)
        assert raising.events == ["execute", "exception:KeyError"]
        # Its first execution outlives its timeout and then loses a (forced) lock race: it expires.
        client.force_next_lock_fail()
        late = Hooked(slow=0.3, timeout=0.1)
        with pytest.raises(errors.TransactionExpiredError, match="expired after 1 execution"):
            client.submit(late).result(10)
        assert late.events == ["execute", "lock_failure:-1", "expiration"]
        assert cluster.high_water_mark(0) == -1  # nothing committed
