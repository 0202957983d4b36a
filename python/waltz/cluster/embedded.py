"""The embedded metadata store: the same tree as ZooKeeper in one SQLite file, for one machine.

Every process that opens the file gets its own session, a row with a lease that a background
thread renews every quarter of `session_timeout` (each renewal bumps the row's `beat`). Whoever
writes next purges the sessions whose lease ran out, together with their ephemeral entries, so a
killed process's registrations vanish one lease after its last renewal, as with ZooKeeper.
Writes run in `BEGIN IMMEDIATE` transactions (one writer at a time across processes,
`synchronous=FULL`: a compare-and-set that returned survives a crash). Each write appends to an
`events` table; each process polls it and fires its one-shot watches, so watches cross processes
without a server.

Time: no wall clock decides a lease. The processes sharing the file have a wall clock each,
which may be stepped or skewed (the torture run's clock faults do it to one process at a time):
a lease compared against another process's wall clock ended every other session whenever one
process's clock stepped forward. So a process purges a session only when it has seen the
session's `beat` unchanged for the session's whole timeout on its own monotonic clock; a session
it has just started watching gets a whole timeout from then. The session's own view
(`is_connected`) is measured on the monotonic clock from before the renewal was written and turns
false half a lease after it, well before anyone else may purge it; a full lease after it, the
session counts itself lost. The wall-clock `expires` column is still written, for processes of
an older version sharing the file.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from waltz import clock, errors
from waltz.cluster.store import (
    Check,
    Create,
    Delete,
    EventThread,
    EventType,
    MetadataStore,
    Op,
    SessionState,
    SetData,
    Stat,
    Watcher,
    WatchEvent,
    check_path,
    parent_of,
)
from waltz.private_files import create_private

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    path TEXT PRIMARY KEY,
    parent TEXT,
    data BLOB NOT NULL,
    version INTEGER NOT NULL,
    cversion INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    owner INTEGER NOT NULL,
    ctime_ms INTEGER NOT NULL,
    mtime_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS nodes_parent ON nodes(parent);
CREATE INDEX IF NOT EXISTS nodes_owner ON nodes(owner);
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    expires REAL NOT NULL,
    timeout REAL NOT NULL,
    pid INTEGER NOT NULL,
    beat INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    zxid INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL,
    kind TEXT NOT NULL,
    at REAL NOT NULL
);
INSERT OR IGNORE INTO nodes VALUES ('/', NULL, x'', 0, 0, 0, 0, 0, 0);
"""

# Only the newest this many events are kept; a process that fell further behind fires every
# watch it holds on the gap (receivers re-read). Counted, not timed: pruning by age against the
# pruner's wall clock let a process whose clock stepped minutes ahead delete events the others
# had not polled yet, and when nothing newer followed, nobody noticed the gap.
_EVENTS_KEPT = 10_000

_COLUMNS = "data, version, cversion, owner, ctime_ms, mtime_ms, (SELECT count(*) FROM nodes c WHERE c.parent = n.path)"


def _add_beat(db: sqlite3.Connection) -> None:
    """A store file made before sessions had a beat gets the column (processes starting together
    may race to add it: the loser's error is the winner's success)."""
    if any(c[1] == "beat" for c in db.execute("PRAGMA table_info(sessions)")):
        return
    try:
        db.execute("ALTER TABLE sessions ADD COLUMN beat INTEGER NOT NULL DEFAULT 0")
    except sqlite3.OperationalError as e:
        if "duplicate column" not in str(e):
            raise


def _stat(row: Sequence[Any]) -> Stat:
    return Stat(
        version=row[1],
        cversion=row[2],
        ephemeral_owner=row[3],
        created_ms=row[4],
        modified_ms=row[5],
        num_children=row[6],
    )


