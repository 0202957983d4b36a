"""`waltz-node`: the daemons. A user's mistake prints one line and exits non-zero."""

from __future__ import annotations

import json
import logging
import sys

import click

from waltz import errors
from waltz.config import load_storage_node_config


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {"time": self.formatTime(record), "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        )


def _setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


@click.group()
def main() -> None:
    """Waltz daemons."""


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="TOML configuration file")
def storage(config_path: str) -> None:
    """Run a storage node until SIGTERM or SIGINT."""
    from waltz.storage.daemon import run

    try:
        config = load_storage_node_config(config_path)
        _setup_logging(config.logging.level, config.logging.json)
        run(config)
    except errors.WaltzError as e:
        click.echo(f"waltz-node storage: {e}", err=True)
        sys.exit(1)
    except OSError as e:
        click.echo(f"waltz-node storage: {e}", err=True)
        sys.exit(1)


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="TOML configuration file")
def server(config_path: str) -> None:
    """Run a Waltz server until SIGTERM or SIGINT."""
    from waltz.config import load_server_config
    from waltz.server.daemon import run as run_server

    try:
        config = load_server_config(config_path)
        _setup_logging(config.logging.level, config.logging.json)
        run_server(config)
    except (errors.WaltzError, OSError) as e:
        click.echo(f"waltz-node server: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
