"""A replica whose last segment a power loss tore (torture seed 61): a hole where a record began
and valid records after it, all written since the last sync. Its storage node opens the partition
(cutting the torn tail) and the next store session takes the replica back: it is filled from its
peers and rejoins the write path, instead of staying out as corrupt."""

from __future__ import annotations

import asyncio
import pathlib
import struct
from collections.abc import Iterator

import pytest
from support.daemons import Node, nodes_cluster
from support.processes import start, stop, wait_http
from waltz.cluster.metadata import ClusterMetadata
from waltz.server.store_session import StoreSession
from waltz.storage import RecordBatch, ReqId


@pytest.fixture
def cluster(metadata_url: str, tmp_path: pathlib.Path) -> Iterator[tuple[ClusterMetadata, list[Node], str]]:
    yield from nodes_cluster(metadata_url, tmp_path)


def batch(tag: str, n: int) -> RecordBatch:
    return RecordBatch([(ReqId(1, 1, 0, i), i, f"{tag}-{i}".encode()) for i in range(n)])


def tear(node: Node, record: int) -> int:
    """Zeros `record` in partition 0's last segment of a stopped node, as a torn write leaves it
    (the records after it stay valid); returns the record's offset."""
    part = node.config.parent / "data" / "0"
    seg = sorted(part.glob("*.seg"))[-1]
    first = int(seg.stem)
    idx = seg.with_suffix(".idx").read_bytes()[128:]  # a clean close wrote every entry
    offset, after = struct.unpack_from(">qq", idx, 8 * (record - first))
    with open(seg, "r+b") as f:  # the blocks the disk never wrote: the zeros they held
        f.seek(offset)
        f.write(bytes(after - offset))
    seg.with_suffix(".idx").write_bytes(seg.with_suffix(".idx").read_bytes()[:128])  # as lost as the data
    return offset


def test_a_replica_with_a_torn_write_is_taken_back(cluster) -> None:
    meta, nodes, _ = cluster
    torn = nodes[2]

    async def go() -> None:
        s = await StoreSession.open(meta, 0, generation=1, timeout=5.0)
        for i in range(40):
            await s.append(batch(f"a{i}", 5))
        await s.close()
        await asyncio.to_thread(stop, torn.proc)
        tear(torn, 190)
        torn.proc = start(torn.config)
        await asyncio.to_thread(wait_http, torn.ports["http_port"], torn.proc)
        s2 = await StoreSession.open(meta, 0, generation=1, timeout=5.0)
        assert s2.high_water_mark == 199
        deadline = asyncio.get_running_loop().time() + 30
        while torn.address not in s2.replicas_in_write_path:
            assert asyncio.get_running_loop().time() < deadline, f"the torn replica never rejoined: {s2.recovery_log}"
            await s2.append(batch("b", 1))
            await asyncio.sleep(0.05)
        last = (await s2.append(batch("c", 2)))[1]
        await s2.close()
        copies = [await asyncio.to_thread(n.admin_records) for n in nodes]
        assert len(copies[2]) == last + 1 and copies[0] == copies[1] == copies[2]
        assert bytes(copies[2][190].data) == b"a38-0"

    asyncio.run(go())
