"""`waltz cluster`: create, show, verify and delete a cluster's metadata."""

from __future__ import annotations

import socket
import ssl
import uuid
from typing import Any

import click

from waltz._extras import require

require("rich", "cli", "The waltz command")

from rich.text import Text

from waltz import errors, role_secrets
from waltz.cli.context import admin_call, cluster_metadata, cluster_name, tls_context
from waltz.cli.output import Failed, Output, pass_output, user_errors
from waltz.cluster.metadata import UNRESOLVED, ClusterInfo, ClusterMetadata, StorageNodeInfo
from waltz.tls import handshake_error


@click.group()
def cluster() -> None:
    """Create, inspect, check and delete a cluster."""


@cluster.command()
@click.option("--name", help="Cluster name (default: the --cluster option).")
@click.option("--partitions", type=click.IntRange(1, 1 << 20), required=True, help="Number of partitions.")
@click.option("--replicas", type=click.IntRange(1, 64), required=True, help="Replicas per partition.")
@click.option(
    "--key",
    "cluster_key",
    type=click.UUID,
    envvar="WALTZ_CLUSTER_KEY",
    help="The cluster key to create it with (env WALTZ_CLUSTER_KEY; default: a new one).",
)
@pass_output
@user_errors
def create(out: Output, name: str | None, partitions: int, replicas: int, cluster_key: uuid.UUID | None) -> None:
    """Create a cluster with a new cluster key, or --key (idempotent for the same shape and key)."""
    name = name or cluster_name()
    secrets = role_secrets.secrets_from_env()
    with cluster_metadata(name) as meta:
        info, created = meta.create(name, partitions, replicas, cluster_key)
        # With every role's secret given, a ZooKeeper cluster gets its per-role access lists at once.
        acls = len(secrets) == 3 and meta.store.description.startswith("zk://")
        if acls:
            meta.set_role_acls(secrets)
    out.emit(
        {
            "created": created,
            "name": info.name,
            "cluster_key": str(info.cluster_key),
            "partitions": info.partitions,
            "replicas": info.replicas,
            "acls": acls,
        },
        lambda: out.line(
            f"{'created' if created else 'exists already:'} cluster {info.name} "
            f"(key {info.cluster_key}, {info.partitions} partitions, {info.replicas} replicas)"
            + ("; per-role ZooKeeper ACLs set" if acls else "")
        ),
    )


@cluster.command("set-acls")
@pass_output
@user_errors
def set_acls(out: Output) -> None:
    """Give the cluster's ZooKeeper tree per-role access lists (servers and admins write, clients
    read the cluster info, server registrations and assignment). The digest users' passwords are
    the role secrets in WALTZ_SERVER_SECRET, WALTZ_ADMIN_SECRET and WALTZ_CLIENT_SECRET, all three
    required. Upgrade servers and clients first: older clients write their ids to ZooKeeper."""
    secrets = role_secrets.secrets_from_env()
    missing = [env for role, env in role_secrets.ROLE_SECRET_ENVS.items() if role not in secrets]
    if missing:
        raise errors.ClusterError(f"set-acls needs every role's secret: set {', '.join(missing)}")
    with cluster_metadata() as meta:
        n = meta.set_role_acls(secrets)
    out.emit({"entries": n}, lambda: out.line(f"per-role access lists set on {n} entries of {meta.paths.root}"))


