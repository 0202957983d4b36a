"""The standstill check of a torture run: a partition must go on committing while the only faults
active silence a minority of its replicas (issue 37: proving `partial-partition` and `one-way`
able to fail).

A replica silent for its server (a link that holds its bytes, a node paused, a server cut from one
node, a direction lost) leaves a majority that answers, so commits go on: the store session counts
the majority and takes the silent replica out of the write path. The history checker cannot see a
session that waits for the silent one instead (nothing is lost, the run only commits less), so the
nemesis watches the observed high-water marks: a partition whose mark did not rise for `STANDSTILL`
seconds while no fault that explains it ran, nor had run for `QUIET_AFTER` seconds, is a problem
of the run. Every other fault explains a standstill (a server or its clients' link faulted, a
majority down, the metadata store gone, a replica moved, the recovery after any of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

STANDSTILL = 3.0
"""Seconds without a commit that are a finding (the faults hold 1 to 6 s; the observer asks once a
second; a correct session does not wait for a silent minority at all)."""
QUIET_AFTER = 20.0
"""Seconds after a fault that explains a standstill before partitions are judged again (a killed
server's partitions move back, recoveries run, a majority catches up)."""
LINK_QUIET_AFTER = 3.0
"""The same after a link to a server held its bytes or slowed them (`one-way`, `partition`, `slow`
on a server): the held bytes flow at the heal and nothing has to recover."""
START_GRACE = 5.0
"""Seconds after the first observation before judging: the clients have just mounted."""
MINORITY_FAULTS = ("partial-partition",)
"""Faults that silence one storage node for one server, whatever their target."""
NODE_LINK_FAULTS = ("one-way", "partition", "slow", "pause")
"""Faults that silence or slow a minority when their target is a storage node (a server as target
cuts its partitions from their clients, which explains a standstill)."""


class ActiveFault(Protocol):
    kind: str
    targets: tuple[str, ...]
    explains_standstill: bool
    """Set by the nemesis on a minority fault that struck a partition already short of a replica."""


@dataclasses.dataclass
class _Partition:
    mark: int
    rose_at: float
    reported: bool = False
    faults: dict[str, None] = dataclasses.field(default_factory=dict)
    """The faults active while it stood still (in the order they were seen)."""


class ProgressWatch:
    """Fed once a nemesis step with the observed marks and the active faults; returns findings."""

    def __init__(
        self,
        storage: Sequence[str],
        *,
        standstill: float = STANDSTILL,
        quiet_after: float = QUIET_AFTER,
        link_quiet_after: float = LINK_QUIET_AFTER,
        start_grace: float = START_GRACE,
    ) -> None:
        self.storage = set(storage)
        self.standstill, self.quiet_after, self.start_grace = standstill, quiet_after, start_grace
        self.link_quiet_after = link_quiet_after
        self._partitions: dict[int, _Partition] = {}
        self._explained_until: float | None = None
        self.judged_seconds = 0.0
        """How long partitions were judged (every fault active silenced a minority, or none ran)."""
        self._last: float | None = None

    def explains(self, fault: ActiveFault) -> bool:
        """Whether `fault` can stop a partition's commits (everything but a silent minority)."""
        if getattr(fault, "explains_standstill", False):
            return True
        if fault.kind in MINORITY_FAULTS:
            return False
        if fault.kind in NODE_LINK_FAULTS:
            return not all(t in self.storage for t in fault.targets)
        return True

    def _held_server_link(self, fault: ActiveFault) -> bool:
        return (
            fault.kind in NODE_LINK_FAULTS
            and fault.kind != "pause"
            and not getattr(fault, "explains_standstill", False)
            and not any(t in self.storage for t in fault.targets)
        )

    def observe(self, marks: dict[int, int], active: Iterable[ActiveFault], now: float) -> list[str]:
        active = list(active)
        if self._explained_until is None:
            self._explained_until = now + self.start_grace
        for f in active:
            if self.explains(f):
                quiet = self.link_quiet_after if self._held_server_link(f) else self.quiet_after
                self._explained_until = max(self._explained_until, now + quiet)
        findings: list[str] = []
        judged = now >= self._explained_until
        if judged and self._last is not None:
            self.judged_seconds += now - max(self._last, self._explained_until)
        self._last = now
        for p, mark in sorted(marks.items()):
            seen = self._partitions.get(p)
            if seen is None or mark > seen.mark:
                self._partitions[p] = _Partition(mark, now)
                continue
            if judged:
                seen.faults.update((f"{f.kind} on {', '.join(f.targets)}", None) for f in active)
            since = max(seen.rose_at, self._explained_until)
            if judged and not seen.reported and now - since >= self.standstill:
                seen.reported = True
                faults = ", ".join(seen.faults) or "no fault"
                findings.append(
                    f"standstill: partition {p} committed nothing for {now - since:.0f} s (high-water mark {mark}) "
                    f"while only a minority of its replicas was faulted ({faults} meanwhile)"
                )
        return findings
