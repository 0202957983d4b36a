"""`waltz storage`: storage nodes in the metadata (add, remove, assign replicas) and on the nodes
themselves through their admin ports (partitions, availability, status, recovery copies)."""

from __future__ import annotations

import asyncio
from typing import Any

import click

from waltz._extras import require

require("rich", "cli", "The waltz command")

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from waltz import errors
from waltz.cli.context import admin_call, cluster_metadata, tls_context
from waltz.cli.output import Failed, Output, pass_output, user_errors
from waltz.cluster.metadata import ClusterMetadata, StorageNodeInfo, parse_address
from waltz.role_secrets import credential_from_env
from waltz.storage.client import StorageAdminClient

NODE = click.option(
    "--storage", "address", required=True, metavar="HOST:PORT", help="Storage node (its storage-protocol address)."
)
PARTITIONS = click.option(
    "--partition",
    "-p",
    "partitions",
    type=click.IntRange(0),
    multiple=True,
    required=True,
    help="Partition id (repeatable).",
)


@click.group()
def storage() -> None:
    """Storage nodes: membership, replica assignment, partitions, availability, recovery."""


def _node(meta: ClusterMetadata, address: str) -> StorageNodeInfo:
    return meta.storage_node(address)


def _partition_status(meta: ClusterMetadata, node: StorageNodeInfo, partition: int) -> dict[str, Any]:
    for s in admin_call(meta, node, lambda c: c.status()):
        if s["partition"] == partition:
            return s
    raise Failed(f"storage node {node.address} does not hold partition {partition} (run `waltz storage add-partition`)")


def _changed(out: Output, changed: bool, what: str, doc: dict[str, Any] | None = None) -> None:
    out.emit(
        {"changed": changed, **(doc or {})},
        lambda: out.line(what if changed else f"{what} (already so; nothing changed)"),
    )


# -- metadata: membership and replica assignment --------------------------------------------
@storage.command("add-node")
@NODE
@click.option("--admin-port", type=click.IntRange(1, 65535), required=True, help="The node's admin port.")
@click.option("--group", type=click.IntRange(0), default=0, show_default=True, help="Storage group.")
@pass_output
@user_errors
def add_node(out: Output, address: str, admin_port: int, group: int) -> None:
    """Add a storage node to the cluster (idempotent)."""
    with cluster_metadata() as meta:
        changed = meta.add_storage_node(address, admin_port, group)
    _changed(out, changed, f"storage node {parse_address(address)} in group {group}, admin port {admin_port}")


@storage.command("remove-node")
@NODE
@pass_output
@user_errors
def remove_node(out: Output, address: str) -> None:
    """Remove a storage node that holds no partitions (idempotent)."""
    with cluster_metadata() as meta:
        changed = meta.remove_storage_node(address)
    _changed(out, changed, f"removed storage node {parse_address(address)}")


@storage.command()
@NODE
@PARTITIONS
@pass_output
@user_errors
def assign(out: Output, address: str, partitions: tuple[int, ...]) -> None:
    """Assign replicas of partitions to a storage node in the metadata (idempotent)."""
    with cluster_metadata() as meta:
        changed = [p for p in partitions if meta.assign_partition(address, p)]
    _changed(
        out,
        bool(changed),
        f"assigned partitions {sorted(partitions)} to {parse_address(address)}",
        {"partitions": changed},
    )


@storage.command()
@NODE
@PARTITIONS
@pass_output
@user_errors
def unassign(out: Output, address: str, partitions: tuple[int, ...]) -> None:
    """Take replicas of partitions away from a storage node in the metadata (idempotent)."""
    with cluster_metadata() as meta:
        changed = [p for p in partitions if meta.unassign_partition(address, p)]
    _changed(
        out,
        bool(changed),
        f"unassigned partitions {sorted(partitions)} from {parse_address(address)}",
        {"partitions": changed},
    )


