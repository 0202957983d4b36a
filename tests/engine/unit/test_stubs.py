"""Typing: the stub `waltz/_native.pyi` matches the compiled extension (stubtest), and the
package passes mypy --strict."""

import pathlib
import subprocess
import sys


def test_stub_matches_the_extension():
    allow = pathlib.Path(__file__).with_name("stubtest-allowlist.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "waltz._native", "--allowlist", str(allow), "--ignore-disjoint-bases"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_package_type_checks_strictly():
    """`mypy --strict` over python/waltz (configured in pyproject.toml): the package ships py.typed."""
    root = pathlib.Path(__file__).parents[3]
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
