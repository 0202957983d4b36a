"""Bulk reads: whole ranges of a partition as column buffers or Arrow record batches.

The native scan hands over one buffer per column; nothing here touches a record one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from waltz._native import Partition, ScanChunk

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
    if partition_id is not None:
        arrays.insert(0, pa.array([partition_id] * n, pa.int32()))
        names.insert(0, "partition")
    return pa.RecordBatch.from_arrays(arrays, names=names)
