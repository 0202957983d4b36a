"""The torture run as CI runs it: a short schedule of every fault on a real cluster (ZooKeeper
metadata, so kill-zookeeper is in), then the checker over every history and drained copy.
`waltz torture --duration 1h --seed S` is the long form (docs/torture.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.processes import zookeeper_available
from waltz.torture.nemesis import FAULTS
from waltz.torture.run import TortureOptions, run_torture

DURATION = float(os.environ.get("WALTZ_TORTURE_SECONDS", "45"))


def test_short_schedule_of_faults_loses_nothing(tmp_path):
    if not zookeeper_available():
        pytest.fail("ZooKeeper is not installed: run scripts/setup.sh")
    said: list[str] = []
    faults = FAULTS
    options = TortureOptions(
        tmp_path / "run",
        duration=DURATION,
        seed=11,
        clients=2,
        partitions=2,
        zookeeper=True,
        hold=(1.0, 4.0),
        faults=faults,
        min_faults=8,
    )
    result = run_torture(options, say=said.append)
    assert result.problems == [], "\n".join(result.problems)
    assert result.report.ok, result.report.render()
    # A run that committed or injected next to nothing would prove nothing.
    counts = result.report.counts
    assert sum(c.acknowledged for c in counts.values()) > 200
    assert sum(c.reads for c in counts.values()) > 0 and all(c.hwm_observations > 0 for c in counts.values())
    assert sum(result.faults.values()) >= 8 and len(result.faults) >= 5, result.faults
    assert set(result.faults) <= set(faults)
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["passed"] is True and saved["faults"] == result.faults


def test_the_command_passes_a_quiet_run_and_its_checker_catches_a_lost_acknowledgement(tmp_path):
    """`waltz torture` end to end without faults (exit 0, PASSED); then the same pipeline judges
    the run's own history against drains that lost an acknowledged transaction: the checker must
    say so (the run above could not fail otherwise)."""
    from waltz.torture import check, read_drains, read_history

    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "waltz.cli.main",
            "torture",
            "--duration",
            "3s",
            "--faults",
            "none",
            "--clients",
            "1",
            "--partitions",
            "1",
            "--directory",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "history check: OK" in done.stdout and "PASSED" in done.stdout
    history = read_history(sorted((run / "history").glob("*.jsonl")))
    drains = read_drains(run / "drains.jsonl")
    acked = next(e for e in history.events if e.f == "append" and e.type == "ok")
    damaged = {
        source: {p: [r for r in recs if r.txid != acked.txid] for p, recs in parts.items()}
        for source, parts in drains.items()
    }
    report = check(history, damaged)
    assert "lost-ack" in report.kinds(), report.render()
