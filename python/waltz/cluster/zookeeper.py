"""The metadata store on ZooKeeper, through kazoo.

Reads and writes are retried across connection loss (kazoo's command retry), not across a
session expiry. A write retried after a lost answer may report a conflict for its own write (a
create: exists; a compare-and-set: version changed): callers re-read, which `MetadataStore.update`
does (a counter bumped this way may skip a value, never repeat one). A recursive delete is not
atomic on ZooKeeper (children first, then the entry with its version). Multi-operation
transactions are not retried (their
outcome after a lost answer is unknown, reported as `MetadataUnavailableError`).

Session states come from kazoo's listener: SUSPENDED when the connection drops (kazoo notices
within two thirds of the session timeout, before the server can expire the session), LOST when
the session expired, then CONNECTED with a new session. Listeners and watches run on our own
event thread, never on kazoo's connection thread, so they may call the store.

With credentials in the URL (`zk://user:secret@host:port/chroot`) the client authenticates with
the digest scheme and every entry it creates is readable and writable by that user only.
Otherwise a process given its role's secret (`role=`: servers their `[role_secrets] server`,
clients `client`, the CLI `WALTZ_ADMIN_SECRET`) authenticates as the digest user named after its
role, and every entry it creates takes its parent's access list: the per-role lists that
`set_role_acls` puts on a cluster's tree (`waltz cluster set-acls`; docs/operations.md, "Security
model") then carry over to every entry created later. ZooKeeper shows a digest user's password
hash only to a reader with the ADMIN permission, so a server rebuilds the list from the roles the
parent names and its own copies of their secrets (`acl_secrets`: a server's `[role_secrets]`). With
`?tls_ca=PEM&tls_cert=PEM&tls_key=PEM` the link runs inside mutual TLS (ZooKeeper's
`secureClientPort`): the server's certificate must chain to `tls_ca` and this process presents
`tls_cert`.
"""

from __future__ import annotations

import contextlib
import pathlib
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from waltz._extras import require

require("kazoo", "zookeeper", "ZooKeeper metadata")

TLS_QUERY_KEYS = ("tls_ca", "tls_cert", "tls_key")
"""The ZooKeeper URL's query parameters that turn on mutual TLS (all three or none)."""

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    OperationTimeoutError,
    RolledBackError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import EventType as KazooEvent
from kazoo.protocol.states import WatchedEvent, ZnodeStat
from kazoo.retry import RetryFailedError
from kazoo.security import ACL, Id, make_digest_acl, make_digest_acl_credential

from waltz import errors
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
from waltz.tls import TlsSection, check

_EVENTS = {
    KazooEvent.CREATED: EventType.CREATED,
    KazooEvent.CHANGED: EventType.CHANGED,
    KazooEvent.DELETED: EventType.DELETED,
    KazooEvent.CHILD: EventType.CHILD,
}
_STATES = {
    KazooState.CONNECTED: SessionState.CONNECTED,
    KazooState.SUSPENDED: SessionState.SUSPENDED,
    KazooState.LOST: SessionState.LOST,
}


def _stat(s: ZnodeStat) -> Stat:
    return Stat(
        version=s.version,
        cversion=s.cversion,
        ephemeral_owner=s.ephemeralOwner,
        num_children=s.numChildren,
        created_ms=s.ctime,
        modified_ms=s.mtime,
    )


def _error(e: Exception, what: str) -> errors.MetadataError:
    if isinstance(e, NoNodeError):
        return errors.MetadataNotFoundError(f"{what}: no such entry (or a missing parent)")
    if isinstance(e, NodeExistsError):
        return errors.MetadataExistsError(f"{what}: already exists")
    if isinstance(e, BadVersionError):
        return errors.MetadataVersionError(f"{what}: version changed since it was read")
    if isinstance(e, NotEmptyError):
        return errors.MetadataNotEmptyError(f"{what}: has children")
    if isinstance(e, ConnectionClosedError):  # a SessionExpiredError subclass: the client was closed
        return errors.MetadataUnavailableError(f"{what}: the store is not started or is closed")
    if isinstance(e, SessionExpiredError):
        return errors.MetadataSessionLostError(f"{what}: ZooKeeper session expired")
    if isinstance(e, NoAuthError):
        return errors.MetadataError(f"{what}: not authorised (check the credentials in the zk:// URL)")
    if isinstance(e, (ConnectionLoss, OperationTimeoutError, KazooTimeoutError, RetryFailedError)):
        return errors.MetadataUnavailableError(f"{what}: ZooKeeper unreachable ({type(e).__name__}); outcome unknown")
    return errors.MetadataError(f"{what}: {type(e).__name__}: {e}")


