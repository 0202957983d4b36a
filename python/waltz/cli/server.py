"""`waltz server`: the servers registered in the cluster."""

from __future__ import annotations

from typing import Any

import click

from waltz.cli.context import cluster_metadata
from waltz.cli.output import Output, pass_output, user_errors


@click.group()
def server() -> None:
    """Servers registered in the cluster."""


@server.command("list")
@pass_output
@user_errors
def list_(out: Output) -> None:
    """List live servers, the partitions assigned to them and what they serve."""
    with cluster_metadata() as meta:
        servers = sorted(meta.servers(), key=lambda s: s.server_id)
        assignment, _ = meta.assignment()
    rows: list[dict[str, Any]] = [
        {
            "id": s.server_id,
            "endpoint": s.endpoint,
            "assigned": {p: a.generation for p, a in sorted(assignment.items()) if a.server == s.server_id},
            "serving": dict(sorted(s.serving.items())),
            "preferred": list(s.preferred),
        }
        for s in servers
    ]

    def human() -> None:
        def fmt(d: dict[int, int]) -> str:
            return ", ".join(f"{p}@{g}" for p, g in d.items()) or "-"

        out.table(
            "servers (partition@generation)",
            ["id", "endpoint", "assigned", "serving", "preferred"],
            [
                (
                    r["id"],
                    r["endpoint"],
                    fmt(r["assigned"]),
                    fmt(r["serving"]),
                    ", ".join(map(str, r["preferred"])) or "-",
                )
                for r in rows
            ],
        )
        if not rows:
            out.line("no server is registered")

    out.emit(rows, human)
