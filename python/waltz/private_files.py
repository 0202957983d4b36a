"""Files and directories only their owner may read: configurations (they name the cluster key's
store), keys, the local cluster's state and the embedded metadata. A umask of 022 left them
readable to every user of the host, and the cluster key was the only credential (issue 34)."""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Creates `path` (and missing parents) and gives it mode 0700, whatever the umask; an
    existing directory is made private too."""
    p = Path(path)
    p.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(p, DIR_MODE)
    return p


def create_private(path: str | os.PathLike[str]) -> None:
    """Makes sure `path` exists with mode 0600 (created empty if missing), so that what opens it
    next (SQLite, say) keeps that mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: bytes | str, mode: int = FILE_MODE) -> None:
    """Writes `data` to `path` with `mode` (0600 unless told), replacing what it held."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # an existing file keeps its mode through O_CREAT
        f.write(data.encode() if isinstance(data, str) else data)
