"""The storage engine: crash-safe segment logs of partitions in a storage directory.

`Partition` is the engine's partition (one segment log); `EnginePartition` names the same class
where the server's (`waltz.server.partition.ServerPartition`) or the client's
(`waltz.client.partition.ClientPartition`) is also in view."""

from waltz._native import (
    Partition,
    PartitionInfo,
    Record,
    RecordBatch,
    RecordHeader,
    ReqId,
    ScanChunk,
    Storage,
    StorageNode,
)
from waltz.storage.client import StorageAdminClient, StorageClient
from waltz.storage.scan import iter_scan, scan_to_arrow

EnginePartition = Partition

__all__ = [
    "EnginePartition",
    "Partition",
    "PartitionInfo",
    "Record",
    "RecordBatch",
    "RecordHeader",
    "ReqId",
    "ScanChunk",
    "Storage",
    "StorageAdminClient",
    "StorageClient",
    "StorageNode",
    "iter_scan",
    "scan_to_arrow",
]
