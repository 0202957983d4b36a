"""`waltz`: administration of a cluster, its storage nodes and offline files.

Commands are grouped by what they act on (`cluster`, `storage`, `server`, `disk`, `log`); each group
lives in its own module. `--json` prints one JSON document instead of tables.
"""

from __future__ import annotations

import click

from waltz import __version__
from waltz.cli.cluster import cluster
from waltz.cli.demo import demo
from waltz.cli.dev import dev
from waltz.cli.disk import disk
from waltz.cli.log import log
from waltz.cli.retention import retention
from waltz.cli.server import server
from waltz.cli.storage import storage
from waltz.cli.tls import tls
from waltz.cli.torture import torture


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="waltz", message="%(prog)s %(version)s")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@click.option(
    "--metadata",
    envvar="WALTZ_METADATA",
    metavar="URL",
    help="Metadata store: zk://host:port[/chroot] or embedded:/path/to/metadata.db (env WALTZ_METADATA).",
)
@click.option(
    "--cluster", envvar="WALTZ_CLUSTER", default="default", show_default=True, help="Cluster name (env WALTZ_CLUSTER)."
)
@click.option(
    "--connect-timeout", type=float, default=10.0, show_default=True, help="Seconds to wait for the metadata store."
)
@click.option(
    "--tls-ca",
    envvar="WALTZ_TLS_CA",
    metavar="PEM",
    help="CA that storage nodes' and servers' certificates must chain to (env WALTZ_TLS_CA).",
)
@click.option(
    "--tls-cert", envvar="WALTZ_TLS_CERT", metavar="PEM", help="Client certificate for mutual TLS (env WALTZ_TLS_CERT)."
)
@click.option("--tls-key", envvar="WALTZ_TLS_KEY", metavar="PEM", help="Private key of --tls-cert (env WALTZ_TLS_KEY).")
def main(
    as_json: bool,
    metadata: str | None,
    cluster: str,
    connect_timeout: float,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
) -> None:
    """Administer a Waltz cluster."""


main.add_command(cluster)
main.add_command(storage)
main.add_command(server)
main.add_command(disk)
main.add_command(log)
main.add_command(retention)
main.add_command(tls)
main.add_command(demo)
main.add_command(dev)
main.add_command(torture)

if __name__ == "__main__":
    main()
