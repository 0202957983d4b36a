"""Command-line entry points: `waltz` (administration, the demo; needs the `cli` extra) and
`waltz-node` (the daemons; the core install)."""

from __future__ import annotations

import sys

from waltz.cli.exit_codes import MISSING_EXTRA_EXIT
from waltz.errors import MissingExtraError


def waltz() -> None:
    """The `waltz` console script. Without the `cli` extra, one line naming it, never a traceback."""
    try:
        from waltz.cli.main import main
    except MissingExtraError as e:
        if sys.argv[1:] == ["--version"]:
            # Which version is installed is worth knowing before any extra is added.
            from waltz import __version__

            print(f"waltz {__version__}")
            return
        print(f"waltz: {e}", file=sys.stderr)
        sys.exit(MISSING_EXTRA_EXIT)
    main()


__all__ = ["MISSING_EXTRA_EXIT", "waltz"]