@cluster.command()
@pass_output
@user_errors
def show(out: Output) -> None:
    """Show the cluster: key, storage nodes, servers and the partition assignment."""
    with cluster_metadata() as meta:
        info = meta.info()
        nodes = meta.storage_nodes()
        servers = {s.server_id: s for s in meta.servers()}
        assignment, _ = meta.assignment()
        parts: list[dict[str, Any]] = []
        for p in range(info.partitions):
            pm, _ = meta.partition_metadata(p)
            a = assignment.get(p)
            parts.append(
                {
                    "partition": p,
                    "server": a.server if a else None,
                    "endpoint": servers[a.server].endpoint if a and a.server in servers else None,
                    "generation": a.generation if a else 0,
                    "store_session": pm.session_id,
                    "replicas": [n.address for n in nodes if p in n.partitions],
                }
            )
    doc = {
        "name": info.name,
        "cluster_key": str(info.cluster_key),
        "partitions": info.partitions,
        "replicas": info.replicas,
        "root": meta.paths.root,
        "metadata": meta.store.description,
        "storage_nodes": [
            {"address": n.address, "admin_port": n.admin_port, "group": n.group, "partitions": list(n.partitions)}
            for n in nodes
        ],
        "servers": [
            {"id": s.server_id, "endpoint": s.endpoint, "serving": sorted(s.serving)} for s in servers.values()
        ],
        "assignment": parts,
    }

    def human() -> None:
        out.kv(
            f"cluster {info.name}",
            [
                ("cluster key", info.cluster_key),
                ("partitions", info.partitions),
                ("replicas", info.replicas),
                ("metadata", f"{meta.store.description} {meta.paths.root}"),
            ],
        )
        out.table(
            "storage nodes",
            ["address", "admin port", "group", "partitions"],
            [(n.address, n.admin_port, n.group, _ranges(n.partitions)) for n in nodes],
        )
        out.table(
            "servers",
            ["id", "endpoint", "serving"],
            [(s.server_id, s.endpoint, _ranges(sorted(s.serving))) for s in servers.values()],
        )
        out.table(
            "partitions",
            ["partition", "server", "generation", "store session", "replicas"],
            [
                (x["partition"], x["endpoint"] or "-", x["generation"], x["store_session"], ", ".join(x["replicas"]))
                for x in parts
            ],
        )

    out.emit(doc, human)


@cluster.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Delete even while servers are registered.")
@pass_output
@user_errors
def delete(out: Output, yes: bool, force: bool) -> None:
    """Delete the cluster's metadata (not the storage nodes' files)."""
    with cluster_metadata() as meta:
        if not meta.exists():
            out.emit({"deleted": False}, lambda: out.line(f"no cluster at {meta.paths.root}; nothing to delete"))
            return
        info = meta.info()
        live = meta.servers()
        if live and not force:
            raise Failed(f"{len(live)} servers are registered in cluster {info.name}; stop them first or pass --force")
        if not yes:
            if out.as_json:
                raise Failed("deleting a cluster needs --yes when printing JSON")
            click.confirm(
                f"Delete cluster {info.name} (key {info.cluster_key}) from {meta.store.description}?", abort=True
            )
        meta.delete()
    out.emit({"deleted": True, "name": info.name}, lambda: out.line(f"deleted cluster {info.name}"))


@cluster.command()
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds per storage node or server check.")
@pass_output
@user_errors
def verify(out: Output, timeout: float) -> None:
    """Check the cluster: assignments, reachability, quorums, recovery. Exit 1 on any failure."""
    with cluster_metadata() as meta:
        checks = _verify(meta, timeout)
    failed = [c for c in checks if c["status"] == "FAIL"]

    def human() -> None:
        colour = {"PASS": "green", "WARN": "yellow", "FAIL": "red"}
        out.table(
            "cluster verify",
            ["check", "status", "detail"],
            [(c["check"], Text(c["status"], style=colour[c["status"]]), c["detail"]) for c in checks],
        )
        out.line("[red]FAILED[/]" if failed else "[green]all checks passed[/]", markup=True)

    out.emit({"ok": not failed, "checks": checks}, human)
    if failed:
        raise click.exceptions.Exit(1)


