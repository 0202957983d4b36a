"""How long the nemesis keeps injecting: the duration, then on until `min_faults` started (a short
run on a loaded machine spends its seconds in slow operator steps), never past twice the duration."""

from __future__ import annotations

import pathlib

from waltz.torture.run import TortureOptions, _keep_injecting


def options(min_faults: int) -> TortureOptions:
    return TortureOptions(pathlib.Path("unused"), duration=45.0, min_faults=min_faults)


def test_the_schedule_runs_its_duration_whatever_was_injected() -> None:
    assert _keep_injecting(0.0, 0, options(0))
    assert _keep_injecting(44.9, 100, options(8))
    assert not _keep_injecting(45.0, 0, options(0))


def test_too_few_faults_extend_the_schedule_up_to_twice_its_duration() -> None:
    assert _keep_injecting(45.0, 7, options(8))
    assert _keep_injecting(89.9, 3, options(8))
    assert not _keep_injecting(90.0, 3, options(8))
    assert not _keep_injecting(46.0, 8, options(8))
