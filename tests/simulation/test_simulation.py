"""The deterministic simulation of store sessions and recovery (`sim.py`), as tests: many seeds
(`pytest --seeds N --first-seed S`), exact replay, and faults the invariants must catch."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys
import time

import pytest
import sim


@pytest.fixture(autouse=True)
def _quiet() -> object:
    logging.disable(logging.CRITICAL)  # thousands of expected warnings per seed
    yield None
    logging.disable(logging.NOTSET)


def test_seeds(request: pytest.FixtureRequest) -> None:
    first, count = request.config.getoption("--first-seed"), request.config.getoption("--seeds")
    started = time.perf_counter()
    acked = sessions = 0
    faults: dict[str, int] = {}
    for seed in range(first, first + count):
        r = sim.run(seed, duration=3.0)  # raises SimulationError naming the seed
        acked += r.acknowledged
        sessions += r.sessions
        for k, v in r.faults.items():
            faults[k] = faults.get(k, 0) + v
    print(
        f"\n{count} seeds from {first} in {time.perf_counter() - started:.1f}s: {acked} acknowledged, {sessions} "
        f"sessions, faults {faults}"
    )
    assert acked > count * 100 and sessions > count and faults.get("majority-crash", 0) > 0


def test_disks_lost_one_at_a_time_lose_nothing() -> None:
    """Only wipes (a node's disk replaced, the node back empty), with the servers' default lag
    allowance so sessions live long enough for a replica that lost its files to come back while
    the session that recorded it clean still runs.
    That session hands over to a successor instead of catching it up; nothing acknowledged is lost
    (the run checks it) and the wiped nodes end up with the whole log."""
    handed = 0
    for seed in range(12):
        r = sim.run(seed, replicas=3, duration=3.0, faults=("wipe",), max_lag=256)
        assert r.faults.get("wipe", 0) > 0 and r.acknowledged > 100
        handed += sum(1 for line in r.trace if "hands over" in line and "lost its files" in line)
    assert handed > 0, "no session met a replica that lost its files while it ran"


RETENTION_FAULTS = (
    "retention",
    "retention",
    "retention",
    "long-crash",
    "crash",
    "partition",
    "server-crash",
    "failover",
)


def test_retention_during_faults_loses_nothing_it_must_keep() -> None:
    """Retention deletes below random replicas' own low-water marks while replicas crash, are cut
    off and fail over: replicas left behind restart at the first id the others hold and are
    caught up; every acknowledged id above what retention deleted everywhere is in the final log."""
    restarts = deleted = 0
    for seed in range(16):
        r = sim.run(seed, duration=3.0, faults=RETENTION_FAULTS)
        assert r.acknowledged > 100
        deleted += sum(1 for line in r.trace if "retention on" in line)
        restarts += sum(1 for line in r.trace if "restarts its log at" in line)
    assert deleted > 0 and restarts > 0, (deleted, restarts)


def test_a_seed_replays_exactly() -> None:
    a, b = sim.run(7, duration=2.0), sim.run(7, duration=2.0)
    assert a.trace == b.trace and len(a.trace) > 20
    assert sim.run(8, duration=2.0).trace != a.trace


@pytest.mark.parametrize(
    ("mutant", "found"),
    [
        ("guessing-vote", "acknowledged"),
        ("no-fence", "acknowledged"),
        ("trusting-lost-files", "acknowledged"),
        ("retention-past-the-mark", "uncommitted ids went"),
    ],
)
def test_the_invariants_catch_a_broken_system(mutant: str, found: str) -> None:
    """Negative controls (in a process of their own: the mutant patches modules): a vote that
    ignores unreachable replicas, nodes that never fence an older session, and a recovery that
    believes a replica which lost its files (found by `waltz torture`), lose
    acknowledged transactions within a few seeds; a node whose retention ignores its low-water
    mark deletes uncommitted ids (the default fault mix includes retention); the simulation says
    so with a replay line."""
    out = subprocess.run(
        [sys.executable, str(pathlib.Path(sim.__file__)), "--seeds", "40", "--duration", "3", "--mutant", mutant],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        "FAILED: seed" in out.stderr and found in out.stderr and "replay: python tests/simulation/sim.py" in out.stderr
    )
