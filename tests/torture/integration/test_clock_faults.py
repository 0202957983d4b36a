"""The clock faults of issue 37 (item 2) on a real cluster with the embedded metadata store, which
every server and client shares and whose leases were the part of Waltz a wall clock could break:
every kind is injected in a short seeded run, the checker finds nothing, and no clock fault ended a
metadata session of a process that still ran. The mutant
tests/torture/mutants/embedded-wall-clock-leases.patch (docs/torture.md) fails the same run."""

from __future__ import annotations

import json
import os

from waltz.torture.clock_faults import CLOCK_FAULTS
from waltz.torture.run import TortureOptions, run_torture

DURATION = float(os.environ.get("WALTZ_TORTURE_SECONDS", "40"))


def test_clock_steps_and_skews_lose_nothing_and_end_no_session(tmp_path):
    said: list[str] = []
    result = run_torture(
        TortureOptions(
            tmp_path / "run",
            duration=DURATION,
            seed=7,
            clients=2,
            partitions=2,
            hold=(2.0, 6.0),
            interval=0.5,
            faults=CLOCK_FAULTS,
            heal_timeout=60.0,
            cover=True,
        ),
        say=said.append,
    )
    assert result.problems == [], "\n".join(result.problems)
    assert result.report.ok, result.report.render()
    assert set(result.faults) == set(CLOCK_FAULTS), (result.faults, "\n".join(said))
    assert sum(c.acknowledged for c in result.report.counts.values()) > 200
    heals = [
        json.loads(line)
        for line in (tmp_path / "run" / "history" / "nemesis.jsonl").read_text().splitlines()
        if '"heal"' in line
    ]
    # The sessions check looked at the servers' and the clients' sessions, not at an empty table.
    assert any(h.get("sessions_watched", 0) >= 4 for h in heals), heals
