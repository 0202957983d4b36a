"""Checks a torture run: the history the workload recorded against the logs drained afterwards.

The reference drain (the cluster's feed, by default) is the committed log; every other source
(each replica's files) must agree with it byte for byte, and the history's claims (acks,
failures, reads, observed high-water marks, real-time order) must hold on it. Each check adds
anomalies to the report; one broken fact may show up in several checks, each naming what it saw.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence

from waltz.torture.drain import Drains, Record
from waltz.torture.history import APPEND, FAIL, HWM, INFO, INVOKE, OK, READ, Event, History
from waltz.torture.report import Anomaly, PartitionCounts, Report

# How many records an aggregated anomaly (a whole replica's mismatches) keeps as examples.
EXAMPLES = 10


@dataclasses.dataclass
class AppendOp:
    """One append: its invocation and its last completion (None: the process never learned)."""

    invoke: Event
    completion: Event | None = None

    @property
    def payload(self) -> str:
        assert self.invoke.payload is not None
        return self.invoke.payload

    @property
    def outcome(self) -> str:
        return INFO if self.completion is None else self.completion.type

    @property
    def events(self) -> tuple[Event, ...]:
        return (self.invoke,) if self.completion is None else (self.invoke, self.completion)


def ranges(ids: Iterable[int], limit: int = 10) -> str:
    """'3..7, 9' for 3,4,5,6,7,9 (at most `limit` runs shown)."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs[:limit])
    return text + (f", ... ({len(runs) - limit} more runs)" if len(runs) > limit else "")


def pair_appends(history: History, anomalies: list[Anomaly]) -> list[AppendOp]:
    """The history's appends as operations, matched by payload id (unique per run)."""
    ops: dict[str, AppendOp] = {}
    for e in history.events:
        if e.f != APPEND:
            continue
        assert e.payload is not None
        op = ops.get(e.payload)
        if e.type == INVOKE:
            if op is not None:
                anomalies.append(
                    Anomaly(
                        "malformed-history",
                        e.partition,
                        f"payload {e.payload} invoked twice (payload ids must be unique)",
                        op.events + (e,),
                    )
                )
            else:
                ops[e.payload] = AppendOp(e)
            continue
        if op is None:
            anomalies.append(
                Anomaly(
                    "malformed-history", e.partition, f"{e.type} of payload {e.payload}, which was never invoked", (e,)
                )
            )
        elif (e.process, e.partition) != (op.invoke.process, op.invoke.partition):
            anomalies.append(
                Anomaly(
                    "malformed-history",
                    e.partition,
                    f"{e.type} of payload {e.payload} by another process or on another partition than its invocation",
                    op.events + (e,),
                )
            )
        elif op.completion is not None and op.completion.type != INFO:
            anomalies.append(
                Anomaly("malformed-history", e.partition, f"payload {e.payload} completed twice", op.events + (e,))
            )
        else:  # an info is "not known yet": a definite outcome learned later replaces it
            op.completion = e
    return list(ops.values())


class _Log:
    """The committed log of one partition (the reference drain), indexed, with its own checks."""

    def __init__(
        self, partition: int, source: str, records: Sequence[Record], first_id: int | None, out: list[Anomaly]
    ) -> None:
        self.source = source
        self.records: list[Record] = []
        self.by_id: dict[int, Record] = {}
        self.by_payload: dict[str, list[Record]] = defaultdict(list)
        expected = first_id if first_id is not None else (records[0].txid if records else 0)
        self.first_id = expected
        for r in records:
            if r.txid < expected:
                prev = self.records[-1] if self.records else None
                out.append(
                    Anomaly(
                        "id-order",
                        partition,
                        f"{source} holds id {r.txid} after id {expected - 1}",
                        records=((source, prev), (source, r)) if prev else ((source, r),),
                    )
                )
                continue
            if r.txid > expected:
                around = ((source, self.records[-1]),) if self.records else ()
                out.append(
                    Anomaly(
                        "id-gap",
                        partition,
                        f"{source} lacks ids {ranges(range(expected, r.txid))}",
                        records=around + ((source, r),),
                    )
                )
            self.records.append(r)
            self.by_id[r.txid] = r
            if r.payload is not None:
                self.by_payload[r.payload].append(r)
            expected = r.txid + 1
        self.last_id = expected - 1

    def id_of(self, payload: str) -> int | None:
        found = self.by_payload.get(payload)
        return found[0].txid if found else None


