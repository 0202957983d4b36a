"""One suite, two implementations: every test runs against the embedded SQLite store and against a
real ZooKeeper server (see the `metadata_url` fixture)."""

from __future__ import annotations

import os
import pathlib
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from waltz import clock, errors
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
        with db:  # what a purge does first (the owner removes its ephemeral entries when it notices)
            db.execute("DELETE FROM sessions WHERE id = ?", (store.session_id,))
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

    results = store.transaction(
        [Create("/t/new", b"n"), SetData("/t", b"1", version=0), Check("/t", 1), Create("/t/s-", sequential=True)]
    )
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


def test_ephemeral_of_a_killed_process_vanishes_after_its_session_timeout(
    store: MetadataStore, metadata_url: str
) -> None:
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


def test_embedded_sessions_do_not_depend_on_any_process_wall_clock(tmp_path) -> None:
    """Issue 37 item 2: leases compared against each process's wall clock let one process whose
    clock stepped forward end every other session (and one stepped back lose its own). Two
    processes an hour ahead and an hour behind write and hold entries for several timeouts: no
    session ends."""
    url = f"embedded:{tmp_path / 'm.db'}"
    store = open_store(url, session_timeout=TIMEOUT)
    store.start()
    states: list[SessionState] = []
    store.add_listener(states.append)
    first = store.session_id
    store.create("/mine", b"", ephemeral=True)
    code = (
        "import sys, time\n"
        "from waltz.cluster import open_store\n"
        f"s = open_store({url!r}, session_timeout={TIMEOUT})\n"
        "s.start()\n"
        "s.create('/' + sys.argv[1], b'', ephemeral=True)\n"
        "print('ready', flush=True)\n"
        f"for i in range({int(TIMEOUT * 4 / 0.1)}):\n"
        "    s.create('/' + sys.argv[1] + '-' + str(i), b'')\n"
        "    time.sleep(0.1)\n"
        "print(s.session_id, flush=True)\n"
        "sys.stdin.read()\n"
    )
    procs = []
    try:
        for name, offset_ms in (("ahead", 3_600_000), ("behind", -3_600_000)):
            (tmp_path / name).write_text(clock.render(offset_ms))
            env = {**os.environ, clock.CLOCK_FILE_ENV: str(tmp_path / name)}
            procs.append(
                p := subprocess.Popen(
                    [sys.executable, "-c", code, name],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    text=True,
                )
            )
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        sessions = {name: store.get(f"/{name}")[1].ephemeral_owner for name in ("ahead", "behind")}
        for p, name in zip(procs, ("ahead", "behind"), strict=True):
            assert p.stdout is not None and int(p.stdout.readline()) == sessions[name], f"{name} lost its session"
            assert store.get(f"/{name}")[1].ephemeral_owner == sessions[name]
        assert store.session_id == first and store.get("/mine")[1].ephemeral_owner == first
        assert SessionState.LOST not in states
    finally:
        for p in procs:
            p.kill()
            p.wait()
        store.close()


def test_embedded_events_outlive_a_process_whose_clock_is_ahead(tmp_path) -> None:
    """Issue 37 item 2: events were pruned by age on the pruning process's wall clock, so one an
    hour ahead deleted every event at its next renewal, before the others had polled it."""
    path = tmp_path / "m.db"
    store = open_store(f"embedded:{path}", session_timeout=TIMEOUT)
    store.start()
    try:
        store.create("/before", b"")
        (tmp_path / "ahead").write_text(clock.render(3_600_000))
        code = (
            "import time\n"
            "from waltz.cluster import open_store\n"
            f"s = open_store({f'embedded:{path}'!r}, session_timeout=0.4)\n"
            "s.start()\n"
            "time.sleep(1.0)\n"  # several renewals, each of which pruned
            "s.close()\n"
        )
        env = {**os.environ, clock.CLOCK_FILE_ENV: str(tmp_path / "ahead")}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        db = sqlite3.connect(path, timeout=30)
        try:
            assert db.execute("SELECT count(*) FROM events WHERE path = '/before'").fetchone()[0] == 1
        finally:
            db.close()
    finally:
        store.close()


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


# -- Regressions from an adversarial review of the metadata stores: each failed on the code as
#    first written (see the numbered findings). --------------------------------------------------


