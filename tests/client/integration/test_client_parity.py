"""Issue 36 against a real cluster (3 storage nodes, a `waltz-node server`): two instances
splitting the partitions (`ClientConfig.partitions`), `client.append`, the Prometheus collector
scraped after real transactions, and one application run on the mock and on the cluster with
the same outcome."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from support.bank_app import scenario
from support.client_app import Increment, MemoryApp, Write
from support.daemons import PARTITIONS, setup  # noqa: F401  (fixture)
from test_client import config, servers  # noqa: F401  (fixture)
from waltz import errors
from waltz.client import JSON, AsyncWaltzClient, PartitionLocalLock, WaltzClient
from waltz.client.metrics import ClientCollector
from waltz.client.mock import MockCluster, MockWaltzClient

pytestmark = pytest.mark.parametrize("metadata_url", ["embedded"], indirect=True)


def wait_applied(app: MemoryApp, partition: int, mark: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while app.marks[partition] < mark:
        assert time.monotonic() < deadline, f"partition {partition} applied {app.marks[partition]} of {mark}"
        time.sleep(0.02)


def test_two_instances_split_four_partitions(servers) -> None:  # noqa: F811
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    assert PARTITIONS == 4
    apps = [MemoryApp(), MemoryApp()]
    with (
        WaltzClient(apps[0], config(url, partitions=(0, 2))) as a,
        WaltzClient(apps[1], config(url, partitions=[3, 1])) as b,
    ):
        assert a.mounted_partitions == (0, 2) and b.mounted_partitions == (1, 3)
        assert a.partitions == b.partitions == 4
        # Each instance writes to its own partitions; the feed of each delivers only those.
        for i in range(20):
            assert a.append((0, 2)[i % 2], {"id": f"a{i}"}, serializer=JSON) == i // 2
            b.submit(Write(f"b{i}", partition=(1, 3)[i % 2])).result(30)
        # A partition of the other instance fails at once, without waiting or sending.
        started = time.monotonic()
        with pytest.raises(
            errors.PartitionNotMountedError,
            match=r"partition 1 is not mounted by this client \(it mounts partitions \[0, 2\]",
        ):
            a.append(1, b"elsewhere")
        with pytest.raises(errors.PartitionNotMountedError):
            b.submit(Write("elsewhere", partition=0))
        assert time.monotonic() - started < 1.0
        a.flush()
        b.flush()
        assert a.high_water_mark(1) == 9  # asking about another partition's mark still works
        assert [s["partition"] for s in a.status()] == [0, 2]
    assert set(apps[0].applied) == {0, 2} and set(apps[1].applied) == {1, 3}
    assert [d["id"] for _, d in apps[0].applied[2]] == [f"a{i}" for i in range(1, 20, 2)]
    assert [d["id"] for _, d in apps[1].applied[3]] == [f"b{i}" for i in range(1, 20, 2)]
    assert not apps[0].errors and not apps[1].errors
    with pytest.raises(errors.ConfigError, match=r"partitions \[7\] do not exist: cluster e2e has 4"):
        WaltzClient(MemoryApp(), config(url, partitions=(1, 7)))


def test_append_sync_and_async_with_locks(servers) -> None:  # noqa: F811
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app = MemoryApp(fetch_data=False)
    with WaltzClient(app, config(url, partitions=(0,), max_frame=1 << 20)) as client:
        assert client.append(0, b"one") == 0
        assert client.append(0, "two", serializer=JSON, header=5, locks=[PartitionLocalLock("k", 1)]) == 1
        assert client.high_water_mark(0) == 1
        with pytest.raises(ValueError, match="does not fit in a frame"):  # raised, not retried
            client.append(0, b"x" * (1 << 20))

    async def go() -> None:
        async with AsyncWaltzClient(MemoryApp(fetch_data=False), config(url, partitions=(0,))) as c:
            assert await c.append(0, b"three", append_locks=[PartitionLocalLock("k", 1)]) == 2
            assert await c.transaction_data(0, 1) == b'"two"'

    asyncio.run(go())


def test_metrics_collector_scrapes_a_real_client(servers) -> None:  # noqa: F811
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    app, behind = MemoryApp(fetch_data=False), threading.Event()

    class Slow(MemoryApp):
        """Applies partition 1 only once told: its feed lag shows in the scrape."""

        def apply_transaction(self, transaction):  # type: ignore[no-untyped-def]
            if transaction.partition == 1:
                behind.wait(30)
            super().apply_transaction(transaction)

    registry = CollectorRegistry()
    with WaltzClient(app, config(url)) as writer, WaltzClient(Slow(fetch_data=False), config(url)) as reader:
        registry.register(ClientCollector(writer))
        incs = [Increment(app) for _ in range(10)]
        threads = [threading.Thread(target=lambda c=c: writer.submit(c).result(30)) for c in incs]  # type: ignore[misc]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(6):
            writer.append(1, b"%d" % i)
        writer.flush()

        def sample(name: str, partition: str | None = None) -> float | None:
            labels = {} if partition is None else {"partition": partition}
            return registry.get_sample_value(name, labels)

        assert sample("waltz_client_commits_total") == 16
        lock_failures = sum(c.lock_failures for c in incs)
        assert sample("waltz_client_lock_failures_total") == lock_failures
        assert sample("waltz_client_data_requests_total") == writer.stats.data_requests
        assert (
            sample("waltz_client_retries_total") is not None and sample("waltz_client_retries_total") >= lock_failures
        )  # type: ignore[operator]
        assert sample("waltz_client_pending", "0") == 0
        assert sample("waltz_client_applied_high_water_mark", "0") == 9
        assert sample("waltz_client_feed_lag", "1") == 0
        # The lagging reader: 6 committed on partition 1, at most the first one in its callback.
        lagging = CollectorRegistry()
        lagging.register(ClientCollector(reader))
        wait = time.monotonic() + 10
        while lagging.get_sample_value("waltz_client_feed_lag", {"partition": "1"}) != 6:
            assert time.monotonic() < wait, lagging.get_sample_value("waltz_client_feed_lag", {"partition": "1"})
            time.sleep(0.05)
        behind.set()
        # A context counts as pending until it completes (here its on_completion hook holds it).
        hold, holding = threading.Event(), threading.Event()

        class Held(Write):
            def on_completion(self, result: bool) -> None:
                holding.set()
                hold.wait(30)

        future = writer.submit(Held("held", partition=3))
        assert holding.wait(30)
        assert sample("waltz_client_pending", "3") == 1
        hold.set()
        assert future.result(30) is True
        assert sample("waltz_client_pending", "3") == 0 and sample("waltz_client_commits_total") == 17


def test_the_same_application_on_the_mock_and_on_a_real_cluster(servers) -> None:  # noqa: F811
    s, _, _, url = servers
    s.start("s1")
    s.wait_all_served()
    mock = MockCluster(partitions=PARTITIONS)
    on_mock = scenario(lambda bank: MockWaltzClient(bank, mock))
    on_cluster = scenario(lambda bank: WaltzClient(bank, config(url)))
    assert on_mock == on_cluster
    assert on_cluster["slow_events"] == ["execute:100", "lock_failure:2", "execute:50", "completion:False"]
    assert on_cluster["balances"] == {1: 50, 2: 10, 3: 50} and on_cluster["same_state"]
