"""One version, Cargo.toml's: the installed distribution, `waltz.__version__` and both commands'
`--version` report it; `-h` is `--help` on both commands and their subcommands."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys
import tomllib

import pytest
import waltz

ROOT = pathlib.Path(__file__).parents[3]
SCRIPTS = pathlib.Path(sys.executable).parent  # the console scripts installed with the package


def cargo_version() -> str:
    return str(tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"])


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60)


def test_the_version_has_one_source() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in pyproject and pyproject["dynamic"] == ["version"]
    assert waltz.__version__ == cargo_version()
    assert importlib.metadata.version("waltz-log") == cargo_version()


@pytest.mark.parametrize("command", ["waltz", "waltz-node"])
def test_version_option(command: str) -> None:
    proc = run(command, "--version")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{command} {cargo_version()}\n", "")


@pytest.mark.parametrize(
    "argv",
    [
        ("waltz",),
        ("waltz", "cluster"),
        ("waltz", "cluster", "create"),
        ("waltz", "storage", "add-node"),
        ("waltz", "demo"),
        ("waltz-node",),
        ("waltz-node", "storage"),
        ("waltz-node", "server"),
    ],
)
def test_dash_h_is_help(argv: tuple[str, ...]) -> None:
    short, long = run(*argv, "-h"), run(*argv, "--help")
    assert short.returncode == 0, short.stderr
    assert short.stdout.startswith(f"Usage: {' '.join(argv)} ")
    assert short.stdout == long.stdout
