"""The torture history checker (`waltz.torture`): valid histories from a small simulator of correct
partitions pass; one deliberately broken history per check is caught, by the right anomaly
kind, naming the operations involved; history files survive a writer killed mid-line."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from waltz import errors
from waltz.torture import (
    KINDS,
    History,
    HistoryError,
    HistoryWriter,
    PayloadError,
    Record,
    Report,
    TornLineWarning,
    check,
    decode_payload,
    digest,
    encode_payload,
    lock_name,
    read_drains,
    read_history,
    record_from_bytes,
    write_drains,
)
from waltz.torture.worker import outcome_is_certain_failure

POOL = [lock_name("pool", i) for i in range(4)]


# --- a correct partition, simulated --------------------------------------------------------------


@dataclasses.dataclass
class _Op:
    process: int
    partition: int
    payload: str
    hwm: int
    w: list[str]
    r: list[str]
    a: list[str]
    phase: str = "invoked"  # invoked -> committed | refused | dropped
    completed: bool = False


class Sim:
    """Sequential model of correct partitions: ids are assigned in order under the exact lock rule
    (unless `enforce_locks` is off); clients apply the log at their own pace and build on that
    mark; acks arrive after the commit, may be lost (info) or never arrive (process killed);
    consumers reconnect and resume; an observer asks for the mark. Every choice comes from `seed`."""

    def __init__(
        self, seed: int, partitions: int = 2, clients: int = 4, consumers: int = 2, enforce_locks: bool = True
    ) -> None:
        self.rng = random.Random(seed)
        self.enforce_locks = enforce_locks
        self.t = 1_000_000
        self.events: list[dict[str, Any]] = []
        self.logs: dict[int, list[Record]] = {p: [] for p in range(partitions)}
        self.writer: dict[int, dict[str, int]] = {p: {} for p in range(partitions)}
        self.view = {(c, p): -1 for c in range(clients) for p in range(partitions)}
        self.ops: list[_Op] = []
        self.feed = {(100 + k, p): [0, 0] for k in range(consumers) for p in range(partitions)}  # next id, connection
        self.clients, self.partitions = clients, partitions
        self.violations: set[tuple[int, int]] = set()  # (partition, txid) the lock rule would have refused

    def now(self) -> int:
        self.t += self.rng.randint(1, 5)
        return self.t

    def emit(self, process: int, f: str, type_: str, partition: int, **fields: Any) -> None:
        self.events.append(
            {"process": process, "type": type_, "f": f, "partition": partition, "time": self.now(), **fields}
        )

    def run(self, steps: int = 400) -> Sim:
        actions = [self.invoke, self.commit, self.complete, self.apply, self.read, self.observe]
        for _ in range(steps):
            self.rng.choices(actions, weights=[3, 3, 3, 2, 3, 1])[0]()
        return self

    def invoke(self) -> None:
        c, p = self.rng.randrange(self.clients), self.rng.randrange(self.partitions)
        if sum(1 for op in self.ops if op.process == c and not op.completed) >= 2:
            return
        w = self.rng.sample(POOL, self.rng.randint(0, 2))
        r = self.rng.sample([x for x in POOL if x not in w], self.rng.randint(0, 1))
        a = self.rng.sample(POOL, 1) if self.rng.random() < 0.1 else []
        op = _Op(c, p, f"p{c}-{len(self.ops):06d}", self.view[c, p], w, r, a)
        self.ops.append(op)
        self.emit(
            c, "append", "invoke", p, payload=op.payload, write_locks=w, read_locks=r, append_locks=a, client_hwm=op.hwm
        )

    def commit(self) -> None:
        waiting = [op for op in self.ops if op.phase == "invoked"]
        if not waiting:
            return
        op = self.rng.choice(waiting)
        log, writer = self.logs[op.partition], self.writer[op.partition]
        conflict = any(writer.get(lock, -1) > op.hwm for lock in op.w + op.r)
        if conflict and self.enforce_locks:
            op.phase = "refused"
        elif self.rng.random() < 0.08:
            op.phase = "dropped"
        else:
            txid = len(log)
            data = encode_payload(
                op.payload,
                client_hwm=op.hwm,
                write_locks=op.w,
                read_locks=op.r,
                append_locks=op.a,
                size=self.rng.choice([0, 40, 300]),
            )
            log.append(record_from_bytes(txid, data, header=self.rng.choice([0, 0, 7])))
            for lock in op.w + op.a:
                writer[lock] = txid
            if conflict:
                self.violations.add((op.partition, txid))
            op.phase = "committed"

    def complete(self) -> None:
        open_ = [op for op in self.ops if not op.completed]
        if not open_:
            return
        op = self.rng.choice(open_)
        if op.phase == "invoked":
            if self.rng.random() < 0.2:  # a timeout: it may still commit later
                op.completed = True
                self.emit(op.process, "append", "info", op.partition, payload=op.payload, error="timeout")
            return
        op.completed = True
        if op.phase == "committed" and self.rng.random() < 0.85:
            txid = next(r.txid for r in self.logs[op.partition] if r.payload == op.payload)
            self.emit(op.process, "append", "ok", op.partition, payload=op.payload, txid=txid)
        elif op.phase == "refused" or (op.phase == "dropped" and self.rng.random() < 0.5):
            self.emit(
                op.process,
                "append",
                "fail",
                op.partition,
                payload=op.payload,
                error="lock failure" if op.phase == "refused" else "dropped",
            )
        else:
            self.emit(op.process, "append", "info", op.partition, payload=op.payload)

    def apply(self) -> None:
        c, p = self.rng.randrange(self.clients), self.rng.randrange(self.partitions)
        if self.logs[p]:
            self.view[c, p] = self.rng.randint(self.view[c, p], len(self.logs[p]) - 1)

    def read(self) -> None:
        (k, p) = self.rng.choice(sorted(self.feed))
        pos = self.feed[k, p]
        if self.rng.random() < 0.1:
            pos[1] += 1  # reconnect: resumes where it was
        if pos[0] < len(self.logs[p]):
            r = self.logs[p][pos[0]]
            self.emit(k, "read", "ok", p, txid=r.txid, payload=r.payload, digest=r.digest, connection=pos[1])
            pos[0] += 1

    def observe(self) -> None:
        p = self.rng.randrange(self.partitions)
        if self.rng.random() < 0.5:
            self.emit(200, "hwm", "ok", p, value=len(self.logs[p]) - 1, invoked=self.now())
        else:
            self.emit(201, "hwm", "ok", p, value=len(self.logs[p]) - 1)

    def history(self) -> History:
        return History.from_objects(self.events)

    def drains(self) -> dict[str, dict[int, list[Record]]]:
        """The cluster; r1 replicates everything; r2 only partition 0; r3 lags (a prefix)."""
        return {
            "cluster": {p: list(log) for p, log in self.logs.items()},
            "r1": {p: list(log) for p, log in self.logs.items()},
            "r2": {0: list(self.logs[0])},
            "r3": {p: log[: self.rng.randint(0, len(log))] for p, log in self.logs.items()},
        }

    def check(self) -> Report:
        return check(self.history(), self.drains(), lagging=["r3"])


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_valid_simulated_histories_pass(seed: int) -> None:
    report = Sim(seed).run().check()
    assert report.ok, report.render()


def test_the_simulator_exercises_every_outcome() -> None:
    # The passing histories above are only worth something if they contain the hard cases.
    total: Counter[str] = Counter()
    for seed in range(10):
        for c in Sim(seed).run().check().counts.values():
            total.update(dataclasses.asdict(c))
    assert all(
        total[k] > 0
        for k in ("acknowledged", "failed", "unknown", "committed", "unknown_committed", "reads", "hwm_observations")
    ), total


@settings(max_examples=25, derandomize=True, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_lock_check_finds_exactly_the_conflicts_a_careless_server_let_through(seed: int) -> None:
    sim = Sim(seed, enforce_locks=False).run()
    found = {(a.partition, r.txid) for a in sim.check().of_kind("lock-violation") for _, r in a.records[-1:]}
    assert found == sim.violations


@settings(max_examples=25, derandomize=True, deadline=None)
@given(st.integers(0, 2**32 - 1), st.randoms(use_true_random=False))
def test_a_lost_ack_is_found_anywhere(seed: int, pick: random.Random) -> None:
    sim = Sim(seed).run()
    acked = [e for e in sim.events if e["type"] == "ok" and e["f"] == "append"]
    if not acked:
        return
    lost = pick.choice(acked)
    drains = sim.drains()
    for source in drains.values():
        if lost["partition"] in source:
            source[lost["partition"]] = [r for r in source[lost["partition"]] if r.payload != lost["payload"]]
    report = check(sim.history(), drains, lagging=["r3"])
    assert any(lost["payload"] in a.payloads for a in report.of_kind("lost-ack")), report.render()


def _replay(obj: dict[str, Any], w: HistoryWriter) -> None:
    """Writes a simulated event through the writer's typed methods."""
    p, t = obj["partition"], obj["time"]
    if obj["f"] == "read":
        w.read(p, obj["txid"], obj["payload"], obj["digest"], obj["connection"], time=t)
    elif obj["f"] == "hwm":
        w.hwm(p, obj["value"], invoked=obj.get("invoked"), time=t)
    elif obj["type"] == "invoke":
        w.invoke(
            p,
            obj["payload"],
            write_locks=obj["write_locks"],
            read_locks=obj["read_locks"],
            append_locks=obj["append_locks"],
            client_hwm=obj["client_hwm"],
            time=t,
        )
    elif obj["type"] == "ok":
        w.ok(p, obj["payload"], obj["txid"], time=t)
    else:
        getattr(w, obj["type"])(p, obj["payload"], error=obj.get("error"), time=t)