def role_acl(secrets: Mapping[str, str], *, client_reads: bool) -> list[Any]:
    """The access list of a cluster's entry: the `admin` and `server` digest users (each with its
    role's secret as password) may do everything, except that only `admin` may change access
    lists; `client` may read, where `client_reads`."""
    acl = [
        make_digest_acl("admin", secrets["admin"], all=True),
        make_digest_acl("server", secrets["server"], read=True, write=True, create=True, delete=True),
    ]
    if client_reads:
        acl.append(make_digest_acl("client", secrets["client"], read=True))
    return acl


@contextlib.contextmanager
def _mapped(what: str) -> Iterator[None]:
    try:
        yield
    except (KazooException, KazooTimeoutError, RetryFailedError) as e:
        raise _error(e, what) from e


class _Wrapped:
    """A watcher as kazoo sees it. Equal for equal watchers, so that kazoo's per-path watcher set
    keeps one registration per watcher and path, as ZooKeeper (and the embedded store) do."""

    __slots__ = ("watch", "events")

    def __init__(self, watch: Watcher, events: EventThread) -> None:
        self.watch, self.events = watch, events

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Wrapped) and other.watch == self.watch

    def __hash__(self) -> int:
        return hash(self.watch)

    def __call__(self, event: WatchedEvent) -> None:
        kind = _EVENTS.get(event.type)
        if kind is not None:  # kazoo has already stripped the chroot from event.path
            self.events.submit(self.watch, WatchEvent(kind, event.path))


