"""One suite, two implementations: every test runs against the embedded SQLite store and against a
real ZooKeeper server (see the `metadata_url` fixture)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from waltz import errors
from waltz.cluster import open_store
from waltz.cluster.store import (
    Check,
    ChildrenWatch,
    Create,
    DataWatch,
    Delete,
    EphemeralRegistration,
    EventType,
    MetadataStore,
    SessionState,
    SetData,
    WatchEvent,
)

TIMEOUT = 2.0


def wait_for(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def store(metadata_url: str) -> Iterator[MetadataStore]:
    s = open_store(metadata_url, session_timeout=TIMEOUT)
    s.start()
    yield s
    s.close()


@pytest.fixture
def other(metadata_url: str, store: MetadataStore) -> Iterator[MetadataStore]:
    """A second session on the same store (as another process would have)."""
    s = open_store(metadata_url, session_timeout=TIMEOUT)
    s.start()
    yield s
    s.close()


def expire(store: MetadataStore, metadata_url: str) -> None:
    """Ends the store's session from outside, as a lease running out or ZooKeeper expiring it."""
    if metadata_url.startswith("embedded:"):
        db = sqlite3.connect(metadata_url[len("embedded:") :], timeout=30)
        with db:
            db.execute("UPDATE sessions SET expires = 0 WHERE id = ?", (store.session_id,))
        db.close()
    else:
        from kazoo.client import KazooClient

        twin = KazooClient(hosts=store.hosts, client_id=store._zk.client_id)  # type: ignore[attr-defined]
        twin.start()
        twin.stop()
        twin.close()


def test_versions_and_compare_and_set(store: MetadataStore) -> None:
    assert store.create("/a", b"one") == "/a"
    data, stat = store.get("/a")
    assert (data, stat.version, stat.ephemeral_owner) == (b"one", 0, 0)
    assert store.set("/a", b"two", version=0).version == 1
    with pytest.raises(errors.MetadataVersionError):
        store.set("/a", b"three", version=0)
    assert store.get("/a")[0] == b"two"
    assert store.set("/a", b"four").version == 2
    with pytest.raises(errors.MetadataVersionError):
        store.delete("/a", version=1)
    store.delete("/a", version=2)
    assert store.exists("/a") is None
    with pytest.raises(errors.MetadataNotFoundError):
        store.get("/a")
    with pytest.raises(errors.MetadataNotFoundError):
        store.set("/a", b"x")


def test_create_rules(store: MetadataStore) -> None:
    with pytest.raises(errors.MetadataNotFoundError):
        store.create("/missing/child")
    store.create("/deep/er/path", b"x", make_parents=True)
    assert store.get("/deep/er/path")[0] == b"x"
    assert store.get("/deep/er")[0] == b""
    with pytest.raises(errors.MetadataExistsError):
        store.create("/deep")
    store.create("/eph", ephemeral=True)
    assert store.get("/eph")[1].ephemeral_owner == store.session_id != 0
    with pytest.raises(errors.MetadataError):
        store.create("/eph/child")
    for bad in ["relative", "/trailing/", "/double//slash", "/dot/.."]:
        with pytest.raises(errors.MetadataError, match="bad metadata path"):
            store.create(bad)


def test_sequential_names_are_unique_across_sessions(store: MetadataStore, other: MetadataStore) -> None:
    store.create("/q")
    made = [s.create("/q/item-", sequential=True) for s in (store, other, store, other)]
    assert len(set(made)) == 4
    suffixes = [int(p.rsplit("-", 1)[1]) for p in made]
    assert suffixes == sorted(suffixes)
    assert all(len(p.rsplit("-", 1)[1]) == 10 for p in made)
    assert store.children("/q") == sorted(p.rsplit("/", 1)[1] for p in made)


def test_children_and_recursive_delete(store: MetadataStore) -> None:
    for p in ["/r/b", "/r/a", "/r/a/x", "/r/c"]:
        store.create(p, make_parents=True)
    assert store.children("/r") == ["a", "b", "c"]
    assert store.get("/r")[1].num_children == 3
    with pytest.raises(errors.MetadataNotEmptyError):
        store.delete("/r")
    store.delete("/r", recursive=True)
    assert store.exists("/r") is None and store.exists("/r/a/x") is None
    with pytest.raises(errors.MetadataNotFoundError):
        store.children("/r")


