"""The metadata store interface: a small ZooKeeper-shaped tree both implementations provide.

Paths are absolute and `/`-separated; every entry holds bytes and a version that starts at 0 and
grows by one on every `set`. Writes can compare-and-set on that version; entries can be
ephemeral (tied to the store session, gone when it ends) and sequential (a 10-digit counter is
appended to the name). Watches are one-shot, as in ZooKeeper: a callback fires at most once, on
the store's event thread, and the receiver reads again (and re-arms) to see the new state.
`DataWatch` and `ChildrenWatch` build persistent watches from them.

The session moves through CONNECTED → SUSPENDED (cannot confirm the session is alive: stop any
work that needs exclusivity) → CONNECTED (same session, resume) or LOST (the session expired and
its ephemerals are gone; a new session follows with CONNECTED). `is_connected` is the check an
exclusive holder makes before acting.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from waltz import errors

log = logging.getLogger(__name__)


class SessionState(enum.Enum):
    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"


class EventType(enum.Enum):
    CREATED = "created"
    CHANGED = "changed"
    DELETED = "deleted"
    CHILD = "child"


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    type: EventType
    path: str


@dataclasses.dataclass(frozen=True)
class Stat:
    version: int
    """Data version: 0 at creation, +1 per set."""
    cversion: int
    """Child version: +1 per child created or deleted."""
    ephemeral_owner: int
    """Session id owning an ephemeral entry, 0 for a persistent one."""
    num_children: int
    created_ms: int
    modified_ms: int


Watcher = Callable[[WatchEvent], None]
Listener = Callable[[SessionState], None]


@dataclasses.dataclass(frozen=True)
class Create:
    path: str
    data: bytes = b""
    ephemeral: bool = False
    sequential: bool = False


@dataclasses.dataclass(frozen=True)
class SetData:
    path: str
    data: bytes
    version: int = -1


@dataclasses.dataclass(frozen=True)
class Delete:
    path: str
    version: int = -1


@dataclasses.dataclass(frozen=True)
class Check:
    path: str
    version: int


Op = Create | SetData | Delete | Check


def check_path(path: str) -> str:
    if not path.startswith("/") or (path != "/" and path.endswith("/")) or "//" in path or "\x00" in path:
        raise errors.MetadataError(f"bad metadata path {path!r}: absolute, '/'-separated, no trailing '/'")
    parts = path.split("/")[1:]
    if path != "/" and any(p in (".", "..") for p in parts):
        raise errors.MetadataError(f"bad metadata path {path!r}: '.' and '..' are not names")
    return path


def parent_of(path: str) -> str:
    head = path.rsplit("/", 1)[0]
    return head or "/"


def join(*parts: str | int) -> str:
    return "/" + "/".join(str(p).strip("/") for p in parts if str(p).strip("/"))


class EventThread:
    """One thread that runs watch callbacks and session listeners in the order they happened,
    so a callback may call the store (and block) without stalling the store's own I/O."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._queue.put((fn, args))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except Exception:  # a callback's bug must not stop the others
                log.exception("metadata callback %r failed", fn)

    def stop(self) -> None:
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class MetadataStore(ABC):
    """A session with a metadata store. Thread-safe; callbacks run on one event thread."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._listeners_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    @abstractmethod
    def start(self, timeout: float = 15.0) -> None:
        """Connects and opens a session; raises `MetadataUnavailableError` after `timeout`."""

    @abstractmethod
    def close(self) -> None:
        """Ends the session: its ephemeral entries are removed at once."""

    @property
    @abstractmethod
    def session_id(self) -> int: ...

    @property
    @abstractmethod
    def is_connected(self) -> bool:
        """True while the session is known alive. An exclusive holder checks it before acting."""

    @property
    @abstractmethod
    def description(self) -> str:
        """Where this store is, for messages (`zk://host:port/chroot`, `embedded:/path`)."""

    def __enter__(self) -> MetadataStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the watch event thread (where store calls may block)."""

    # -- session listeners -----------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """`listener(state)` runs at every session state change, on the session-state thread, in
        order. It must not block and must not call the store (SUSPENDED behind a blocked store
        call would come too late): hand store work to `call_soon`."""
        with self._listeners_lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._listeners_lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _notify(self, state: SessionState) -> None:
        """Runs the listeners; implementations call it on their session-state thread."""
        with self._listeners_lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(state)
            except Exception:  # a listener's bug must not stop the others or the event thread
                log.exception("metadata session listener failed")

    # -- the tree --------------------------------------------------------------------------
    @abstractmethod
    def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequential: bool = False,
        make_parents: bool = False,
    ) -> str:
        """Creates an entry and returns its path (with the counter when sequential)."""

    @abstractmethod
    def get(self, path: str, watch: Watcher | None = None) -> tuple[bytes, Stat]:
        """Data and stat; the watch fires on the next change or deletion."""

    @abstractmethod
    def exists(self, path: str, watch: Watcher | None = None) -> Stat | None:
        """Stat or None; the watch fires on creation, change or deletion."""

    @abstractmethod
    def set(self, path: str, data: bytes, version: int = -1) -> Stat:
        """Replaces the data; with `version` >= 0 only if the entry is still at that version."""

    @abstractmethod
    def delete(self, path: str, version: int = -1, *, recursive: bool = False) -> None: ...

    @abstractmethod
    def children(self, path: str, watch: Watcher | None = None) -> list[str]:
        """Child names, sorted; the watch fires when a child is created or deleted (or the entry goes)."""

    @abstractmethod
    def transaction(self, ops: Sequence[Op]) -> list[Any]:
        """Applies every op or none. Returns per op: the created path, the new Stat, or True.
        Raises `MetadataTransactionError` naming the failing op."""

    def set_role_acls(self, root: str, client_reads: Callable[[str], bool], secrets: Mapping[str, str]) -> int:
        """Gives every entry from `root` down the per-role access list (ZooKeeper only: the
        embedded store is one file, guarded by its file mode). Returns how many entries it set."""
        raise errors.ClusterError(f"{self.description} has no access lists: per-role ACLs exist on ZooKeeper only")

    # -- built on the primitives -----------------------------------------------------------
    def ensure_path(self, path: str) -> None:
        """Creates the entry and its missing parents as empty persistent entries."""
        check_path(path)
        if path == "/" or self.exists(path) is not None:
            return
        self.ensure_path(parent_of(path))
        try:
            self.create(path)
        except errors.MetadataExistsError:
            pass

    def update(self, path: str, change: Callable[[bytes], bytes | None], *, attempts: int = 100) -> tuple[bytes, Stat]:
        """Read-modify-write with compare-and-set, retried on conflict. `change` gets the current
        data and returns the new data, or None to leave it; returns (data, stat) as stored."""
        for _ in range(attempts):
            data, stat = self.get(path)
            new = change(data)
            if new is None:
                return data, stat
            try:
                return new, self.set(path, new, version=stat.version)
            except errors.MetadataVersionError:
                continue
        raise errors.MetadataVersionError(f"{path}: still conflicting after {attempts} compare-and-set attempts")


class _PersistentWatch:
    """A watch re-armed after each event and after every new session, until `stop()`."""

    def __init__(self, store: MetadataStore, path: str) -> None:
        self._store, self._path = store, check_path(path)
        self._stopped = False
        self._lock = threading.Lock()
        store.add_listener(self._on_state)
        self._fire()

    def _read_and_call(self) -> None:
        raise NotImplementedError

    def _fire(self, _event: WatchEvent | None = None) -> None:
        with self._lock:
            if self._stopped:
                return
            try:
                self._read_and_call()
            except errors.MetadataError as e:
                # Re-armed by the next CONNECTED.
                log.warning("watch on %s not re-armed: %s", self._path, e)

    def _on_state(self, state: SessionState) -> None:
        if state is SessionState.CONNECTED:
            self._store.call_soon(self._fire)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._store.remove_listener(self._on_state)


class DataWatch(_PersistentWatch):
    """Calls `fn(data, stat)` now and after every change; `(None, None)` while the entry is absent."""

    def __init__(self, store: MetadataStore, path: str, fn: Callable[[bytes | None, Stat | None], None]) -> None:
        self._fn = fn
        super().__init__(store, path)

    def _read_and_call(self) -> None:
        try:
            data, stat = self._store.get(self._path, watch=self._fire)
        except errors.MetadataNotFoundError:
            # Absent: watch for its creation (and read again if it appeared in between).
            if self._store.exists(self._path, watch=self._fire) is not None:
                return self._read_and_call()
            self._fn(None, None)
            return
        self._fn(data, stat)


class ChildrenWatch(_PersistentWatch):
    """Calls `fn(children)` now and after every child change; `[]` while the entry is absent."""

    def __init__(self, store: MetadataStore, path: str, fn: Callable[[list[str]], None]) -> None:
        self._fn = fn
        super().__init__(store, path)

    def _read_and_call(self) -> None:
        try:
            names = self._store.children(self._path, watch=self._fire)
        except errors.MetadataNotFoundError:
            if self._store.exists(self._path, watch=self._fire) is not None:
                return self._read_and_call()
            names = []
        self._fn(names)


class EphemeralRegistration:
    """An ephemeral entry that is re-created after a lost session (with its current data).

    With `sequential=True` each re-creation gets a new name; `path` is the current one."""

    RETRY_SECONDS = 1.0

    def __init__(self, store: MetadataStore, path: str, data: bytes, *, sequential: bool = False) -> None:
        self._store, self._base, self._data, self._sequential = store, check_path(path), data, sequential
        self._lock = threading.Lock()
        self._closed = False
        # Listen first: a session lost while the entry is being created still re-creates it.
        store.add_listener(self._on_state)
        try:
            self.path = self._create()
        except BaseException:
            store.remove_listener(self._on_state)
            raise

    def _create(self) -> str:
        try:
            return self._store.create(
                self._base, self._data, ephemeral=True, sequential=self._sequential, make_parents=True
            )
        except errors.MetadataExistsError:
            # Ours from before a reconnect (same session), or a leftover of an expired one that the
            # store has not purged yet: replace it only if it is not another live session's.
            _, stat = self._store.get(self._base)
            if stat.ephemeral_owner != self._store.session_id:
                raise
            self._store.set(self._base, self._data)
            return self._base

    def _on_state(self, state: SessionState) -> None:
        if state is SessionState.CONNECTED:
            self._store.call_soon(self._ensure)

    def _ensure(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                stat = self._store.exists(self.path)
                if stat is None or stat.ephemeral_owner != self._store.session_id:
                    self.path = self._create()
                    log.info("re-created ephemeral %s after a new metadata session", self.path)
                return
            except errors.MetadataError as e:
                log.warning("could not re-create ephemeral %s yet (retrying): %s", self._base, e)
        retry = threading.Timer(self.RETRY_SECONDS, self._store.call_soon, args=(self._ensure,))
        retry.daemon = True
        retry.start()

    def update(self, data: bytes) -> None:
        """Replaces the data; kept for re-creation even when the write itself fails now. The write
        goes out after the lock is let go: with the store unreachable it waits for as long as that
        lasts, and `close` takes the lock (a server stopping while ZooKeeper was down waited for
        ever; a re-creation meanwhile already carries this data)."""
        with self._lock:
            self._data = data
            path = self.path
        self._store.set(path, data)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._store.remove_listener(self._on_state)
        # The entry goes with the session its owner is about to close; deleting it first only
        # lets the others see it go at once. Without a session (the store unreachable) that
        # delete would retry for up to twice the session timeout, holding up a stopping server
        # (torture seed 89: past its 60 s).
        if not self._store.is_connected:
            return
        try:
            self._store.delete(self.path)
        except errors.MetadataError:
            pass
