"""The bank and list-append checkers (`waltz.torture.bank`, `waltz.torture.list_append`) on
hand-made committed logs: a correct log (built by a sequential model that reads exactly what the
log holds below each id) passes; each kind of anomaly is reported, by its kind."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from waltz.torture import decode_payload, encode_payload, record_from_bytes
from waltz.torture.bank import check_bank
from waltz.torture.drain import Record
from waltz.torture.list_append import EMPTY, chain, check_list_append


def record(txid: int, payload: str, extra: Any, hwm: int | None = None) -> Record:
    data = encode_payload(payload, client_hwm=txid - 1 if hwm is None else hwm, extra=extra)
    return record_from_bytes(txid, data)


def test_a_payload_carries_the_workloads_description_and_keeps_it_checked():
    extra = {"r": {"3": [2, "w0-1", "ab"]}, "a": [3]}
    data = encode_payload("w0-2", client_hwm=5, size=300, extra=extra)
    assert decode_payload(data).extra == extra and len(data) == 300
    assert record_from_bytes(7, data).extra == extra
    assert decode_payload(encode_payload("w0-3", client_hwm=5)).extra is None
    damaged = data.replace(b'"a":[3]', b'"a":[4]')
    assert record_from_bytes(7, damaged).payload is None  # the filler no longer matches


# --- list-append -------------------------------------------------------------------------------


def list_append_log(n: int = 300, keys: int = 5, seed: int = 1) -> list[Record]:
    """A correct log: each transaction reads exactly the appends committed below it."""
    rng = random.Random(seed)
    lists: dict[int, list[str]] = {k: [] for k in range(keys)}
    out = []
    for txid in range(n):
        payload = f"w0-{txid:05d}"
        ks = rng.sample(range(keys), rng.choice([1, 2, 3]))
        reads = [k for k in ks if rng.random() < 0.6]
        appends = [k for k in ks if k not in reads or rng.random() < 0.5]
        out.append(record(txid, payload, {"r": {str(k): read_of(lists[k]) for k in reads}, "a": appends}))
        for k in appends:
            lists[k].append(payload)
    return out


def read_of(values: list[str]) -> list[Any]:
    h = EMPTY
    for v in values:
        h = chain(h, v)
    return [len(values), values[-1] if values else None, h]


def kinds(anomalies) -> Counter[str]:
    return Counter(a.kind for a in anomalies)


def test_a_correct_list_append_log_passes():
    log = list_append_log()
    assert sum(len(r.extra["r"]) for r in log) > 100 and max(n for r in log for n, *_ in r.extra["r"].values()) > 20
    assert check_list_append({0: log, 1: list_append_log(seed=2)}) == []


def test_a_stale_read_and_the_cycle_it_makes_are_reported():
    # T1 reads key 0 as empty although T0 (below it) appended to it, and reads key 1 with T0's
    # append: T1 -rw-> T0 -wr-> T1, a G2 cycle.
    log = [
        record(0, "t0", {"r": {}, "a": [0, 1]}),
        record(1, "t1", {"r": {"0": read_of([]), "1": read_of(["t0"])}, "a": []}, hwm=-1),
    ]
    found = check_list_append({0: log})
    assert kinds(found) == {"la-stale-read": 1, "la-cycle": 1}, [a.render() for a in found]
    cycle = next(a for a in found if a.kind == "la-cycle")
    assert "G2" in cycle.message and {r.payload for _, r in cycle.records} == {"t0", "t1"}


def test_a_read_from_the_future_is_reported():
    log = [
        record(0, "t0", {"r": {"0": read_of(["t1"])}, "a": []}),
        record(1, "t1", {"r": {}, "a": [0]}),
    ]
    assert kinds(check_list_append({0: log})) == {"la-stale-read": 1}


def test_transactions_that_read_each_others_appends_form_a_g1c_cycle():
    log = [
        record(0, "t0", {"r": {"1": read_of(["t1"])}, "a": [0]}),
        record(1, "t1", {"r": {"0": read_of(["t0"])}, "a": [1]}),
    ]
    found = check_list_append({0: log})
    assert kinds(found) == {"la-stale-read": 1, "la-cycle": 1}
    assert next(a for a in found if a.kind == "la-cycle").message.startswith("G1c")


def test_a_read_that_is_not_a_prefix_of_the_final_order_is_reported():
    log = list_append_log(50)
    last = log[-1]
    # A read of a value that never made it to the log (a lost append), or in another order.
    bogus = {"r": {"0": read_of(["w0-00003", "lost"])}, "a": []}
    log.append(record(last.txid + 1, "w0-bogus", bogus))
    found = check_list_append({0: log})
    assert kinds(found) == {"la-incompatible-order": 1}, [a.render() for a in found]


def test_a_value_appended_twice_is_reported():
    log = [record(0, "t0", {"r": {}, "a": [0]}), record(1, "t1", {"r": {}, "a": [0]})]
    log.append(record(2, "t0", {"r": {}, "a": [0]}))  # the same transaction committed again
    assert kinds(check_list_append({0: log}))["la-duplicate-append"] == 1


# --- bank --------------------------------------------------------------------------------------

ACCOUNTS, OPENING = 4, 100


def bank_log(n: int = 200, seed: int = 1) -> tuple[list[Record], dict[str, Any]]:
    """A correct log and the database that applied it once."""
    rng = random.Random(seed)
    bal = dict.fromkeys(range(ACCOUNTS), OPENING)
    log, applied = [], []
    for txid in range(n):
        a, b = rng.sample(range(ACCOUNTS), 2)
        amount = min(rng.randint(1, 50), bal[a])
        log.append(record(txid, f"w0-{txid:05d}", {"from": a, "to": b, "amount": amount, "seen": [bal[a], bal[b]]}))
        bal[a] -= amount
        bal[b] += amount
        applied.append((0, txid, f"w0-{txid:05d}"))
    db = {"balances": {(0, a): v for a, v in bal.items()}, "applied": applied, "marks": {0: n - 1}}
    return log, db


def test_a_correct_bank_passes():
    log, db = bank_log()
    assert check_bank({0: log}, db, ACCOUNTS, OPENING) == []


def test_a_transfer_applied_twice_is_reported():
    log, db = bank_log()
    x = log[10].extra
    db["applied"].append((0, 57, log[10].payload))  # a second instance applied it again at 57
    db["balances"][(0, x["from"])] -= x["amount"]
    db["balances"][(0, x["to"])] += x["amount"]
    found = kinds(check_bank({0: log}, db, ACCOUNTS, OPENING))
    assert found["bank-applied-twice"] == 1 and found["bank-balance-mismatch"] == 1, found


def test_a_stale_read_that_overdraws_is_reported_in_the_replay():
    log, db = bank_log(20)
    replay = dict.fromkeys(range(ACCOUNTS), OPENING)
    for r in log:
        replay[r.extra["from"]] -= r.extra["amount"]
        replay[r.extra["to"]] += r.extra["amount"]
    poor = min(replay, key=lambda a: replay[a])
    other = (poor + 1) % ACCOUNTS
    stale = {"from": poor, "to": other, "amount": replay[poor] + 5, "seen": [replay[poor] + 5, replay[other]]}
    log.append(record(20, "w1-stale", stale, hwm=3))
    db["applied"].append((0, 20, "w1-stale"))
    db["balances"][(0, poor)] -= stale["amount"]
    db["balances"][(0, other)] += stale["amount"]
    db["marks"][0] = 20
    found = kinds(check_bank({0: log}, db, ACCOUNTS, OPENING))
    assert found == {"bank-stale-read": 1, "bank-negative": 2}, found  # replayed, and in the database


def test_money_created_lost_or_applied_outside_the_log_is_reported():
    log, db = bank_log()
    db["balances"][(0, 0)] += 1
    found = kinds(check_bank({0: log}, db, ACCOUNTS, OPENING))
    assert found == {"bank-total": 1, "bank-balance-mismatch": 1}, found
    log, db = bank_log()
    db["applied"] = [row for row in db["applied"] if row[1] != 5] + [(0, 900, "w9-ghost")]
    db["marks"][0] = 150
    found = kinds(check_bank({0: log}, db, ACCOUNTS, OPENING))
    assert found == {"bank-not-applied": 2, "bank-phantom-apply": 1}, found


def test_the_command_offers_every_workload():
    from waltz.cli.torture import torture
    from waltz.torture.workload import WORKLOADS

    option = next(p for p in torture.params if p.name == "workload")
    assert tuple(option.type.choices) == WORKLOADS
