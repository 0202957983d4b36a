"""`waltz retention`: the policy and holds in the metadata (show, set, hold, release), and what
each replica holds now (first id, bytes on disk, oldest segment, bytes reclaimed) through the
storage nodes' admin ports."""

from __future__ import annotations

import time
from typing import Any

import click

from waltz import clock
from waltz._extras import require

require("rich", "cli", "The waltz command")

from waltz import errors
from waltz.cli.context import admin_call, cluster_metadata
from waltz.cli.output import Failed, Output, pass_output, user_errors
from waltz.cluster import retention as policy_store
from waltz.cluster.metadata import ClusterMetadata
from waltz.cluster.retention import RetentionPolicy


@click.group()
def retention() -> None:
    """Retention: how much of each partition's log storage nodes keep, and holds on it."""


def _age(ms: int | None) -> str:
    if ms is None:
        return "none"
    for unit, n in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= n and ms % n == 0:
            return f"{ms // n}{unit}"
    return f"{ms}ms"


def _size(n: int | None) -> str:
    if n is None:
        return "none"
    for unit, k in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _policy_doc(p: RetentionPolicy) -> dict[str, Any]:
    return {"max_age_ms": p.max_age_ms, "max_bytes": p.max_bytes, "min_kept": p.min_kept}


def _replicas(meta: ClusterMetadata, partitions: int) -> list[dict[str, Any]]:
    """What every storage node reports of its partitions; an unreachable node is one row."""
    rows: list[dict[str, Any]] = []
    now = clock.now_ms()
    for node in meta.storage_nodes():
        try:
            status = admin_call(meta, node, lambda c: c.status(), timeout=5.0)
        except (errors.WaltzError, OSError) as e:
            rows.append({"storage": node.address, "error": str(e)})
            continue
        for s in status:
            if s["partition"] >= partitions:
                continue
            oldest = s.get("oldest_ms", -1)
            rows.append(
                {
                    "storage": node.address,
                    "partition": s["partition"],
                    "first_transaction_id": s["first_transaction_id"],
                    "max_transaction_id": s["max_transaction_id"],
                    "low_water_mark": s["local_low_water_mark"],
                    "bytes_on_disk": s.get("bytes_on_disk", -1),
                    "oldest_segment_age_ms": now - oldest if oldest >= 0 else None,
                    "reclaimed_bytes": s.get("reclaimed_bytes", 0),
                    "retention_limit": s.get("retention_limit", -1),
                    "retention_hold": s.get("retention_hold", -1),
                }
            )
    return rows


