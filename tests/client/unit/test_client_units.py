"""Pure client logic: the transaction monitor's settlement rules, the builder's checks, the
serializers, and the client configuration file."""

from __future__ import annotations

import pathlib

import pytest
from waltz.client import JSON, TEXT, ClientConfig, PartitionLocalLock, TransactionBuilder
from waltz.client.monitor import TransactionMonitor
from waltz.client_protocol import lock_hash
from waltz.config import ConfigError


def test_a_commit_settles_it_and_fails_everything_sent_before() -> None:
    m: TransactionMonitor[str] = TransactionMonitor()
    for seq in (1, 2, 3, 4):
        m.sent(seq, f"w{seq}", 0.0)
    attempt, failed = m.committed(3)
    assert attempt is not None and attempt.work == "w3"
    assert [a.work for a in failed] == ["w1", "w2"]
    assert len(m) == 1 and m.oldest() is not None and m.oldest().seq == 4  # type: ignore[union-attr]
    assert m.committed(2) == (None, [])  # already settled (failed): a late duplicate is ignored
    assert m.refused(4) is not None and len(m) == 0


def test_a_flush_settles_up_to_its_mark_and_a_mount_settles_all() -> None:
    m: TransactionMonitor[int] = TransactionMonitor()
    for seq in range(1, 6):
        m.sent(seq, seq, float(seq))
    assert [a.seq for a in m.failed_through(3)] == [1, 2, 3]
    assert m.newest_seq() == 5
    assert [a.seq for a in m.fail_all()] == [4, 5]
    assert m.oldest() is None and m.newest_seq() is None


def test_sequences_must_rise() -> None:
    m: TransactionMonitor[int] = TransactionMonitor()
    m.sent(5, 0, 0.0)
    with pytest.raises(AssertionError):
        m.sent(5, 0, 0.0)


def test_builder_checks_its_inputs() -> None:
    b = TransactionBuilder(0, 7)
    assert b.client_high_water_mark == 7
    with pytest.raises(ValueError, match="32-bit"):
        b.set_header(2**31)
    with pytest.raises(TypeError, match="must be bytes"):
        b.set_data("text without a serializer")
    with pytest.raises(TypeError, match="PartitionLocalLock"):
        b.add_write_locks(("account", 1))  # type: ignore[arg-type]
    b.set_data({"b": 1, "a": [1, 2]}, JSON)
    assert b.data == b'{"a":[1,2],"b":1}'
    b.add_read_locks(PartitionLocalLock("account", 1))
    assert b.read_locks[0].hash == lock_hash("account", 1) != PartitionLocalLock("account", 2).hash
    assert TEXT.deserialize(TEXT.serialize("é")) == "é"


def test_config_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text('[client]\nmetadata = "embedded:/tmp/m.db"\ncluster = "prod"\nmax_pending = 8\nmount_timeout = 5\n')
    c = ClientConfig.from_file(path)
    assert (c.cluster, c.max_pending, c.mount_timeout, c.client_id) == ("prod", 8, 5.0, -1)
    path.write_text('[client]\nmetadata = "embedded:/tmp/m.db"\nmax_pending = 0\n')
    with pytest.raises(ConfigError, match=r"client.toml \[client\]: max_pending must be positive"):
        ClientConfig.from_file(path)
    path.write_text('[client]\nmetadata = "embedded:/tmp/m.db"\nmax_pendin = 3\n')
    with pytest.raises(ConfigError, match="unknown key"):
        ClientConfig.from_file(path)
    path.write_text('[client]\ncluster = "x"\n')
    with pytest.raises(ConfigError, match="metadata is required"):
        ClientConfig.from_file(path)
    with pytest.raises(ConfigError, match="client_id"):
        ClientConfig(metadata="embedded:/tmp/m.db", client_id=-5)


def test_config_partitions_and_retry_seed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text('[client]\nmetadata = "embedded:/tmp/m.db"\npartitions = [3, 1, 3]\nretry_seed = 9\n')
    c = ClientConfig.from_file(path)
    assert c.partitions == (1, 3) and c.retry_seed == 9  # sorted, once each
    assert ClientConfig(metadata="embedded:/tmp/m.db").partitions is None  # every partition
    for bad, why in (
        ([], "at least one partition"),
        ([-1], "non-negative"),
        ("0", "a list of partition ids"),
        ([True], "non-negative"),
    ):
        with pytest.raises(ConfigError, match=why):
            ClientConfig(metadata="embedded:/tmp/m.db", partitions=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must not exceed reconnect_backoff_max"):
        ClientConfig(metadata="embedded:/tmp/m.db", reconnect_backoff=3.0, reconnect_backoff_max=2.0)


def test_a_data_fetch_that_times_out_raises_instead_of_spinning() -> None:
    """Found by `waltz torture`: `Transaction.data()` took the fetch's own RequestTimeoutError (a
    TimeoutError) for its 0.5 s wait running out, and re-raised it in a loop whose traceback
    grew until the process ran out of memory. The fetch's outcome, whatever it is, is returned."""
    import asyncio
    import threading

    from waltz import errors
    from waltz.client.transaction import Transaction

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:

        async def timed_out(partition: int, txid: int) -> bytes:
            raise errors.RequestTimeoutError(f"partition {partition}: no answer for {txid}")

        async def slow(partition: int, txid: int) -> bytes:
            await asyncio.sleep(0.7)  # longer than one wait: the loop must go round once
            return b"data of %d" % txid

        outcome: list[BaseException] = []

        def fetch() -> None:
            try:
                Transaction(0, 7, 0, (1, 1, 0, 1), timed_out, loop).data()
            except BaseException as e:  # noqa: BLE001 - the outcome is what the test checks
                outcome.append(e)

        caller = threading.Thread(target=fetch, daemon=True)
        caller.start()
        caller.join(60)  # a liveness bound, not a speed check: before the fix it never returned
        assert not caller.is_alive(), "data() spun on the fetch's TimeoutError instead of raising it"
        assert isinstance(outcome[0], errors.RequestTimeoutError) and "no answer for 7" in str(outcome[0])
        assert Transaction(0, 8, 0, (1, 1, 0, 2), slow, loop).data() == b"data of 8"
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_an_append_rejection_goes_to_its_partition_not_to_a_request_with_the_same_number() -> None:
    """An APPEND_REJECTED Failure carries the append's sequence (counted per partition), which
    collides with the link's request numbers (Mount, Flush): the waiting request took it and
    failed, and the refused append stayed pending, to be executed again later."""
    import asyncio

    from waltz import client_protocol as cp
    from waltz.client.network import Link

    async def go() -> None:
        pushed: list[cp.Message] = []
        link = Link("127.0.0.1:1", "server", lambda _link, m: pushed.append(m), lambda _link, _why: None)
        flush: asyncio.Future[cp.Message] = asyncio.get_running_loop().create_future()
        link._waiting[3] = flush
        rejected = cp.Failure(3, 0, cp.FailureKind.APPEND_REJECTED, "append (1, 1, 0, 3): too large")
        link._dispatch(rejected)
        assert pushed == [rejected] and not flush.done()
        other = cp.Failure(3, 0, cp.FailureKind.NOT_COMMITTED, "not committed")
        link._dispatch(other)
        assert flush.done() and isinstance(flush.exception(), Exception) and pushed == [rejected]

    asyncio.run(go())