class _PartitionCheck:
    def __init__(
        self, partition: int, log: _Log, ops: list[AppendOp], reads: list[Event], hwms: list[Event], out: list[Anomaly]
    ) -> None:
        self.p, self.log, self.ops, self.reads, self.hwms, self.out = partition, log, ops, reads, hwms, out
        self.op_of = {op.payload: op for op in ops}

    def add(
        self,
        kind: str,
        message: str,
        events: Iterable[Event] = (),
        records: Iterable[Record] = (),
        source: str | None = None,
    ) -> None:
        self.out.append(
            Anomaly(kind, self.p, message, tuple(events), tuple((source or self.log.source, r) for r in records))
        )

    def events_of(self, payload: str | None) -> tuple[Event, ...]:
        op = self.op_of.get(payload) if payload is not None else None
        return op.events if op else ()

    def counts(self) -> PartitionCounts:
        c = PartitionCounts(committed=len(self.log.records), reads=len(self.reads), hwm_observations=len(self.hwms))
        c.consumers = len({e.process for e in self.reads})
        for op in self.ops:
            if op.outcome == OK:
                c.acknowledged += 1
            elif op.outcome == FAIL:
                c.failed += 1
            else:
                c.unknown += 1
                c.unknown_committed += self.log.id_of(op.payload) is not None
        return c

    def committed_records(self) -> None:
        """Each committed record is intact, appears once, and was invoked by someone."""
        for r in self.log.records:
            if r.payload is None:
                self.add(
                    "corrupt-record",
                    f"the committed transaction at id {r.txid} does not decode: {r.error}",
                    records=[r],
                )
            elif r.payload not in self.op_of:
                self.add(
                    "phantom-payload",
                    f"payload {r.payload} committed at id {r.txid} was never invoked on partition {self.p}",
                    records=[r],
                )
        for payload, found in self.log.by_payload.items():
            if len(found) > 1:
                self.add(
                    "duplicate-payload",
                    f"payload {payload} committed {len(found)} times, at ids {ranges(r.txid for r in found)}",
                    self.events_of(payload),
                    found,
                )

    def outcomes(self) -> None:
        """Acks are in the log at their id, failures are not, unknowns may be either."""
        for op in self.ops:
            committed = self.log.by_payload.get(op.payload, [])
            if op.outcome == OK:
                assert op.completion is not None and op.completion.txid is not None
                acked = op.completion.txid
                if any(r.txid == acked for r in committed):
                    continue
                if acked < self.log.first_id and not committed:
                    continue  # deleted by retention: below where the committed log now starts
                at = self.log.by_id.get(acked)
                holds = f"id {acked} holds {at.payload if at else 'nothing'}"
                if not committed:
                    self.add(
                        "lost-ack",
                        f"payload {op.payload} acknowledged at id {acked} is not in the committed log ({holds})",
                        op.events,
                        [at] if at else [],
                    )
                else:
                    where = ranges(r.txid for r in committed)
                    self.add(
                        "ack-wrong-id",
                        f"payload {op.payload} acknowledged at id {acked} is committed at id {where} ({holds})",
                        op.events + self.events_of(at.payload if at else None),
                        committed + ([at] if at else []),
                    )
            elif op.outcome == FAIL and committed:
                self.add(
                    "failed-committed",
                    f"payload {op.payload} reported failed is committed at id {ranges(r.txid for r in committed)}",
                    op.events,
                    committed,
                )

    def sources(self, drains: Drains, reference: str, lagging: Collection[str | tuple[str, int]]) -> None:
        """Every other source agrees with the log byte for byte; one outside the write set (`lagging`) may miss ids."""
        for source in sorted(drains):
            if source == reference or self.p not in drains[source]:
                continue
            lags = source in lagging or (source, self.p) in lagging
            seen: set[int] = set()
            disorder: list[Record] = []
            mismatch: list[Record] = []
            extra: list[Record] = []
            prev: Record | None = None
            for r in drains[source][self.p]:
                if prev is not None and r.txid <= prev.txid:
                    disorder += [prev, r]
                    continue
                prev = r
                seen.add(r.txid)
                ref = self.log.by_id.get(r.txid)
                if ref is None:
                    extra.append(r)
                elif ref.digest != r.digest:
                    mismatch += [ref, r]
            if disorder:
                self.out.append(
                    Anomaly(
                        "replica-order",
                        self.p,
                        f"{source}'s ids repeat or go back at {ranges(r.txid for r in disorder[1::2])}",
                        records=tuple((source, r) for r in disorder[: 2 * EXAMPLES]),
                    )
                )
            if mismatch:
                pairs = tuple(
                    (s, r)
                    for i, r in enumerate(mismatch[: 2 * EXAMPLES])
                    for s in [reference if i % 2 == 0 else source]
                )
                self.out.append(
                    Anomaly(
                        "replica-mismatch",
                        self.p,
                        f"{source} holds other bytes than {reference} at ids {ranges(r.txid for r in mismatch[1::2])}",
                        records=pairs,
                    )
                )
            if extra:
                self.add(
                    "replica-extra",
                    f"{source} holds ids {ranges(r.txid for r in extra)}, not in {reference} (its last id is "
                    f"{self.log.last_id})",
                    records=extra[:EXAMPLES],
                    source=source,
                )
            missing = [r for r in self.log.records if r.txid not in seen]
            if missing and not lags:
                self.add(
                    "replica-missing",
                    f"{source} lacks committed ids {ranges(r.txid for r in missing)} (pass it in `lagging` if it is "
                    "outside the write set)",
                    records=missing[:EXAMPLES],
                )

    def consumers(self) -> None:
        """Each read matches the log, and each consumer's stream rises by exactly one, across reconnects too."""
        last: dict[int | str, Event] = {}
        for e in self.reads:
            assert e.txid is not None
            ref = self.log.by_id.get(e.txid)
            if ref is None and e.txid < self.log.first_id:
                pass  # read before retention deleted it: nothing left to compare with
            elif ref is None:
                self.add(
                    "read-uncommitted",
                    f"process {e.process} read id {e.txid} ({e.payload}), not in the committed log (last id "
                    f"{self.log.last_id})",
                    [e],
                )
            elif ref.digest != e.digest or (e.payload is not None and e.payload != ref.payload):
                self.add(
                    "read-mismatch",
                    f"process {e.process} read {e.payload} at id {e.txid} where the log holds {ref.payload}",
                    [e],
                    [ref],
                )
            prev = last.get(e.process)
            last[e.process] = e
            if prev is None or prev.txid is None or e.txid == prev.txid + 1:
                continue
            across = f" across reconnect {prev.connection}->{e.connection}" if e.connection != prev.connection else ""
            if e.txid > prev.txid + 1:
                self.add(
                    "consumer-skip",
                    f"process {e.process} read id {e.txid} after {prev.txid}{across}: skipped "
                    f"{ranges(range(prev.txid + 1, e.txid))}",
                    [prev, e],
                )
            else:
                self.add(
                    "consumer-repeat", f"process {e.process} read id {e.txid} after {prev.txid}{across}", [prev, e]
                )

    def _known_committed(self) -> list[tuple[int, int, Event]]:
        """(time, id, event): at `time`, id `id` was certainly committed (an ack, a read, an observed
        mark), counting only what the log confirms so that one lie is not reported twice."""
        out: list[tuple[int, int, Event]] = []
        for op in self.ops:
            txid = self.log.id_of(op.payload)
            if op.outcome == OK and op.completion is not None and txid is not None:
                out.append((op.completion.time, txid, op.completion))
        out += [(e.time, e.txid, e) for e in self.reads if e.txid is not None and e.txid in self.log.by_id]
        out += [(e.time, e.value, e) for e in self.hwms if e.value is not None and e.value <= self.log.last_id]
        out.sort(key=lambda x: x[0])
        return out

    def realtime(self) -> None:
        """A transaction invoked after id x was known committed gets an id above x."""
        known = self._known_committed()
        committed = [(op.invoke.time, txid, op) for op in self.ops if (txid := self.log.id_of(op.payload)) is not None]
        committed.sort(key=lambda x: x[0])
        best: tuple[int, int, Event] | None = None
        i = 0
        for invoked, txid, op in committed:
            while i < len(known) and known[i][0] < invoked:
                if best is None or known[i][1] > best[1]:
                    best = known[i]
                i += 1
            if best is not None and best[1] >= txid:
                _, before, e = best
                self.add(
                    "realtime-order",
                    f"payload {op.payload} invoked at t={invoked}, after id {before} was known committed "
                    f"(t={e.time}: {e.describe()}), got id {txid}",
                    (e,) + op.events,
                    [self.log.by_id[txid]],
                )

    def locks(self) -> None:
        """The server's rule, over committed transactions: T with client mark C commits only if no
        transaction with id in (C, T) wrote (write or append lock) one of T's write or read locks."""
        writer: dict[str, Record] = {}
        for r in self.log.records:
            if r.payload is None or r.client_hwm is None:
                continue
            if r.client_hwm >= r.txid:
                self.add(
                    "client-hwm-ahead",
                    f"payload {r.payload} committed at id {r.txid} with client high-water mark {r.client_hwm}",
                    self.events_of(r.payload),
                    [r],
                )
            winners = {
                w.txid: w
                for lock in r.write_locks + r.read_locks
                if (w := writer.get(lock)) is not None and w.txid > r.client_hwm
            }
            if winners:
                ws = sorted(winners.values(), key=lambda w: w.txid)
                shared = sorted(
                    {
                        lock
                        for w in ws
                        for lock in (w.write_locks + w.append_locks)
                        if lock in r.write_locks + r.read_locks and writer.get(lock) is w
                    }
                )
                events = self.events_of(r.payload) + tuple(e for w in ws for e in self.events_of(w.payload))
                self.add(
                    "lock-violation",
                    f"payload {r.payload} committed at id {r.txid} with client high-water mark {r.client_hwm}, but "
                    + ", ".join(f"{w.payload} at id {w.txid}" for w in ws)
                    + f" wrote its lock(s) {shared} in between",
                    events,
                    ws + [r],
                )
            for lock in r.write_locks + r.append_locks:
                writer[lock] = r

    def high_water_marks(self) -> None:
        """Observed marks never go below what was known committed before they were asked (the same
        process's earlier observations, and, with `invoked`, anything known earlier), nor above the log."""
        known = self._known_committed_all()
        floor: dict[int, tuple[int, Event]] = {}  # observation index -> highest id known before it was asked
        asked = sorted((e.invoked, k) for k, e in enumerate(self.hwms) if e.invoked is not None)
        i, best = 0, None
        for t, k in asked:
            while i < len(known) and known[i][0] < t:
                if best is None or known[i][1] > best[1]:
                    best = known[i]
                i += 1
            if best is not None:
                floor[k] = (best[1], best[2])
        highest: dict[int | str, tuple[int, Event]] = {}  # each process's highest earlier observation
        for k, e in enumerate(self.hwms):
            assert e.value is not None
            prev = highest.get(e.process)
            if prev is not None and (k not in floor or prev[0] > floor[k][0]):
                floor[k] = prev
            if prev is None or e.value > prev[0]:
                highest[e.process] = (e.value, e)
            if k in floor and floor[k][0] > e.value:
                value, by = floor[k]
                self.add(
                    "hwm-decrease",
                    f"process {e.process} observed high-water mark {e.value} after {value} was known ({by.describe()})",
                    [by, e],
                )
            if e.value > self.log.last_id:
                self.add(
                    "hwm-beyond-log",
                    f"process {e.process} observed high-water mark {e.value}, the log's last id is {self.log.last_id}",
                    [e],
                    self.log.records[-1:],
                )

    def _known_committed_all(self) -> list[tuple[int, int, Event]]:
        # For the mark itself every observation counts, even one above the log: "it went down" and
        # "it was too high" are then both reported, each naming its events.
        out = [x for x in self._known_committed() if x[2].f != HWM]
        out += [(e.time, e.value, e) for e in self.hwms if e.value is not None]
        out.sort(key=lambda x: x[0])
        return out


