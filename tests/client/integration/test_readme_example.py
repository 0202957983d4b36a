"""The README's client example, extracted from README.md and run as written against `waltz dev
up` with the environment `dev up` prints: the README cannot drift from the code."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from support.dev_cluster import dev_cluster, waltz

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def readme_example() -> str:
    found = re.search(r"<!-- readme-example: client -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert found, "README.md has no client example marked <!-- readme-example: client -->"
    return found.group(1)


def test_readme_example_runs_against_waltz_dev_up(tmp_path: pathlib.Path) -> None:
    code = readme_example()
    assert 15 <= len(code.strip().splitlines()) <= 25
    script = tmp_path / "example.py"
    script.write_text(code)
    directory = tmp_path / "dev"
    with dev_cluster(directory) as up:
        env = {**os.environ, **up["environment"]}
        for run in range(2):  # the second run replays the first one's transaction, then adds its own
            done = subprocess.run(
                [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == f"committed transaction {run}; total {5 * (run + 1)}", (
                done.stdout + done.stderr
            )
        # What `dev up` prints names what the example needs: the environment and the directory.
        human = waltz("dev", "up", "--directory", str(directory)).stdout.decode()
        assert f"export WALTZ_METADATA=embedded:{directory / 'metadata.db'}" in human
        assert f"waltz dev down --directory {directory}" in human and "waltz log read -p 0" in human
        assert up["commands"]["stop"] == f"waltz dev down --directory {directory}"
        assert waltz("log", "read", "-p", "0", env=up["environment"]).stdout.decode().splitlines() == [
            '0\t0\t{"add":5}',
            '1\t0\t{"add":5}',
        ]