@storage.command("auto-assign")
@click.option("--group", type=click.IntRange(0), required=True, help="Storage group to spread every partition over.")
@pass_output
@user_errors
def auto_assign(out: Output, group: int) -> None:
    """Give every partition without a replica in the group one, on its least loaded node
    (idempotent; never removes a replica)."""
    with cluster_metadata() as meta:
        placement = meta.auto_assign(group)
    out.emit(
        {"group": group, "placement": placement},
        lambda: out.table(
            f"group {group}",
            ["storage node", "partitions"],
            [(a, ", ".join(map(str, ps)) or "-") for a, ps in placement.items()],
        ),
    )


@storage.command("list")
@click.option("--status", "with_status", is_flag=True, help="Also ask every node for its partitions' state.")
@pass_output
@user_errors
def list_(out: Output, with_status: bool) -> None:
    """List the storage nodes, their groups and assigned partitions."""
    rows: list[dict[str, Any]] = []
    with cluster_metadata() as meta:
        for n in meta.storage_nodes():
            row: dict[str, Any] = {
                "address": n.address,
                "admin_port": n.admin_port,
                "group": n.group,
                "partitions": list(n.partitions),
            }
            if with_status:
                try:
                    row["status"] = admin_call(meta, n, lambda c: c.status())
                    row["reachable"] = True
                except (errors.WaltzError, OSError) as e:
                    row["reachable"], row["error"] = False, str(e)
            rows.append(row)

    def human() -> None:
        cols = ["address", "admin port", "group", "partitions"] + (["state"] if with_status else [])
        table = []
        for r in rows:
            line = [r["address"], r["admin_port"], r["group"], ", ".join(map(str, r["partitions"])) or "-"]
            if with_status:
                if not r["reachable"]:
                    line.append(f"unreachable: {r['error']}")
                else:
                    line.append(
                        "; ".join(
                            f"{s['partition']}: max {s['max_transaction_id']} lwm {s['low_water_mark']}"
                            + ("" if s["readable"] and s["writable"] else " (unavailable)")
                            + (f" FAILED {s['failure']}" if s["failure"] else "")
                            for s in r["status"]
                        )
                        or "no partitions"
                    )
            table.append(line)
        out.table("storage nodes", cols, table)

    out.emit(rows, human)


# -- the nodes themselves ---------------------------------------------------------------------
@storage.command("add-partition")
@NODE
@PARTITIONS
@pass_output
@user_errors
def add_partition(out: Output, address: str, partitions: tuple[int, ...]) -> None:
    """Create (or restore parked) partition files on a node; the replicas must be assigned to it."""
    with cluster_metadata() as meta:
        node = _node(meta, address)
        missing = [p for p in partitions if p not in node.partitions]
        if missing:
            raise Failed(f"partitions {missing} are not assigned to {node.address}; run `waltz storage assign` first")

        async def run(c: StorageAdminClient) -> list[int]:
            present = {x["partition"] for x in await c.status()}
            for p in partitions:
                await c.assign(p)
            return [p for p in partitions if p not in present]

        added = admin_call(meta, node, run)
    _changed(
        out, bool(added), f"storage node {node.address} holds partitions {sorted(partitions)}", {"partitions": added}
    )


@storage.command("remove-partition")
@NODE
@PARTITIONS
@click.option("--delete-files", is_flag=True, help="Delete the files instead of parking them as <id>.unassigned.")
@click.option("--force", is_flag=True, help="Even if the metadata still assigns the replica to this node.")
@pass_output
@user_errors
def remove_partition(out: Output, address: str, partitions: tuple[int, ...], delete_files: bool, force: bool) -> None:
    """Stop serving partitions on a node (files parked, or deleted with --delete-files)."""
    with cluster_metadata() as meta:
        node = _node(meta, address)
        still = [p for p in partitions if p in node.partitions]
        if still and not force:
            raise Failed(
                f"partitions {still} are still assigned to {node.address}; run `waltz storage unassign` first (or "
                "--force)"
            )

        async def run(c: StorageAdminClient) -> None:
            for p in partitions:
                await c.unassign(p, delete_files=delete_files)

        admin_call(meta, node, run)
    _changed(
        out,
        True,
        f"storage node {node.address} no longer serves partitions {sorted(partitions)}"
        + (" (files deleted)" if delete_files else " (files parked)"),
    )


