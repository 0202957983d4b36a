"""The nemesis of a torture run: faults started and healed on a random schedule from a seed.

Each fault takes a target (a member, a link) and is healed after a random while:

    kill-storage   SIGKILL one storage node; restart it
    kill-majority  SIGKILL two of the three storage nodes at once (the cluster must stop
                   committing, not lose or invent anything); restart both
    kill-server    SIGKILL a server; restart it
    kill-zookeeper SIGKILL ZooKeeper (runs on ZooKeeper only); restart it
    pause          SIGSTOP a storage node or a server (past its session timeout: a zombie
                   writer wakes up); SIGCONT
    partition      blackhole the link to a storage node (from the servers) or to a server (from
                   the clients); heal it
    slow           delay every chunk on such a link; heal it
    reset          reset every connection on such a link and refuse new ones; heal it
    fsync-eio      fdatasync fails with EIO on a storage node (strace fault injection); the node
                   must refuse to acknowledge more. Healed as an operator would: restart it
    enospc         pwrite fails with ENOSPC on a storage node (strace); restart it
    corrupt        SIGKILL a storage node, flip a byte in a committed record of one of its
                   replicas, restart it; healed with the documented repair (docs/operations.md:
                   remove the replica's files, add the partition, recover-partition from a
                   healthy replica, make it writable)
    partial-partition  one server cut from one storage node only (the other server still
                   reaches it, and the first reaches the other nodes); heal it
    one-way        the link to a storage node or a server moves bytes one way only (a lost
                   direction: requests arrive and no answer comes back, or the reverse); heal it
    zombie         one server and half the client workers cut from the metadata store (ZooKeeper
                   behind its proxy; runs on ZooKeeper only) past the server's session timeout,
                   while they still reach the storage nodes and each other: the cut clients keep
                   sending appends to it while the others write to the server that took its
                   partitions; it must not write a byte more; heal it
    dup-client-id  a misbehaving client process (torture/bad_clients.py) mounts every partition
                   under a live honest client's id with another token: it must be refused
    oversized-locks  one sends an append with more locks than max_transaction_locks: it must be
                   rejected, never committed, the connection still answering
    stalled-reader one mounts every partition and asks for the whole log again and again without
                   reading: the servers' memory must stay bounded
                   (The three run alone, for at least 4 s, and the honest clients must commit
                   meanwhile; healed by stopping the process.)
    move-replica   move one replica of a partition to a storage node without one, with the
                   documented operator sequence (torture/membership.py; the run adds a fourth
                   storage node for it)
    stop-server    SIGTERM a server (it hands its partitions to the other at once); restart it
    remove-node    retire a storage node: its replicas moved away, `waltz storage remove-node`,
                   the process stopped; heal it by starting it and adding it back, empty
    power-loss, power-loss-majority, power-outage, disk-full, slow-disk
                   disk faults on LazyFS, a FUSE layer under the storage nodes that loses
                   unsynced writes (waltz/torture/disk.py says what each does)
    clock-step-forward, clock-step-backward
                   step the wall clock of a storage node, a server or a client worker by 5 s to
                   5 min; heal it (waltz/torture/clock_faults.py)
    clock-skew     run such a clock at 0.25x, 0.5x, 2x or 4x; heal it
                   (With the embedded metadata store, a clock fault that ran with no other kind
                   of fault must not have ended any process's metadata session.)

With `--standstill`, while the only faults active silence a minority of the replicas
(partial-partition; one-way, partition, slow or pause on a storage node), every partition must go
on committing: one that stands still that long is a problem of the run (waltz/torture/progress.py).

At most one storage node is faulted at a time (a minority of the three replicas), except by
kill-majority, power-loss-majority, power-outage and disk-full, which run alone; at most one
server; faults otherwise combine.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pathlib
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from waltz.local import LocalCluster
from waltz.local.cluster import REPLICAS
from waltz.local.zookeeper import ZooKeeperServer
from waltz.torture import clock_faults, membership, net_faults
from waltz.torture.clock_faults import CLOCK_FAULTS
from waltz.torture.disk import DISK_FAULTS, MAJORITY_DISK_FAULTS, start_disk_fault
from waltz.torture.lazyfs import LazyFs
from waltz.torture.progress import MINORITY_FAULTS, NODE_LINK_FAULTS, ProgressWatch
from waltz.torture.proxy import FaultProxy

FAULTS = (
    "kill-storage",
    "kill-majority",
    "kill-server",
    "kill-zookeeper",
    "pause",
    "partition",
    "slow",
    "reset",
    "fsync-eio",
    "enospc",
    "corrupt",
    "partial-partition",
    "one-way",
    "zombie",
    "dup-client-id",
    "oversized-locks",
    "stalled-reader",
    "move-replica",
    "stop-server",
    "remove-node",
    *DISK_FAULTS,
    *CLOCK_FAULTS,
)
BAD_CLIENT_FAULTS = ("dup-client-id", "oversized-locks", "stalled-reader")
ALONE_FAULTS = ("kill-majority", *MAJORITY_DISK_FAULTS, *BAD_CLIENT_FAULTS)
"""Faults no other fault joins: a majority of the storage nodes down or failing, and a bad client
whose honest neighbours must keep committing."""
STRACE_FAULTS = ("fsync-eio", "enospc")


# Faults whose heal goes through the metadata: the corrupt replica's repair, and the retired node
# added back (`waltz storage add-node`), which retried against a killed ZooKeeper until its deadline.
HEALS_THROUGH_METADATA = ("corrupt", "remove-node")


@dataclasses.dataclass
class Fault:
    kind: str
    targets: tuple[str, ...]
    heal_at: float
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    undo: Callable[[], None] = lambda: None
    sessions: clock_faults.SessionWatch | None = None
    """A clock fault's watch on the metadata sessions; dropped when another kind of fault joins."""
    explains_standstill: bool = False
    """Set on a minority fault that began while a partition wrote to fewer than all its replicas
    (one still catching up): silencing another may leave no majority in the write path."""


