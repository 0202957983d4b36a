"""The list-append workload (`--workload list-append`, and `lock-fallback` over thousands of
keys), checked the way Elle checks list-append histories.

Each key of a partition holds a list: the values appended to it, in log order. A transaction
touches 1 to 3 keys of its partition; on each it reads the list (read lock), appends its payload
id (append lock), or reads then appends (write lock). Those are the three locks of
docs/locking.md, and together they promise that a committed transaction saw exactly the appends
committed below its id: a read lock fails if the key was written after the client's mark, an
append lock never fails but moves the key's version. The lists are the worker's own state, built
from its feed; a read is recorded as `[length, last value, chain hash]` (the hash of the whole
list, chained value by value, so histories stay small however long the lists grow). The
transaction's bytes (payload "x") carry `{"r": {key: [n, last, hash]}, "a": [keys appended]}`.

`check_list_append` judges the committed log alone:
- `la-duplicate-append`: a value twice in a key's final order;
- `la-incompatible-order`: a read that is not a prefix of the key's final order (Elle's
  incompatible order; a read of a lost append shows up here too);
- `la-stale-read`: a read that is a prefix, but not the one the log held just below the
  transaction's id (too short: a stale read the locks should have refused; too long: a read
  from the future);
- `la-cycle`: a cycle in the graph of write-write (consecutive appends), write-read (the last
  value read was appended by) and read-write (the next value after a read was appended by)
  dependencies between committed transactions: G0, G1c or G2 by Adya's names.
An acknowledged append missing from the log is the plain checker's `lost-ack`.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from waltz.torture.drain import Record
from waltz.torture.feed import FeedRecorder
from waltz.torture.op import Op
from waltz.torture.report import Anomaly
from waltz.torture.workload import Workload

KEY_LOCK = "la"
EMPTY = ""


def chain(h: str, value: str) -> str:
    """The hash of a list extended by `value`, from the hash `h` of the list before it."""
    return hashlib.blake2b(f"{h}/{value}".encode(), digest_size=8).hexdigest()


class Lists:
    """A worker's lists, from its feed: (partition, key) -> [length, last value, hash]."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lists: dict[tuple[int, int], list[Any]] = defaultdict(lambda: [0, None, EMPTY])

    def apply(self, partition: int, record: Record) -> None:
        x = record.extra
        if record.payload is None or not isinstance(x, dict):
            return
        with self.lock:
            for key in x.get("a", ()):
                entry = self.lists[(partition, key)]
                entry[0] += 1
                entry[1] = record.payload
                entry[2] = chain(entry[2], record.payload)


class Txn(Op):
    lock = KEY_LOCK

    def __init__(self, lists: Lists, reads: list[int], appends: list[int], *args: Any) -> None:
        super().__init__(*args)
        self.lists, self.reads, self.appends = lists, reads, appends

    def extra(self, client_high_water_mark: int) -> Any:
        # The lists are at least as new as the mark (the feed moves its mark after applying).
        with self.lists.lock:
            seen = {str(k): list(self.lists.lists.get((self.partition, k), [0, None, EMPTY])) for k in self.reads}
        return {"r": seen, "a": self.appends}


class ListAppendWorkload(Workload):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lists = Lists()

    def feed(self, on_record: Callable[[int, Record], None]) -> FeedRecorder:
        def both(partition: int, record: Record) -> None:
            on_record(partition, record)
            self.lists.apply(partition, record)  # before the feed's mark moves past it

        return FeedRecorder(both)

    def _key(self, rng: random.Random) -> int:
        s = self.settings
        if s.hot_keys and rng.random() < 0.8:
            return rng.randrange(min(s.hot_keys, s.keys))
        return rng.randrange(s.keys)

    def op(self, rng: random.Random, payload: str, partition: int, on_applied: Callable[[Any], None]) -> Any:
        keys: list[int] = []
        for _ in range(rng.choice([1, 2, 2, 3])):
            k = self._key(rng)
            if k not in keys:
                keys.append(k)
        reads: list[int] = []
        appends: list[int] = []
        locks: dict[str, list[int]] = {"w": [], "r": [], "a": []}
        for k in keys:
            what = rng.choice(("r", "a", "ra"))
            locks["w" if what == "ra" else what].append(k)
            if "r" in what:
                reads.append(k)
            if "a" in what:
                appends.append(k)
        return Txn(self.lists, reads, appends, payload, partition, locks, 64, self.spec["op_timeout"], on_applied)


