"""Heals that go through the metadata bring a killed ZooKeeper back first, even before it is due:
the nemesis heals one fault at a time, so such a heal would otherwise retry against a dead
ZooKeeper until its deadline (seed 75: `waltz storage add-node` after a remove-node)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from waltz.torture.nemesis import HEALS_THROUGH_METADATA, Fault, Nemesis


def nemesis() -> Nemesis:
    cluster: Any = SimpleNamespace(members=[])
    kinds = ("corrupt", "remove-node", "kill-zookeeper", "kill-storage")
    zookeeper: Any = object()
    return Nemesis(cluster, {}, random.Random(1), kinds, lambda e: None, lambda m: None, zookeeper=zookeeper)


def fault(kind: str, order: list[str], heal_at: float) -> Fault:
    return Fault(kind, (kind,), heal_at, undo=lambda: order.append(kind))


@pytest.mark.parametrize("kind", HEALS_THROUGH_METADATA)
def test_a_metadata_heal_restarts_zookeeper_first(kind: str) -> None:
    order: list[str] = []
    n = nemesis()
    first, zk = fault(kind, order, 1.0), fault("kill-zookeeper", order, 99.0)
    n.active = [first, zk]
    n.heal(first)
    assert order == ["kill-zookeeper", kind]
    assert n.active == [] and n.problems == []


def test_other_heals_leave_zookeeper_to_its_time() -> None:
    order: list[str] = []
    n = nemesis()
    kill, zk = fault("kill-storage", order, 1.0), fault("kill-zookeeper", order, 99.0)
    n.active = [kill, zk]
    n.heal(kill)
    assert order == ["kill-storage"]
    assert n.active == [zk]