@storage.command()
@NODE
@PARTITIONS
@click.option("--readable/--unreadable", default=None, help="Serve reads of the partition.")
@click.option("--writable/--unwritable", default=None, help="Accept writes of the partition from servers.")
@pass_output
@user_errors
def availability(
    out: Output, address: str, partitions: tuple[int, ...], readable: bool | None, writable: bool | None
) -> None:
    """Mark partitions on a node readable/unreadable and writable/unwritable (kept until the node restarts)."""
    with cluster_metadata() as meta:
        node = _node(meta, address)

        async def run(c: StorageAdminClient) -> list[dict[str, Any]]:
            status = {s["partition"]: s for s in await c.status()}
            done = []
            for p in partitions:
                if p not in status:
                    raise Failed(f"storage node {node.address} does not hold partition {p}")
                r = status[p]["readable"] if readable is None else readable
                w = status[p]["writable"] if writable is None else writable
                await c.set_availability(p, readable=r, writable=w)
                done.append({"partition": p, "readable": r, "writable": w})
            return done

        result = admin_call(meta, node, run)
    out.emit(
        result,
        lambda: out.table(
            f"availability on {node.address}",
            ["partition", "readable", "writable"],
            [(d["partition"], d["readable"], d["writable"]) for d in result],
        ),
    )


@storage.command("max-transaction-id")
@NODE
@click.option("--partition", "-p", type=click.IntRange(0), required=True)
@pass_output
@user_errors
def max_transaction_id(out: Output, address: str, partition: int) -> None:
    """The highest transaction id a node holds for a partition (-1 when empty)."""
    with cluster_metadata() as meta:
        s = _partition_status(meta, _node(meta, address), partition)
    out.emit(
        {"partition": partition, "max_transaction_id": s["max_transaction_id"], "low_water_mark": s["low_water_mark"]},
        lambda: out.line(str(s["max_transaction_id"])),
    )


@storage.command("recover-partition")
@click.option("--source", required=True, metavar="HOST:PORT", help="Healthy storage node to copy from.")
@click.option("--destination", required=True, metavar="HOST:PORT", help="Storage node to fill.")
@click.option("--partition", "-p", type=click.IntRange(0), required=True)
@click.option(
    "--batch-size", type=click.IntRange(1, 100_000), default=1000, show_default=True, help="Records per request."
)
@pass_output
@user_errors
def recover_partition(out: Output, source: str, destination: str, partition: int, batch_size: int) -> None:
    """Copy a partition's committed records from a healthy replica into another one.

    Copies what the destination lacks up to the source's low-water mark (everything at or below
    it is committed), then raises the destination's low-water mark to it (keeping its own session
    id), so that recovery keeps what was copied. The destination is marked unwritable for
    servers meanwhile and made available again at the end. Stopping it halfway is safe: run it
    again and it continues from the destination's last record."""
    with cluster_metadata() as meta:
        src, dst = _node(meta, source), _node(meta, destination)
        if src.address == dst.address:
            raise Failed("source and destination are the same node")
        if partition not in dst.partitions:
            raise Failed(f"partition {partition} is not assigned to {dst.address}; run `waltz storage assign` first")
        info = meta.info()
        result = asyncio.run(_recover(out, info.cluster_key, info.partitions, src, dst, partition, batch_size))
    out.emit(
        result,
        lambda: out.line(
            f"partition {partition}: copied {result['copied']} records from {src.address} to {dst.address}; "
            f"destination now ends at {result['destination_max']} with low-water mark {result['low_water_mark']}"
            + (
                ""
                if result["writable"]
                else ". It was unwritable before this run and stays so: `waltz storage availability --storage "
                f"{dst.address} -p {partition} --writable`"
            )
        ),
    )