def test_transactions_are_all_or_nothing(store: MetadataStore) -> None:
    store.create("/t", b"0")
    with pytest.raises(errors.MetadataTransactionError) as failed:
        store.transaction([Create("/t/new", b"n"), SetData("/t", b"1", version=0), Check("/t", 5)])
    assert failed.value.index == 2
    assert isinstance(failed.value.cause, errors.MetadataVersionError)
    assert store.exists("/t/new") is None
    assert store.get("/t") == (b"0", store.get("/t")[1]) and store.get("/t")[1].version == 0

    results = store.transaction([Create("/t/new", b"n"), SetData("/t", b"1", version=0), Check("/t", 1), Create("/t/s-", sequential=True)])
    assert results[0] == "/t/new"
    assert results[1].version == 1
    assert results[2] is True
    assert results[3].startswith("/t/s-")
    store.transaction([Delete("/t/new"), Delete(results[3])])
    assert store.children("/t") == []


def test_one_shot_watches_cross_sessions(store: MetadataStore, other: MetadataStore) -> None:
    seen: list[WatchEvent] = []
    lock = threading.Lock()

    def record(e: WatchEvent) -> None:
        with lock:
            seen.append(e)

    assert store.exists("/w", watch=record) is None
    other.create("/w", b"1")
    wait_for(lambda: seen, what="create watch")
    assert seen == [WatchEvent(EventType.CREATED, "/w")]

    store.get("/w", watch=record)
    store.children("/w", watch=record)
    other.set("/w", b"2")
    other.create("/w/kid")
    wait_for(lambda: len(seen) == 3, what="change and child watches")
    assert set(seen[1:]) == {WatchEvent(EventType.CHANGED, "/w"), WatchEvent(EventType.CHILD, "/w")}

    # One-shot: later changes do not fire again until re-armed.
    other.set("/w", b"3")
    other.delete("/w/kid")
    time.sleep(0.5)
    assert len(seen) == 3

    store.get("/w", watch=record)
    other.delete("/w")
    wait_for(lambda: len(seen) == 4, what="delete watch")
    assert seen[3] == WatchEvent(EventType.DELETED, "/w")


def test_persistent_watches_follow_every_change(store: MetadataStore, other: MetadataStore) -> None:
    values: list[bytes | None] = []
    kids: list[list[str]] = []
    dw = DataWatch(store, "/p", lambda data, stat: values.append(data))
    cw = ChildrenWatch(store, "/p", kids.append)
    other.create("/p", b"a")
    wait_for(lambda: values[-1:] == [b"a"], what="data watch on create")
    for v in [b"b", b"c"]:
        other.set("/p", v)
        wait_for(lambda v=v: values[-1:] == [v], what=f"data watch sees {v!r}")
    other.create("/p/x")
    other.create("/p/y")
    wait_for(lambda: kids and kids[-1] == ["x", "y"], what="children watch")
    dw.stop()
    cw.stop()
    n = len(values)
    other.set("/p", b"after-stop")
    time.sleep(0.5)
    assert len(values) == n


def test_ephemeral_entries_end_with_their_session(store: MetadataStore, other: MetadataStore) -> None:
    other.create("/live", b"", ephemeral=True)
    other.close()
    assert store.exists("/live") is None


