"""`waltz demo`: a local cluster (3 storage nodes, 2 servers, as processes), client processes
moving money between accounts concurrently, a storage node and a server killed with SIGKILL
midway and restarted, then a verification of everything the log promises."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from waltz._extras import require

require("rich", "demo", "The demo")

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from waltz import errors
from waltz.demo.bank import ACCOUNTS_PER_PARTITION, INITIAL_BALANCE, balances_digest
from waltz.local import LocalCluster


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    directory: pathlib.Path
    metadata: str | None = None
    """A metadata store URL (zk://...); None: embedded in the directory."""
    clients: int = 3
    transfers: int = 1000
    """Per client."""
    partitions: int = 4
    chaos: bool = True
    tls: bool = False
    timeout: float = 600.0
    """How long the transfers, and then the verification, may take."""


@dataclasses.dataclass
class Chaos:
    """A SIGKILL once `at` of the transfers are acknowledged, a restart `pause` seconds later."""

    member: str
    at: float
    pause: float = 1.5
    killed_at: float | None = None
    restarted: bool = False


class Teller:
    def __init__(self, directory: pathlib.Path, index: int, transfers: int, config: dict[str, Any]) -> None:
        self.directory = directory / f"client-{index}"
        self.directory.mkdir(parents=True)
        self.index = index
        self._acks_seen = 0
        self._offset = 0
        with open(self.directory / "teller.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "waltz.demo.teller",
                    str(self.directory),
                    str(index),
                    str(transfers),
                    json.dumps(config),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def completed(self) -> int:
        """Transfers completed so far (lines of acks.log, read incrementally)."""
        try:
            with open(self.directory / "acks.log", "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        complete = chunk.rfind(b"\n") + 1
        self._acks_seen += chunk[:complete].count(b"\n")
        self._offset += complete
        return self._acks_seen

    def acks(self) -> list[str]:
        """The transfers acknowledged as committed."""
        path = self.directory / "acks.log"
        return [line for line in path.read_text().split() if not line.startswith("-")] if path.exists() else []

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.directory / name).read_text())  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None and code != 0:
            log = (self.directory / "teller.log").read_text(errors="replace").strip().splitlines()
            raise errors.WaltzError(f"client {self.index} exited with {code}: {log[-1] if log else '(no output)'}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_demo(options: DemoOptions, console: Console) -> dict[str, Any]:
    """Runs the demo; returns the verification (its "passed" says whether every check held).
    KeyboardInterrupt stops the clients and the cluster before it propagates."""
    o = options
    console.print(
        f"[bold]Waltz demo[/]: a bank ledger on a local cluster in {o.directory}\n"
        f"  3 storage nodes, 2 servers, {o.partitions} partitions, metadata "
        f"{'in ' + o.metadata if o.metadata else 'embedded (no ZooKeeper)'}; "
        f"{o.clients} client processes x {o.transfers} transfers"
    )
    cluster = LocalCluster.create(o.directory, metadata=o.metadata, partitions=o.partitions, tls=o.tls)
    tellers: list[Teller] = []
    try:
        with console.status("starting the cluster") as status:
            cluster.start(step=lambda s: status.update(s))
        console.print(f"  cluster up: {', '.join(m.name + '@' + m.address for m in cluster.members)}")
        config = cluster.client_settings()
        clients_dir = o.directory / "clients"
        for i in range(o.clients):  # one at a time, so an interrupt meanwhile stops those already started
            tellers.append(Teller(clients_dir, i, o.transfers, config))
        chaos = [Chaos("storage-1", 0.3), Chaos("server-0", 0.55)] if o.chaos else []
        _run_transfers(cluster, tellers, chaos, o, console)
        return {"metadata": cluster.metadata_url, **_verify(cluster, tellers, chaos, o, console)}
    finally:
        for t in tellers:
            t.stop()
        cluster.stop()


def _run_transfers(
    cluster: LocalCluster, tellers: list[Teller], chaos: list[Chaos], o: DemoOptions, console: Console
) -> None:
    total = o.clients * o.transfers
    columns = (TextColumn("  transfers completed"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    deadline = time.monotonic() + o.timeout
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("transfers", total=total)
        while True:
            acked = sum(t.completed() for t in tellers)
            progress.update(task, completed=acked)
            _chaos_step(cluster, chaos, acked / total, console.print)
            for t in tellers:
                t.check_alive()
            if all(t.read("done.json") is not None for t in tellers):
                break
            if time.monotonic() > deadline:
                raise errors.WaltzError(
                    f"the transfers did not complete within {o.timeout:.0f} s; logs in {o.directory}"
                )
            time.sleep(0.1)
        progress.update(task, completed=sum(t.completed() for t in tellers))
    for c in chaos:  # the run may outpace the schedule: every kill happens, every member returns
        while not c.restarted:
            _chaos_step(cluster, chaos, 1.0, console.print)
            time.sleep(0.1)


def _chaos_step(cluster: LocalCluster, chaos: list[Chaos], done: float, say: Callable[[str], None]) -> None:
    now = time.monotonic()
    for c in chaos:
        if c.killed_at is None and done >= c.at:
            cluster.kill(c.member, signal.SIGKILL)
            c.killed_at = now
            say(f"  [red]SIGKILL[/] {c.member} at {done:.0%} of the transfers")
        elif c.killed_at is not None and not c.restarted and now - c.killed_at >= c.pause:
            cluster.start_member(c.member)
            c.restarted = True
            say(f"  [green]restarted[/] {c.member} after {now - c.killed_at:.1f} s")


def _verify(
    cluster: LocalCluster, tellers: list[Teller], chaos: list[Chaos], o: DemoOptions, console: Console
) -> dict[str, Any]:
    done = [t.read("done.json") or {} for t in tellers]
    targets = {p: max(d["high_water_marks"][str(p)] for d in done) for p in range(o.partitions)}
    (o.directory / "clients" / "final.json").write_text(json.dumps(targets))
    deadline = time.monotonic() + o.timeout
    with console.status("clients are applying the rest of the log"):
        while not all(t.read("report.json") for t in tellers):
            for t in tellers:
                t.check_alive()
            if time.monotonic() > deadline:
                raise errors.WaltzError(f"the clients did not apply the log within {o.timeout:.0f} s")
            time.sleep(0.1)
    reports = [t.read("report.json") or {} for t in tellers]
    with console.status("waiting until every replica is back in the write path"):
        cluster.wait_served()
        cluster.wait_replicas()
    with console.status("reading every replica"):
        for m in cluster.members:  # quiet: nothing writes while the replicas are read
            if m.role == "server":
                cluster.kill(m.name, signal.SIGTERM)
        replicas = {m.name: _read_replica(cluster, m.name, targets) for m in cluster.members if m.role == "storage"}
    return _judge(tellers, done, reports, replicas, targets, chaos, o)


def _read_replica(cluster: LocalCluster, name: str, targets: dict[int, int]) -> dict[int, dict[str, Any]]:
    """Per partition: a digest of records 0..target and the transfers they hold, in order."""

    async def read(client: Any) -> dict[int, dict[str, Any]]:
        out = {}
        for p, target in targets.items():
            digest, ids, txid = hashlib.sha256(), [], 0
            while txid <= target:
                records = await client.records(p, txid, 1000)
                if not records:
                    break
                for r in records[: target - txid + 1]:
                    req = r.req_id
                    digest.update(
                        f"{r.txid}|{req.client_id}|{req.generation}|{req.partition_id}|{req.sequence}|{r.header}|".encode()
                    )
                    digest.update(bytes(r.data))
                    ids.append(json.loads(bytes(r.data)))
                txid += len(records)
            out[p] = {"digest": digest.hexdigest()[:16], "records": min(txid, target + 1), "transfers": ids}
        return out

    return cluster.admin(name, read)  # type: ignore[no-any-return]


def _judge(
    tellers: list[Teller],
    done: list[dict[str, Any]],
    reports: list[dict[str, Any]],
    replicas: dict[str, dict[int, dict[str, Any]]],
    targets: dict[int, int],
    chaos: list[Chaos],
    o: DemoOptions,
) -> dict[str, Any]:
    committed = sum(t + 1 for t in targets.values())
    first = next(iter(replicas.values()))
    log = [t for p in sorted(first) for t in first[p]["transfers"]]
    # The log replayed on its own: the balances every client database must equal.
    balances = {a: INITIAL_BALANCE for a in range(o.partitions * ACCOUNTS_PER_PARTITION)}
    stale = 0  # transfers computed on a balance their account no longer had: what the locks prevent
    for t in log:
        stale += t["seen"] != balances[t["from"]]
        balances[t["from"]] -= t["amount"]
        balances[t["to"]] += t["amount"]
    in_log = [t["id"] for t in log]
    acked = [a for t in tellers for a in t.acks()]
    lost = sorted(set(acked) - set(in_log))
    counts = [d["counts"] for d in done]
    initial = INITIAL_BALANCE * len(balances)
    log_digest = balances_digest(balances.items())
    replica_table = {
        p: {name: (r[p]["digest"], r[p]["records"]) for name, r in replicas.items()} for p in sorted(targets)
    }
    checks = {
        "acknowledged transactions lost": len(lost) == 0,
        "transfers committed twice": len(in_log) == len(set(in_log)),
        "every client applied every committed transaction": all(r["applied"] == committed for r in reports),
        "no transfer computed on a stale balance": stale == 0,
        "total balance conserved": sum(balances.values()) == initial and all(r["total"] == initial for r in reports),
        "no negative balance": min(balances.values()) >= 0 and all(r["negative"] == 0 for r in reports),
        "client databases equal the log": all(r["digest"] == log_digest for r in reports),
        "replica checksums equal": all(
            len({d for d, _ in per.values()}) == 1 and all(n == targets[p] + 1 for _, n in per.values())
            for p, per in replica_table.items()
        ),
    }
    return {
        "acknowledged": len(acked),
        "committed": committed,
        "submitted": o.clients * o.transfers,
        "declined": sum(c["declined"] for c in counts),
        "expired": sum(c["expired"] for c in counts),
        "errors": sum(c["errors"] for c in counts),
        "lock_failures": sum(c["lock_failures"] for c in counts),
        "retries": sum(c["executions"] for c in counts) - o.clients * o.transfers,
        "clients": [
            {
                "client": t.index,
                "applied": r["applied"],
                "total_balance": r["total"],
                "digest": r["digest"],
                **d["counts"],
            }
            for t, r, d in zip(tellers, reports, done)
        ],
        "initial_balance": initial,
        "log_balance": sum(balances.values()),
        "log_digest": log_digest,
        "replicas": {
            str(p): {n: {"digest": d, "records": c} for n, (d, c) in per.items()} for p, per in replica_table.items()
        },
        "lost": lost,
        "duplicates": len(in_log) - len(set(in_log)),
        "stale": stale,
        "negative": sum(1 for b in balances.values() if b < 0),
        "chaos": [{"member": c.member, "killed_at_fraction": c.at} for c in chaos],
        "checks": checks,
        "passed": all(checks.values()),
    }


def render(result: dict[str, Any], console: Console) -> None:
    def ok(good: bool) -> str:
        return "[green]✓[/]" if good else "[bold red]✗[/]"

    checks = result["checks"]
    table = Table(title="Verification", title_justify="left", show_header=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("", justify="center")
    table.add_row("transfers submitted", str(result["submitted"]), "")
    table.add_row("transactions acknowledged", str(result["acknowledged"]), "")
    table.add_row("transactions committed (in the log)", str(result["committed"]), "")
    table.add_row("declined (source account empty) / expired", f"{result['declined']} / {result['expired']}", "")
    table.add_row("lock failures / retries", f"{result['lock_failures']} / {result['retries']}", "")
    table.add_row(
        "transfers computed on a stale balance",
        str(result["stale"]),
        ok(checks["no transfer computed on a stale balance"]),
    )
    for c in result["clients"]:
        table.add_row(f"applied by client {c['client']}", str(c["applied"]), ok(c["applied"] == result["committed"]))
    totals = sorted({c["total_balance"] for c in result["clients"]} | {result["log_balance"]})
    table.add_row(
        "total balance (initial → final)",
        f"{result['initial_balance']} → {', '.join(map(str, totals))}",
        ok(checks["total balance conserved"]),
    )
    table.add_row(
        "accounts below zero (log / client databases)", str(result["negative"]), ok(checks["no negative balance"])
    )
    table.add_row("client databases equal the log", result["log_digest"], ok(checks["client databases equal the log"]))
    for p, per in result["replicas"].items():
        digests = {v["digest"] for v in per.values()}
        table.add_row(
            f"partition {p} replica checksums ({len(per)} replicas)",
            ", ".join(sorted(digests)),
            ok(len(digests) == 1 and checks["replica checksums equal"]),
        )
    table.add_row("transfers committed twice", str(result["duplicates"]), ok(result["duplicates"] == 0))
    table.add_row("acknowledged transactions lost", str(len(result["lost"])), ok(not result["lost"]))
    console.print(table)
    if result["passed"]:
        console.print("[bold green]verification passed[/]: nothing acknowledged was lost; every copy agrees")
    else:
        failed = [k for k, v in checks.items() if not v]
        console.print(f"[bold red]verification FAILED[/]: {', '.join(failed)}")


def default_directory() -> pathlib.Path:
    import tempfile

    return pathlib.Path(tempfile.mkdtemp(prefix="waltz-demo-"))


def install_sigterm_as_interrupt() -> None:
    """SIGTERM stops the demo the way Ctrl-C does: clients, then servers, then storage."""

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


__all__ = ["DemoOptions", "default_directory", "install_sigterm_as_interrupt", "render", "run_demo"]
