"""How `waltz` commands print: a rich table for people, one JSON document with `--json`.

A user's mistake (`UsageError`, any `WaltzError`) prints one line on stderr and exits 1 (2 for a
missing extra); only a bug prints a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import click

from waltz._extras import require

require("rich", "cli", "The waltz command")

from rich.console import Console
from rich.table import Table
from rich.text import Text

from waltz import errors
from waltz.cli.exit_codes import MISSING_EXTRA_EXIT

F = TypeVar("F", bound=Callable[..., Any])

_out = Console(highlight=False, soft_wrap=True)


class Output:
    """Per invocation: `--json` or human output. Reached from a command with `pass_output`."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def emit(self, document: Any, human: Callable[[], None]) -> None:
        """Prints `document` as JSON when asked, else runs `human` to render it."""
        if self.as_json:
            click.echo(json.dumps(_plain(document), indent=2, sort_keys=True))
        else:
            human()

    def table(self, title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        t = Table(title=title, title_justify="left", show_lines=False)
        for c in columns:
            t.add_column(c)
        for r in rows:
            # Cells are data (paths, messages): never read as rich markup unless already a Text.
            t.add_row(*(v if isinstance(v, Text) else Text("" if v is None else str(v)) for v in r))
        _out.print(t)

    def line(self, text: str, *, markup: bool = False) -> None:
        _out.print(text, markup=markup)

    def kv(self, title: str | None, pairs: Sequence[tuple[str, Any]]) -> None:
        self.table(title, ["key", "value"], pairs)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def pass_output(f: F) -> F:
    """Gives the command an `Output` as its first argument."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        root = ctx.find_root()
        as_json = bool(root.params.get("as_json")) or bool(ctx.params.get("as_json"))
        return f(Output(as_json), *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Failed(click.ClickException):
    """A check failed or an operation could not be done; exits 1 after printing its message."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"waltz: {self.format_message()}", err=True)


class MissingExtra(Failed):
    """The command needs an extra that is not installed (`waltz demo` without `demo`)."""

    exit_code = MISSING_EXTRA_EXIT


def user_errors(f: F) -> F:
    """Turns a Waltz error or an OS error into one line on stderr and exit code 1."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except errors.MissingExtraError as e:
            raise MissingExtra(str(e)) from e
        except (errors.WaltzError, OSError) as e:
            raise Failed(str(e)) from e

    return wrapper  # type: ignore[return-value]


__all__ = ["Failed", "Output", "pass_output", "user_errors"]
