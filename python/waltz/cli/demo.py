"""`waltz demo`: the bank ledger on a local cluster, with failures, and its verification."""

from __future__ import annotations

import json
import pathlib
import sys

import click

from waltz._extras import require

require("rich", "cli", "The waltz command")

from rich.console import Console

from waltz.cli.output import Failed, user_errors


@click.command()
@click.option(
    "--directory",
    type=click.Path(file_okay=False, path_type=pathlib.Path),
    help="Where the cluster keeps its data and logs (must not hold a cluster yet). Default: a new temporary directory.",
)
@click.option(
    "--zookeeper", metavar="HOST:PORT[,...]", help="Run against this ZooKeeper instead of the embedded metadata store."
)
@click.option("--clients", type=click.IntRange(1, 16), default=3, show_default=True, help="Client processes.")
@click.option("--transfers", type=click.IntRange(1), default=1000, show_default=True, help="Transfers per client.")
@click.option("--partitions", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--short", is_flag=True, help="A quick run (150 transfers per client), as CI runs it.")
@click.option("--no-chaos", is_flag=True, help="Do not kill a storage node and a server midway.")
@click.option("--tls", is_flag=True, help="Generate certificates and run every link over mutual TLS.")
@click.option(
    "--result",
    "result_path",
    type=click.Path(dir_okay=False, path_type=pathlib.Path),
    help="Also write the verification as JSON to this file.",
)
@user_errors
def demo(
    directory: pathlib.Path | None,
    zookeeper: str | None,
    clients: int,
    transfers: int,
    partitions: int,
    short: bool,
    no_chaos: bool,
    tls: bool,
    result_path: pathlib.Path | None,
) -> None:
    """Run a bank ledger on a local cluster and verify that nothing acknowledged was lost.

    Starts 3 storage nodes and 2 servers as processes on 127.0.0.1, runs client processes that
    move money between accounts under write locks, each applying the log to its own SQLite
    database; kills a storage node and a server with SIGKILL midway and restarts them; then
    checks every acknowledged transfer is committed once, balances are conserved, every client
    database equals the log and the replicas are identical. Exit 1 if a check fails; Ctrl-C
    stops everything cleanly (exit 130)."""
    from waltz.demo.runner import DemoOptions, default_directory, install_sigterm_as_interrupt, render, run_demo

    install_sigterm_as_interrupt()
    metadata = None
    if zookeeper:
        import uuid

        # A chroot of its own: demos never meet another cluster's metadata.
        metadata = f"zk://{zookeeper}/waltz-demo-{uuid.uuid4().hex[:8]}"
    options = DemoOptions(
        directory=(directory or default_directory()).resolve(),
        metadata=metadata,
        clients=clients,
        transfers=150 if short else transfers,
        partitions=partitions,
        chaos=not no_chaos,
        tls=tls,
    )
    console = Console(highlight=False)
    try:
        result = run_demo(options, console)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]interrupted[/]: clients and cluster stopped; data kept in {options.directory}")
        sys.exit(130)
    render(result, console)
    console.print(f"data and logs: {options.directory}")
    if result_path is not None:
        result_path.write_text(json.dumps(result, indent=2))
    if not result["passed"]:
        raise Failed("demo verification failed (see the table above)")
