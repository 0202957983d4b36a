"""The disk faults in CI: a short run of every one of them on LazyFS (power losses of one node,
two and all three, a full disk on a majority, a slow disk), with segments rolling during them,
then the checker. The schedule of every fault (test_torture.py) draws them too."""

from __future__ import annotations

import json
import os

from waltz.torture.disk import DISK_FAULTS
from waltz.torture.run import TortureOptions, run_torture

DURATION = float(os.environ.get("WALTZ_TORTURE_DISK_SECONDS", "35"))


def test_every_disk_fault_loses_nothing(tmp_path):
    options = TortureOptions(
        tmp_path / "run", duration=DURATION, seed=4, clients=2, partitions=2, hold=(1.0, 3.0), faults=DISK_FAULTS
    )
    result = run_torture(options, say=lambda _: None)
    assert result.problems == [], "\n".join(result.problems)
    assert result.report.ok, result.report.render()
    # The schedule draws from every disk fault; which ones land depends on timing too (a fault
    # is only drawn when the active ones allow it), so a short run is held to most of them.
    assert set(result.faults) <= set(DISK_FAULTS) and len(result.faults) >= 3, result.faults
    assert sum(result.faults.values()) >= 5, result.faults
    assert sum(c.acknowledged for c in result.report.counts.values()) > 100
    # Segments rolled: the 64 KiB segments of a disk-fault run filled up more than once.
    segments = list((tmp_path / "run" / "cluster" / "disks").glob("*/*/*.seg"))
    assert len(segments) > 2 * 3, segments
    events = [json.loads(line) for line in (tmp_path / "run" / "history" / "nemesis.jsonl").read_text().splitlines()]
    losses = [e for e in events if e.get("fault", "").startswith("power-") and e.get("type") == "start"]
    assert losses and all(set(e["lost"]) == set(e["targets"]) for e in losses)
