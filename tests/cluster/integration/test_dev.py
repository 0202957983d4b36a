"""`waltz dev up/down/status`: a local cluster that outlives the command that started it,
administered with the environment `dev up` prints."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

from test_demo import processes_under

WALTZ = [sys.executable, "-m", "waltz.cli.main"]


def waltz(*args: str, ok: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*WALTZ, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )
    assert done.returncode == (0 if ok else 1), done.stdout + done.stderr
    if not ok:
        assert "Traceback" not in done.stderr and done.stderr.startswith("waltz: "), done.stderr
    return done


def test_dev_up_status_down(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "dev"
    where = ["--directory", str(d)]
    try:
        up = json.loads(waltz("--json", "dev", "up", *where, "--partitions", "2").stdout)
        assert [m["name"] for m in up["members"]] == ["storage-0", "storage-1", "storage-2", "server-0", "server-1"]
        assert all(m["health"] == "ok" and m["pid"] for m in up["members"]), up
        # The members outlive `dev up`: they are still running now that it returned.
        pids = {m["name"]: m["pid"] for m in up["members"]}
        assert set(pids.values()) <= set(processes_under(d))
        status = json.loads(waltz("--json", "dev", "status", *where).stdout)
        assert {m["name"]: m["pid"] for m in status["members"]} == pids

        # The printed environment administers the cluster with the other commands.
        env = up["environment"]
        assert env["WALTZ_METADATA"] == f"embedded:{d / 'metadata.db'}"
        servers = json.loads(waltz("--json", "server", "list", env=env).stdout)
        assert len(servers) == 2 and sorted(p for s in servers for p in s["serving"]) == ["0", "1"]
        waltz("cluster", "verify", env=env)
        human = waltz("dev", "status", *where).stdout
        assert "storage-0" in human and "server-1" in human

        # A dead member: status says so and fails; `dev up` brings back only that one.
        os.kill(pids["storage-2"], signal.SIGKILL)
        failed = waltz("--json", "dev", "status", *where, ok=False)
        assert "not every member is up and healthy" in failed.stderr
        dead = {m["name"]: m for m in json.loads(failed.stdout)["members"]}
        assert dead["storage-2"]["health"] == "down" and dead["storage-2"]["pid"] is None
        again = json.loads(waltz("--json", "dev", "up", *where).stdout)
        new_pids = {m["name"]: m["pid"] for m in again["members"]}
        assert new_pids["storage-2"] != pids["storage-2"]
        assert {k: v for k, v in new_pids.items() if k != "storage-2"} == {
            k: v for k, v in pids.items() if k != "storage-2"
        }

        down = json.loads(waltz("--json", "dev", "down", *where).stdout)
        assert down["killed"] == [] and not processes_under(d)
        assert "down" in waltz("dev", "status", *where, ok=False).stdout
        # Up again on the same data: the cluster's log survived.
        waltz("dev", "up", *where)
        waltz("cluster", "verify", env=env)
    finally:
        subprocess.run([*WALTZ, "dev", "down", *where, "--purge"], capture_output=True, timeout=120)
    assert not d.exists() and not processes_under(d)


def test_dev_errors_are_one_line(tmp_path: pathlib.Path) -> None:
    assert "no local cluster in" in waltz("dev", "status", "--directory", str(tmp_path / "none"), ok=False).stderr
    assert "no local cluster in" in waltz("dev", "down", "--directory", str(tmp_path / "none"), ok=False).stderr
    # Fewer storage nodes than replicas: click refuses the option (usage errors exit 2).
    bad = subprocess.run(
        [*WALTZ, "dev", "up", "--directory", str(tmp_path / "x"), "--storage-nodes", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "'--storage-nodes': 2 is not in the range 3<=x<=16" in bad.stderr
    assert not (tmp_path / "x").exists()
    # A damaged cluster.json: one line naming it, nothing started.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "cluster.json").write_text("{not json")
    assert "cluster.json: unreadable" in waltz("dev", "up", "--directory", str(tmp_path / "broken"), ok=False).stderr


def test_dev_up_creates_everything_private_under_umask_022(tmp_path: pathlib.Path) -> None:
    """Issue 34: under umask 022 the configs, the metadata store, the state file (all holding or
    leading to the cluster key) and the storage files were created readable by every user of the
    host. Only certificates, which are public, may be readable by others now; the CA's key is not
    beside the certificates the members are given."""
    d = tmp_path / "dev"
    where = ["--directory", str(d)]
    old = os.umask(0o022)
    try:
        up = json.loads(waltz("--json", "dev", "up", *where, "--partitions", "1", "--tls").stdout)
        assert all(m["health"] == "ok" for m in up["members"]), up
    finally:
        os.umask(old)
    try:
        public = {"ca.pem", "storage.pem", "server.pem", "admin.pem", "client.pem"}
        seen = {"dirs": 0, "files": 0}
        for path in [d, *d.rglob("*")]:
            mode = path.stat().st_mode & 0o777
            if path.is_dir():
                seen["dirs"] += 1
                assert mode == 0o700, f"{path}: {oct(mode)}"
            elif path.name not in public:
                seen["files"] += 1
                assert mode & 0o077 == 0, f"{path}: {oct(mode)}"
        names = {p.name for p in d.rglob("*")}
        assert {"metadata.db", "waltz-storage.ctl"} <= names and any(n.endswith(".toml") for n in names), names
        assert {".seg", ".idx"} <= {p.suffix for p in d.rglob("*")}
        ca_key, node_key = d / "tls" / "ca-private" / "ca-key.pem", d / "tls" / "storage-key.pem"
        assert ca_key.exists() and not (d / "tls" / "ca-key.pem").exists()
        assert "ca-private" not in "".join(p.read_text() for p in (d / "config").glob("*.toml"))
        assert node_key.exists()
    finally:
        waltz("dev", "down", *where)
