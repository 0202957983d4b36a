"""What a torture client sees in its feed: every committed transaction of every partition, from
the first, with its bytes, as `Record`s. The workers record it as reads; the final drain of the
cluster is one more feed, read by a fresh client once the faults have healed."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from waltz.client import WaltzClientCallbacks
from waltz.client.transaction import Transaction
from waltz.torture.drain import Record, record_from_bytes


class FeedRecorder(WaltzClientCallbacks):
    """Client callbacks that keep nothing but marks and what arrived (`on_record` for each)."""

    def __init__(self, on_record: Callable[[int, Record], None] = lambda p, r: None, *, keep: bool = False) -> None:
        self.marks: defaultdict[int, int] = defaultdict(lambda: -1)
        self.committed_ids: dict[str, int] = {}
        """payload -> the id it committed at, as this feed delivered it."""
        self.records: defaultdict[int, list[Record]] = defaultdict(list)
        self._keep = keep
        self._on_record = on_record
        self._changed = threading.Condition()

    def get_client_high_water_mark(self, partition: int) -> int:
        with self._changed:
            return self.marks[partition]

    def apply_transaction(self, transaction: Transaction) -> None:
        data = transaction.data()
        p, txid = transaction.partition, transaction.transaction_id
        record = record_from_bytes(txid, data, transaction.header)
        # The client applies a partition in order and without gaps; a feed that did not is what
        # the checker's consumer-skip and consumer-repeat report, so it is recorded, not asserted.
        self._on_record(p, record)
        with self._changed:
            if record.payload is not None:
                self.committed_ids.setdefault(record.payload, txid)
            if self._keep:
                self.records[p].append(record)
            self.marks[p] = max(self.marks[p], txid)
            self._changed.notify_all()

    def wait_for(self, targets: Mapping[int, int], timeout: float, stop: threading.Event | None = None) -> list[int]:
        """Waits until every partition's mark reached its target; returns the partitions that
        did not once no mark moved for `timeout` (or when `stop` was set). A feed that keeps
        moving is waited for: a fresh client of a long run replays hundreds of thousands of
        transactions (a fixed 180 s failed the drain of a 35-minute run)."""
        deadline = time.monotonic() + timeout
        seen: tuple[int, ...] = ()
        with self._changed:
            while True:
                behind = [p for p, t in targets.items() if self.marks[p] < t]
                marks = tuple(self.marks[p] for p in targets)
                if marks != seen:
                    seen, deadline = marks, time.monotonic() + timeout
                left = deadline - time.monotonic()
                if not behind or left <= 0 or (stop is not None and stop.is_set()):
                    return behind
                self._changed.wait(min(left, 0.2))
