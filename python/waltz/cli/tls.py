"""`waltz tls`: certificates for mutual TLS (docs/operations.md, "TLS")."""

from __future__ import annotations

import dataclasses
import pathlib

import click

from waltz.cli.output import Output, pass_output, user_errors
from waltz.tls import generate_dev_certificates


@click.group()
def tls() -> None:
    """Certificates for mutual TLS."""


@tls.command()
@click.option(
    "--directory",
    required=True,
    type=click.Path(file_okay=False, path_type=pathlib.Path),
    help="Where to write the PEM files (created if missing).",
)
@click.option(
    "--host",
    "hosts",
    multiple=True,
    metavar="H",
    help="An IP address or DNS name clients dial to reach the nodes and servers; repeat for more "
    "(default: 127.0.0.1 and localhost).",
)
@click.option("--force", is_flag=True, help="Overwrite certificate files already in the directory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@pass_output
@user_errors
def generate(out: Output, directory: pathlib.Path, hosts: tuple[str, ...], force: bool, as_json: bool) -> None:
    """Generate a development CA and one certificate per role: storage (storage nodes), server
    (servers), admin (operators and this CLI) and client (applications); the role is the URI
    name waltz:role:<role>. Not for production: there, each node gets its own certificate from
    a CA whose key stays offline."""
    files = generate_dev_certificates(directory, hosts or ("127.0.0.1", "localhost"), overwrite=force)
    document = {k: str(v) for k, v in dataclasses.asdict(files).items()}

    def human() -> None:
        out.table(f"certificates in {directory}", ["file", "path"], list(document.items()))
        out.line(
            f'storage node TOML: [tls] ca = "{files.ca}", cert = "{files.storage_cert}", '
            f'key = "{files.storage_key}"\n'
            f'server TOML: [tls] ca = "{files.ca}", cert = "{files.server_cert}", key = "{files.server_key}"\n'
            f"waltz CLI: --tls-ca {files.ca} --tls-cert {files.admin_cert} --tls-key {files.admin_key}\n"
            f'applications: tls_ca = "{files.ca}", tls_cert = "{files.client_cert}", '
            f'tls_key = "{files.client_key}"'
        )

    out.emit(document, human)
