"""`waltz log`: append to a partition and read its committed transactions from the console.

`append` commits one transaction through the client library (mounting only that partition);
`read` and `tail` read committed ranges straight from the storage replicas through the log
reader (`waltz.client.log_reader`), polling the partition's high-water mark to follow it."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from typing import Any, BinaryIO

import click

from waltz import errors
from waltz.cli.context import cluster_name, tls_context
from waltz.cli.output import Failed, Output, pass_output, user_errors
from waltz.role_secrets import credential_from_env

POLL = 0.2
"""Seconds between two looks at the high-water mark while following."""

PARTITION = click.option("-p", "--partition", type=click.IntRange(0), required=True, help="The partition.")


@click.group()
def log() -> None:
    """Append to a partition, read or follow its committed transactions."""


def _metadata() -> str:
    url = click.get_current_context().find_root().params.get("metadata")
    if not url:
        raise errors.ClusterError("no metadata store given: pass --metadata URL or set WALTZ_METADATA")
    return str(url)


def _root(name: str) -> Any:
    return click.get_current_context().find_root().params.get(name)


@log.command()
@PARTITION
@click.option("--data", metavar="TEXT", help="The transaction's data (UTF-8).")
@click.option("--file", "path", type=click.File("rb"), help="Read the data from this file ('-': standard input).")
@click.argument("stdin", required=False, metavar="[-]")
@click.option(
    "--header", type=click.IntRange(-(2**31), 2**31 - 1), default=0, show_default=True, help="The 32-bit header."
)
@pass_output
@user_errors
def append(
    out: Output, partition: int, data: str | None, path: BinaryIO | None, stdin: str | None, header: int
) -> None:
    """Commit one transaction: --data TEXT, --file F, or - for standard input. Prints its id."""
    if stdin not in (None, "-"):
        raise click.UsageError(
            f"unexpected argument {stdin!r}: the data comes from --data, --file or - (standard input)"
        )
    given = [x for x in (data, path, stdin) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give the data in exactly one way: --data TEXT, --file F, or - (standard input)")
    payload = data.encode() if data is not None else path.read() if path is not None else sys.stdin.buffer.read()
    try:
        txid = _append(_metadata(), cluster_name(), partition, payload, header)
    except ValueError as e:  # a partition the cluster does not have
        raise Failed(str(e)) from e
    out.emit(
        {"partition": partition, "transaction_id": txid, "bytes": len(payload)},
        lambda: out.line(f"partition {partition}: committed transaction {txid} ({len(payload)} bytes)"),
    )


def _append(metadata: str, cluster: str, partition: int, payload: bytes, header: int) -> int:
    from waltz.client import ClientConfig, WaltzClient, WaltzClientCallbacks
    from waltz.client.log_reader import LogReader

    tls = {k: _root(k) for k in ("tls_ca", "tls_cert", "tls_key") if _root(k)}

    async def start_mark() -> int:
        async with LogReader(metadata, cluster, ssl=tls_context(), credential=credential_from_env()) as reader:
            return await reader.high_water_mark(partition)

    class FromNow(WaltzClientCallbacks):
        """Applies nothing: the feed starts at the mark read before (no replay of the log)."""

        def __init__(self, mark: int) -> None:
            self.mark = mark

        def get_client_high_water_mark(self, partition: int) -> int:
            return self.mark

        def apply_transaction(self, transaction: Any) -> None:
            self.mark = transaction.transaction_id

    config = ClientConfig(metadata=metadata, cluster=cluster, partitions=(partition,), **tls)
    with WaltzClient(FromNow(asyncio.run(start_mark())), config) as client:
        return client.append(partition, payload, header=header)


@log.command()
@PARTITION
@click.option(
    "--from",
    "start",
    default="earliest",
    show_default=True,
    metavar="earliest|latest|ID",
    help="The first transaction: the oldest one held, the next one to commit, or an id.",
)
@click.option(
    "--to", "end", type=click.IntRange(0), help="The last transaction (default: the newest, or none with --follow)."
)
@click.option("--follow", "-f", is_flag=True, help="Go on printing transactions as they commit (Ctrl-C ends).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per transaction (JSON Lines).")
@pass_output
@user_errors
def read(out: Output, partition: int, start: str, end: int | None, follow: bool, as_json: bool) -> None:
    """Print the partition's committed transactions, in order."""
    _read(out, partition, start, end, follow)


@log.command()
@PARTITION
@click.option("--json", "as_json", is_flag=True, help="One JSON object per transaction (JSON Lines).")
@pass_output
@user_errors
def tail(out: Output, partition: int, as_json: bool) -> None:
    """Print transactions as they commit, from now on (read --from latest --follow)."""
    _read(out, partition, "latest", None, True)


def _read(out: Output, partition: int, start: str, end: int | None, follow: bool) -> None:
    if start not in ("earliest", "latest") and not start.isdigit():
        raise click.BadParameter(f"{start!r}: earliest, latest or a transaction id", param_hint="--from")
    try:
        asyncio.run(_print_range(out, _metadata(), cluster_name(), partition, start, end, follow))
    except KeyboardInterrupt:  # Ctrl-C ends --follow: not an error
        pass
    except ValueError as e:  # a partition the cluster does not have
        raise Failed(str(e)) from e


async def _print_range(
    out: Output, metadata: str, cluster: str, partition: int, start: str, end: int | None, follow: bool
) -> None:
    from waltz.client.log_reader import LogReader

    async with LogReader(metadata, cluster, ssl=tls_context(), credential=credential_from_env()) as reader:
        mark = await reader.high_water_mark(partition)
        if start == "earliest":
            nxt = await reader.first_transaction_id(partition) if mark >= 0 else 0
        elif start == "latest":
            nxt = mark + 1
        else:
            nxt = int(start)
        while True:
            last = mark if end is None else min(mark, end)
            if nxt <= last:
                async for records in reader.read(partition, nxt, last):
                    for r in records:
                        _print_record(out, partition, r.txid, r.header, r.data)
                    sys.stdout.flush()
                nxt = last + 1
            if not follow or (end is not None and nxt > end):
                return
            await asyncio.sleep(POLL)
            mark = await reader.high_water_mark(partition)


def _print_record(out: Output, partition: int, txid: int, header: int, data: bytes) -> None:
    try:
        text: str | None = data.decode()
    except UnicodeDecodeError:
        text = None
    if out.as_json:
        doc: dict[str, Any] = {"partition": partition, "transaction_id": txid, "header": header}
        if text is not None:
            doc["data"] = text
        else:
            doc["data_base64"] = base64.b64encode(data).decode()
        click.echo(json.dumps(doc, sort_keys=True))
    else:
        shown = text if text is not None else "base64:" + base64.b64encode(data).decode()
        click.echo(f"{txid}\t{header}\t{shown}")
