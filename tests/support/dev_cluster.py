"""A `waltz dev up` cluster in a test's directory, stopped and purged at the end: what the
README's example and the `waltz log` commands run against."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

WALTZ = [sys.executable, "-m", "waltz.cli.main"]


def waltz(
    *args: str,
    env: dict[str, str] | None = None,
    ok: bool | None = True,
    input: bytes | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[bytes]:
    """Runs `waltz ARGS`; `ok` True expects exit 0, False a one-line error (exit 1, or 2 for a usage
    error), None either."""
    done = subprocess.run(
        [*WALTZ, *args], capture_output=True, timeout=timeout, env={**os.environ, **(env or {})}, input=input
    )
    if ok is not None:
        assert (done.returncode == 0) == ok, (done.stdout + done.stderr).decode(errors="replace")
    if ok is False:
        assert b"Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith(b"waltz: ") or b"Error:" in done.stderr, done.stderr
    return done


@contextlib.contextmanager
def dev_cluster(directory: pathlib.Path, partitions: int = 2, tls: bool = False) -> Iterator[dict[str, Any]]:
    """`waltz --json dev up` in `directory` (with `--tls`: mutual TLS on every link, the
    environment naming the admin certificate); yields its document (environment, commands,
    members)."""
    where = ["--directory", str(directory)]
    try:
        up = ["--partitions", str(partitions), *(["--tls"] if tls else [])]
        yield json.loads(waltz("--json", "dev", "up", *where, *up).stdout)
    finally:
        if directory.exists():
            waltz("dev", "down", *where, "--purge", ok=None)