def test_ephemeral_of_a_killed_process_vanishes_after_its_session_timeout(store: MetadataStore, metadata_url: str) -> None:
    code = (
        "import sys, time\n"
        "from waltz.cluster import open_store\n"
        f"s = open_store({metadata_url!r}, session_timeout={TIMEOUT})\n"
        "s.start()\n"
        "s.create('/killed', b'', ephemeral=True)\n"
        "print('ready', flush=True)\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert store.exists("/killed") is not None
        proc.kill()
        proc.wait()
        wait_for(lambda: store.exists("/killed") is None, what="the killed process's ephemeral to vanish")
    finally:
        proc.kill()
        proc.wait()


def test_lost_session_is_replaced_and_registrations_recreated(store: MetadataStore, metadata_url: str) -> None:
    states: list[SessionState] = []
    store.add_listener(states.append)
    reg = EphemeralRegistration(store, "/servers/s1", b"endpoint")
    first = store.session_id
    assert store.get("/servers/s1")[1].ephemeral_owner == first

    expire(store, metadata_url)
    wait_for(lambda: SessionState.LOST in states, what="LOST")
    wait_for(lambda: states[-1] is SessionState.CONNECTED and store.session_id != first, what="a new session")
    wait_for(
        lambda: (st := store.exists("/servers/s1")) is not None and st.ephemeral_owner == store.session_id,
        what="the registration to be re-created under the new session",
    )
    assert store.get("/servers/s1")[0] == b"endpoint"
    assert store.is_connected
    reg.close()
    assert store.exists("/servers/s1") is None


def test_update_retries_compare_and_set_under_contention(store: MetadataStore, other: MetadataStore) -> None:
    store.create("/counter", b"0")

    def bump(s: MetadataStore) -> None:
        for _ in range(25):
            s.update("/counter", lambda d: str(int(d) + 1).encode())

    threads = [threading.Thread(target=bump, args=(s,)) for s in (store, other, store, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("/counter")[0] == b"100"


def test_bad_urls_and_unreachable_stores(tmp_path) -> None:
    with pytest.raises(errors.MetadataError, match="unknown metadata store"):
        open_store("mysql://x")
    with pytest.raises(errors.MetadataUnavailableError, match="does not exist"):
        open_store(f"embedded:{tmp_path / 'no' / 'such' / 'dir.db'}").start()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(errors.MetadataUnavailableError):
        open_store(f"embedded:{junk}").start()
    from support.processes import free_port

    with pytest.raises(errors.MetadataUnavailableError, match="cannot reach ZooKeeper"):
        open_store(f"zk://127.0.0.1:{free_port()}").start(timeout=1.0)


def test_embedded_session_suspends_while_the_file_is_locked(tmp_path) -> None:
    path = tmp_path / "m.db"
    store = open_store(f"embedded:{path}", session_timeout=1.0)
    store.start()
    states: list[SessionState] = []
    store.add_listener(states.append)
    try:
        blocker = sqlite3.connect(path, timeout=30, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        wait_for(lambda: SessionState.SUSPENDED in states, what="SUSPENDED")
        assert not store.is_connected
        blocker.execute("ROLLBACK")
        blocker.close()
        wait_for(lambda: states[-1] is SessionState.CONNECTED and store.is_connected, what="CONNECTED again")
    finally:
        store.close()


def test_zookeeper_session_suspends_when_the_server_dies(tmp_path) -> None:
    from support.processes import ZooKeeperServer
    from waltz.torture.proxy import FaultProxy, ProxyLoop

    server = ZooKeeperServer(tmp_path / "zk")
    server.start()
    # The store dials through a proxy that refuses connections until the restarted ZooKeeper
    # serves. A Connect that reaches it while it still loads its data goes unanswered for a
    # whole session timeout, and the restored session may expire meanwhile (seen in CI).
    proxies = ProxyLoop()
    gate = FaultProxy(proxies, "zookeeper", server.port)
    store = open_store(f"zk://127.0.0.1:{gate.port}/s", session_timeout=6.0)
    store.start()
    states: list[SessionState] = []
    store.add_listener(states.append)
    try:
        session = store.session_id
        gate.set_mode("reset")
        server.kill()
        wait_for(lambda: SessionState.SUSPENDED in states, what="SUSPENDED")
        assert not store.is_connected
        # An operation issued while ZooKeeper is down is retried and completes once it is back.
        done: list[str] = []
        writer = threading.Thread(target=lambda: done.append(store.create("/written-while-down", b"x")))
        writer.start()
        server.start()
        assert server.serving()
        gate.set_mode("pass")
        wait_for(lambda: store.is_connected, what="reconnect")
        writer.join(timeout=30)
        assert done == ["/written-while-down"]
        assert store.get("/written-while-down")[0] == b"x"
        assert store.session_id == session  # the server kept the session across its restart
    finally:
        store.close()
        gate.close()
        proxies.close()
        server.stop()


def test_zookeeper_digest_acl_keeps_other_clients_out(zookeeper) -> None:
    owner = open_store(zookeeper.url("/acl-test").replace("zk://", "zk://admin:s3cret@"))
    owner.start()
    stranger = open_store(zookeeper.url("/acl-test"))
    stranger.start()
    try:
        owner.create("/guarded", b"secret")
        with pytest.raises(errors.MetadataError, match="not authorised"):
            stranger.get("/guarded")
        with pytest.raises(errors.MetadataError, match="not authorised"):
            stranger.set("/guarded", b"x")
        assert owner.get("/guarded")[0] == b"secret"
    finally:
        owner.close()
        stranger.close()
