"""The nemesis's clock faults (issue 37 item 2): one process's wall clock stepped forward, stepped
back, or running slow or fast, through the clock file that process reads (waltz/clock.py and
rust/src/engine/clock.rs; the run starts every storage node, server and client worker with
`WALTZ_CLOCK_FILE` naming a file of its own under `<cluster>/clock/`). Healed by removing the
file: the process is back on the system clock (a step back for a fast clock, forward for a slow one).

What a clock may not break beyond what the history checker sees: with the embedded metadata store,
every server and client holds a session in the shared SQLite file, and one process's clock must
not end anyone's session. While only clock faults run, every session alive when a clock fault
started must still be there when it heals (`SessionWatch`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import sqlite3
import time
from typing import Any

from waltz import clock

CLOCK_FAULTS = ("clock-step-forward", "clock-step-backward", "clock-skew")
STEPS = (5.0, 300.0)
"""Seconds a step moves the clock by, drawn uniformly (past any session timeout, within the day a
connection sequence may run ahead)."""
RATES = (0.25, 0.5, 2.0, 4.0)
QUIET_AFTER = 20.0
"""Seconds after another kind of fault healed before a clock fault watches the sessions (past the
servers' and the clients' session timeouts, 3 s and 10 s in a torture run)."""


def clock_file(directory: pathlib.Path, name: str) -> pathlib.Path:
    return directory / "clock" / name


def environment(directory: pathlib.Path, name: str) -> dict[str, str]:
    """What a process named `name` needs in its environment to read its clock file."""
    return {clock.CLOCK_FILE_ENV: str(clock_file(directory, name))}


def start(directory: pathlib.Path, kind: str, target: str, rng: random.Random) -> dict[str, Any]:
    """Writes `target`'s clock file for a fault of `kind`; returns the fault's detail."""
    if kind == "clock-skew":
        rate = rng.choice(RATES)
        offset_ms, detail = 0.0, {"rate": rate}
    else:
        step = rng.uniform(*STEPS) * (1 if kind == "clock-step-forward" else -1)
        rate, offset_ms, detail = 1.0, step * 1000, {"step_s": round(step, 1)}
    path = clock_file(directory, target)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # Since the system clock's now: a skew starts where the clock is, with no step of its own.
    tmp.write_text(clock.render(offset_ms, rate, time.time() * 1000 if rate != 1.0 else 0.0))
    os.replace(tmp, path)  # a reader never sees half a file
    return detail


def heal(directory: pathlib.Path, target: str) -> None:
    clock_file(directory, target).unlink(missing_ok=True)


class SessionWatch:
    """The embedded store's sessions of other processes alive when a clock fault started; `lost()`
    names those gone although their process still runs. Only meaningful while no other kind of
    fault (a pause, a kill, a cut from the store) could end a session for its own reasons."""

    def __init__(self, metadata_url: str) -> None:
        self.path = metadata_url[len("embedded:") :] if metadata_url.startswith("embedded:") else None
        self.sessions = self._alive()

    def _alive(self) -> dict[int, int]:
        if self.path is None:
            return {}
        with contextlib.closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)) as db:
            rows = db.execute("SELECT id, pid FROM sessions").fetchall()
        return {sid: pid for sid, pid in rows if pid != os.getpid() and _running(pid)}

    def lost(self) -> list[str]:
        if not self.sessions:
            return []
        now = self._alive()
        return [
            f"metadata session {sid} of process {pid}"
            for sid, pid in sorted(self.sessions.items())
            if sid not in now and _running(pid)
        ]


def _running(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "T")