class Nemesis:
    """Starts and heals faults on `cluster`; `log(event)` records each in the run's history."""

    def __init__(
        self,
        cluster: LocalCluster,
        proxies: dict[str, FaultProxy],
        rng: random.Random,
        kinds: tuple[str, ...],
        log: Callable[[dict[str, Any]], None],
        say: Callable[[str], None],
        *,
        zookeeper: ZooKeeperServer | None = None,
        max_active: int = 2,
        hold: tuple[float, float] = (1.0, 6.0),
        committed: Callable[[], dict[int, int]] = dict,
        metadata_proxy: FaultProxy | None = None,
        cover: bool = False,
        disks: dict[str, LazyFs] | None = None,
        clients: tuple[str, ...] = (),
        client_pids: Callable[[], dict[str, int]] = dict,
        standstill: float | None = None,
    ) -> None:
        unknown = set(kinds) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)} (known: {', '.join(FAULTS)})")
        if "kill-zookeeper" in kinds and zookeeper is None:
            kinds = tuple(k for k in kinds if k != "kill-zookeeper")
        if "zombie" in kinds and metadata_proxy is None:
            kinds = tuple(k for k in kinds if k != "zombie")
        self.metadata_proxy, self.cover = metadata_proxy, cover
        self.disks = disks or {}
        if not self.disks:  # the storage nodes run on LazyFS only when the run mounted it
            kinds = tuple(k for k in kinds if k not in DISK_FAULTS)
        if set(kinds) & set(STRACE_FAULTS) and shutil.which("strace") is None:
            raise RuntimeError("fsync-eio and enospc need strace (apt install strace)")
        self.cluster, self.proxies, self.rng, self.kinds = cluster, proxies, rng, kinds
        self.zookeeper = zookeeper
        self.log, self.say = log, say
        self.max_active, self.hold = max_active, hold
        self.committed = committed
        self.client_pids = client_pids
        """The client workers' process ids by name (the zombie cuts some from the metadata store)."""
        self.active: list[Fault] = []
        self.counts: dict[str, int] = {}
        self.storage = [m.name for m in cluster.members if m.role == "storage"]
        self.servers = [m.name for m in cluster.members if m.role == "server"]
        self.clients = list(clients)  # the client workers, by the names of their clock files
        self.problems: list[str] = []
        self._other_healed_at = float("-inf")
        self.progress = None if standstill is None else ProgressWatch(self.storage, standstill=standstill)
        """The standstill check (`torture/progress.py`), when the run asks for it (`--standstill`;
        never with retention, whose checkpoint every 200 transactions opens a new session)."""

    # ---- schedule ----------------------------------------------------------------------------

    def step(self) -> None:
        """Heals what is due, and maybe starts one more fault."""
        now = time.monotonic()
        # ZooKeeper first: other heals (the corrupt replica's repair) go through the metadata.
        for f in sorted((f for f in self.active if f.heal_at <= now), key=lambda f: f.kind != "kill-zookeeper"):
            self.heal(f)
        if self.progress is not None:
            for finding in self.progress.observe(self.committed(), self.active, time.monotonic()):
                self.problems.append(finding)
                self.say(f"nemesis: {finding}")
        if len(self.active) >= self.max_active or any(f.kind in ALONE_FAULTS for f in self.active):
            return
        if self.rng.random() < 0.5 and not self.cover:
            return
        choices = [k for k in self.kinds if self._possible(k)]
        if self.cover:  # every kind once before any twice (waiting for it): a short run covers them all
            least = min(self.counts.get(k, 0) for k in self.kinds)
            choices = [k for k in choices if self.counts.get(k, 0) == least]
        if choices:
            self.start(self.rng.choice(choices))

    def heal_all(self) -> None:
        for f in sorted(self.active, key=lambda f: f.kind != "kill-zookeeper"):
            self.heal(f)

    def _busy(self, role: str) -> set[str]:
        names = self.storage if role == "storage" else self.servers
        return {t for f in self.active for t in f.targets if t in names}

    def _possible(self, kind: str) -> bool:
        storage_busy, servers_busy = self._busy("storage"), self._busy("server")
        if kind in ALONE_FAULTS:
            return not self.active
        if kind == "partial-partition":
            return not storage_busy and not servers_busy
        if kind == "zombie":
            return not servers_busy
        if kind in ("kill-server", "stop-server"):
            return not servers_busy
        if kind in membership.MEMBERSHIP_FAULTS:  # the operator's rule: a majority of the replicas reachable
            return not storage_busy and not any(f.kind == "kill-zookeeper" for f in self.active)
        if kind == "kill-zookeeper":
            return not any(f.kind == "kill-zookeeper" for f in self.active)
        if kind in ("pause", "partition", "slow", "reset", "one-way"):
            return not storage_busy or not servers_busy
        if kind in CLOCK_FAULTS:
            return bool(self._clock_targets())
        return not storage_busy

    def _pick_member(self) -> str:
        """A storage node or a server, from a role with nothing faulted yet."""
        roles = [r for r in ("storage", "server") if not self._busy(r)]
        role = self.rng.choice(roles)
        return self.rng.choice(self.storage if role == "storage" else self.servers)

    def _clock_targets(self) -> list[str]:
        """Processes a clock fault may take: members of a role with nothing faulted, and clients
        whose clock is their own."""
        busy = {t for f in self.active for t in f.targets}
        members = [*([] if self._busy("storage") else self.storage), *([] if self._busy("server") else self.servers)]
        return [*members, *(c for c in self.clients if c not in busy)]

    # ---- faults --------------------------------------------------------------------------------

    def start(self, kind: str) -> None:
        hold = self.rng.uniform(*self.hold)
        fault = Fault(kind, (), time.monotonic() + hold)
        c = self.cluster
        # Measured before the fault strikes: its own replica leaves the write path soon after.
        in_path = c.server_metric("waltz_server_replicas_in_write_path") if self._may_be_judged(kind) else {}
        if kind == "kill-storage":
            fault.targets = (self.rng.choice(self.storage),)
            c.kill(fault.targets[0])
            fault.undo = lambda: c.start_member(fault.targets[0])
        elif kind == "kill-majority":
            fault.targets = tuple(self.rng.sample(self.storage, 2))
            for t in fault.targets:
                c.kill(t)

            def restart_both() -> None:
                for t in fault.targets:
                    c.start_member(t)

            fault.undo = restart_both
        elif kind in ("kill-server", "stop-server"):
            fault.targets = (self.rng.choice(self.servers),)
            if kind == "kill-server":
                c.kill(fault.targets[0])
                fault.undo = lambda: c.start_member(fault.targets[0])
            else:
                c.kill(fault.targets[0], signal.SIGTERM)
                fault.undo = lambda: membership.start_when_stopped(c, fault.targets[0])
        elif kind in membership.MEMBERSHIP_FAULTS:
            # Done here, start to end (the metadata and the nodes see it at once); its targets
            # stay busy for the hold so no storage fault lands on them right after. An operator's
            # step that keeps failing is a finding, and the run goes on to its checks.
            try:
                if kind == "move-replica":
                    fault.detail = membership.move_replica(c, self.rng, self.say)
                else:
                    fault.detail, fault.undo = membership.remove_node(c, self.rng, self.say)
            except RuntimeError as e:
                self.problems.append(f"{kind} failed: {e}")
                fault.detail = {"failed": str(e)}
            moved = fault.detail.get("moved", {})
            named = (fault.detail.get("from"), fault.detail.get("to"), fault.detail.get("node"), *moved.values())
            fault.targets = tuple(dict.fromkeys(t for t in named if t))
        elif kind == "kill-zookeeper":
            zk = self.zookeeper
            assert zk is not None
            fault.targets = ("zookeeper",)
            zk.kill()
            fault.undo = zk.start
        elif kind == "pause":
            target = self._pick_member()
            fault.targets = (target,)
            c.kill(target, signal.SIGSTOP)
            fault.undo = lambda: c.kill(target, signal.SIGCONT)
        elif kind in ("partition", "slow", "reset"):
            target = self._pick_member()
            fault.targets = (target,)
            proxy = self.proxies[target]
            mode = {"partition": "blackhole", "slow": "delay", "reset": "reset"}[kind]
            delay = self.rng.choice([0.005, 0.02, 0.1]) if kind == "slow" else 0.0
            fault.detail = {"link": f"to {target}", "delay": delay} if delay else {"link": f"to {target}"}
            proxy.set_mode(mode, delay)  # type: ignore[arg-type]
            fault.undo = lambda: proxy.set_mode("pass")
        elif kind in STRACE_FAULTS:
            target = self.rng.choice(self.storage)
            fault.targets = (target,)
            fault.detail, fault.undo = self._strace(target, kind)
        elif kind == "corrupt":
            target = self.rng.choice(self.storage)
            fault.targets = (target,)
            fault.detail = self._corrupt(target)
            partition = fault.detail.get("partition")
            fault.undo = (lambda: self._repair(target, partition)) if partition is not None else (lambda: None)
        elif kind in ("partial-partition", "one-way", "zombie", *BAD_CLIENT_FAULTS):
            fault.targets, fault.detail, fault.undo, fault.heal_at = net_faults.start(self, kind, hold)
        elif kind in DISK_FAULTS:
            fault.targets, fault.detail, fault.undo = start_disk_fault(kind, c, self.disks, self.storage, self.rng)
        elif kind in CLOCK_FAULTS:
            target = self.rng.choice(self._clock_targets())
            fault.targets = (target,)
            # A session another fault ended (a pause past its timeout) may be replaced a little
            # after that fault healed: only sessions of a quiet cluster are watched.
            quiet = time.monotonic() - self._other_healed_at > clock_faults.QUIET_AFTER
            if quiet and all(f.kind in CLOCK_FAULTS for f in self.active):
                fault.sessions = clock_faults.SessionWatch(c.metadata_url)
            fault.detail = clock_faults.start(c.directory, kind, target, self.rng)
            fault.undo = lambda: clock_faults.heal(c.directory, target)
        else:  # pragma: no cover - FAULTS is checked in __init__
            raise ValueError(kind)
        short = {p: int(in_path.get(p, 0)) for p in range(c.partitions) if in_path.get(p, 0) < REPLICAS}
        if self.progress is not None and not self.progress.explains(fault) and short:
            fault.explains_standstill = True
            fault.detail["short_write_paths"] = short
        hold = fault.heal_at - time.monotonic()
        if kind not in CLOCK_FAULTS:
            for f in self.active:
                f.sessions = None
        self.active.append(fault)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.log({"f": "nemesis", "type": "start", "fault": kind, "targets": list(fault.targets), **fault.detail})
        extra = "".join(f" {k}={v}" for k, v in fault.detail.items())
        self.say(f"nemesis: {kind} {', '.join(fault.targets)}{extra} for {hold:.1f} s")

    def _may_be_judged(self, kind: str) -> bool:
        """Whether a fault of `kind` may be one the standstill check judges: a minority fault,
        unless a server is paused (its metrics would hold the nemesis up 2 s; the fault then
        explains a standstill, unmeasured)."""
        paused = any(f.kind == "pause" and set(f.targets) & set(self.servers) for f in self.active)
        return self.progress is not None and kind in (*MINORITY_FAULTS, *NODE_LINK_FAULTS) and not paused

    def heal(self, fault: Fault) -> None:
        if fault.kind in HEALS_THROUGH_METADATA:  # ZooKeeper comes back first, even if not yet due
            for zk in [f for f in self.active if f.kind == "kill-zookeeper"]:
                self.heal(zk)
        self.active.remove(fault)
        try:
            fault.undo()
        except Exception as e:  # a heal that fails is a finding of its own, and the run goes on
            msg = f"healing {fault.kind} on {', '.join(fault.targets)} failed: {type(e).__name__}: {e}"
            self.problems.append(msg)
            self.say(f"nemesis: {msg}")
        if fault.sessions is not None and (lost := fault.sessions.lost()):
            during = f"while {fault.kind} on {', '.join(fault.targets)} ran"
            msg = f"{during}, these ended: {', '.join(lost)} (their processes still run)"
            self.problems.append(msg)
            self.say(f"nemesis: {msg}")
        if fault.kind not in CLOCK_FAULTS:
            self._other_healed_at = time.monotonic()
        watched = {} if fault.sessions is None else {"sessions_watched": len(fault.sessions.sessions)}
        self.log({"f": "nemesis", "type": "heal", "fault": fault.kind, "targets": list(fault.targets), **watched})

    def _strace(self, target: str, kind: str) -> tuple[dict[str, Any], Callable[[], None]]:
        pid = self.cluster.pid(target)
        if pid is None:
            return {"skipped": "not running"}, lambda: None
        after = self.rng.randint(1, 20)
        syscalls, err = ("fdatasync,fsync", "EIO") if kind == "fsync-eio" else ("pwrite64,write", "ENOSPC")
        # -f: the fsync and write calls happen on the node's worker threads, not its main one.
        proc = subprocess.Popen(
            [
                "strace",
                "-f",
                "-qq",
                "-o",
                "/dev/null",
                "-p",
                str(pid),
                "-e",
                f"trace={syscalls}",
                "-e",
                f"inject={syscalls}:error={err}:when={after}+",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        def undo() -> None:
            proc.terminate()  # detaches; the node keeps its refusal until restarted, as it must
            proc.wait(10)
            self.cluster.kill(target)
            self.cluster.start_member(target)

        return {"syscalls": syscalls, "error": err, "after": after}, undo

    def _corrupt(self, target: str) -> dict[str, Any]:
        """Flips one data byte of a committed record (at or below an observed high-water mark)."""
        c = self.cluster
        marks = self.committed()
        # The repair wipes the replica. Only where all three replicas are in the write path: a
        # replica repaired earlier counts as having lost its files until a new store session
        # takes it in clean, and wiping a second one then is wiping a majority, which
        # docs/operations.md forbids (recovery refuses to decide; seed 38 did it on 2026-11-25).
        in_path = c.server_metric("waltz_server_replicas_in_write_path")
        c.kill(target)
        data_dir = c.directory / "data" / target
        candidates = sorted((p, m) for p, m in marks.items() if m >= 0 and in_path.get(p, 0) >= REPLICAS)
        detail: dict[str, Any] = {}
        if candidates:
            p, mark = self.rng.choice(candidates)
            from waltz._native import inspect_segment

            for seg in sorted(glob.glob(str(data_dir / str(p) / "*.seg"))):
                report = inspect_segment(seg, limit=1 << 30)
                records = [r for r in report["records"] if r["txid"] <= mark and r["data_length"] > 0]
                if not records:
                    continue
                r = self.rng.choice(records)
                ends = [x["offset"] for x in report["records"] if x["offset"] > r["offset"]] + [report["valid_end"]]
                at = min(ends) - 1 - self.rng.randrange(r["data_length"])
                with open(seg, "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([byte ^ (1 << self.rng.randrange(8))]))
                    os.fsync(f.fileno())
                detail = {"partition": p, "txid": r["txid"], "file": pathlib.Path(seg).name, "offset": at}
                break
        c.start_member(target)
        return detail or {"skipped": "no committed record yet, or no partition with every replica in its write path"}

    def _repair(self, target: str, partition: int) -> None:
        """The operator's repair of a damaged replica (docs/operations.md), through `waltz`."""
        c = self.cluster
        member = c.member(target)
        address = c.dialed_address(member)
        # Either other replica may be the one outside the current write set (itself repaired
        # earlier and not yet caught up by a new store session): recover-partition refuses such a
        # source ("pick a source from the current session"), so each retry tries the next one.
        sources = [c.dialed_address(c.member(s)) for s in self.storage if s != target and c.pid(s) is not None]
        if not sources:
            raise RuntimeError(f"no other storage node runs to recover {target}'s partition {partition} from")
        part = ["-p", str(partition)]
        deadline = time.monotonic() + 120  # other faults may hold the source or the metadata a while
        membership.waltz_storage(
            c, ["remove-partition", "--storage", address, *part, "--delete-files", "--force"], deadline
        )
        membership.waltz_storage(c, ["add-partition", "--storage", address, *part], deadline)
        copies = [["recover-partition", "--source", src, "--destination", address, *part] for src in sources]
        membership.waltz_storage(c, copies[0], deadline, retry_with=copies[1:])
        membership.waltz_storage(c, ["availability", "--storage", address, *part, "--writable"], deadline)
