"""The checker's verdict: anomalies with the events and records that show them, and counts."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from waltz.torture.drain import Record
from waltz.torture.history import Event

# Every anomaly kind, with what it means (rendered in reports; docs/internals.md lists them too).
KINDS: dict[str, str] = {
    "lost-ack": "an acknowledged transaction is not in the committed log",
    "ack-wrong-id": "an acknowledged transaction is committed, but not at the id it was acknowledged with",
    "failed-committed": "a transaction reported as certainly failed is in the committed log",
    "duplicate-payload": "one payload is committed at several ids",
    "phantom-payload": "a committed payload that no process invoked on this partition",
    "corrupt-record": "committed bytes that are not an intact torture payload",
    "id-gap": "the committed log skips ids",
    "id-order": "the committed log repeats an id or goes back",
    "replica-mismatch": "a source holds other bytes than the committed log at some ids",
    "replica-missing": "a source that must hold the whole log lacks committed ids",
    "replica-extra": "a source holds ids that the committed log does not",
    "replica-order": "a source's ids repeat or go back",
    "read-mismatch": "a consumer received other bytes than the committed log at an id",
    "read-uncommitted": "a consumer received an id that the committed log does not hold",
    "consumer-skip": "a consumer's stream jumped over ids",
    "consumer-repeat": "a consumer's stream repeated an id or went back",
    "realtime-order": "a transaction got an id not above one known committed before it was invoked",
    "lock-violation": "a transaction committed although one committed between its client high-water mark and its id "
    "wrote one of its write or read locks",
    "client-hwm-ahead": "a transaction committed with a client high-water mark at or above its own id",
    "hwm-decrease": "the committed high-water mark was observed below what was known committed before it was asked",
    "hwm-beyond-log": "an observed high-water mark is above the last committed id",
    "malformed-history": "events that do not form operations (a completion without invoke, a payload invoked twice, "
    "...)",
}
# The workloads' own invariants (waltz/torture/bank.py, list_append.py).
KINDS.update(
    {
        "bank-total": "the accounts' total in the database is not what was opened",
        "bank-negative": "a balance is negative (in the database at the end, or replaying the log after a transfer)",
        "bank-stale-read": "a committed transfer saw other balances than the log held just before its id",
        "bank-applied-twice": "the database applied one committed transfer more than once",
        "bank-not-applied": "a committed transfer is not in the database at its id (or its mark is not the log's end)",
        "bank-phantom-apply": "the database applied a transfer that is not in the committed log",
        "bank-balance-mismatch": "the database's balances are not the committed log's replay",
        "la-incompatible-order": "a committed read of a list is not a prefix of the list's final order",
        "la-duplicate-append": "a value appears more than once in a list's final order",
        "la-stale-read": "a committed read did not see exactly the appends committed below its id",
        "la-cycle": "the write-write/write-read/read-write dependency graph of committed transactions has a cycle",
    }
)


@dataclasses.dataclass(frozen=True)
class Anomaly:
    kind: str
    partition: int
    message: str
    events: tuple[Event, ...] = ()
    """The history events involved (invocations, completions, reads, observations)."""
    records: tuple[tuple[str, Record], ...] = ()
    """The drained records involved, with their source."""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @property
    def payloads(self) -> set[str]:
        """Every payload id the anomaly involves."""
        out = {e.payload for e in self.events if e.payload is not None}
        return out | {r.payload for _, r in self.records if r.payload is not None}

    def render(self) -> str:
        lines = [f"[{self.kind}] partition {self.partition}: {self.message}"]
        lines += [f"    event  {e.describe()}" for e in self.events]
        lines += [f"    record {r.describe(source)}" for source, r in self.records]
        return "\n".join(lines)

    def to_json_obj(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "partition": self.partition,
            "message": self.message,
            "events": [e.to_json_obj() for e in self.events],
            "records": [{"source": s, **r.to_json_obj()} for s, r in self.records],
        }


@dataclasses.dataclass
class PartitionCounts:
    acknowledged: int = 0
    failed: int = 0
    unknown: int = 0
    """Operations whose outcome the workload never learned (info, or no completion)."""
    committed: int = 0
    unknown_committed: int = 0
    """Unknown operations found in the committed log."""
    reads: int = 0
    consumers: int = 0
    hwm_observations: int = 0


@dataclasses.dataclass
class Report:
    anomalies: list[Anomaly] = dataclasses.field(default_factory=list)
    counts: dict[int, PartitionCounts] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.anomalies

    def kinds(self) -> Counter[str]:
        return Counter(a.kind for a in self.anomalies)

    def of_kind(self, kind: str) -> list[Anomaly]:
        assert kind in KINDS, kind
        return [a for a in self.anomalies if a.kind == kind]

    def render(self, per_kind: int = 20) -> str:
        """A text report: counts per partition, then up to `per_kind` anomalies of each kind."""
        out = [f"history check: {'OK' if self.ok else f'{len(self.anomalies)} anomalies'}"]
        out.append("partition  acknowledged  failed  unknown  committed  unknown-committed  reads  consumers  hwm-obs")
        for p, c in sorted(self.counts.items()):
            out.append(
                f"{p:>9}  {c.acknowledged:>12}  {c.failed:>6}  {c.unknown:>7}  {c.committed:>9}  "
                f"{c.unknown_committed:>17}"
                f"  {c.reads:>5}  {c.consumers:>9}  {c.hwm_observations:>7}"
            )
        out += [f"warning: {w}" for w in self.warnings]
        for kind, n in sorted(self.kinds().items()):
            out.append(f"\n{kind} ({n}): {KINDS[kind]}")
            shown = self.of_kind(kind)[:per_kind]
            out += [a.render() for a in shown]
            if n > len(shown):
                out.append(f"... and {n - len(shown)} more {kind}")
        return "\n".join(out)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "counts": {str(p): dataclasses.asdict(c) for p, c in sorted(self.counts.items())},
                "kinds": dict(sorted(self.kinds().items())),
                "anomalies": [a.to_json_obj() for a in self.anomalies],
                "warnings": self.warnings,
            },
            indent=indent,
        )