def _unplaced(history: History) -> list[Any]:
    return sorted((dataclasses.replace(e, where="") for e in history.events), key=lambda e: (e.time, str(e.process)))


def test_history_and_drains_round_trip_through_files(tmp_path: Path) -> None:
    sim = Sim(7).run()
    writers: dict[int, HistoryWriter] = {}
    for obj in sim.events:
        if obj["process"] not in writers:
            writers[obj["process"]] = HistoryWriter(
                tmp_path / "history" / f"process-{obj['process']}.jsonl", obj["process"]
            )
        _replay(obj, writers[obj["process"]])
    writers[0].write({"f": "nemesis", "process": "nemesis", "time": 5, "what": "partition heals"})
    for w in writers.values():
        w.close()
    written = sim.drains()
    write_drains(tmp_path / "drains.jsonl", written)

    history = read_history(tmp_path / "history")
    assert _unplaced(history) == _unplaced(sim.history())
    assert history.other == [{"f": "nemesis", "process": "nemesis", "time": 5, "what": "partition heals"}]
    drains = read_drains(tmp_path / "drains.jsonl")
    assert drains == {
        s: {p: rs for p, rs in ps.items() if rs} for s, ps in written.items()
    }  # an empty list writes no line
    report = check(history, drains, lagging=["r3"])
    assert report.ok, report.render()
    assert json.loads(report.to_json())["ok"] is True


