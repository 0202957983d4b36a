"""The wall clock every part of Waltz reads (the native engine has the same in rust/src/engine/clock.rs).

Without `WALTZ_CLOCK_FILE` it is the system clock itself: `time` is `time.time`, nothing in
between. With it, it is the system clock stepped and skewed as that file says, which is how the
torture run's clock faults move one process's clock without moving the machine's. The file
holds three numbers, `offset_ms rate since_ms`; the clock shows
`system + offset + (rate - 1) * (system - since)` (a step is an offset, a slow or fast clock a
rate since the moment the skew began). The file is re-read when its mtime changes, looked at no
more often than every 0.1 s; a missing or unreadable file is no step.

Only wall-clock times go through here (leases stored for other processes, hold expiries,
creation times, connection sequences). Durations and deadlines inside one process use
`time.monotonic`, which the faults leave alone.
"""

from __future__ import annotations

import os
import threading
import time as _time
from collections.abc import Callable

CLOCK_FILE_ENV = "WALTZ_CLOCK_FILE"
CHECK_EVERY = 0.1


def parse(text: str) -> tuple[float, float, float] | None:
    """`(offset_ms, rate, since_ms)` from a clock file's text; None if it is not one."""
    try:
        offset_ms, rate, since_ms = (float(x) for x in text.split())
    except ValueError:
        return None
    if rate > 0 and all(x == x and abs(x) != float("inf") for x in (offset_ms, rate, since_ms)):
        return offset_ms, rate, since_ms
    return None


def render(offset_ms: float, rate: float = 1.0, since_ms: float = 0.0) -> str:
    """A clock file's text (what `parse` reads back)."""
    return f"{offset_ms:.0f} {rate!r} {since_ms:.0f}\n"


class FileClock:
    """The system clock adjusted as the file at `path` says (see the module's docstring)."""

    def __init__(
        self,
        path: str,
        system: Callable[[], float] = _time.time,
        monotonic: Callable[[], float] = _time.monotonic,
    ) -> None:
        self.path, self._system, self._monotonic = path, system, monotonic
        self._lock = threading.Lock()
        self._checked: float | None = None
        self._mtime: int | None = None
        # (offset s, rate, since s), replaced whole: a reader on another thread never mixes two.
        self._adjustment = (0.0, 1.0, 0.0)

    def time(self) -> float:
        now = self._system()
        mono = self._monotonic()
        if self._checked is None or mono - self._checked >= CHECK_EVERY:
            with self._lock:
                self._checked = mono
                self._reload()
        offset, rate, since = self._adjustment
        return now + offset + (rate - 1.0) * (now - since)

    def _reload(self) -> None:
        try:
            mtime: int | None = os.stat(self.path).st_mtime_ns
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return
        self._mtime = mtime
        adjustment = None
        if mtime is not None:
            try:
                with open(self.path) as f:
                    adjustment = parse(f.read())
            except OSError:
                pass
        offset_ms, rate, since_ms = adjustment or (0.0, 1.0, 0.0)
        self._adjustment = (offset_ms / 1000, rate, since_ms / 1000)


def _from_environment() -> Callable[[], float]:
    path = os.environ.get(CLOCK_FILE_ENV)
    return _time.time if not path else FileClock(path).time


time: Callable[[], float] = _from_environment()
"""Seconds since the Unix epoch, like `time.time`."""


def time_ns() -> int:
    return _time.time_ns() if time is _time.time else int(time() * 1e9)


def now_ms() -> int:
    """Milliseconds since the Unix epoch (the unit the metadata and the storage nodes store)."""
    return int(time() * 1000)
