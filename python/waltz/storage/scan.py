"""Bulk reads: whole ranges of a partition as column buffers or Arrow record batches.

The native scan hands over one buffer per column, so files become Arrow without a Python object
per record; only records read over the network (which arrive as objects) are converted one by one.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from waltz._extras import require
from waltz._native import Partition, Record, ScanChunk

if TYPE_CHECKING:
    import pyarrow as pa

COLUMNS = ("transaction_id", "header", "client_id", "generation", "sequence", "data")


def iter_scan(
    partition: Partition,
    start: int | None = None,
    end: int | None = None,
    *,
    chunk_bytes: int = 16 << 20,
) -> Iterator[ScanChunk]:
    """Yields chunks covering `start..=end` (defaults: the whole partition) in order."""
    txid = partition.first_transaction_id if start is None else start
    last = partition.max_transaction_id if end is None else end
    while txid <= last:
        chunk = partition.scan(txid, last, max_bytes=chunk_bytes)
        if chunk.last_txid is None:
            return
        yield chunk
        txid = chunk.last_txid + 1


def scan_to_arrow(chunk: ScanChunk, partition_id: int | None = None) -> pa.RecordBatch:
    """The chunk as an Arrow record batch whose `data` column shares the scanned buffer."""
    require("pyarrow", "arrow", "Arrow record batches")
    import pyarrow as pa

    n = len(chunk)
    b = chunk.buffers()

    def fixed(kind: pa.DataType, buffer: bytes) -> pa.Array:
        return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(buffer)])

    arrays = [
        fixed(pa.int64(), b["txid"]),
        fixed(pa.int32(), b["header"]),
        fixed(pa.int32(), b["client_id"]),
        fixed(pa.int32(), b["generation"]),
        fixed(pa.int32(), b["sequence"]),
        pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(b["offsets"]), pa.py_buffer(b["payload"])]),
    ]
    names = list(COLUMNS)
    if partition_id is not None:  # one constant column, made without a Python object per row
        arrays.insert(0, fixed(pa.int32(), struct.pack("=i", partition_id) * n))
        names.insert(0, "partition")
    return pa.RecordBatch.from_arrays(arrays, names=names)


def scan_rows(chunk: ScanChunk, partition_id: int) -> Iterator[tuple[int, int, int, int, int, int, bytes]]:
    """The chunk one row at a time, `(partition, transaction_id, header, client_id, generation,
    sequence, data)`: the slow path, for callers that need Python objects (and for comparing
    with the Arrow one)."""
    b = chunk.buffers()
    txids = memoryview(b["txid"]).cast("q")
    header, client, generation, sequence = (
        memoryview(b[k]).cast("i") for k in ("header", "client_id", "generation", "sequence")
    )
    offsets, data = memoryview(b["offsets"]).cast("i"), memoryview(b["payload"])
    for i in range(len(chunk)):
        yield (
            partition_id,
            txids[i],
            header[i],
            client[i],
            generation[i],
            sequence[i],
            bytes(data[offsets[i] : offsets[i + 1]]),
        )


def records_to_arrow(records: Sequence[Record], partition_id: int) -> pa.RecordBatch:
    """Records read over the network as the same record batch `scan_to_arrow` makes of files."""
    require("pyarrow", "arrow", "Arrow record batches")
    import pyarrow as pa

    ids = [r.req_id for r in records]
    arrays = [
        pa.array([partition_id] * len(records), pa.int32()),
        pa.array([r.txid for r in records], pa.int64()),
        pa.array([r.header for r in records], pa.int32()),
        pa.array([i.client_id for i in ids], pa.int32()),
        pa.array([i.generation for i in ids], pa.int32()),
        pa.array([i.sequence for i in ids], pa.int32()),
        pa.array([r.data for r in records], pa.binary()),
    ]
    return pa.RecordBatch.from_arrays(arrays, names=["partition", *COLUMNS])
