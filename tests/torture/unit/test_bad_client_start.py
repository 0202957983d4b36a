"""A misbehaving client is judged only if the honest clients were committing when it started
(torture seed 66: one started right after a majority power loss and was blamed for the recovery)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from waltz.torture import net_faults


class _Marks:
    """What `_committing` reads of the nemesis: the observed marks, one reading per call."""

    def __init__(self, sums: Iterator[int]) -> None:
        self._sums = sums
        self.calls = 0

    def committed(self) -> dict[int, int]:
        self.calls += 1
        return {0: next(self._sums), 1: 0}


def test_a_cluster_that_commits_is_judged_from_the_risen_mark() -> None:
    marks = _Marks(iter([10, 10, 12, 15]))
    assert net_faults._committing(marks, wait=5.0) == 12  # type: ignore[arg-type]
    assert marks.calls == 3


def test_a_cluster_that_commits_nothing_is_not_judged() -> None:
    marks = _Marks(itertools.repeat(7))
    assert net_faults._committing(marks, wait=1.2) is None  # type: ignore[arg-type]
    assert marks.calls >= 2