# --- broken histories, one per check -------------------------------------------------------------


class Scenario:
    """A hand-written history of partition 0: events get increasing times in the order written,
    the log gets records in the order committed."""

    def __init__(self) -> None:
        self.t = 0
        self.objs: list[dict[str, Any]] = []
        self.data: list[tuple[bytes, int]] = []  # the committed log's bytes and header
        self.specs: dict[str, dict[str, Any]] = {}

    def _emit(self, process: int, f: str, type_: str, **fields: Any) -> None:
        self.t += 10
        self.objs.append({"process": process, "type": type_, "f": f, "partition": 0, "time": self.t, **fields})

    def spec(
        self,
        payload: str,
        hwm: int | None = None,
        w: tuple[str, ...] = (),
        r: tuple[str, ...] = (),
        a: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        if payload not in self.specs:  # a client caught up with the log, unless told otherwise
            self.specs[payload] = dict(
                client_hwm=len(self.data) - 1 if hwm is None else hwm,
                write_locks=list(w),
                read_locks=list(r),
                append_locks=list(a),
            )
        return self.specs[payload]

    def invoke(self, process: int, payload: str, **spec: Any) -> None:
        self._emit(process, "append", "invoke", payload=payload, **self.spec(payload, **spec))

    def commit(self, payload: str, **spec: Any) -> int:
        self.data.append((encode_payload(payload, **self.spec(payload, **spec), size=64), 0))
        return len(self.data) - 1

    def id_of(self, payload: str) -> int:
        return next(i for i, (d, _) in enumerate(self.data) if decode_payload(d).payload == payload)

    def ok(self, process: int, payload: str, txid: int | None = None) -> None:
        self._emit(process, "append", "ok", payload=payload, txid=self.id_of(payload) if txid is None else txid)

    def fail(self, process: int, payload: str) -> None:
        self._emit(process, "append", "fail", payload=payload, error="lock failure")

    def info(self, process: int, payload: str) -> None:
        self._emit(process, "append", "info", payload=payload, error="timeout")

    def append(self, process: int, payload: str, **spec: Any) -> int:
        self.invoke(process, payload, **spec)
        txid = self.commit(payload)
        self.ok(process, payload)
        return txid

    def read(self, process: int, txid: int, connection: int = 0) -> None:
        r = self.records()[txid]
        self._emit(process, "read", "ok", txid=txid, payload=r.payload, digest=r.digest, connection=connection)

    def hwm(self, process: int, value: int, asked: bool = False) -> None:
        self._emit(process, "hwm", "ok", value=value, **({"invoked": self.t + 5} if asked else {}))

    def records(self) -> list[Record]:
        return [record_from_bytes(i, d, h) for i, (d, h) in enumerate(self.data)]

    def drains(self, records: list[Record] | None = None) -> dict[str, dict[int, list[Record]]]:
        rs = self.records() if records is None else records
        return {"cluster": {0: rs}, "r1": {0: list(rs)}, "r2": {0: list(rs)}}

    def check(self, drains: dict[str, dict[int, list[Record]]] | None = None, **kw: Any) -> Report:
        report = check(History.from_objects(self.objs), self.drains() if drains is None else drains, **kw)
        assert report.render() and json.loads(report.to_json())  # both always render
        return report


def only(report: Report, kind: str) -> list[Any]:
    """The anomalies, after asserting they are all of `kind`."""
    assert set(report.kinds()) == {kind}, report.render()
    return report.of_kind(kind)


def events_of(anomaly: Any) -> set[tuple[str, str]]:
    return {(e.type, e.payload) for e in anomaly.events}


def test_a_valid_scenario_passes() -> None:
    s = Scenario()
    s.append(0, "a", w=("L",))
    s.append(1, "b", r=("L",))
    s.read(9, 0)
    s.read(9, 1, connection=1)
    s.hwm(8, 1, asked=True)
    report = s.check()
    assert report.ok and report.counts[0].acknowledged == 2 and report.counts[0].committed == 2, report.render()
    assert "OK" in report.render()


def test_lost_ack() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(1, "b")
    [a] = only(s.check(s.drains(s.records()[:1])), "lost-ack")
    assert a.payloads == {"b"} and events_of(a) == {("invoke", "b"), ("ok", "b")}
    assert "b acknowledged at id 1" in a.message


def test_ids_retention_deleted_may_be_missing_and_everything_after_them_is_checked() -> None:
    """Retention deleted ids 0..1 everywhere: their acks and reads are not anomalies, and a lost
    ack above the log's start still is."""
    s = Scenario()
    for name in ("a", "b", "c", "d"):
        s.append(0, name)
    s.read(9, 0)
    s.read(9, 1)
    s.read(9, 2)
    kept = s.records()[2:]
    drains = {"cluster": {0: kept}, "r1": {0: list(kept)}}
    report = s.check(drains, first_id=None)
    assert report.ok, report.render()
    assert s.check(drains).kinds()  # from id 0 the deleted ids are a gap: only with the start given
    [lost] = only(s.check({"cluster": {0: kept[:1]}, "r1": {0: kept[:1]}}, first_id=None), "lost-ack")
    assert lost.payloads == {"d"}


def test_failed_but_committed() -> None:
    s = Scenario()
    s.append(0, "a")
    s.invoke(1, "b")
    s.commit("b")
    s.fail(1, "b")
    [a] = only(s.check(), "failed-committed")
    assert events_of(a) == {("invoke", "b"), ("fail", "b")} and [r.txid for _, r in a.records] == [1]


def test_unknown_may_or_may_not_commit() -> None:
    s = Scenario()
    s.invoke(0, "a")
    s.commit("a")
    s.info(0, "a")
    s.invoke(1, "b")  # never completed, never committed: the process died
    report = s.check()
    assert report.ok and (report.counts[0].unknown, report.counts[0].unknown_committed) == (2, 1)


def test_duplicate_payload() -> None:
    s = Scenario()
    s.invoke(0, "a")
    s.commit("a")
    s.commit("a")
    s.ok(0, "a", txid=0)
    [a] = only(s.check(), "duplicate-payload")
    assert "a" in a.message and "0..1" in a.message and ("ok", "a") in events_of(a)


def test_gap_in_ids() -> None:
    s = Scenario()
    s.append(0, "a")
    s.invoke(1, "b")
    s.commit("b")
    s.info(1, "b")
    s.append(2, "c")
    rs = s.records()
    [a] = only(s.check(s.drains([rs[0], rs[2]])), "id-gap")
    assert "lacks ids 1" in a.message and a.payloads == {"a", "c"}


def test_repeated_id() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(1, "b")
    rs = s.records()
    drains = s.drains()
    drains["cluster"][0] = [rs[0], rs[1], rs[1]]
    [a] = only(s.check(drains), "id-order")
    assert "id 1 after id 1" in a.message and a.payloads == {"b"}


def test_replica_byte_mismatch() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(1, "b")
    drains = s.drains()
    damaged = bytearray(s.data[1][0])
    damaged[-1] ^= 1
    drains["r2"][0] = [drains["r2"][0][0], record_from_bytes(1, bytes(damaged))]
    [a] = only(s.check(drains), "replica-mismatch")
    assert "r2" in a.message and "ids 1" in a.message
    assert [(src, r.txid) for src, r in a.records] == [("cluster", 1), ("r2", 1)] and "b" in a.payloads


def test_replica_shorter_only_if_allowed() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(1, "b")
    drains = s.drains()
    drains["r1"][0] = drains["r1"][0][:1]
    [a] = only(s.check(drains), "replica-missing")
    assert "r1 lacks committed ids 1" in a.message and a.payloads == {"b"}
    assert s.check(drains, lagging=["r1"]).ok
    assert s.check(drains, lagging=[("r1", 0)]).ok
    assert not s.check(drains, lagging=[("r1", 1)]).ok


def test_replica_with_ids_beyond_the_log() -> None:
    s = Scenario()
    s.append(0, "a")
    s.invoke(1, "b")
    s.commit("b")
    s.info(1, "b")
    drains = s.drains()
    drains["cluster"][0] = drains["cluster"][0][:1]  # b was a dirty tail, never committed
    drains["r2"][0] = drains["r2"][0][:1]
    [a] = only(s.check(drains), "replica-extra")
    assert a.payloads == {"b"}


def test_replica_ids_going_back() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(1, "b")
    drains = s.drains()
    rs = drains["r1"][0]
    drains["r1"][0] = [rs[0], rs[1], rs[0]]
    [a] = only(s.check(drains), "replica-order")
    assert "r1's ids repeat or go back at 0" in a.message and a.payloads == {"a", "b"}


def test_consumer_skip_across_reconnect() -> None:
    s = Scenario()
    for p in "abcd":
        s.append(0, p)
    s.read(9, 0)
    s.read(9, 1)
    s.read(9, 3, connection=1)
    [a] = only(s.check(), "consumer-skip")
    assert "across reconnect 0->1" in a.message and "skipped 2" in a.message
    assert [(e.txid, e.payload) for e in a.events] == [(1, "b"), (3, "d")]


def test_consumer_duplicate_across_reconnect() -> None:
    s = Scenario()
    for p in "abc":
        s.append(0, p)
    s.read(9, 0)
    s.read(9, 1)
    s.read(9, 1, connection=1)
    s.read(9, 2, connection=1)
    [a] = only(s.check(), "consumer-repeat")
    assert "id 1 after 1 across reconnect 0->1" in a.message and a.payloads == {"b"}


def test_consumer_reads_other_bytes_or_uncommitted_ids() -> None:
    s = Scenario()
    s.append(0, "a")
    s.read(9, 0)
    s.objs[-1]["digest"] = digest(b"something else")
    [a] = only(s.check(), "read-mismatch")
    assert a.payloads == {"a"}
    s.objs[-1]["digest"] = s.records()[0].digest
    s.objs.append({**s.objs[-1], "txid": 1, "payload": "ghost", "time": s.t + 1})
    [a] = only(s.check(), "read-uncommitted")
    assert "read id 1" in a.message and a.payloads == {"ghost"}


def test_realtime_order_violation() -> None:
    s = Scenario()
    s.invoke(0, "a", hwm=-1)
    s.commit("b", hwm=-1)  # b takes id 0 before it is even invoked ...
    s.commit("a")
    s.ok(0, "a")
    s.invoke(1, "b")  # ... which happens after a was acknowledged at id 1
    s.ok(1, "b")
    [a] = only(s.check(), "realtime-order")
    assert events_of(a) == {("ok", "a"), ("invoke", "b"), ("ok", "b")}
    assert "b invoked" in a.message and "after id 1 was known committed" in a.message and "got id 0" in a.message


def test_realtime_order_counts_reads_and_unknown_operations() -> None:
    s = Scenario()
    s.invoke(0, "a", hwm=-1)
    s.commit("b", hwm=-1)
    s.commit("a")
    s.info(0, "a")
    s.read(9, 1)  # a consumer saw id 1 committed ...
    s.invoke(1, "b")  # ... before b, whose outcome is unknown, was invoked
    [a] = only(s.check(), "realtime-order")
    assert {(e.f, e.payload) for e in a.events} == {("read", "a"), ("append", "b")}


@pytest.mark.parametrize(
    "first, second, violates",
    [
        ({"w": ("L",)}, {"w": ("L",)}, True),
        ({"w": ("L",)}, {"r": ("L",)}, True),
        ({"a": ("L",)}, {"w": ("L",)}, True),  # an append lock is a write for the others
        ({"a": ("L",)}, {"a": ("L",)}, False),  # append locks never fail
        ({"r": ("L",)}, {"w": ("L",)}, False),  # a read moves no version
        ({"w": ("L",)}, {"w": ("M",)}, False),
    ],
)
def test_lock_violation(first: dict[str, Any], second: dict[str, Any], violates: bool) -> None:
    s = Scenario()
    s.append(0, "a", hwm=-1, **first)
    s.append(1, "b", hwm=-1, **second)  # computed before a committed
    report = s.check()
    if not violates:
        assert report.ok, report.render()
        return
    [a] = only(report, "lock-violation")
    assert {("invoke", "a"), ("invoke", "b")} <= events_of(a) and a.payloads == {"a", "b"}
    assert "b committed at id 1 with client high-water mark -1, but a at id 0 wrote its lock(s) ['L']" in a.message


def test_lock_check_uses_the_window_between_mark_and_id() -> None:
    s = Scenario()
    s.append(0, "a", w=("L",))
    s.append(1, "x")
    s.append(2, "b", hwm=0, w=("L",))  # saw a: no conflict though ids passed since
    s.append(3, "c", hwm=1, r=("L",))  # saw b? no: b is id 2 > 1
    [a] = only(s.check(), "lock-violation")
    assert a.payloads == {"b", "c"}


def test_client_hwm_at_or_above_its_own_id() -> None:
    s = Scenario()
    s.append(0, "a", hwm=0)
    [a] = only(s.check(), "client-hwm-ahead")
    assert a.payloads == {"a"}


def test_hwm_decreasing_in_one_process() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(0, "b")
    s.hwm(8, 1)
    s.hwm(8, 0)
    [a] = only(s.check(), "hwm-decrease")
    assert [e.value for e in a.events] == [1, 0] and "observed high-water mark 0 after 1" in a.message


def test_hwm_decreasing_across_processes_needs_the_asking_time() -> None:
    s = Scenario()
    for p in "ab":  # no acks: only the observations say what was committed when
        s.invoke(0, p)
        s.commit(p)
        s.info(0, p)
    s.hwm(8, 1)
    s.hwm(7, 0)  # when it was asked is unknown: maybe before the other's answer
    assert s.check().ok
    s.hwm(6, 0, asked=True)
    [a] = only(s.check(), "hwm-decrease")
    assert [(e.process, e.value) for e in a.events] == [(8, 1), (6, 0)]


def test_hwm_below_an_earlier_acknowledgement() -> None:
    s = Scenario()
    s.append(0, "a")
    s.append(0, "b")
    s.hwm(8, 0, asked=True)
    [a] = only(s.check(), "hwm-decrease")
    assert [(e.type, e.payload) for e in a.events][0] == ("ok", "b")


def test_hwm_beyond_the_log() -> None:
    s = Scenario()
    s.append(0, "a")
    s.hwm(8, 3)
    [a] = only(s.check(), "hwm-beyond-log")
    assert "mark 3, the log's last id is 0" in a.message


def test_ack_at_wrong_id() -> None:
    s = Scenario()
    s.invoke(0, "a")
    s.invoke(1, "b")
    s.commit("a")
    s.commit("b")
    s.ok(0, "a", txid=1)
    s.info(1, "b")
    [a] = only(s.check(), "ack-wrong-id")
    assert "a acknowledged at id 1 is committed at id 0 (id 1 holds b)" in a.message
    assert {("ok", "a"), ("invoke", "b")} <= events_of(a)


def test_phantom_and_corrupt_records() -> None:
    s = Scenario()
    s.append(0, "a")
    s.commit("nobody")
    [a] = only(s.check(), "phantom-payload")
    assert a.payloads == {"nobody"}
    s.data[1] = (s.data[1][0][:-1] + bytes([s.data[1][0][-1] ^ 1]), 0)  # damaged the same way everywhere
    [a] = only(s.check(), "corrupt-record")
    assert "damaged" in a.message


def test_malformed_history() -> None:
    s = Scenario()
    s.append(0, "a")
    s._emit(0, "append", "ok", payload="never-invoked", txid=5)
    s.invoke(0, "a")
    kinds = s.check().kinds()
    assert kinds == Counter({"malformed-history": 2})


def test_every_kind_is_described() -> None:
    assert all(KINDS.values())
    report = Report()
    assert report.ok and "OK" in report.render()


# --- payloads and files ----------------------------------------------------------------------------


def test_payload_round_trip_padding_and_damage() -> None:
    data = encode_payload("p1-000002", client_hwm=41, write_locks=["pool:1"], read_locks=["pool:2"], size=500)
    assert len(data) == 500
    p = decode_payload(data)
    assert (p.payload, p.client_hwm, p.write_locks, p.read_locks, p.append_locks) == (
        "p1-000002",
        41,
        ("pool:1",),
        ("pool:2",),
        (),
    )
    assert len(encode_payload("x", client_hwm=-1, size=1)) > 1  # size is a minimum
    for i in (0, 20, 499):
        damaged = bytearray(data)
        damaged[i] ^= 0x40
        with pytest.raises(PayloadError):
            decode_payload(bytes(damaged))
    with pytest.raises(PayloadError):
        decode_payload(data[:-1])
    assert digest(data) != digest(data, header=1)


def test_torn_last_line_is_ignored_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "p1.jsonl"
    with HistoryWriter(path, 1) as w:
        w.invoke(0, "p1-1", write_locks=["pool:0"], client_hwm=-1)
        w.ok(0, "p1-1", 0)
        w.invoke(0, "p1-2")
    with open(path, "ab") as f:
        f.write(b'{"process":1,"type":"ok","f":"append","partition":0,"pay')  # killed mid-write
    with pytest.warns(TornLineWarning):
        history = read_history(path)
    assert [(e.type, e.payload) for e in history.events] == [("invoke", "p1-1"), ("ok", "p1-1"), ("invoke", "p1-2")]
    assert len(history.warnings) == 1 and "p1.jsonl:4" in history.warnings[0]

    with pytest.warns(TornLineWarning):  # a restarted writer cuts the fragment before appending
        w = HistoryWriter(path, 1)
    w.fail(0, "p1-2", error="lock failure")
    w.close()
    history = read_history([path])
    assert not history.warnings and [e.type for e in history.events] == ["invoke", "ok", "invoke", "fail"]


def test_damage_inside_a_history_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "p1.jsonl"
    path.write_text('{"process":1,"type":"invoke","f":"append","partition":0,"payload":"x","time":1}\n{"proc\n{}\n')
    with pytest.raises(HistoryError, match="p1.jsonl:2"):
        read_history(path)
    path.write_text('{"process":1,"type":"ok","f":"append","partition":0,"payload":"x","time":1}\n')
    with pytest.raises(HistoryError, match="p1.jsonl:1: missing 'txid'"):
        read_history(path)


def test_the_worker_counts_a_failure_as_definite_only_on_the_clients_word() -> None:
    certain = outcome_is_certain_failure
    assert certain(errors.RequestFailedError("refused", "append_rejected"))
    assert certain(errors.MountTimeoutError("not mounted; the transaction was not sent"))
    assert certain(errors.TransactionExpiredError("expired after 3 executions"))
    assert certain(errors.ClientClosedError("closed before it was sent"))
    assert not certain(errors.MountTimeoutError("sent, then the mount timed out", outcome_unknown=True))
    assert not certain(errors.ClientClosedError("closed; it was sent and may still commit", outcome_unknown=True))
    assert not certain(errors.RequestTimeoutError("no answer"))
    assert not certain(ValueError("the context raised"))
