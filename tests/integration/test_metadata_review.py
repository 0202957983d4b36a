"""Regression tests from an adversarial review of the metadata stores: each failed on the code
as first written (see the numbered findings)."""

from __future__ import annotations

import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from waltz import errors
from waltz.cluster import open_store
from waltz.cluster.store import EventType, MetadataStore, SessionState, WatchEvent

from test_metadata_store import TIMEOUT, store, wait_for  # noqa: F401  (store is a fixture)


# ---------------------------------------------------------------------------------------------
# 1. SUSPENDED is starved behind a watch callback blocked in a store call (both stores).
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["embedded", "zookeeper"])
def outage(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[tuple[str, Callable[[], None], Callable[[], None]]]:
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


# ---------------------------------------------------------------------------------------------
# 2. Embedded: SUSPENDED was announced ~0.8 lease late while the file was locked (stale `now`).
# ---------------------------------------------------------------------------------------------


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
        assert at - last_renewal < timeout, f"SUSPENDED {at - last_renewal:.2f}s after the last renewal (lease {timeout}s)"
        assert not s.is_connected
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        s.close()


# ---------------------------------------------------------------------------------------------
# 3. Embedded: a renewal that did not commit still advances `_last_renewal` -> is_connected lies.
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 4. Embedded: `_add_watch` catch-up reads the DB under `_watch_lock`; the lease thread's poll
#    waits for that lock, so a writer blocked on the file freezes the heartbeat (no SUSPENDED).
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 5. ZooKeeper: recursive delete ignores the version (compare-and-delete is not checked) and
#    succeeds silently on a missing entry; the embedded store checks both.
# ---------------------------------------------------------------------------------------------


def test_recursive_delete_honours_the_version(store: MetadataStore) -> None:
    store.create("/v/kid", make_parents=True)
    store.set("/v", b"changed")  # version 1
    with pytest.raises(errors.MetadataVersionError):
        store.delete("/v", version=0, recursive=True)
    assert store.exists("/v/kid") is not None


def test_recursive_delete_of_a_missing_entry_is_not_found(store: MetadataStore) -> None:
    with pytest.raises(errors.MetadataNotFoundError):
        store.delete("/missing", recursive=True)


# ---------------------------------------------------------------------------------------------
# 6. ZooKeeper: every registration wraps the watcher in a new closure, so kazoo keeps them all.
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 7. ZooKeeper: watch event paths are un-chrooted twice (kazoo already strips the chroot).
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# 8. Interface differences a caller trips on.
# ---------------------------------------------------------------------------------------------


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
