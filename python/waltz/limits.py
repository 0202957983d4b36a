"""What the daemons' limits against hostile or broken peers share: the file descriptor limit a
connection cap must fit in, and the count and log line of every refusal (issue 34: a limit that
refused someone silently left operators guessing)."""

from __future__ import annotations

import collections
import logging
import resource
import threading
import time


def raise_file_limit(need: int) -> int:
    """Raises the soft file descriptor limit towards `need` (as far as the hard limit allows) and
    returns the soft limit now in force (`need` when unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return need if soft == resource.RLIM_INFINITY else soft
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logging.getLogger(__name__).debug("cannot raise the file descriptor limit to %d: %s", target, e)
    return soft


class Refusals:
    """Counts refusals by reason (exported as a Prometheus counter by the daemon) and logs them,
    at most one line per reason every `interval` seconds with the number refused since: a flood
    must not become a flood of log lines. Thread-safe (the HTTP endpoint's threads share one)."""

    def __init__(self, log: logging.Logger, what: str, interval: float = 10.0) -> None:
        self.log, self.what, self.interval = log, what, interval
        self.counts: collections.Counter[str] = collections.Counter()
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()

    def refuse(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            self._unlogged[reason] += 1
            if now - self._last_log.get(reason, -self.interval) < self.interval:
                return
            self._last_log[reason] = now
            n, self._unlogged[reason] = self._unlogged[reason], 0
        more = f" ({n} refused for this reason in the last {self.interval:g} s)" if n > 1 else ""
        self.log.warning("%s refused (%s): %s%s", self.what, reason, detail, more)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
