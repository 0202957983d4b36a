"""`waltz dev`: a local cluster that keeps running in the background, all in one directory."""

from __future__ import annotations

import pathlib
import shlex
import shutil
from typing import TYPE_CHECKING

import click

from waltz import errors
from waltz.cli.output import Output, pass_output, user_errors

if TYPE_CHECKING:
    from waltz.local import LocalCluster, MemberStatus

DEFAULT_DIRECTORY = pathlib.Path.home() / ".waltz" / "dev"

DIRECTORY = click.option(
    "--directory",
    type=click.Path(file_okay=False, path_type=pathlib.Path),
    envvar="WALTZ_DEV_DIRECTORY",
    default=DEFAULT_DIRECTORY,
    show_default=True,
    help="The cluster's directory (env WALTZ_DEV_DIRECTORY).",
)


@click.group()
def dev() -> None:
    """A local cluster for development: storage nodes and servers as background processes."""


@dev.command()
@DIRECTORY
@click.option("--partitions", type=click.IntRange(1, 1024), default=4, show_default=True, help="On creation only.")
@click.option("--storage-nodes", type=click.IntRange(3, 16), default=3, show_default=True, help="On creation only.")
@click.option("--servers", type=click.IntRange(1, 16), default=2, show_default=True, help="On creation only.")
@click.option(
    "--zookeeper", metavar="HOST:PORT[,...]", help="On creation only: metadata in this ZooKeeper instead of embedded."
)
@click.option("--tls", is_flag=True, help="On creation only: generate certificates, mutual TLS on every link.")
@pass_output
@user_errors
def up(
    out: Output,
    directory: pathlib.Path,
    partitions: int,
    storage_nodes: int,
    servers: int,
    zookeeper: str | None,
    tls: bool,
) -> None:
    """Create the cluster (first time) and start whatever is not running; waits until served."""
    from waltz.local import LocalCluster
    from waltz.local.cluster import STATE_FILE

    if (directory / STATE_FILE).exists():
        cluster = LocalCluster.open(directory)
    else:
        metadata = f"zk://{zookeeper}/waltz-dev" if zookeeper else None
        cluster = LocalCluster.create(
            directory, metadata=metadata, partitions=partitions, storage_nodes=storage_nodes, servers=servers, tls=tls
        )
    try:
        cluster.start(step=lambda s: None if out.as_json else out.line(f"  {s}"))
    except (errors.WaltzError, KeyboardInterrupt):
        cluster.stop()
        raise
    _print_status(out, cluster, footer=True)


@dev.command()
@DIRECTORY
@click.option("--purge", is_flag=True, help="Also delete the directory: data, logs and configuration.")
@pass_output
@user_errors
def down(out: Output, directory: pathlib.Path, purge: bool) -> None:
    """Stop every member (servers first, SIGKILL after 30 s)."""
    from waltz.local import LocalCluster

    cluster = LocalCluster.open(directory)
    killed = cluster.stop()
    if purge:
        shutil.rmtree(cluster.directory)
    out.emit(
        {"stopped": [m.name for m in cluster.members], "killed": killed, "purged": purge},
        lambda: out.line(
            f"stopped {len(cluster.members)} members"
            + (f" (killed {', '.join(killed)})" if killed else "")
            + (f"; deleted {cluster.directory}" if purge else "")
        ),
    )


@dev.command()
@DIRECTORY
@pass_output
@user_errors
def status(out: Output, directory: pathlib.Path) -> None:
    """Each member's pid, address and health; exit 1 unless all are up and healthy."""
    from waltz.local import LocalCluster

    cluster = LocalCluster.open(directory)
    statuses = _print_status(out, cluster, footer=False)
    if any(s.health != "ok" for s in statuses):
        raise errors.ClusterError("not every member is up and healthy")


def _print_status(out: Output, cluster: LocalCluster, footer: bool) -> list[MemberStatus]:
    statuses = cluster.status()
    where = "" if cluster.directory == DEFAULT_DIRECTORY else f" --directory {shlex.quote(str(cluster.directory))}"
    commands = {
        "status": f"waltz dev status{where}",
        "stop": f"waltz dev down{where}",
        "append": "waltz log append -p 0 --data hello",
        "read": "waltz log read -p 0",
        "tail": "waltz log tail -p 0",
    }
    document = {
        "directory": str(cluster.directory),
        "environment": cluster.environment(),
        "commands": commands,
        "members": [s.to_json() for s in statuses],
    }

    def human() -> None:
        out.table(
            f"local cluster in {cluster.directory}",
            ["member", "pid", "address", "http", "health"],
            [(s.name, s.pid or "-", s.address, s.http, s.health) for s in statuses],
        )
        if footer:
            out.line("use it (the waltz commands and the README's client example read these):")
            for k, v in cluster.environment().items():
                out.line(f"  export {k}={shlex.quote(v)}")
            out.line("then:")
            for name in ("append", "read", "tail", "status", "stop"):
                out.line(f"  {commands[name]}")
            out.line(f"logs: {cluster.directory / 'logs'}")

    out.emit(document, human)
    return statuses