class _Checks:
    """The rows of `waltz cluster verify`: PASS (True), WARN (None) or FAIL (False) with a detail."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        self.rows.append(
            {"check": check, "status": "PASS" if ok else ("WARN" if ok is None else "FAIL"), "detail": detail}
        )


def _verify(meta: ClusterMetadata, timeout: float) -> list[dict[str, Any]]:
    checks = _Checks()
    info = meta.info()
    nodes = meta.storage_nodes()
    _check_replica_assignment(checks, info, nodes)
    healthy = _check_storage_nodes(checks, meta, nodes, timeout)
    _check_quorums(checks, info, nodes, healthy)
    _check_servers(checks, meta, info, timeout)
    _check_recovery(checks, meta, info, nodes)
    return checks.rows


def _check_replica_assignment(checks: _Checks, info: ClusterInfo, nodes: list[StorageNodeInfo]) -> None:
    found = len(checks.rows)
    for p in range(info.partitions):
        holders = [n.address for n in nodes if p in n.partitions]
        if len(holders) < info.replicas:
            checks.add(
                f"partition {p} replicas",
                False,
                f"{len(holders)} of {info.replicas} assigned ({', '.join(holders) or 'none'})",
            )
        elif len(holders) > info.replicas:
            checks.add(
                f"partition {p} replicas", None, f"{len(holders)} assigned, more than the {info.replicas} configured"
            )
    # One storage node under two names counts as one replica.
    seen_at: dict[tuple[Any, ...], str] = {}
    for n in nodes:
        try:
            resolved = tuple(
                sorted(
                    {
                        ai[4][:2]
                        for ai in socket.getaddrinfo(n.host, int(n.address.rsplit(":", 1)[1]), type=socket.SOCK_STREAM)
                    }
                )
            )
        except OSError:
            continue
        for other, addr in seen_at.items():
            if set(other) & set(resolved):
                checks.add(
                    f"storage {n.address} replicas", False, f"the same endpoint as {addr}: one node counted twice"
                )
        seen_at[resolved] = n.address
    if len(checks.rows) == found:
        checks.add("replica assignment", True, f"every partition has {info.replicas} replicas assigned")


def _check_storage_nodes(
    checks: _Checks, meta: ClusterMetadata, nodes: list[StorageNodeInfo], timeout: float
) -> dict[str, set[int]]:
    """Each storage node reachable, holding what it is assigned, healthy; returns the healthy
    partitions of each node."""
    healthy: dict[str, set[int]] = {}
    for n in nodes:
        try:
            status = admin_call(meta, n, lambda c: c.status(), timeout=timeout)
        except (errors.ClusterKeyMismatch, errors.PartitionCountMismatch) as e:
            checks.add(f"storage {n.address}", False, f"admin port {n.admin_address} belongs to another cluster: {e}")
            continue
        except (errors.WaltzError, OSError) as e:
            checks.add(f"storage {n.address}", False, f"admin port {n.admin_address} unreachable: {e}")
            continue
        present = {s["partition"]: s for s in status}
        missing = [p for p in n.partitions if p not in present]
        broken = {p: s["failure"] for p, s in present.items() if s["failure"]}
        closed = [p for p, s in present.items() if not (s["readable"] and s["writable"])]
        extra = sorted(p for p in present if p not in n.partitions)
        healthy[n.address] = {p for p in n.partitions if p in present and p not in broken and p not in closed}
        problems = []
        if missing:
            problems.append(f"assigned but absent: {missing} (run `waltz storage add-partition`)")
        if broken:
            problems.append(f"failed: {broken}")
        if closed:
            problems.append(f"marked unavailable: {closed}")
        checks.add(
            f"storage {n.address}",
            not problems,
            "; ".join(problems) or f"reachable, {len(n.partitions)} partitions healthy",
        )
        if extra:
            checks.add(
                f"storage {n.address} extra",
                None,
                f"holds partitions {extra} it is not assigned (`waltz storage remove-partition`)",
            )
    return healthy


def _check_quorums(
    checks: _Checks, info: ClusterInfo, nodes: list[StorageNodeInfo], healthy: dict[str, set[int]]
) -> None:
    quorum = info.replicas // 2 + 1
    short = []
    for p in range(info.partitions):
        ok = sum(1 for n in nodes if p in healthy.get(n.address, set()))
        if ok < quorum:
            short.append(f"{p} ({ok}/{quorum})")
    checks.add(
        "quorums",
        not short,
        f"without a healthy quorum: {', '.join(short)}" if short else f"every partition has {quorum}+ healthy replicas",
    )


def _check_servers(checks: _Checks, meta: ClusterMetadata, info: ClusterInfo, timeout: float) -> None:
    """Each server reachable (through TLS when configured), and the assignment served as written."""
    servers = {s.server_id: s for s in meta.servers()}
    assignment, _ = meta.assignment()
    if not servers:
        checks.add("servers", False, "no server is registered")
    context = tls_context()
    for s in servers.values():
        try:
            with socket.create_connection((s.host, s.port), timeout=timeout) as sock:
                if context is not None:
                    _tls_handshake(sock, context, s.host, f"server {s.endpoint}")
            checks.add(f"server {s.server_id}", True, f"{s.endpoint} reachable, serving {_ranges(sorted(s.serving))}")
        except OSError as e:
            checks.add(f"server {s.server_id}", False, f"{s.endpoint} unreachable: {e}")
    orphans = [p for p in range(info.partitions) if p not in assignment or assignment[p].server not in servers]
    mismatched = [
        p for p, a in assignment.items() if a.server in servers and servers[a.server].serving.get(p) != a.generation
    ]
    intruders = sorted(
        f"{p} by server {s.server_id}"
        for s in servers.values()
        for p in s.serving
        if p not in assignment or assignment[p].server != s.server_id or assignment[p].session != s.session
    )
    if servers:
        checks.add(
            "partition assignment",
            not orphans and not mismatched and not intruders,
            (f"unassigned: {orphans}. " if orphans else "")
            + (f"assigned but not (yet) served: {mismatched}. " if mismatched else "")
            + (f"served without being assigned: {', '.join(intruders)}" if intruders else "")
            or "every partition is served by a live server under its current generation",
        )


def _check_recovery(checks: _Checks, meta: ClusterMetadata, info: ClusterInfo, nodes: list[StorageNodeInfo]) -> None:
    """Every assigned replica in its partition's current store session, its closing settled."""
    pending = []
    never = []
    for p in range(info.partitions):
        pm, _ = meta.partition_metadata(p)
        if pm.session_id < 0:
            never.append(p)
            continue
        lagging = [
            r
            for r in (n.address for n in nodes if p in n.partitions)
            if r not in pm.replicas
            or pm.replicas[r].session_id != pm.session_id
            or pm.replicas[r].closing_high_water_mark != UNRESOLVED
        ]
        if lagging:
            pending.append(f"{p}: {', '.join(lagging)}")
    if never:
        checks.add(
            "recovery",
            None if not pending else False,
            f"no store session yet for partitions {_ranges(never)}"
            + (f"; not recovered: {'; '.join(pending)}" if pending else ""),
        )
    else:
        checks.add(
            "recovery",
            not pending,
            f"replicas not in the current session: {'; '.join(pending)}"
            if pending
            else "every replica is in its partition's current store session",
        )


def _tls_handshake(sock: socket.socket, context: ssl.SSLContext, host: str, peer: str) -> None:
    """A TLS handshake on a connected socket; its failure raises `TlsError` with the cause."""
    try:
        with context.wrap_socket(sock, server_hostname=host):
            pass
    except (ssl.SSLError, ConnectionError) as e:
        raise handshake_error(peer, e) from e


def _ranges(values: Any) -> str:
    """[0,1,2,5] → '0-2, 5'."""
    vs = sorted(values)
    if not vs:
        return "-"
    out, start, prev = [], vs[0], vs[0]
    for v in vs[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


__all__ = ["cluster"]