def check_list_append(log: Mapping[int, Sequence[Record]], source: str = "cluster") -> list[Anomaly]:
    out: list[Anomaly] = []
    for p, records in sorted(log.items()):
        out += _check_partition(p, records, source)
    return out


def _check_partition(p: int, records: Sequence[Record], source: str) -> list[Anomaly]:
    out: list[Anomaly] = []
    txns = [r for r in records if r.payload is not None and isinstance(r.extra, dict)]
    by_id = {r.txid: r for r in txns}
    # The final order of every key: the appenders' ids, in log order, and the prefix hashes.
    order: dict[int, list[int]] = defaultdict(list)
    hashes: dict[int, list[str]] = defaultdict(lambda: [EMPTY])
    seen_values: dict[int, dict[str, int]] = defaultdict(dict)
    for r in txns:
        for key in r.extra.get("a", ()):
            assert r.payload is not None
            first = seen_values[key].get(r.payload)
            if first is not None:
                out.append(
                    Anomaly(
                        "la-duplicate-append",
                        p,
                        f"value {r.payload} is in key {key}'s list twice (txids {first} and {r.txid})",
                        records=((source, by_id[first]), (source, r)),
                    )
                )
            seen_values[key][r.payload] = r.txid
            order[key].append(r.txid)
            hashes[key].append(chain(hashes[key][-1], r.payload))
    edges: dict[int, dict[int, str]] = defaultdict(dict)

    def edge(a: int, b: int, kind: str) -> None:
        if a != b:
            edges[a].setdefault(b, kind)

    for key, writers in order.items():
        for a, b in zip(writers, writers[1:]):
            edge(a, b, "ww")
    for r in txns:
        for k, (n, last, h) in r.extra.get("r", {}).items():
            key = int(k)
            writers, prefix = order.get(key, []), hashes[key]
            if n > len(writers) or prefix[n] != h:
                out.append(
                    Anomaly(
                        "la-incompatible-order",
                        p,
                        f"{r.payload} (txid {r.txid}) read key {key} as {n} values ending with {last}: not a prefix of "
                        f"its final order ({len(writers)} values)",
                        records=((source, r),),
                    )
                )
                continue
            below = sum(1 for w in writers if w < r.txid)
            if n != below:
                what = "stale: it misses the appends of txids" if n < below else "from the future: the appends of txids"
                out.append(
                    Anomaly(
                        "la-stale-read",
                        p,
                        f"{r.payload} (txid {r.txid}, client hwm {r.client_hwm}) read {n} values of key {key}; the log "
                        f"holds {below} below its id ({what} {sorted(set(writers[n:below] + writers[below:n]))})",
                        records=((source, r),)
                        + tuple((source, by_id[w]) for w in writers[min(n, below) : max(n, below)][:5]),
                    )
                )
            if n > 0:
                edge(writers[n - 1], r.txid, "wr")
            if n < len(writers):
                edge(r.txid, writers[n], "rw")
    for cycle in _cycles(edges):
        members = set(cycle)
        kinds = {kind for a in cycle for b, kind in edges.get(a, {}).items() if b in members}
        name = "G0" if kinds == {"ww"} else "G2" if "rw" in kinds else "G1c"
        out.append(
            Anomaly(
                "la-cycle",
                p,
                f"{name}: {len(cycle)} transactions in a dependency cycle ({', '.join(sorted(kinds))} edges): "
                f"txids {cycle[:10]}",
                records=tuple((source, by_id[t]) for t in cycle[:10]),
            )
        )
    return out


def _cycles(edges: Mapping[int, Mapping[int, str]]) -> list[list[int]]:
    """The strongly connected components with more than one node (Tarjan, iterative), each as
    its sorted members: every one of them lies on a cycle."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    out: list[list[int]] = []
    counter = 0
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, {})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out