class ZooKeeperStore(MetadataStore):
    """`ZooKeeperStore("host:port[,host:port]/chroot")`, or with `user:secret@` credentials."""

    def __init__(
        self,
        hosts: str,
        *,
        session_timeout: float = 10.0,
        user: str | None = None,
        secret: str | None = None,
        tls: TlsSection | None = None,
        role: tuple[str, bytes] | None = None,
        acl_secrets: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.hosts = hosts
        self.session_timeout = session_timeout
        kwargs: dict[str, Any] = {}
        self._inherit_acls = False
        if user is not None:
            kwargs["auth_data"] = [("digest", f"{user}:{secret or ''}")]
            kwargs["default_acl"] = [make_digest_acl(user, secret or "", all=True)]
        elif role is not None:
            kwargs["auth_data"] = [("digest", f"{role[0]}:{role[1].decode()}")]
            self._inherit_acls = True
        self._acl_secrets = dict(acl_secrets or {})
        if tls is not None and tls.enabled:
            # Mutual TLS to ZooKeeper's secure port; the certificate is checked against the CA (the
            # host name is not: ZooKeeper's own clients do not check it either).
            kwargs.update(use_ssl=True, verify_certs=True, ca=str(tls.ca), certfile=str(tls.cert), keyfile=str(tls.key))
        self._zk = KazooClient(
            hosts=hosts,
            timeout=session_timeout,
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 2.0},
            # ignore_expire=False: an expired session fails the call (as in the embedded store)
            # instead of silently continuing under a new session.
            command_retry={
                "max_tries": 20,
                "delay": 0.1,
                "backoff": 2,
                "max_delay": 2.0,
                "deadline": session_timeout * 2,
                "ignore_expire": False,
            },
            **kwargs,
        )
        self._user = user
        self._events: EventThread | None = None
        # Session states on their own thread: a watch callback blocked in a retried store call
        # (up to 2 x session_timeout) must not hold back SUSPENDED.
        self._states: EventThread | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        session_timeout: float = 10.0,
        role: tuple[str, bytes] | None = None,
        acl_secrets: Mapping[str, str] | None = None,
    ) -> ZooKeeperStore:
        """`zk://[user:secret@]host:port[,host:port][/chroot][?tls_ca=PEM&tls_cert=PEM&tls_key=PEM]`."""
        parsed = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        unknown = sorted(set(query) - set(TLS_QUERY_KEYS))
        if unknown:
            raise errors.MetadataError(
                f"bad ZooKeeper URL: unknown parameter(s) {', '.join(unknown)} (known: {', '.join(TLS_QUERY_KEYS)})"
            )
        tls = None
        if query:
            paths = [pathlib.Path(query[k][-1]) if k in query else None for k in TLS_QUERY_KEYS]
            try:
                check(paths, TLS_QUERY_KEYS, "ZooKeeper URL")
            except errors.ConfigError as e:
                raise errors.MetadataError(str(e)) from None
            tls = TlsSection(*paths)
        netloc = parsed.netloc
        user = secret = None
        if "@" in netloc:
            cred, netloc = netloc.rsplit("@", 1)
            user, _, secret = cred.partition(":")
            user, secret = urllib.parse.unquote(user), urllib.parse.unquote(secret)
        if not netloc:
            raise errors.MetadataError(f"bad ZooKeeper URL {url!r}: expected zk://host:port[/chroot]")
        chroot = parsed.path.rstrip("/")
        return cls(
            netloc + chroot,
            session_timeout=session_timeout,
            user=user,
            secret=secret,
            tls=tls,
            role=role,
            acl_secrets=acl_secrets,
        )

    def start(self, timeout: float = 15.0) -> None:
        self._events = EventThread(f"waltz-zookeeper-events {self.hosts}")
        self._states = EventThread(f"waltz-zookeeper-states {self.hosts}")
        self._zk.add_listener(self._on_kazoo_state)
        try:
            with warnings.catch_warnings():
                # kazoo warns that the chroot is missing; it is created just below.
                warnings.simplefilter("ignore", UserWarning)
                self._zk.start(timeout=timeout)
        except KazooTimeoutError as e:
            self._zk.stop()
            self._zk.close()
            self._events.stop()
            self._states.stop()
            raise errors.MetadataUnavailableError(f"cannot reach ZooKeeper at {self.hosts} within {timeout}s") from e
        chroot = self._zk.chroot
        if chroot:
            # kazoo does not create the chroot itself.
            with self._unrooted() as zk, _mapped(f"creating chroot {chroot}"):
                zk.retry(zk.ensure_path, chroot)

    @contextlib.contextmanager
    def _unrooted(self) -> Iterator[KazooClient]:
        chroot = self._zk.chroot
        self._zk.chroot = ""
        try:
            yield self._zk
        finally:
            self._zk.chroot = chroot

    def close(self) -> None:
        self._zk.remove_listener(self._on_kazoo_state)
        try:
            self._zk.stop()
        finally:
            self._zk.close()
            if self._events is not None:
                self._events.stop()
            if self._states is not None:
                self._states.stop()

    def _on_kazoo_state(self, state: str) -> None:
        # Runs on kazoo's connection thread: hand over, never block here.
        if self._states is not None:
            self._states.submit(self._notify, _STATES[state])

    def call_soon(self, fn: Callable[[], None]) -> None:
        if self._events is not None:
            self._events.submit(fn)

    @property
    def session_id(self) -> int:
        cid = self._zk.client_id
        return int(cid[0]) if cid else 0

    @property
    def is_connected(self) -> bool:
        return bool(self._zk.state == KazooState.CONNECTED)

    @property
    def description(self) -> str:
        return f"zk://{self.hosts}"

    def _wrap(self, watch: Watcher | None) -> Any:
        if watch is None:
            return None
        assert self._events is not None
        return _Wrapped(watch, self._events)

    def create(
        self,
        path: str,
        data: bytes = b"",
        *,
        ephemeral: bool = False,
        sequential: bool = False,
        make_parents: bool = False,
    ) -> str:
        check_path(path)
        with _mapped(f"create {path}"):
            acl = self._inherited_acl(path)
            if sequential:
                # Not retried: a retry after a lost answer would create a second entry.
                return str(
                    self._zk.create(
                        path, bytes(data), acl=acl, ephemeral=ephemeral, sequence=True, makepath=make_parents
                    )
                )
            return str(
                self._zk.retry(self._zk.create, path, bytes(data), acl=acl, ephemeral=ephemeral, makepath=make_parents)
            )

    def _inherited_acl(self, path: str, pending: Mapping[str, Any] | None = None) -> Any:
        """The access list a new entry at `path` takes: its parent's, for a store that logged in
        as a role (None otherwise: kazoo's default). `pending`: lists of entries a transaction
        creates before this one."""
        if not self._inherit_acls:
            return None
        parent = parent_of(path)
        if pending is not None and parent in pending:
            return pending[parent]
        # The nearest existing ancestor's: parents made on the way (makepath) get the same list.
        while parent != "/":
            try:
                acl, _ = self._zk.retry(self._zk.get_acls, parent)
            except NoNodeError:
                parent = parent_of(parent)
                continue
            return [self._unmasked(a, path) for a in acl]
        return None

    def _unmasked(self, entry: Any, path: str) -> Any:
        """`entry` of a parent's list with the digest user's hash restored from our copy of that
        role's secret (ZooKeeper masks it, `user:x`, for readers without the ADMIN permission)."""
        if entry.id.scheme != "digest" or not entry.id.id.endswith(":x"):
            return entry
        user = entry.id.id[:-2]
        secret = self._acl_secrets.get(user)
        if not secret:
            raise errors.MetadataError(
                f"create {path}: its parent's access list names the {user} role, whose secret this process "
                f"does not have ([role_secrets] {user}): it cannot give the new entry the same list"
            )
        return ACL(entry.perms, Id("digest", make_digest_acl_credential(user, secret)))

    def set_role_acls(self, root: str, client_reads: Callable[[str], bool], secrets: Mapping[str, str]) -> int:
        missing = [r for r in ("server", "admin", "client") if not secrets.get(r)]
        if missing:
            raise errors.ClusterError(
                f"per-role ACLs need the server, admin and client secrets; missing: {', '.join(missing)}"
            )
        done = 0
        pending = [check_path(root)]
        with _mapped(f"setting the access lists under {root}"):
            while pending:
                path = pending.pop()
                self._zk.retry(self._zk.set_acls, path, role_acl(secrets, client_reads=client_reads(path)))
                done += 1
                pending.extend(f"{path.rstrip('/')}/{c}" for c in self._zk.retry(self._zk.get_children, path))
        return done

    def get(self, path: str, watch: Watcher | None = None) -> tuple[bytes, Stat]:
        with _mapped(f"get {check_path(path)}"):
            data, stat = self._zk.retry(self._zk.get, path, watch=self._wrap(watch))
        return bytes(data), _stat(stat)

    def exists(self, path: str, watch: Watcher | None = None) -> Stat | None:
        with _mapped(f"exists {check_path(path)}"):
            stat = self._zk.retry(self._zk.exists, path, watch=self._wrap(watch))
        return None if stat is None else _stat(stat)

    def set(self, path: str, data: bytes, version: int = -1) -> Stat:
        with _mapped(f"set {check_path(path)}"):
            return _stat(self._zk.retry(self._zk.set, path, bytes(data), version=version))

    def delete(self, path: str, version: int = -1, *, recursive: bool = False) -> None:
        if check_path(path) == "/":
            raise errors.MetadataError("/ cannot be deleted")
        with _mapped(f"delete {path}"):
            if recursive:
                # Not kazoo's recursive delete: it ignores `version` and a missing entry.
                stat = self._zk.retry(self._zk.exists, path)
                if stat is None:
                    raise NoNodeError()
                if version >= 0 and stat.version != version:
                    raise BadVersionError()
                for child in self._zk.retry(self._zk.get_children, path):
                    self._delete_tree(f"{path}/{child}")
            self._zk.retry(self._zk.delete, path, version=version)

    def _delete_tree(self, path: str) -> None:
        try:
            for child in self._zk.retry(self._zk.get_children, path):
                self._delete_tree(f"{path}/{child}")
            self._zk.retry(self._zk.delete, path)
        except NoNodeError:
            pass

    def children(self, path: str, watch: Watcher | None = None) -> list[str]:
        with _mapped(f"children of {check_path(path)}"):
            return sorted(self._zk.retry(self._zk.get_children, path, watch=self._wrap(watch)))

    def transaction(self, ops: Sequence[Op]) -> list[Any]:
        t = self._zk.transaction()
        created: dict[str, Any] = {}
        for op in ops:
            check_path(op.path)
            if isinstance(op, Create):
                with _mapped(f"create {op.path}"):
                    created[op.path] = acl = self._inherited_acl(op.path, created)
                t.create(op.path, bytes(op.data), acl=acl, ephemeral=op.ephemeral, sequence=op.sequential)
            elif isinstance(op, SetData):
                t.set_data(op.path, bytes(op.data), version=op.version)
            elif isinstance(op, Delete):
                t.delete(op.path, version=op.version)
            elif isinstance(op, Check):
                t.check(op.path, op.version)
            else:
                raise errors.MetadataError(f"unknown transaction operation {op!r}")
        with _mapped("transaction"):
            results = t.commit()
        for i, (op, r) in enumerate(zip(ops, results)):
            if isinstance(r, Exception) and not isinstance(r, RolledBackError):
                cause = _error(r, f"{type(op).__name__.lower()} {op.path}")
                raise errors.MetadataTransactionError(f"transaction failed at operation {i} ({op}): {cause}", i, cause)
        out: list[Any] = []
        for r in results:
            out.append(_stat(r) if isinstance(r, ZnodeStat) else r)
        return out
