"""Torture testing: the history a workload records, and the checker that judges a run by it and
by the logs drained afterwards (docs/internals.md, "Torture histories")."""

from waltz.torture.checker import AppendOp, check
from waltz.torture.drain import Drains, DrainWriter, Record, read_drains, record_from_bytes, write_drains
from waltz.torture.history import Event, History, HistoryWriter, parse_event, read_history
from waltz.torture.jsonl import HistoryError, TornLineWarning
from waltz.torture.payload import Payload, PayloadError, decode_payload, digest, encode_payload, lock_name
from waltz.torture.report import KINDS, Anomaly, PartitionCounts, Report

__all__ = [
    "KINDS",
    "Anomaly",
    "AppendOp",
    "DrainWriter",
    "Drains",
    "Event",
    "History",
    "HistoryError",
    "HistoryWriter",
    "PartitionCounts",
    "Payload",
    "PayloadError",
    "Record",
    "Report",
    "TornLineWarning",
    "check",
    "decode_payload",
    "digest",
    "encode_payload",
    "lock_name",
    "parse_event",
    "read_drains",
    "read_history",
    "record_from_bytes",
    "write_drains",
]