def check(
    history: History,
    drains: Drains,
    *,
    reference: str = "cluster",
    lagging: Collection[str | tuple[str, int]] = (),
    first_id: int | None = 0,
) -> Report:
    """Checks `history` against `drains` (`{source: {partition: [Record, ...]}}`).

    `reference` names the source that is the committed log (what the cluster serves once healed).
    Every other source must hold exactly its records, byte for byte, on each partition it has an
    entry for (leave a partition out of a source that does not replicate it). A source in
    `lagging` (a name, or a (name, partition) pair: a replica outside the current write set, or
    one whose head was removed by retention) may miss ids, but what it holds must agree.
    `first_id`: the log's first id (None: wherever the reference starts). Ids below it may
    legitimately be missing (retention deleted them): an acknowledgement or a read of one is not
    an anomaly; everything from it on is checked as always.
    """
    if reference not in drains:
        raise ValueError(f"no drain of the reference source {reference!r} (sources: {sorted(drains)})")
    report = Report(warnings=list(history.warnings))
    ops = pair_appends(history, report.anomalies)
    ops_of: dict[int, list[AppendOp]] = defaultdict(list)
    for op in ops:
        ops_of[op.invoke.partition].append(op)
    reads_of: dict[int, list[Event]] = defaultdict(list)
    hwms_of: dict[int, list[Event]] = defaultdict(list)
    for e in history.events:
        if e.f == READ:
            reads_of[e.partition].append(e)
        elif e.f == HWM:
            hwms_of[e.partition].append(e)
    partitions = set(ops_of) | set(reads_of) | set(hwms_of) | set(drains[reference])
    for p in sorted(partitions):
        if p not in drains[reference]:
            report.warnings.append(f"{reference} has no drain of partition {p}: checked as empty")
        log = _Log(p, reference, drains[reference].get(p, []), first_id, report.anomalies)
        c = _PartitionCheck(p, log, ops_of[p], reads_of[p], hwms_of[p], report.anomalies)
        c.committed_records()
        c.outcomes()
        c.sources(drains, reference, lagging)
        c.consumers()
        c.realtime()
        c.locks()
        c.high_water_marks()
        report.counts[p] = c.counts()
    return report
