"""The cluster manager: which server serves which partition, under which generation.

Every server runs a `ServerMembership`. It registers the server (an ephemeral entry that also
reports the partitions the server is serving right now), stands in the leader election, and
delivers the server's share of the assignment to the server. The elected leader computes the
assignment with `plan()`, a pure function, and writes it with compare-and-set.

At most one server serves a partition at any moment:
- a server stops serving everything as soon as its metadata session is SUSPENDED or LOST, which
  happens before the store can expire the session (kazoo notices a dead connection within two
  thirds of the session timeout; the embedded store suspends at half the lease);
- a partition leaves a live server in two steps: the leader first unassigns it (the owner
  stops and reports that it no longer serves it), and only then gives it to the new owner;
- a partition of a server whose session ended (crash, kill -9, partition from the store) is
  given away directly: its ephemeral registration is gone only after the session expired.
Every change of owner, including to "nobody", bumps the partition's generation, and the
generation lives in the same entry as the owner, so a generation is never handed out twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from waltz import clock, errors
from waltz.cluster.layout import decode, encode
from waltz.cluster.metadata import Assignment, ClusterMetadata, PartitionAssignment, ServerInfo
from waltz.cluster.store import ChildrenWatch, DataWatch, EphemeralRegistration, SessionState, WatchEvent, join

log = logging.getLogger(__name__)


def plan(partitions: int, servers: Mapping[int, ServerInfo], current: Assignment) -> Assignment:
    """The next assignment, given the live servers (with what they report serving) and the current one.

    A server counts as the owner only in the incarnation (metadata session) it was given the
    partition in. Balanced (loads differ by at most one, preferences aside), sticky (a partition stays where it
    is unless balance or a preference moves it), preferred partitions go to the lowest-id live
    server that prefers them. A move away from a live server is split in two plans: unassign,
    then, once no other live server reports serving it, assign."""
    cur = {p: current.get(p, PartitionAssignment(None, 0)) for p in range(partitions)}
    live = sorted(servers)
    if not live:
        return {p: a if a.server is None else PartitionAssignment(None, a.generation + 1) for p, a in cur.items()}

    desired: dict[int, int] = {}
    pinned: set[int] = set()
    load = {s: 0 for s in live}
    for p in range(partitions):
        fans = [s for s in live if p in servers[s].preferred]
        if fans:
            desired[p] = fans[0]
            pinned.add(p)
            load[fans[0]] += 1
    free = partitions - len(pinned)
    # Non-preferred partitions are balanced over everyone; a server's preferred ones count too.
    cap = -(-(free + sum(load.values())) // len(live))
    for p in range(partitions):
        owner = cur[p].server
        if p not in desired and owner in load and servers[owner].session == cur[p].session and load[owner] < cap:
            desired[p] = owner
            load[owner] += 1
    for p in range(partitions):
        if p not in desired:
            s = min(live, key=lambda x: (load[x], x))
            desired[p] = s
            load[s] += 1
    while True:
        hi = max(live, key=lambda x: (load[x], -x))
        lo = min(live, key=lambda x: (load[x], x))
        movable = [p for p in range(partitions) if desired[p] == hi and p not in pinned]
        if load[hi] - load[lo] <= 1 or not movable:
            break
        # Move the partition that is not currently served by `hi` if there is one (cheapest).
        p = next((q for q in movable if cur[q].server != hi), movable[-1])
        desired[p] = lo
        load[hi] -= 1
        load[lo] += 1

    def alive(a: PartitionAssignment) -> bool:
        return a.server is not None and a.server in servers and servers[a.server].session == a.session

    out: Assignment = {}
    for p, a in cur.items():
        want = desired[p]
        if a.server == want and alive(a):
            out[p] = a
        elif alive(a):
            out[p] = PartitionAssignment(None, a.generation + 1)  # step 1: the live owner lets go
        elif any(p in servers[s].serving for s in live if s != want):
            out[p] = a if a.server is None else PartitionAssignment(None, a.generation + 1)  # still letting go
        else:
            out[p] = PartitionAssignment(want, a.generation + 1, servers[want].session)
    return out


Deliver = Callable[[dict[int, int]], None]


class ServerMembership:
    """A server's membership: registration, leader election, and its partitions.

    `deliver(partitions)` is called with {partition: generation} every time the server's share
    changes, and with {} the moment the metadata session is in doubt. It runs on one of the
    store's threads (serialised) and must return only once the server serves exactly that set,
    without calling the store: the membership then reports it, and the leader waits for that
    report before handing a partition on."""

    REBALANCE_INTERVAL = 2.0

    def __init__(
        self,
        metadata: ClusterMetadata,
        host: str,
        port: int,
        deliver: Deliver,
        *,
        preferred: tuple[int, ...] = (),
        server_id: int | None = None,
    ) -> None:
        self.metadata = metadata
        self.store = metadata.store
        self.host, self.port, self.preferred = host, port, tuple(preferred)
        self._deliver = deliver
        self.server_id = server_id if server_id is not None else metadata.next_id("server")
        self._serving: dict[int, int] = {}
        self._claiming: dict[int, int] = {}
        self._serving_lock = threading.RLock()
        self._started_ms = clock.now_ms()
        self._registration: EphemeralRegistration | None = None
        self._candidate: EphemeralRegistration | None = None
        self._watches: list[DataWatch | ChildrenWatch] = []
        self._leader = False
        self._dirty = threading.Event()
        self._report_needed = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def serving(self) -> dict[int, int]:
        with self._serving_lock:
            return dict(self._serving)

    @property
    def is_leader(self) -> bool:
        return self._leader

    def _info(self) -> bytes:
        """The registration: what is served, plus what is being claimed (never under-reported)."""
        reported = {**self._serving, **self._claiming}
        return encode(
            ServerInfo(self.server_id, self.host, self.port, self.preferred, reported, self._started_ms).to_json()
        )

    def start(self) -> None:
        self.metadata.info()  # a clear error now if the cluster does not exist
        self.store.add_listener(self._on_state)
        self._registration = EphemeralRegistration(self.store, self.metadata.paths.server(self.server_id), self._info())
        self._candidate = EphemeralRegistration(
            self.store, join(self.metadata.paths.manager, "candidate-"), encode(self.server_id), sequential=True
        )
        for target, name in ((self._lead, "cluster-manager"), (self._report_loop, "serving-report")):
            t = threading.Thread(target=target, name=f"waltz-{name} {self.server_id}", daemon=True)
            t.start()
            self._threads.append(t)
        self._watches.append(self.metadata.watch_assignment(self._on_assignment))
        self._watches.append(ChildrenWatch(self.store, self.metadata.paths.manager, self._on_candidates))
        log.info("server %d registered at %s:%d", self.server_id, self.host, self.port)

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        self._report_needed.set()
        for w in self._watches:
            w.stop()
        self.store.remove_listener(self._on_state)
        for t in self._threads:
            t.join(timeout=10)
        self._set_serving({})
        for reg in (self._candidate, self._registration):
            if reg is not None:
                reg.close()

    # -- this server's share -----------------------------------------------------------------
    def _on_state(self, state: SessionState) -> None:
        # On the session-state thread: stopping must not wait for any store call.
        if state is not SessionState.CONNECTED:
            log.warning("server %d: metadata session %s; serving nothing until it is back", self.server_id, state.value)
            self._set_serving({})
        else:
            self._dirty.set()
            self.store.call_soon(self._reread_assignment)

    def _reread_assignment(self) -> None:
        try:
            assignment, _ = self.metadata.assignment()
        except errors.WaltzError as e:
            log.warning("server %d: cannot read the assignment after reconnecting: %s", self.server_id, e)
            return
        self._on_assignment(assignment)

    def _on_assignment(self, assignment: Assignment) -> None:
        session = self.store.session_id
        mine = {p: a.generation for p, a in assignment.items() if a.server == self.server_id and a.session == session}
        self._set_serving(mine)

    def _set_serving(self, partitions: dict[int, int]) -> None:
        """Serves exactly `partitions`. New ones are claimed first: the claim is written into the
        registration, then the assignment is read again and only what is still ours (same
        incarnation, same generation) is started. The leader reads the assignment before the
        registrations, so either it saw the claim (and waits for us to let go) or it wrote its
        move before the claim, and the confirming read sees the move. Store work happens
        outside the lock, so a concurrent stop (SUSPENDED) never waits for the store."""
        with self._serving_lock:
            if self._stop.is_set():
                partitions = {}  # closed (or closing): nothing, whatever a late event says
            added = {p: g for p, g in partitions.items() if self._serving.get(p) != g}
            if added:
                self._claiming = dict(added)
                claim = self._info()
        if added and self._registration is not None:
            try:
                self._registration.update(claim)
                current, _ = self.metadata.assignment()
            except errors.WaltzError as e:
                log.info("server %d: cannot claim %s yet (retrying): %s", self.server_id, sorted(added), e)
                partitions = {p: g for p, g in partitions.items() if p not in added}
                retry = threading.Timer(1.0, self.store.call_soon, args=(self._reread_assignment,))
                retry.daemon = True
                retry.start()
            else:
                session = self.store.session_id
                partitions = {
                    p: g
                    for p, g in partitions.items()
                    if p not in added or current.get(p) == PartitionAssignment(self.server_id, g, session)
                }
        try:
            with self._serving_lock:
                if self._stop.is_set() or (partitions and not self.store.is_connected):
                    partitions = {}  # an assignment read before the session went into doubt
                if partitions != self._serving:
                    self._deliver(dict(partitions))
                    self._serving = dict(partitions)
        finally:
            with self._serving_lock:
                self._claiming = {}
            self._report_needed.set()

    def _report_loop(self) -> None:
        """Writes what the server serves into its registration, one write at a time and always the
        newest state, so a slow store never delays stopping and never reorders reports."""
        while not self._stop.is_set():
            if not self._report_needed.wait(1.0):
                continue
            self._report_needed.clear()
            if self._stop.is_set() or self._registration is None:
                return
            with self._serving_lock:
                info = self._info()
            try:
                self._registration.update(info)
            except errors.MetadataError as e:
                # Re-created with this data after a new session; retried here otherwise.
                log.info("server %d: serving %s not reported yet: %s", self.server_id, sorted(self._serving), e)
                self._report_needed.set()
                self._stop.wait(0.5)
            self._dirty.set()

    # -- leadership --------------------------------------------------------------------------
    def _on_candidates(self, names: list[str]) -> None:
        # The lowest candidate leads. Compared by the server id it holds, not by name: a candidate
        # of ours whose creation answer was lost is still ours.
        leader = False
        if names:
            first = join(self.metadata.paths.manager, sorted(names)[0])
            try:
                leader = decode(self.store.get(first)[0], first) == self.server_id
            except errors.MetadataNotFoundError:
                self._dirty.set()  # it just left; the children watch fires again
            except errors.MetadataError as e:
                log.warning("server %d: cannot read candidate %s: %s", self.server_id, first, e)
        if leader != self._leader:
            log.info("server %d %s the cluster manager", self.server_id, "is now" if leader else "is no longer")
        self._leader = leader
        self._dirty.set()

    def _on_change(self, _event: WatchEvent | None = None) -> None:
        self._dirty.set()

    def _lead(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self.REBALANCE_INTERVAL)
            self._dirty.clear()
            if self._stop.is_set():
                return
            if not (self._leader and self.store.is_connected):
                continue
            try:
                self.rebalance()
            except errors.MetadataVersionError:
                self._dirty.set()  # someone wrote in between; plan again from what is there now
            except errors.WaltzError as e:
                log.warning("cluster manager %d: rebalance failed, will retry: %s", self.server_id, e)

    def rebalance(self) -> Assignment:
        """One leader step: read the live servers and the assignment, write the next plan."""
        info = self.metadata.info()
        paths = self.metadata.paths
        # The assignment first: every registration read below is then at least as new as the
        # plan it is checked against (a claim made before a move was written is seen).
        current, version = self.metadata.assignment(watch=self._on_change)
        servers: dict[int, ServerInfo] = {}
        for name in self.store.children(paths.servers, watch=self._on_change):
            try:
                data, stat = self.store.get(join(paths.servers, name), watch=self._on_change)
            except errors.MetadataNotFoundError:
                continue
            s = ServerInfo.from_json(decode(data, join(paths.servers, name)), stat.ephemeral_owner)
            servers[s.server_id] = s
        nxt = plan(info.partitions, servers, current)
        if nxt != current and self._leader and self.store.is_connected:
            self.metadata.set_assignment(nxt, version)
            moved = {p: (current.get(p), a) for p, a in nxt.items() if current.get(p) != a}
            log.info("cluster manager %d: assignment changed: %s", self.server_id, moved)
        return nxt


__all__ = ["ServerMembership", "plan"]
