"""The standstill check (`waltz.torture.progress`): a partition must go on committing while only a
minority of its replicas is faulted; any other fault, and a while after it, explains a halt."""

from __future__ import annotations

import dataclasses

from waltz.torture.progress import LINK_QUIET_AFTER, QUIET_AFTER, STANDSTILL, START_GRACE, ProgressWatch

STORAGE = ("storage-0", "storage-1", "storage-2")


@dataclasses.dataclass
class F:
    kind: str
    targets: tuple[str, ...]
    explains_standstill: bool = False


def run(watch: ProgressWatch, steps: list[tuple[float, dict[int, int], list[F]]]) -> list[str]:
    found: list[str] = []
    for now, marks, active in steps:
        found += watch.observe(marks, active, now)
    return found


def halted(start: float, seconds: int, marks: dict[int, int], active: list[F]) -> list[tuple[float, dict, list[F]]]:
    return [(start + i, marks, active) for i in range(seconds + 1)]


def test_a_partition_halted_under_a_minority_fault_is_a_finding_once() -> None:
    watch = ProgressWatch(STORAGE)
    cut = [F("partial-partition", ("server-0", "storage-1"))]
    steps = [(float(t), {0: t, 1: t}, []) for t in range(int(START_GRACE) + 2)]
    t0 = steps[-1][0] + 1
    # Partition 0 stops at 100 while partition 1 goes on: only partition 0 is reported, once.
    steps += [(t0 + i, {0: 100, 1: 200 + i}, cut) for i in range(int(STANDSTILL) + 5)]
    found = run(watch, steps)
    assert len(found) == 1, found
    assert found[0].startswith(
        f"standstill: partition 0 committed nothing for {STANDSTILL:.0f} s (high-water mark 100)"
    )
    assert "partial-partition on server-0, storage-1" in found[0]
    # It rises, then halts again: a second finding.
    t1 = t0 + STANDSTILL + 6
    again = run(watch, [(t1, {0: 101, 1: 300}, cut), *halted(t1 + 1, int(STANDSTILL) + 1, {0: 101, 1: 300}, cut)])
    assert [f.split(" committed")[0] for f in again] == ["standstill: partition 0", "standstill: partition 1"]


def test_storage_link_faults_are_a_minority_and_server_ones_explain_a_halt() -> None:
    watch = ProgressWatch(STORAGE)
    assert not watch.explains(F("one-way", ("storage-2",)))
    assert not watch.explains(F("pause", ("storage-0",)))
    assert not watch.explains(F("partition", ("storage-1",)))
    assert not watch.explains(F("slow", ("storage-1",)))
    assert watch.explains(F("one-way", ("server-1",)))
    # Struck while a partition was already short of a replica: no majority may be left to write to.
    assert watch.explains(F("partial-partition", ("server-0", "storage-1"), explains_standstill=True))
    assert watch.explains(F("partition", ("server-0",)))
    for kind in ("kill-storage", "kill-majority", "kill-server", "stop-server", "zombie", "move-replica", "corrupt"):
        assert watch.explains(F(kind, ("storage-0",))), kind


def test_no_finding_while_or_shortly_after_a_fault_that_explains_a_halt() -> None:
    watch = ProgressWatch(STORAGE)
    kill = [F("kill-server", ("server-0",))]
    steps = [(float(t), {0: 5}, kill if t < 20 else []) for t in range(int(20 + QUIET_AFTER))]
    assert run(watch, steps) == []
    assert watch.judged_seconds == 0
    # Once quiet that long, the same halt is judged from the end of the explanation on.
    later = 20 + QUIET_AFTER
    found = run(watch, [(later + i, {0: 5}, []) for i in range(int(STANDSTILL) + 1)])
    assert len(found) == 1 and "no fault meanwhile" in found[0]
    assert watch.judged_seconds >= STANDSTILL


def test_the_clients_mounting_are_given_a_grace() -> None:
    watch = ProgressWatch(STORAGE)
    assert run(watch, [(float(t), {0: -1}, []) for t in range(int(START_GRACE))]) == []
    assert run(watch, [(START_GRACE + STANDSTILL, {0: -1}, [])]) != []


def test_a_held_link_to_a_server_explains_a_halt_for_less_long() -> None:
    watch = ProgressWatch(STORAGE)
    cut = [F("one-way", ("server-0",))]
    steps = [(float(t), {0: 5}, cut if t < 20 else []) for t in range(int(20 + LINK_QUIET_AFTER + STANDSTILL) + 1)]
    found = run(watch, steps)
    assert len(found) == 1 and "no fault meanwhile" in found[0]
