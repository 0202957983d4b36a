"""JSON lines that survive their writer being killed.

Torture processes are killed with SIGKILL at any moment, so a line must reach the file in one
`write(2)` on an `O_APPEND` descriptor: the kernel then holds it whole or not at all, except the
very last line of a dying process, which may be cut short. Readers drop such a torn last line
with a warning; anything else that does not parse is damage and an error.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any


class HistoryError(ValueError):
    """A history or drain file that cannot be read: the message names the file and line."""


class TornLineWarning(UserWarning):
    """A file's last line was cut short by its writer's death and was ignored."""


class JsonLinesWriter:
    """Appends one JSON object per line, each in a single unbuffered write (thread-safe)."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._drop_torn_tail()

    def _drop_torn_tail(self) -> None:
        # A process restarted on the file of a killed one would glue its first line onto the
        # torn fragment, leaving damage in the middle of the file: cut the fragment first.
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n")
        if cut < 0 and size > len(tail):
            raise HistoryError(f"{self.path}: last line longer than 1 MiB and not terminated")
        keep = size - len(tail) + cut + 1
        warnings.warn(
            f"{self.path}: dropped a torn last line of {size - keep} bytes before appending",
            TornLineWarning,
            stacklevel=3,
        )
        os.ftruncate(self._fd, keep)

    def write(self, obj: Mapping[str, Any]) -> None:
        line = (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            view = memoryview(line)
            while view:  # a regular file takes it all at once; the loop is for EINTR-like short writes
                n = os.write(self._fd, view)
                view = view[n:]
            if self._fsync:
                os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> JsonLinesWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expand_paths(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; a directory stands for its `*.jsonl` files, sorted by name."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        out.extend(sorted(path.glob("*.jsonl")) if path.is_dir() else [path])
    return out


def read_json_lines(path: Path, warn: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each line of `path`; a torn last line is reported in `warn`
    (and as a TornLineWarning) and skipped."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop()  # after the last newline: empty unless the writer died mid-line
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise HistoryError(f"{path}:{number}: not JSON ({e}); only the last line of a file may be torn") from None
        if not isinstance(obj, dict):
            raise HistoryError(f"{path}:{number}: a line must be a JSON object, not {type(obj).__name__}")
        yield number, obj
    if torn.strip():
        message = f"{path}:{len(lines) + 1}: ignored a torn last line of {len(torn)} bytes (its writer died mid-line)"
        warn.append(message)
        warnings.warn(message, TornLineWarning, stacklevel=2)
