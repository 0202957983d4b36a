"""`waltz`: administration of a cluster, its storage nodes and offline files.

Commands are grouped by what they act on (`cluster`, `storage`, `server`, `disk`); each group
lives in its own module. `--json` (before or after the subcommand) prints one JSON document.
"""

from __future__ import annotations

import click

from waltz.cli.disk import disk


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
def main(as_json: bool) -> None:
    """Administer a Waltz cluster."""


main.add_command(disk)


if __name__ == "__main__":
    main()