async def _recover(
    out: Output, key: Any, count: int, src: StorageNodeInfo, dst: StorageNodeInfo, partition: int, batch_size: int
) -> dict[str, Any]:
    ssl = tls_context()
    async with (
        await StorageAdminClient.connect(
            src.host, src.admin_port, cluster_key=key, partition_count=count, ssl=ssl, credential=credential_from_env()
        ) as s,
        await StorageAdminClient.connect(
            dst.host, dst.admin_port, cluster_key=key, partition_count=count, ssl=ssl, credential=credential_from_env()
        ) as d,
    ):
        before = {x["partition"]: x for x in await d.status()}.get(partition)
        if before is None:
            raise Failed(
                f"destination {dst.address} does not hold partition {partition}; run `waltz storage add-partition` "
                "first"
            )
        # Servers are kept out first; only then is the destination's state read, so nothing a
        # server does can make it stale.
        await d.set_availability(partition, readable=before["readable"], writable=False)
        ok = False
        copied = 0
        try:
            s_status = {x["partition"]: x for x in await s.status()}.get(partition)
            d_status = {x["partition"]: x for x in await d.status()}[partition]
            if s_status is None:
                raise Failed(f"source {src.address} does not hold partition {partition}")
            if s_status["failure"]:
                raise Failed(f"source {src.address} partition {partition} has failed: {s_status['failure']}")
            if d_status["newest_session"] > s_status["session_id"]:
                raise Failed(
                    f"destination {dst.address} has seen store session {d_status['newest_session']}, newer than the "
                    f"source's {s_status['session_id']}: pick a source from the current session"
                )
            target = s_status["low_water_mark"]
            d_max = d_status["max_transaction_id"]
            # Only what is at or below the destination's own low-water mark is known committed:
            # everything above it must equal the source's, record by record.
            s_first = s_status["first_transaction_id"]
            if d_max + 1 < s_first:
                # The source's retention deleted past the destination's end: it restarts where the
                # source starts (all of it is below the source's own low-water mark, committed).
                await d.restart_log(partition, s_first)
                d_status = {x["partition"]: x for x in await d.status()}[partition]
                d_max = d_status["max_transaction_id"]
            nxt = max(d_status["low_water_mark"] + 1, d_status["first_transaction_id"], 0)
            if nxt < s_first <= d_max:
                raise Failed(
                    f"destination {dst.address} holds transactions {nxt}..{s_first - 1} above its low-water mark "
                    f"that the source {src.address} no longer holds (retention) to compare with; remove the "
                    "destination's files (`waltz storage remove-partition --delete-files --force`), add it again, "
                    "and rerun"
                )
            while nxt <= d_max:
                ours = await d.records(partition, nxt, min(batch_size, d_max - nxt + 1))
                theirs = await s.records(partition, nxt, len(ours))
                diff = next((r.txid for r, t in zip(ours, theirs) if r != t), None)
                if ours and not theirs and diff is None:
                    # Not a difference: the source ends first. The destination may hold
                    # acknowledged transactions the source lacks, so it must not be wiped for this.
                    raise Failed(
                        f"source {src.address} ends before transaction {nxt}, which the destination {dst.address} "
                        "holds; "
                        f"pick a source that holds at least up to {d_max}"
                    )
                if not ours or not theirs or diff is not None:
                    raise Failed(
                        f"destination {dst.address} differs from the source at transaction "
                        f"{diff if diff is not None else nxt}; "
                        "remove the destination's files (`waltz storage remove-partition --delete-files --force`), "
                        "add it again, and rerun"
                    )
                nxt = ours[min(len(ours), len(theirs)) - 1].txid + 1

            with Progress(
                TextColumn("partition {task.fields[p]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                disable=out.as_json or target <= d_max,
                transient=True,
            ) as bar:
                task = bar.add_task("copy", total=max(0, target - d_max), p=partition)
                nxt = d_max + 1
                while nxt <= target:
                    batch = [
                        r
                        for r in await s.records(partition, nxt, min(batch_size, target - nxt + 1))
                        if r.txid <= target
                    ]
                    if not batch:
                        raise Failed(
                            f"source {src.address} returned no record at transaction {nxt} (below its low-water mark "
                            f"{target})"
                        )
                    await d.append(partition, batch)
                    copied += len(batch)
                    nxt = batch[-1].txid + 1
                    bar.advance(task, len(batch))
            if target > d_status["low_water_mark"]:
                # Its own session id, not the source's: a destination that lost its files must
                # still look so to recovery (docs/internals.md, "Replicas that lost their files").
                await d.set_partition_info(partition, d_status["session_id"], target)
            ok = True
        except Failed as e:
            raise Failed(
                f"{e.message}. The destination partition stays unwritable for servers until "
                f"`waltz storage availability --storage {dst.address} -p {partition} --writable` or until its node "
                "restarts "
                "(availability is not kept across restarts; what was copied is committed, and the low-water mark "
                "is raised only after a whole copy)"
            ) from e
        finally:
            # Back to what the operator had; after a failure it stays out of the servers' way.
            if ok:
                await d.set_availability(partition, readable=before["readable"], writable=before["writable"])
        final = {x["partition"]: x for x in await d.status()}[partition]
    return {
        "partition": partition,
        "source": src.address,
        "destination": dst.address,
        "copied": copied,
        "destination_max": final["max_transaction_id"],
        "low_water_mark": final["low_water_mark"],
        "session_id": final["session_id"],
        "writable": final["writable"],
    }


@storage.command("reset-fence")
@NODE
@click.option("--partition", "-p", type=click.IntRange(0), required=True)
@click.option(
    "--to", "session", type=click.IntRange(0), required=True, metavar="SESSION", help="The fence's new value."
)
@pass_output
@user_errors
def reset_fence(out: Output, address: str, partition: int, session: int) -> None:
    """Lower a partition's fence on a node that a request no server sent raised (servers then fail
    as stale on it forever). Refused below the newest session the cluster metadata issued for the
    partition, so no server's session is ever let back in after a newer one."""
    with cluster_metadata() as meta:
        issued = meta.partition_metadata(partition)[0].session_id
        if session < issued:
            raise Failed(
                f"partition {partition}: the cluster metadata issued session {issued}; the fence cannot go below it"
            )
        node = _node(meta, address)
        admin_call(meta, node, lambda c: c.reset_fence(partition, session))
    _changed(
        out,
        True,
        f"partition {partition} on {node.address}: fence lowered to session {session}",
        {"partition": partition, "fence": session},
    )


FORCE = click.option(
    "--force",
    is_flag=True,
    help="Override the node's refusal (needs the admin role: an admin certificate, or the admin secret "
    "without TLS). The node logs it as an error. Read docs/operations.md, 'Forcing a refused request', first.",
)


@storage.command("truncate")
@NODE
@click.option("--partition", "-p", type=click.IntRange(0), required=True)
@click.option(
    "--to", "txid", type=click.IntRange(-1), required=True, metavar="TXID", help="The last transaction id to keep."
)
@FORCE
@pass_output
@user_errors
def truncate(out: Output, address: str, partition: int, txid: int, force: bool) -> None:
    """Cut a replica's log after TXID on one node, while the partition is marked unwritable there
    (`waltz storage availability --unwritable`). The node refuses to cut committed records (at or
    below its low-water mark) unless --force."""
    with cluster_metadata() as meta:
        node = _node(meta, address)
        admin_call(meta, node, lambda c: c.truncate(partition, txid, force=force))
    _changed(
        out,
        True,
        f"partition {partition} on {node.address}: truncated after {txid}" + (" (forced)" if force else ""),
        {"partition": partition, "max_transaction_id": txid, "forced": force},
    )


@storage.command("raise-fence")
@NODE
@click.option("--partition", "-p", type=click.IntRange(0), required=True)
@click.option(
    "--to", "session", type=click.IntRange(0), required=True, metavar="SESSION", help="The fence's new value."
)
@FORCE
@pass_output
@user_errors
def raise_fence(out: Output, address: str, partition: int, session: int, force: bool) -> None:
    """Raise a partition's fence on a node to a session the cluster metadata issued. The node refuses
    a session more than 2^32 above its fence (as it refuses such a server) unless --force; a
    session the metadata never issued is refused here, since it would fence every server out."""
    with cluster_metadata() as meta:
        issued = meta.partition_metadata(partition)[0].session_id
        if session > issued:
            raise Failed(
                f"partition {partition}: the cluster metadata issued sessions up to {issued}; a fence above it "
                "would refuse every server"
            )
        node = _node(meta, address)
        admin_call(meta, node, lambda c: c.raise_fence(partition, session, force=force))
    _changed(
        out,
        True,
        f"partition {partition} on {node.address}: fence raised to session {session}" + (" (forced)" if force else ""),
        {"partition": partition, "fence": session, "forced": force},
    )
