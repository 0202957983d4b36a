"""`waltz torture`: a local cluster under faults, and the check that nothing acknowledged was
lost (docs/torture.md)."""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

import click

from waltz._extras import require

require("rich", "cli", "The waltz command")

from rich.console import Console

from waltz.cli.output import Failed, user_errors


def _seconds(value: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
    if not m:
        raise click.BadParameter(f"{value!r} is not a duration (e.g. 90s, 10m, 1h)")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


@click.command()
@click.option("--duration", default="60s", show_default=True, help="How long faults are injected (90s, 10m, 1h).")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds the schedule and the workload: a run replays from it."
)
@click.option("--clients", type=click.IntRange(1, 32), default=3, show_default=True, help="Client processes.")
@click.option("--partitions", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option(
    "--faults", metavar="KIND,...", help="Only these faults (default: all). `--faults none` runs without faults."
)
@click.option(
    "--zookeeper", is_flag=True, help="Keep the metadata in a real ZooKeeper (Debian package) that is killed too."
)
@click.option(
    "--retention",
    metavar="DURATION",
    help="Run with a retention policy of this max age (e.g. 20s), small segments and frequent checkpoints, so "
    "deletions happen during the faults; the checker then allows the ids deleted everywhere to be missing.",
)
@click.option(
    "--heal-timeout",
    default="180s",
    show_default=True,
    help="How long the end of the run waits for the cluster and the clients after healing (before failing).",
)
@click.option(
    "--workload",
    type=click.Choice(["log", "bank", "list-append", "lock-fallback"]),
    default="log",
    show_default=True,
    help="log: unique payloads under locks, checked against the log. bank: transfers applied exactly once into one "
    "SQLite database shared by every client through SqlCallbacks (total conserved, no negative balance, each "
    "transfer applied once). list-append: appends and reads of lists under write, read and append locks, checked "
    "like Elle (prefixes, duplicates, stale reads, dependency cycles). lock-fallback: list-append over 4,096 keys "
    "a partition with the servers' lock table squeezed to its hashed array.",
)
@click.option(
    "--segment-size",
    type=click.IntRange(4096),
    help="Bytes per segment on the storage nodes (default: 64 KiB with --retention or disk faults, so that "
    "segments roll during the faults; the node's default otherwise).",
)
@click.option(
    "--directory",
    type=click.Path(file_okay=False, path_type=pathlib.Path),
    help="Where the run keeps the cluster, histories and report (new or empty). Default: a new temporary directory.",
)
@user_errors
def torture(
    duration: str,
    seed: int,
    clients: int,
    partitions: int,
    faults: str | None,
    zookeeper: bool,
    retention: str | None,
    heal_timeout: str,
    workload: str,
    segment_size: int | None,
    directory: pathlib.Path | None,
) -> None:
    """Run clients against a local cluster while faults strike, then check every history.

    Starts 3 storage nodes and 2 servers behind fault-injecting proxies, client processes that
    append transactions (some under locks) and consume the whole feed, and a nemesis that kills,
    pauses, partitions, slows and resets members, fails their fsyncs and writes, corrupts a
    replica, moves replicas to another storage node as an operator would (move-replica, onto a
    fourth node) and stops servers gracefully (stop-server), on a schedule drawn from --seed.
    Disk faults run the storage nodes on LazyFS, a FUSE layer that keeps unsynced writes in
    memory: power-loss (one node loses its unsynced writes, the last one maybe torn at a page
    boundary), power-loss-majority (two nodes at once), power-outage (all of them), disk-full
    (ENOSPC on two nodes until space returns) and slow-disk (a delay on every write and sync).
    Then everything heals, the cluster's feed and every
    replica's files are drained, and the checker judges the histories against them. Exit 1 on
    any anomaly or problem; the report is in DIRECTORY/report.json.

    Partial faults too: partial-partition cuts one server from one storage node only, one-way
    loses one direction of a link, zombie cuts one server from the metadata store (--zookeeper)
    while it still reaches storage and clients; dup-client-id, oversized-locks and stalled-reader
    run a misbehaving client next to the honest ones. Clock faults: clock-step-forward and
    clock-step-backward move one process's wall clock by seconds to minutes, clock-skew runs it
    slow or fast (each process reads a clock file of its own)."""
    from waltz.torture.nemesis import FAULTS
    from waltz.torture.run import TortureOptions, run_torture

    kinds = FAULTS if faults is None else tuple(k for k in faults.split(",") if k and k != "none")
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        raise Failed(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    d = directory or pathlib.Path(tempfile.mkdtemp(prefix="waltz-torture-"))
    console = Console(stderr=True)
    console.print(f"[bold]Waltz torture[/] in {d}")
    result = run_torture(
        TortureOptions(
            d,
            duration=_seconds(duration),
            seed=seed,
            clients=clients,
            partitions=partitions,
            faults=kinds,
            zookeeper=zookeeper,
            retention_max_age=None if retention is None else _seconds(retention),
            heal_timeout=_seconds(heal_timeout),
            workload=workload,
            segment_size=segment_size,
        ),
        say=lambda s: console.print(f"  {s}", highlight=False),
    )
    print(result.report.render())
    print(
        f"transactions committed: {result.transactions}; faults: "
        + (", ".join(f"{k} {n}" for k, n in result.faults.items()) or "none")
        + f"; {result.seconds:.0f} s"
    )
    for p in result.problems:
        print(f"PROBLEM {p}")
    print("PASSED" if result.passed else "FAILED", f"(report: {d / 'report.json'})")
    if not result.passed:
        sys.exit(1)
