"""The torture workloads with their own invariants (`--workload bank | list-append |
lock-fallback`, docs/torture.md "Workloads"): a short schedule of every fault on a real cluster
(embedded metadata), then the plain checker and the workload's checker over the committed log.
Each asserts that the run passed and that it did enough of what the workload is about to mean
something. `WALTZ_TORTURE_WORKLOAD_SECONDS` changes the schedule's length."""

from __future__ import annotations

import os

import pytest
import sqlalchemy as sa
from waltz.torture import read_drains
from waltz.torture.bank import database, read_bank
from waltz.torture.nemesis import FAULTS
from waltz.torture.run import TortureOptions, run_torture

DURATION = float(os.environ.get("WALTZ_TORTURE_WORKLOAD_SECONDS", "20"))
EMBEDDED_FAULTS = tuple(f for f in FAULTS if f != "kill-zookeeper")


def run(tmp_path, workload: str, **kw):
    options = TortureOptions(
        tmp_path / "run",
        duration=DURATION,
        seed=17,
        hold=(1.0, 4.0),
        faults=EMBEDDED_FAULTS,
        workload=workload,
        min_faults=5,
        **kw,
    )
    result = run_torture(options, say=lambda s: None)
    assert result.problems == [], "\n".join(result.problems)
    assert result.report.ok, result.report.render()
    assert sum(result.faults.values()) >= 5, result.faults
    return result


def test_bank_instances_sharing_one_database_conserve_money_and_apply_each_transfer_once(tmp_path):
    run(tmp_path, "bank", clients=3, partitions=2)
    state = read_bank(tmp_path / "run")
    assert len(state["applied"]) > 100
    engine = database(tmp_path / "run")
    with engine.connect() as conn:
        instances = conn.execute(sa.text("SELECT COUNT(DISTINCT instance) FROM bank_applied")).scalar()
    engine.dispose()
    assert instances >= 2  # the exactly-once step was shared, not one instance doing everything


@pytest.mark.parametrize("workload", ["list-append", "lock-fallback"])
def test_list_append_histories_have_no_anomaly(tmp_path, workload: str):
    result = run(tmp_path, workload, clients=2, partitions=1)
    log = read_drains(tmp_path / "run" / "drains.jsonl")["cluster"][0]
    reads = [n for r in log for n, *_ in r.extra["r"].values()]
    assert len(reads) > 100 and sum(1 for n in reads if n > 0) > 20
    if workload == "lock-fallback":
        keys = {k for r in log for k in r.extra["a"]}
        assert len(keys) > 100, len(keys)  # many more locks than the 512 slots' worth of hot keys
        assert "lock_budget_bytes = 4096" in (tmp_path / "run" / "cluster" / "config" / "server-0.toml").read_text()
        # The array answered: every failure the servers now serving counted was decided by it.
        locks = result.locks
        assert locks["lock_failures"] > 0 and locks["lock_fallback_failures"] == locks["lock_failures"], locks
