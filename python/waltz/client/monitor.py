"""The transaction monitor (spec: "Detection of Failed Append Requests"): the appends a
partition has sent and not yet seen settled, keyed by sequence number. Pure bookkeeping, no I/O.

Appends of one partition travel on one connection and the server takes them in order, so when
the feed delivers this client's append with sequence S, every pending append sent before S
(a lower sequence) has failed: it would have been committed before S. A mount answered READY
settles all of them (the server then has none of ours left), and a Flush answer settles those
sent before the Flush once the feed has passed the high-water mark it reported."""

from __future__ import annotations

import collections
import dataclasses
from typing import Generic, TypeVar

W = TypeVar("W")


@dataclasses.dataclass
class Attempt(Generic[W]):
    seq: int
    work: W
    sent_at: float


class TransactionMonitor(Generic[W]):
    def __init__(self) -> None:
        self._pending: collections.OrderedDict[int, Attempt[W]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def sent(self, seq: int, work: W, now: float) -> None:
        assert not self._pending or seq > next(reversed(self._pending)), "sequences rise in send order"
        self._pending[seq] = Attempt(seq, work, now)

    def committed(self, seq: int) -> tuple[Attempt[W] | None, list[Attempt[W]]]:
        """The feed delivered our append `seq`: (its attempt, or None if it is no longer
        pending, and the attempts sent before it, which failed)."""
        attempt = self._pending.pop(seq, None)
        if attempt is None:
            return None, []
        return attempt, self.failed_through(seq)

    def refused(self, seq: int) -> Attempt[W] | None:
        """The server refused `seq` (a lock failure)."""
        return self._pending.pop(seq, None)

    def failed_through(self, seq: int) -> list[Attempt[W]]:
        """Every pending attempt with a sequence up to `seq`, removed: they failed."""
        out = []
        while self._pending:
            first = next(iter(self._pending))
            if first > seq:
                break
            out.append(self._pending.pop(first))
        return out

    def fail_all(self) -> list[Attempt[W]]:
        out = list(self._pending.values())
        self._pending.clear()
        return out

    def oldest(self) -> Attempt[W] | None:
        return next(iter(self._pending.values()), None)

    def newest_seq(self) -> int | None:
        return next(reversed(self._pending), None)