class EmbeddedStore(MetadataStore):
    """`EmbeddedStore(path)`: the metadata tree in the SQLite file at `path` (created if absent)."""

    def __init__(
        self, path: str | os.PathLike[str], *, session_timeout: float = 10.0, poll_interval: float = 0.05
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.session_timeout = session_timeout
        self.poll_interval = poll_interval
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        self._lease_db: sqlite3.Connection | None = None
        self._session = 0
        self._state = SessionState.LOST
        self._last_renewal = 0.0
        # Session id -> (its beat, monotonic time this process first saw that beat): the purge's
        # evidence, shared by the writer and the lease thread.
        self._seen: dict[int, tuple[int, float]] = {}
        self._seen_lock = threading.Lock()
        self._watch_lock = threading.Lock()
        self._watches: dict[tuple[str, str], list[tuple[int, Watcher]]] = collections.defaultdict(list)
        self._processed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: EventThread | None = None
        # Session states on their own thread: a watch callback blocked in a store call (up to the
        # busy timeout) must not hold back SUSPENDED.
        self._states: EventThread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def _connect(self, busy_timeout: float = 30.0) -> sqlite3.Connection:
        # Created 0600 before SQLite opens it: SQLite gives its -wal and -shm files the database
        # file's mode, and the store holds the cluster key (issue 34).
        if self.path != ":memory:" and not os.path.exists(self.path):
            create_private(self.path)
        db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    def start(self, timeout: float = 15.0) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise errors.MetadataUnavailableError(
                f"embedded metadata store {self.path}: folder {directory} does not exist"
            )
        try:
            db = self._connect()
            # Every statement is idempotent, so processes starting together need no lock here.
            db.executescript(_SCHEMA)
            _add_beat(db)
        except sqlite3.DatabaseError as e:
            raise errors.MetadataUnavailableError(f"embedded metadata store {self.path}: {e}") from e
        self._db = db
        # The lease thread has its own connection with a short busy timeout: a store locked by
        # someone else must turn into SUSPENDED in time, not a renewal stuck behind the lock.
        self._lease_db = self._connect(busy_timeout=self.session_timeout / 4)
        self._events = EventThread(f"waltz-metadata-events {self.path}")
        self._states = EventThread(f"waltz-metadata-states {self.path}")
        with self._lock:
            renewed_at = time.monotonic()
            with _immediate(db):
                self._processed = self._zxid(db)
                session = self._new_session(db)
            self._session, self._last_renewal, self._state = session, renewed_at, SessionState.CONNECTED
        self._thread = threading.Thread(target=self._heartbeat, name=f"waltz-metadata-lease {self.path}", daemon=True)
        self._thread.start()
        self._states.submit(self._notify, SessionState.CONNECTED)

    def close(self) -> None:
        if self._db is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lease_db is not None:
            self._lease_db.close()
        with self._lock:
            db, self._db = self._db, None
            try:
                with _immediate(db):
                    self._end_session(db, self._session)
            except sqlite3.DatabaseError as e:
                log.warning(
                    "%s: could not end session %d cleanly (it expires by itself): %s", self.path, self._session, e
                )
            db.close()
        self._state = SessionState.LOST
        if self._events is not None:
            self._events.stop()
        if self._states is not None:
            self._states.stop()

    def call_soon(self, fn: Callable[[], None]) -> None:
        if self._events is not None:
            self._events.submit(fn)

    @property
    def session_id(self) -> int:
        return self._session

    @property
    def is_connected(self) -> bool:
        return (
            self._db is not None
            and self._state is SessionState.CONNECTED
            and time.monotonic() - self._last_renewal < self.session_timeout / 2
        )

    @property
    def description(self) -> str:
        return f"embedded:{self.path}"

    # -- sessions --------------------------------------------------------------------------
    def _new_session(self, db: sqlite3.Connection) -> int:
        """Inserts a session row; the caller adopts it only once the transaction committed."""
        cur = db.execute(
            "INSERT INTO sessions (expires, timeout, pid) VALUES (?, ?, ?)",
            (clock.time() + self.session_timeout, self.session_timeout, os.getpid()),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def _end_session(self, db: sqlite3.Connection, session: int) -> None:
        for (path,) in db.execute(
            "SELECT path FROM nodes WHERE owner = ? ORDER BY length(path) DESC", (session,)
        ).fetchall():
            self._remove(db, path)
        db.execute("DELETE FROM sessions WHERE id = ?", (session,))

    def _purge(self, db: sqlite3.Connection) -> None:
        rows = db.execute("SELECT id, beat, timeout FROM sessions").fetchall()
        now, expired = time.monotonic(), []
        with self._seen_lock:
            seen, self._seen = self._seen, {}
            for sid, beat, timeout in rows:
                last = seen.get(sid)
                if last is None or last[0] != beat:
                    last = (beat, now)
                elif now - last[1] >= timeout:
                    expired.append(sid)
                self._seen[sid] = last
        for sid in expired:
            log.info("%s: metadata session %d expired; removing its ephemeral entries", self.path, sid)
            self._end_session(db, sid)

    def _heartbeat(self) -> None:
        last_attempt = 0.0
        while not self._stop.wait(self.poll_interval):
            now = time.monotonic()
            if now - last_attempt >= self.session_timeout / 4:
                last_attempt = now
                self._renew()
            # _renew can block for the lease connection's busy timeout: read the clock again.
            if (
                self._state is SessionState.CONNECTED
                and time.monotonic() - self._last_renewal >= self.session_timeout / 2
            ):
                self._set_state(SessionState.SUSPENDED)
            try:
                self._poll()
            except sqlite3.DatabaseError as e:
                log.warning("%s: cannot read metadata events: %s", self.path, e)

    def _renew(self) -> None:
        db = self._lease_db
        if db is None:
            return
        # Measured before the lease is written: the local view never outlives the stored lease.
        renewed_at = time.monotonic()
        session = self._session
        try:
            with _immediate(db):
                lost = self._session_expired(db)
                if lost:  # a lapsed lease nobody purged yet: its ephemeral entries go now
                    self._end_session(db, self._session)
                self._purge(db)
                if lost:
                    session = self._new_session(db)
                else:
                    db.execute(
                        "UPDATE sessions SET expires = ?, beat = beat + 1 WHERE id = ?",
                        (clock.time() + self.session_timeout, self._session),
                    )
                db.execute("DELETE FROM events WHERE zxid <= (SELECT max(zxid) FROM events) - ?", (_EVENTS_KEPT,))
        except sqlite3.DatabaseError as e:
            log.warning("%s: cannot renew metadata session %d: %s", self.path, self._session, e)
            return
        if lost:
            self._set_state(SessionState.LOST)
        # Only now that the lease (or the new session) is committed.
        self._session, self._last_renewal = session, renewed_at
        if lost:
            log.warning("%s: metadata session expired; continuing with new session %d", self.path, self._session)
            self._set_state(SessionState.CONNECTED)
        elif self._state is SessionState.SUSPENDED:
            self._set_state(SessionState.CONNECTED)

    def _session_expired(self, db: sqlite3.Connection) -> bool:
        """Purged by someone, or a whole lease since this process last renewed it (by which
        time anyone may purge it)."""
        if time.monotonic() - self._last_renewal >= self.session_timeout:
            return True
        return db.execute("SELECT 1 FROM sessions WHERE id = ?", (self._session,)).fetchone() is None

    def _set_state(self, state: SessionState) -> None:
        if state is self._state and state is not SessionState.CONNECTED:
            return
        self._state = state
        assert self._states is not None
        self._states.submit(self._notify, state)

    # -- transactions ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._require_db()
            try:
                with _immediate(db):
                    self._purge(db)
                    if self._session_expired(db):
                        raise errors.MetadataSessionLostError(
                            f"{self.description}: metadata session {self._session} expired; ephemeral entries are gone"
                        )
                    yield db
            except sqlite3.DatabaseError as e:
                raise errors.MetadataUnavailableError(f"{self.description}: {e}") from e

    @contextlib.contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._require_db()
            try:
                db.execute("BEGIN")
                try:
                    yield db
                finally:
                    db.execute("COMMIT")
            except sqlite3.DatabaseError as e:
                raise errors.MetadataUnavailableError(f"{self.description}: {e}") from e

    def _require_db(self) -> sqlite3.Connection:
        if self._db is None:
            raise errors.MetadataUnavailableError(f"{self.description}: the store is not started or is closed")
        return self._db

    @staticmethod
    def _zxid(db: sqlite3.Connection) -> int:
        row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def _event(db: sqlite3.Connection, path: str, kind: EventType) -> None:
        db.execute("INSERT INTO events (path, kind, at) VALUES (?, ?, ?)", (path, kind.value, clock.time()))

    # -- operations inside a write transaction -----------------------------------------------
    def _row(self, db: sqlite3.Connection, path: str) -> tuple[Any, ...] | None:
        return db.execute(f"SELECT {_COLUMNS} FROM nodes n WHERE path = ?", (path,)).fetchone()  # type: ignore[no-any-return]

    def _create(self, db: sqlite3.Connection, op: Create, make_parents: bool = False) -> str:
        path = check_path(op.path)
        if path == "/":
            raise errors.MetadataExistsError("/ already exists")
        parent = parent_of(path)
        prow = db.execute("SELECT owner, seq FROM nodes WHERE path = ?", (parent,)).fetchone()
        if prow is None:
            if not make_parents:
                raise errors.MetadataNotFoundError(f"cannot create {path}: {parent} does not exist")
            self._create(db, Create(parent), make_parents=True)
            prow = (0, 0)
        if prow[0]:
            raise errors.MetadataError(f"cannot create {path}: {parent} is ephemeral and cannot have children")
        if op.sequential:
            path = f"{path}{prow[1]:010d}"
            db.execute("UPDATE nodes SET seq = seq + 1 WHERE path = ?", (parent,))
        if db.execute("SELECT 1 FROM nodes WHERE path = ?", (path,)).fetchone():
            raise errors.MetadataExistsError(f"{path} already exists")
        now = int(clock.time() * 1000)
        db.execute(
            "INSERT INTO nodes VALUES (?, ?, ?, 0, 0, 0, ?, ?, ?)",
            (path, parent, bytes(op.data), self._session if op.ephemeral else 0, now, now),
        )
        db.execute("UPDATE nodes SET cversion = cversion + 1 WHERE path = ?", (parent,))
        self._event(db, path, EventType.CREATED)
        self._event(db, parent, EventType.CHILD)
        return path

    def _checked(self, db: sqlite3.Connection, path: str, version: int) -> tuple[Any, ...]:
        row = self._row(db, check_path(path))
        if row is None:
            raise errors.MetadataNotFoundError(f"{path} does not exist")
        if version >= 0 and row[1] != version:
            raise errors.MetadataVersionError(f"{path} is at version {row[1]}, not {version}")
        return row

    def _set(self, db: sqlite3.Connection, op: SetData) -> Stat:
        self._checked(db, op.path, op.version)
        db.execute(
            "UPDATE nodes SET data = ?, version = version + 1, mtime_ms = ? WHERE path = ?",
            (bytes(op.data), int(clock.time() * 1000), op.path),
        )
        self._event(db, op.path, EventType.CHANGED)
        row = self._row(db, op.path)
        assert row is not None
        return _stat(row)

    def _delete(self, db: sqlite3.Connection, op: Delete, recursive: bool = False) -> None:
        if op.path == "/":
            raise errors.MetadataError("/ cannot be deleted")
        row = self._checked(db, op.path, op.version)
        if row[6]:
            if not recursive:
                raise errors.MetadataNotEmptyError(f"{op.path} has {row[6]} children")
            below = db.execute(
                "SELECT path FROM nodes WHERE substr(path, 1, ?) = ? ORDER BY length(path) DESC",
                (len(op.path) + 1, op.path + "/"),
            ).fetchall()
            for (p,) in below:
                self._remove(db, p)
        self._remove(db, op.path)

    def _remove(self, db: sqlite3.Connection, path: str) -> None:
        parent = parent_of(path)
        db.execute("DELETE FROM nodes WHERE path = ?", (path,))
        db.execute("UPDATE nodes SET cversion = cversion + 1 WHERE path = ?", (parent,))
        self._event(db, path, EventType.DELETED)
        self._event(db, parent, EventType.CHILD)

    # -- the interface ---------------------------------------------------------------------
    def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequential: bool = False,
        make_parents: bool = False,
    ) -> str:
        with self._writing() as db:
            return self._create(db, Create(path, data, ephemeral, sequential), make_parents)

    def get(self, path: str, watch: Watcher | None = None) -> tuple[bytes, Stat]:
        with self._reading() as db:
            row = self._row(db, check_path(path))
            zxid = self._zxid(db)
        if watch is not None and row is not None:
            self._add_watch("data", path, watch, zxid)
        if row is None:
            raise errors.MetadataNotFoundError(f"{path} does not exist")
        return bytes(row[0]), _stat(row)

    def exists(self, path: str, watch: Watcher | None = None) -> Stat | None:
        with self._reading() as db:
            row = self._row(db, check_path(path))
            zxid = self._zxid(db)
        if watch is not None:
            self._add_watch("data", path, watch, zxid)
        return None if row is None else _stat(row)

    def set(self, path: str, data: bytes, version: int = -1) -> Stat:
        with self._writing() as db:
            return self._set(db, SetData(path, data, version))

    def delete(self, path: str, version: int = -1, *, recursive: bool = False) -> None:
        with self._writing() as db:
            self._delete(db, Delete(check_path(path), version), recursive)

    def children(self, path: str, watch: Watcher | None = None) -> list[str]:
        with self._reading() as db:
            if db.execute("SELECT 1 FROM nodes WHERE path = ?", (check_path(path),)).fetchone() is None:
                raise errors.MetadataNotFoundError(f"{path} does not exist")
            rows = db.execute("SELECT path FROM nodes WHERE parent = ? ORDER BY path", (path,)).fetchall()
            zxid = self._zxid(db)
        if watch is not None:
            self._add_watch("child", path, watch, zxid)
        return sorted(p.rsplit("/", 1)[1] for (p,) in rows)

    def transaction(self, ops: Sequence[Op]) -> list[Any]:
        with self._writing() as db:
            db.execute("SAVEPOINT multi")
            results: list[Any] = []
            for i, op in enumerate(ops):
                try:
                    if isinstance(op, Create):
                        results.append(self._create(db, op))
                    elif isinstance(op, SetData):
                        results.append(self._set(db, op))
                    elif isinstance(op, Delete):
                        self._delete(db, op)
                        results.append(True)
                    elif isinstance(op, Check):
                        self._checked(db, op.path, op.version)
                        results.append(True)
                    else:
                        raise errors.MetadataError(f"unknown transaction operation {op!r}")
                except errors.MetadataError as e:
                    db.execute("ROLLBACK TO multi")
                    db.execute("RELEASE multi")
                    raise errors.MetadataTransactionError(
                        f"transaction failed at operation {i} ({op}): {e}", i, e
                    ) from e
            db.execute("RELEASE multi")
            return results

    # -- watches ---------------------------------------------------------------------------
    def _add_watch(self, kind: str, path: str, fn: Watcher, since: int) -> None:
        while True:
            with self._watch_lock:
                if since >= self._processed:
                    entries = self._watches[(kind, path)]
                    if all(f != fn for _, f in entries):  # as ZooKeeper: one registration per watcher and path
                        entries.append((since, fn))
                    return
                upto = self._processed
            # The poller already went past our snapshot: look at what it saw without us. Not under
            # _watch_lock: _reading() waits for this process's writers, and the lease thread's poll
            # must never wait for them.
            with self._reading() as db:
                rows = db.execute(
                    "SELECT zxid, path, kind FROM events WHERE zxid > ? AND zxid <= ? AND path = ? ORDER BY zxid",
                    (since, upto, path),
                ).fetchall()
            for _, p, k in rows:
                if self._matches(kind, EventType(k)):
                    assert self._events is not None
                    self._events.submit(fn, WatchEvent(EventType(k), p))
                    return
            since = upto

    @staticmethod
    def _matches(kind: str, event: EventType) -> bool:
        if kind == "data":
            return event is not EventType.CHILD
        return event in (EventType.CHILD, EventType.DELETED)

    def _poll(self) -> None:
        db = self._lease_db
        if db is None:
            return
        rows = db.execute(
            "SELECT zxid, path, kind FROM events WHERE zxid > ? ORDER BY zxid LIMIT 10000", (self._processed,)
        ).fetchall()
        if not rows:
            return
        assert self._events is not None
        with self._watch_lock:
            if rows[0][0] > self._processed + 1:
                # Events we never saw were pruned: fire everything, receivers re-read.
                log.warning(
                    "%s: missed metadata events %d..%d; firing all watches",
                    self.path,
                    self._processed + 1,
                    rows[0][0] - 1,
                )
                for (_kind, path), entries in self._watches.items():
                    for _, fn in entries:
                        self._events.submit(fn, WatchEvent(EventType.CHANGED, path))
                self._watches.clear()
            for zxid, path, kind in rows:
                event = EventType(kind)
                for wkind in ("data", "child"):
                    if not self._matches(wkind, event):
                        continue
                    found = self._watches.get((wkind, path))
                    if not found:
                        continue
                    entries = found
                    keep = [(s, fn) for s, fn in entries if s >= zxid]
                    for s, fn in entries:
                        if s < zxid:
                            self._events.submit(fn, WatchEvent(event, path))
                    if keep:
                        self._watches[(wkind, path)] = keep
                    else:
                        del self._watches[(wkind, path)]
            self._processed = rows[-1][0]


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    else:
        db.execute("COMMIT")


__all__ = ["EmbeddedStore"]
