"""Helpers shared by the tests (and by the benchmarks that start real processes).

Modules here are imported as `support.NAME` (the root `conftest.py` puts `tests/` on the path).
Some are run as their own process by a test, by path: `script(NAME)` gives that path."""

from __future__ import annotations

import pathlib

HERE = pathlib.Path(__file__).parent


def script(name: str) -> pathlib.Path:
    """The path of a support module that a test runs as its own process (`python PATH ARGS`)."""
    return HERE / name
