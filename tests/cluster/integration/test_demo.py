"""`waltz demo`, the README's main job, run as a user runs it: a real command starting real
processes. Its verification must pass with a storage node and a server killed midway, on the
embedded store and on ZooKeeper; Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

WALTZ = [sys.executable, "-m", "waltz.cli.main"]


def processes_under(directory: pathlib.Path) -> list[int]:
    """Pids of live processes whose command line names the directory (members and clients)."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if str(directory).encode() in (proc / "cmdline").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def run_demo(tmp_path: pathlib.Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    directory, result = tmp_path / "demo", tmp_path / "result.json"
    done = subprocess.run(
        [*WALTZ, "demo", "--short", "--directory", str(directory), "--result", str(result), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not processes_under(directory), "the demo left processes running"
    return done, json.loads(result.read_text())


def check_verified(out: str, result: dict) -> None:
    assert result["passed"] and all(result["checks"].values()), result["checks"]
    assert result["lost"] == [] and result["duplicates"] == 0
    # Every submitted transfer completed: committed (acknowledged) or declined for lack of money.
    assert result["acknowledged"] + result["declined"] == result["submitted"] == 3 * 150
    assert result["committed"] >= result["acknowledged"] > 0
    assert all(c["applied"] == result["committed"] for c in result["clients"])
    assert result["log_balance"] == result["initial_balance"]
    for per in result["replicas"].values():
        assert len(per) == 3 and len({r["digest"] for r in per.values()}) == 1
    # The failures really happened while transfers were running.
    for member in ("storage-1", "server-0"):
        assert f"SIGKILL {member}" in out and f"restarted {member}" in out
    assert result["stale"] == 0 and "computed on a stale balance" in out
    assert "acknowledged transactions lost" in out and "verification passed" in out


def test_demo_passes_its_verification_through_kills(tmp_path: pathlib.Path) -> None:
    done, result = run_demo(tmp_path)
    check_verified(done.stdout, result)
    assert result["metadata"] == f"embedded:{tmp_path / 'demo' / 'metadata.db'}"
    # The data directory is kept for inspection: JSON logs of every member.
    logs = sorted(p.name for p in (tmp_path / "demo" / "logs").iterdir())
    assert logs == ["server-0.log", "server-1.log", "storage-0.log", "storage-1.log", "storage-2.log"]
    first = (tmp_path / "demo" / "logs" / "server-1.log").read_text().splitlines()[0]
    assert {"time", "level", "logger", "message"} <= json.loads(first).keys()


def test_demo_on_zookeeper(zookeeper, tmp_path: pathlib.Path) -> None:
    done, result = run_demo(tmp_path, "--zookeeper", zookeeper.hosts)
    check_verified(done.stdout, result)
    assert result["metadata"].startswith(f"zk://{zookeeper.hosts}/waltz-demo-")


def test_ctrl_c_stops_clients_and_cluster(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "demo"
    demo = subprocess.Popen(
        [*WALTZ, "demo", "--directory", str(directory), "--transfers", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    acks = directory / "clients" / "client-0" / "acks.log"
    deadline = time.monotonic() + 120
    while not (acks.exists() and acks.stat().st_size > 0):
        assert demo.poll() is None, demo.communicate()[0]
        assert time.monotonic() < deadline, "no transfer completed"
        time.sleep(0.2)
    assert len(processes_under(directory)) >= 5 + 3
    demo.send_signal(signal.SIGINT)
    out, _ = demo.communicate(timeout=120)
    assert demo.returncode == 130, out
    assert "interrupted" in out and "Traceback" not in out
    assert not processes_under(directory), "Ctrl-C left processes running"
    # A stopped demo is not a cluster to resume by accident: the directory refuses a new demo.
    again = subprocess.run([*WALTZ, "demo", "--short", "--directory", str(directory)], capture_output=True, text=True)
    assert again.returncode == 1 and "already holds a local cluster" in again.stderr


def judge(tmp_path: pathlib.Path, acked: list[str], logged: list[dict]) -> dict:
    """The demo's judge on a one-partition log of transfers between accounts 0 and 1, with client
    databases that agree with that log."""
    from waltz.demo import runner
    from waltz.demo.bank import ACCOUNTS_PER_PARTITION, INITIAL_BALANCE, balances_digest

    class Acked:
        index = 0

        def acks(self) -> list[str]:
            return acked

    balances = {a: INITIAL_BALANCE for a in range(ACCOUNTS_PER_PARTITION)}
    for t in logged:
        balances[t["from"]] -= t["amount"]
        balances[t["to"]] += t["amount"]
    report = {
        "applied": len(logged),
        "total": INITIAL_BALANCE * ACCOUNTS_PER_PARTITION,
        "negative": 0,
        "digest": balances_digest(balances.items()),
    }
    done = {"counts": {"executions": 3, "lock_failures": 0, "committed": 3, "declined": 0, "expired": 0, "errors": 0}}
    replicas = {n: {0: {"digest": "d", "records": len(logged), "transfers": logged}} for n in ("a", "b", "c")}
    options = runner.DemoOptions(directory=tmp_path, clients=1, transfers=3, partitions=1)
    return runner._judge([Acked()], [done], [report], replicas, {0: len(logged) - 1}, [], options)  # type: ignore[list-item]


def test_the_verification_fails_on_a_lost_acknowledgement(tmp_path: pathlib.Path) -> None:
    """The judge, fed a log missing one acknowledged transfer, reports it lost."""
    logged = [{"id": f"c0-{i}", "from": 0, "to": 1, "amount": 1, "seen": 1001 - i} for i in (1, 2)]
    result = judge(tmp_path, ["c0-1", "c0-2", "c0-3"], logged)
    assert result["lost"] == ["c0-3"]
    assert not result["passed"]
    assert [k for k, v in result["checks"].items() if not v] == ["acknowledged transactions lost"]


def test_the_verification_fails_on_a_transfer_computed_on_a_stale_balance(tmp_path: pathlib.Path) -> None:
    """Two transfers from account 0 both computed on its initial balance: the second would have
    lost its write lock. Money is conserved and no balance is negative, yet the locks failed."""
    logged = [{"id": f"c0-{i}", "from": 0, "to": 1, "amount": 100, "seen": 1000} for i in (1, 2)]
    result = judge(tmp_path, ["c0-1", "c0-2"], logged)
    assert result["stale"] == 1 and not result["passed"]
    assert [k for k, v in result["checks"].items() if not v] == ["no transfer computed on a stale balance"]


def test_demo_over_mutual_tls(tmp_path: pathlib.Path) -> None:
    """Every link of the demo (clients, servers to storage nodes, admin reads) over mutual TLS."""
    done, result = run_demo(tmp_path, "--tls")
    check_verified(done.stdout, result)
    configs = tmp_path / "demo" / "config"
    for name in ("storage-0", "server-1"):
        assert "[tls]" in (configs / f"{name}.toml").read_text()
        assert "TLS is not configured" not in (tmp_path / "demo" / "logs" / f"{name}.log").read_text()
