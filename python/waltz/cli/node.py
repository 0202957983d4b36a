"""`waltz-node`: the daemons. A user's mistake prints one line and exits non-zero."""

from __future__ import annotations

import json
import logging
import sys

import click

from waltz import __version__, errors
from waltz.cli.exit_codes import MISSING_EXTRA_EXIT


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "time": self.formatTime(record),
                "level": record.levelname,
                "logger": record.name,
                "message": record.getMessage(),
            }
        )


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="waltz-node", message="%(prog)s %(version)s")
def main() -> None:
    """Waltz daemons."""


def _run_daemon(name: str, config_path: str) -> None:
    """Loads the configuration, sets up logging and runs; a user's mistake is one line, exit 1
    (2 when the configuration needs an extra that is not installed, e.g. ZooKeeper metadata)."""
    from waltz.config import load_server_config, load_storage_node_config
    from waltz.malloc import release_large_blocks

    try:
        if name == "storage":
            from waltz.storage.daemon import run as run_storage

            storage_config = load_storage_node_config(config_path)
            _setup_logging(storage_config.logging.level, storage_config.logging.json)
            release_large_blocks()
            run_storage(storage_config)
        else:
            from waltz.server.daemon import run as run_server

            server_config = load_server_config(config_path)
            _setup_logging(server_config.logging.level, server_config.logging.json)
            release_large_blocks()
            run_server(server_config)
    except (errors.WaltzError, OSError) as e:
        click.echo(f"waltz-node {name}: {e}", err=True)
        sys.exit(MISSING_EXTRA_EXIT if isinstance(e, errors.MissingExtraError) else 1)


CONFIG = click.option(
    "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="TOML configuration file"
)


@main.command()
@CONFIG
def storage(config_path: str) -> None:
    """Run a storage node until SIGTERM or SIGINT."""
    _run_daemon("storage", config_path)


@main.command()
@CONFIG
def server(config_path: str) -> None:
    """Run a Waltz server until SIGTERM or SIGINT."""
    _run_daemon("server", config_path)


if __name__ == "__main__":
    main()
