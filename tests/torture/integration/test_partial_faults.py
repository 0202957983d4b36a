"""The partial partitions and misbehaving clients of issue 37 (items 3 and 7) on a real cluster
with ZooKeeper behind its proxy: every one of those fault kinds is injected at least once in a
short seeded run, the checker finds nothing, no misbehaving client got through, and the honest
clients committed throughout. Each kind's mutant (tests/torture/mutants/, docs/torture.md)
shows the same run failing when the property it tests is broken."""

from __future__ import annotations

import json
import os

import pytest
from support.processes import zookeeper_available
from waltz.torture.run import TortureOptions, run_torture

KINDS = ("partial-partition", "one-way", "zombie", "dup-client-id", "oversized-locks", "stalled-reader")
DURATION = float(os.environ.get("WALTZ_TORTURE_SECONDS", "40"))


def test_partial_partitions_and_bad_clients_lose_nothing(tmp_path):
    if not zookeeper_available():
        pytest.fail("ZooKeeper is not installed: run scripts/setup.sh")
    said: list[str] = []
    result = run_torture(
        TortureOptions(
            tmp_path / "run",
            duration=DURATION,
            seed=3,
            clients=2,
            partitions=2,
            zookeeper=True,
            hold=(1.0, 3.0),
            interval=0.5,
            faults=KINDS,
            heal_timeout=60.0,
            cover=True,
        ),
        say=said.append,
    )
    assert result.problems == [], "\n".join(result.problems)
    assert result.report.ok, result.report.render()
    assert set(result.faults) == set(KINDS), (result.faults, "\n".join(said))
    assert sum(c.acknowledged for c in result.report.counts.values()) > 200
    # What the misbehaving clients saw: a refusal of the borrowed id, a rejection of the locks.
    nemesis = [json.loads(line) for line in (tmp_path / "run" / "history" / "nemesis.jsonl").read_text().splitlines()]
    # Each zombie took clients with it, which kept sending it appends while the rest moved on.
    zombies = [e for e in nemesis if e["type"] == "start" and e["fault"] == "zombie" and "skipped" not in e]
    assert zombies and all(len(z["clients"]) == 1 for z in zombies), zombies
    seen = [e for e in nemesis if e["type"] == "observed"]
    by_kind = {e["fault"]: e["seen"] for e in seen if "skipped" not in e["seen"]}
    if "dup-client-id" in by_kind:
        assert by_kind["dup-client-id"]["refused"] > 0
    if "oversized-locks" in by_kind:
        assert "max_transaction_locks" in by_kind["oversized-locks"]["rejected"]