@pytest.fixture(params=["embedded", "zookeeper"])
def outage(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(url, begin_outage, end_outage): the embedded file locked by another process's
    transaction, or a dedicated ZooKeeper server killed."""
    if request.param == "embedded":
        path = tmp_path / "m.db"
        blocker: list[sqlite3.Connection] = []

        def begin() -> None:
            db = sqlite3.connect(path, timeout=30, isolation_level=None)
            db.execute("BEGIN EXCLUSIVE")
            blocker.append(db)

        def end() -> None:
            for db in blocker:
                db.execute("ROLLBACK")
                db.close()
            blocker.clear()

        yield f"embedded:{path}", begin, end
        end()
    else:
        from support.processes import ZooKeeperServer

        server = ZooKeeperServer(tmp_path / "zk")
        server.start()
        try:
            yield server.url("/outage"), server.kill, server.start
        finally:
            server.stop()


def test_suspended_reaches_listeners_while_a_callback_is_blocked_in_the_store(outage) -> None:
    """The manager stops serving only from its SUSPENDED listener. Listeners share the event
    thread with watch callbacks, and callbacks may call the store and block (the membership's
    `_set_serving` -> `EphemeralRegistration.update` -> `set` runs on it). A store call blocks up
    to the embedded busy timeout (30 s) or kazoo's retry deadline (2 x session timeout), both
    longer than the session: the session can expire, and the partition move to another server,
    while this one has not been told SUSPENDED yet."""
    url, begin_outage, end_outage = outage
    s = open_store(url, session_timeout=TIMEOUT)
    s.start()
    states: list[SessionState] = []
    s.add_listener(states.append)
    started, go = threading.Event(), threading.Event()

    def callback(_e: WatchEvent) -> None:  # e.g. a DataWatch on the assignment -> registration.update
        started.set()
        go.wait()
        try:
            s.set("/x", b"reporting what I serve")
        except errors.MetadataError:
            pass

    try:
        s.create("/x")
        assert s.exists("/trigger", watch=callback) is None
        s.create("/trigger")
        wait_for(started.is_set, what="the callback to run")
        begin_outage()
        go.set()
        # SUSPENDED must reach listeners before anyone else may take our session's place.
        wait_for(lambda: SessionState.SUSPENDED in states, timeout=TIMEOUT, what="SUSPENDED within one session timeout")
    finally:
        go.set()
        end_outage()
        s.close()


def test_embedded_suspended_is_announced_while_the_lease_still_holds(tmp_path: pathlib.Path) -> None:
    timeout = 8.0
    path = tmp_path / "m.db"
    s = open_store(f"embedded:{path}", session_timeout=timeout)
    s.start()
    seen: list[tuple[float, float]] = []

    def on_state(state: SessionState) -> None:
        if state is SessionState.SUSPENDED:
            seen.append((time.monotonic(), s._last_renewal))  # type: ignore[attr-defined]

    s.add_listener(on_state)
    blocker = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        wait_for(lambda: seen, timeout=2 * timeout, what="SUSPENDED")
        at, last_renewal = seen[0]
        # An ordering, not a speed: the holder hears SUSPENDED before anyone may purge its session.
        assert at - last_renewal < timeout, (
            f"SUSPENDED {at - last_renewal:.2f}s after the last renewal (lease {timeout}s)"
        )
        assert not s.is_connected
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        s.close()


def test_embedded_is_connected_is_false_once_the_lease_is_not_extended(tmp_path: pathlib.Path) -> None:
    """`_renew` sets `_last_renewal` between the UPDATE and the COMMIT. If anything after the
    UPDATE fails (here the events pruning, made to fail by an authorizer; in the field a full disk
    or an I/O error at COMMIT), the lease in the file is not extended, yet `is_connected` stays
    true; another process purges the session (and its ephemerals) while it still says connected."""
    path = tmp_path / "m.db"
    s = open_store(f"embedded:{path}", session_timeout=TIMEOUT)
    other = open_store(f"embedded:{path}", session_timeout=TIMEOUT)
    s.start()
    other.start()
    try:
        s.create("/owner", ephemeral=True)

        def deny_event_pruning(action: int, arg1: str | None, *_: object) -> int:
            if action == sqlite3.SQLITE_DELETE and arg1 == "events":
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        s._lease_db.set_authorizer(deny_event_pruning)  # type: ignore[attr-defined]
        # Once the lease is over, the other process may (and does) purge it.
        wait_for(lambda: other.exists("/owner") is None, timeout=10 * TIMEOUT, what="the session to be purged")
        # ... by then this process must not believe it still holds its session.
        assert not s.is_connected, "is_connected is True although the session was purged by another process"
    finally:
        s._lease_db.set_authorizer(None)  # type: ignore[attr-defined]
        other.close()
        s.close()


def test_embedded_watch_catch_up_does_not_freeze_the_lease_thread(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.db"
    s = open_store(f"embedded:{path}", session_timeout=TIMEOUT)
    s.start()
    states: list[SessionState] = []
    s.add_listener(states.append)
    blocker = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        s.create("/x")
        s.set("/x", b"1")
        wait_for(lambda: s._processed > 0, what="the poller to see the writes")  # type: ignore[attr-defined]
        blocker.execute("BEGIN EXCLUSIVE")  # another process mid-transaction
        # A writer of this process waits for the file (holding the store's lock for up to 30 s).
        writer = threading.Thread(target=lambda: _swallow(lambda: s.set("/x", b"2")), daemon=True)
        writer.start()
        time.sleep(0.2)
        # A reader whose snapshot the poller overtook before it registered its watch (a race
        # between `_reading()` and `_add_watch()` in get/exists/children): `since` < `_processed`.
        reader = threading.Thread(
            target=lambda: _swallow(lambda: s._add_watch("data", "/elsewhere", lambda e: None, 0)),  # type: ignore[attr-defined]
            daemon=True,
        )
        reader.start()
        time.sleep(0.2)
        # Other processes keep writing (the file is contended; SQLite's busy handler is not fair,
        # so our writer keeps waiting): one commits an event, then locks the file again.
        blocker.execute("INSERT INTO events (path, kind, at) VALUES ('/elsewhere', 'changed', ?)", (time.time(),))
        blocker.execute("COMMIT")
        blocker.execute("BEGIN EXCLUSIVE")
        wait_for(lambda: SessionState.SUSPENDED in states, timeout=TIMEOUT, what="SUSPENDED within one session timeout")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        s.close()


def _swallow(fn: Callable[[], object]) -> None:
    try:
        fn()
    except errors.MetadataError:
        pass


def test_recursive_delete_honours_the_version(store: MetadataStore) -> None:
    store.create("/v/kid", make_parents=True)
    store.set("/v", b"changed")  # version 1
    with pytest.raises(errors.MetadataVersionError):
        store.delete("/v", version=0, recursive=True)
    assert store.exists("/v/kid") is not None


def test_recursive_delete_of_a_missing_entry_is_not_found(store: MetadataStore) -> None:
    with pytest.raises(errors.MetadataNotFoundError):
        store.delete("/missing", recursive=True)


def test_same_watcher_registered_twice_fires_once(store: MetadataStore) -> None:
    """The embedded store keeps one registration per (watcher, path), "as ZooKeeper". The
    ZooKeeper store does not: the leader's `rebalance` re-registers `_on_change` on every entry
    every 2 s, and each registration stays in kazoo until the entry changes (unbounded growth,
    then N callbacks for one change)."""
    calls: list[WatchEvent] = []

    def watcher(e: WatchEvent) -> None:
        calls.append(e)

    store.create("/d")
    for _ in range(5):
        store.get("/d", watch=watcher)
    store.set("/d", b"x")
    wait_for(lambda: calls, what="the watch")
    time.sleep(0.5)
    assert calls == [WatchEvent(EventType.CHANGED, "/d")]


def test_watch_event_path_when_the_path_starts_like_the_chroot(store: MetadataStore, metadata_url: str) -> None:
    # With zk://host/waltz and the documented layout /waltz/<name>/..., every path starts with
    # the chroot's text. Use the test's own chroot name as the first path segment.
    first = "/" + metadata_url.rstrip("/").rsplit("/", 1)[1] if metadata_url.startswith("zk://") else "/waltz"
    path = first + "/default/assignment"
    store.create(path, b"", make_parents=True)
    seen: list[WatchEvent] = []
    store.get(path, watch=seen.append)
    store.set(path, b"1")
    wait_for(lambda: seen, what="the watch")
    assert seen == [WatchEvent(EventType.CHANGED, path)]


def test_data_may_be_any_bytes_like(store: MetadataStore) -> None:
    # Embedded: bytes(op.data) accepts it. ZooKeeper: kazoo raises TypeError, not a MetadataError.
    store.create("/ba", bytearray(b"x"))
    assert store.get("/ba")[0] == b"x"


def test_operations_after_close_raise_the_same_error(metadata_url: str) -> None:
    s = open_store(metadata_url, session_timeout=TIMEOUT)
    s.start()
    s.close()
    # Embedded: MetadataUnavailableError ("not started or closed"); ZooKeeper: MetadataSessionLostError.
    with pytest.raises(errors.MetadataUnavailableError):
        s.get("/")