@retention.command("show")
@click.option("--replicas/--no-replicas", default=True, show_default=True, help="Ask every storage node too.")
@pass_output
@user_errors
def show(out: Output, replicas: bool) -> None:
    """Show the policy, the per-partition overrides, the holds and what each replica holds."""
    with cluster_metadata() as meta:
        config, _ = policy_store.read(meta)
        n = meta.info().partitions
        rows = _replicas(meta, n) if replicas else []
    now = clock.now_ms()
    doc = {
        "default": _policy_doc(config.default),
        "partitions": {p: _policy_doc(config.policy_for(p)) for p in sorted(config.overrides)},
        "holds": [{**h.__dict__, "active": h.active(now)} for h in sorted(config.holds.values(), key=lambda h: h.name)],
        "replicas": rows,
    }

    def human() -> None:
        d = config.default
        keeps = " (keeps everything)" if d.keeps_everything else ""
        out.kv(
            f"cluster-wide policy{keeps}",
            [("max age", _age(d.max_age_ms)), ("max bytes", _size(d.max_bytes)), ("min kept", d.min_kept)],
        )
        if config.overrides:
            out.table(
                "per-partition policies",
                ["partition", "max age", "max bytes", "min kept"],
                [
                    (p, _age(e.max_age_ms), _size(e.max_bytes), e.min_kept)
                    for p, e in ((p, config.policy_for(p)) for p in sorted(config.overrides))
                ],
            )
        if config.holds:
            out.table(
                "holds",
                ["name", "partition", "from id", "expires in", "active"],
                [
                    (
                        h.name,
                        h.partition,
                        h.txid,
                        "never" if h.expires_ms is None else _age(max(0, h.expires_ms - now) // 1000 * 1000),
                        "yes" if h.active(now) else "expired",
                    )
                    for h in sorted(config.holds.values(), key=lambda h: h.name)
                ],
            )
        if rows:
            out.table(
                "replicas",
                ["storage", "partition", "first id", "max id", "low-water mark", "on disk", "oldest", "reclaimed"],
                [
                    (r["storage"], "-", r["error"], "", "", "", "", "")
                    if "error" in r
                    else (
                        r["storage"],
                        r["partition"],
                        r["first_transaction_id"],
                        r["max_transaction_id"],
                        r["low_water_mark"],
                        _size(r["bytes_on_disk"]),
                        "-" if r["oldest_segment_age_ms"] is None else _age(r["oldest_segment_age_ms"] // 1000 * 1000),
                        _size(r["reclaimed_bytes"]),
                    )
                    for r in rows
                ],
            )

    out.emit(doc, human)


@retention.command("set")
@click.option("--partition", "-p", type=click.IntRange(0), help="Override one partition (default: cluster-wide).")
@click.option("--max-age", metavar="DURATION", help="e.g. 7d, 12h, 30m; 'none' for no age limit.")
@click.option("--max-bytes", metavar="SIZE", help="Per replica, e.g. 500GiB; 'none' for no size limit.")
@click.option("--min-kept", type=click.IntRange(0), help="Transactions always kept, however old or large.")
@click.option(
    "--clear", is_flag=True, help="With --partition: drop its overrides (it follows the cluster-wide policy)."
)
@pass_output
@user_errors
def set_(
    out: Output, partition: int | None, max_age: str | None, max_bytes: str | None, min_kept: int | None, clear: bool
) -> None:
    """Set the retention policy, cluster-wide or for one partition."""
    fields: dict[str, Any] = {}
    if max_age is not None:
        fields["max_age_ms"] = policy_store.parse_duration(max_age)
    if max_bytes is not None:
        fields["max_bytes"] = policy_store.parse_size(max_bytes)
    if min_kept is not None:
        fields["min_kept"] = min_kept
    if clear and partition is None:
        raise click.UsageError("--clear needs --partition")
    if not fields and not clear:
        raise click.UsageError("nothing to set: give --max-age, --max-bytes, --min-kept (or --clear with --partition)")
    with cluster_metadata() as meta:
        config = policy_store.set_policy(meta, partition, clear=clear, **fields)
    p = config.default if partition is None else config.policy_for(partition)
    where = "cluster-wide" if partition is None else f"partition {partition}"
    out.emit(
        {"partition": partition, "policy": _policy_doc(p)},
        lambda: out.line(
            f"retention {where}: max age {_age(p.max_age_ms)}, max bytes {_size(p.max_bytes)}, min kept {p.min_kept}"
            + (" (keeps everything)" if p.keeps_everything else "")
        ),
    )


def _unconfirmed(rows: list[dict[str, Any]], partition: int, txid: int) -> list[str]:
    """The replicas of `partition` not yet known to keep `txid`, each with why. A replica
    confirms when its standing retention order (from the server serving the partition) holds
    from `txid` or below. One with no standing order deletes nothing for now, but has not
    confirmed: the order a server hands it next must carry the hold."""
    pending = []
    for r in rows:
        if "error" in r:
            pending.append(f"{r['storage']}: unreachable ({r['error']})")
        elif r["partition"] == partition:
            if r["first_transaction_id"] > txid:
                pending.append(f"{r['storage']}: already deleted it (first id {r['first_transaction_id']})")
            elif r["retention_hold"] < 0:
                pending.append(
                    f"{r['storage']}: no retention order stands (no server serves the partition, or none has "
                    "handed it the policy yet; it deletes nothing meanwhile)"
                )
            elif r["retention_hold"] > txid:
                pending.append(f"{r['storage']}: its retention order still holds only from {_hold_text(r)}")
    return pending


def _hold_text(r: dict[str, Any]) -> str:
    return "nowhere (no hold)" if r["retention_hold"] == policy_store.NO_HOLD else f"id {r['retention_hold']}"


@retention.command("hold")
@click.argument("name")
@click.option("--partition", "-p", type=click.IntRange(0), required=True, help="Partition to hold.")
@click.option("--id", "txid", type=click.IntRange(0), required=True, help="First transaction id to keep.")
@click.option("--ttl", metavar="DURATION", help="Expire the hold after this long (default: never).")
@click.option(
    "--wait",
    metavar="SECONDS",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="How long to wait for every replica to confirm the hold (0: do not wait).",
)
@pass_output
@user_errors
def hold(out: Output, name: str, partition: int, txid: int, ttl: str | None, wait: float) -> None:
    """Keep transaction ID and everything after it on every replica of PARTITION.

    Writes the hold to the metadata, then waits until every storage node holding PARTITION
    reports it in force (the retention order the partition's server handed it holds from ID or
    below); names the replicas that did not within --wait and exits 1 (the hold stays in the
    metadata). Refused when a replica already deleted the id.
    """
    ttl_ms = policy_store.parse_duration(ttl) if ttl is not None else None
    with cluster_metadata() as meta:
        n = meta.info().partitions
        gone = [r for r in _replicas(meta, n) if r.get("partition") == partition and r["first_transaction_id"] > txid]
        if gone:
            where = ", ".join(f"{r['storage']} (first id {r['first_transaction_id']})" for r in gone)
            raise Failed(f"partition {partition}: transaction {txid} is already deleted on {where}")
        h = policy_store.add_hold(meta, name, partition, txid, ttl_ms)
        deadline = time.monotonic() + wait
        pending = _unconfirmed(_replicas(meta, n), partition, txid) if wait > 0 else []
        while pending and time.monotonic() < deadline:
            time.sleep(0.2)
            pending = _unconfirmed(_replicas(meta, n), partition, txid)
    if pending:
        raise Failed(
            f"hold {h.name} is in the metadata, but partition {partition} has not confirmed it within {wait:g}s on "
            + "; ".join(pending)
            + " (is a server serving the partition? `waltz retention show` lists the replicas)"
        )
    out.emit(
        {**h.__dict__, "confirmed": wait > 0},
        lambda: out.line(
            f"hold {h.name}: partition {h.partition} keeps transaction {h.txid} and after"
            + ("" if ttl_ms is None else f" for {_age(ttl_ms)}")
            + (" (every replica confirmed)" if wait > 0 else " (not waited for)")
        ),
    )


@retention.command("release")
@click.argument("name")
@pass_output
@user_errors
def release(out: Output, name: str) -> None:
    """Remove a hold."""
    with cluster_metadata() as meta:
        found = policy_store.release_hold(meta, name)
    if not found:
        raise Failed(f"no hold named {name!r}")
    out.emit({"released": name}, lambda: out.line(f"hold {name} released"))


__all__ = ["retention"]
