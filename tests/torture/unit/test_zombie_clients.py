"""Which client workers the `zombie` fault cuts from the metadata store with its server."""

from __future__ import annotations

import random

import pytest
from waltz.torture.net_faults import zombie_clients

WORKERS = [f"worker-{i}" for i in range(5)]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_half_the_workers_are_cut_at_least_one_and_one_left_when_there_are_two(count):
    workers = WORKERS[:count]
    for seed in range(50):
        cut = zombie_clients(random.Random(seed), workers)
        assert len(cut) == max(1, count // 2)
        assert set(cut) <= set(workers) and len(set(cut)) == len(cut)
        if count > 1:  # someone still follows the reassignment and writes to the new owner
            assert set(workers) - set(cut)


def test_the_choice_replays_from_the_seed_and_varies_with_it():
    assert zombie_clients(random.Random(7), WORKERS) == zombie_clients(random.Random(7), WORKERS)
    assert len({tuple(zombie_clients(random.Random(s), WORKERS)) for s in range(50)}) > 1


def test_no_workers_none_cut():
    assert zombie_clients(random.Random(1), []) == []
