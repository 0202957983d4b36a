"""The nemesis's disk faults: the storage nodes run on LazyFS (waltz/torture/lazyfs.py), which
loses their unsynced writes on a power loss, fills up and slows down on command.

    power-loss           SIGKILL one storage node and cut its power: its writes that were not
                         fsynced are lost, half the time with the last one torn at a page
                         boundary; restart it
    power-loss-majority  the same on two of the three storage nodes at once (runs alone): what
                         a majority acknowledged was synced, so nothing acknowledged may be lost
    power-outage         the same on every storage node at once (runs alone): only the syncs
                         stand between an acknowledgement and its loss
    disk-full            two of the three disks refuse to grow past a small budget (ENOSPC; runs
                         alone): the cluster must stop committing, lose nothing, and resume when
                         space returns (healed as an operator would: free space, restart them)
    slow-disk            every write and sync of one storage node's disk waits 2, 20 or 100 ms
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

from waltz import errors
from waltz.local import LocalCluster
from waltz.torture.lazyfs import LazyFs

DISK_FAULTS = ("power-loss", "power-loss-majority", "power-outage", "disk-full", "slow-disk")
MAJORITY_DISK_FAULTS = ("power-loss-majority", "power-outage", "disk-full")
"""Faults of two storage nodes at once: they run alone, as kill-majority does."""
DISK_SEGMENT_SIZE = 64 << 10
"""Segment size of a run with disk faults: the segments roll (new files, headers, index
syncs) while disks are lost, full or slow."""


def mount_disks(cluster: LocalCluster, kinds: tuple[str, ...]) -> dict[str, LazyFs]:
    """LazyFS under every storage node's data directory, when a disk fault may strike (before
    the nodes start); {} otherwise."""
    if not set(kinds) & set(DISK_FAULTS):
        return {}
    try:
        import fuse  # noqa: F401 - fusepy loads libfuse2 on import
    except (ImportError, OSError) as e:
        raise errors.WaltzError(
            f"the disk faults ({', '.join(DISK_FAULTS)}) need fusepy and libfuse2 (scripts/setup.sh installs "
            f"both) and /dev/fuse: {e}; or choose other faults with --faults"
        ) from None
    disks: dict[str, LazyFs] = {}
    tag = uuid.uuid4().hex[:8]
    try:
        for m in cluster.members:
            if m.role == "storage":
                disk = LazyFs(
                    cluster.directory / "disks" / m.name,
                    cluster.directory / "data" / m.name,
                    f"waltz-lazyfs-{tag}-{m.name}",
                    cluster.directory / "logs" / f"lazyfs-{m.name}.log",
                )
                disk.start()
                disks[m.name] = disk
    except BaseException:
        unmount_disks(disks)
        raise
    return disks


def unmount_disks(disks: dict[str, LazyFs]) -> None:
    for disk in disks.values():
        disk.stop()


def start_disk_fault(
    kind: str, cluster: LocalCluster, disks: dict[str, LazyFs], storage: list[str], rng: random.Random
) -> tuple[tuple[str, ...], dict[str, Any], Callable[[], None]]:
    """Starts `kind` on `storage` nodes: (targets, detail for the history, undo)."""
    if kind in ("power-loss", "power-loss-majority", "power-outage"):
        count = {"power-loss": 1, "power-loss-majority": 2, "power-outage": len(storage)}[kind]
        targets = tuple(rng.sample(storage, count))
        tears = {t: rng.random() if rng.random() < 0.5 else None for t in targets}
        detail: dict[str, Any] = {}
        for t in targets:
            cluster.kill(t)
        for t in targets:  # every node is down before any disk goes: no write lands in between
            lost = disks[t].power_loss(tears[t])
            detail[t] = lost

        def restart() -> None:
            for t in targets:
                cluster.start_member(t)

        return targets, {"lost": detail}, restart
    if kind == "disk-full":
        targets = tuple(rng.sample(storage, 2))
        budget = rng.choice([0, 4 << 10, 64 << 10])
        for t in targets:
            disks[t].command(f"full {budget}")

        def free_space() -> None:
            # A node whose write failed refuses to write again until restarted (its partitions
            # are poisoned, as after fsync-eio): the operator frees space, then restarts it.
            for t in targets:
                disks[t].command("space")
            for t in targets:
                cluster.kill(t)
                cluster.start_member(t)

        return targets, {"budget": budget}, free_space
    if kind == "slow-disk":
        target = rng.choice(storage)
        delay = rng.choice([0.002, 0.02, 0.1])
        disks[target].command(f"delay {delay}")

        def no_delay() -> None:
            disks[target].command("delay 0")

        return (target,), {"delay": delay}, no_delay
    raise ValueError(kind)
