"""The type stub `waltz/_native.pyi` matches the compiled extension (mypy's stubtest)."""

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
