"""The storage engine: crash-safe segment logs of partitions in a storage directory."""

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

__all__ = [
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
