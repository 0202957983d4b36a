"""Lock table: false positives of the hybrid table (exact LRU + hashed array) against the spec's
hashed array alone, at the same memory budget, on one skewed workload, and checks per second.

    python benches/lock_table.py [--quick] [--json PATH]

Workload: 200,000 distinct locks; 90% of transactions touch a hot set of 20,000 locks; each
transaction write-locks one lock and read-locks another; clients are 0-20,000 transactions behind
(a busy partition whose consumers apply in batches). Budgets: 64 KiB (where the table is the
spec's array alone, by design), 1 MiB (likewise), 2 MiB and the default 8 MiB.
A failure is a false positive when the exact history says there was no conflict. No false
negative is allowed for either table (checked).
"""

from __future__ import annotations

import argparse
import array
import json
import random
import sys
import time

sys.path.insert(0, "python")
from waltz.server.lock_table import HASHES, SLOT_BYTES, LockTable, _mix, lock_hash  # noqa: E402

MASK = (1 << 64) - 1


class SpecArray:
    """The spec's table: one array, N hashes, estimate = min over the lock's slots."""

    def __init__(self, hwm: int, budget: int) -> None:
        self.slots = array.array("q", [hwm]) * (budget // SLOT_BYTES)

    def _idx(self, lock: int) -> list[int]:
        return [_mix((lock & MASK) + i) % len(self.slots) for i in range(HASHES)]

    def check_and_update(self, client: int, txid: int, write: list[int], read: list[int]) -> bool:
        for lock in write + read:
            if min(self.slots[i] for i in self._idx(lock)) > client:
                return False
        for lock in write:
            for i in self._idx(lock):
                self.slots[i] = max(self.slots[i], txid)
        return True


def workload(n: int, seed: int = 7) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    locks = [lock_hash("row", i) for i in range(200_000)]

    def pick() -> int:
        return locks[rng.randrange(20_000)] if rng.random() < 0.9 else locks[rng.randrange(len(locks))]

    return [(pick(), pick(), rng.randrange(20_001)) for _ in range(n)]


def run(kind: str, budget: int, ops: list[tuple[int, int, int]]) -> dict[str, float]:
    table = LockTable(-1, budget) if kind == "hybrid" else SpecArray(-1, budget)
    truth: dict[int, int] = {}
    hwm, fp, failures = -1, 0, 0
    t0 = time.perf_counter()
    for w, r, behind in ops:
        client, txid = max(-1, hwm - behind), hwm + 1
        conflict = truth.get(w, -1) > client or truth.get(r, -1) > client
        if kind == "hybrid":
            ok = table.check_and_update(client, txid, write=[w], read=[r]) is None  # type: ignore[union-attr]
        else:
            ok = table.check_and_update(client, txid, [w], [r])  # type: ignore[call-arg]
        if ok:
            assert not conflict, "false negative"
            truth[w] = txid
            hwm = txid
        else:
            failures += 1
            fp += not conflict
    seconds = time.perf_counter() - t0
    return {
        "false_positive_rate": fp / len(ops),
        "failure_rate": failures / len(ops),
        "checks_per_s": len(ops) / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    ops = workload(100_000 if args.quick else 1_000_000)
    rows, ratios = [], {}
    print("| budget | table | false positives | failures | checks/s |\n|---|---|---|---|---|")
    for budget in (64 << 10, 1 << 20, 2 << 20, 8 << 20):
        res = {k: run(k, budget, ops) for k in ("spec", "hybrid")}
        for k, v in res.items():
            rows.append({"budget": budget, "table": k, **v})
            print(
                f"| {budget >> 10} KiB | {k} | {v['false_positive_rate']:.2%} | {v['failure_rate']:.2%} | "
                f"{v['checks_per_s']:,.0f} |"
            )
        ratios[f"false_positives_hybrid_over_spec_{budget >> 10}k"] = (
            res["hybrid"]["false_positive_rate"] / res["spec"]["false_positive_rate"]
            if res["spec"]["false_positive_rate"]
            else 0.0
        )
        ratios[f"speed_hybrid_over_spec_{budget >> 10}k"] = res["hybrid"]["checks_per_s"] / res["spec"]["checks_per_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transactions": len(ops), "rows": rows, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
