"""A small bank for client tests that run the same application against `waltz.client.mock` and a
real cluster: accounts in memory, transfers under write locks on both accounts, and a scripted
scenario whose outcome is deterministic (a lock race made to happen, a declined transfer,
appends through `client.append`)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from waltz.client import (
    JSON,
    PartitionLocalLock,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
    WaltzClientCallbacks,
)


class Bank(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.marks: dict[int, int] = collections.defaultdict(lambda: -1)
        self.balances: dict[int, int] = collections.defaultdict(int)
        self.log: list[tuple[int, int, Any]] = []

    def get_client_high_water_mark(self, partition: int) -> int:
        with self.lock:
            return self.marks[partition]

    def apply_transaction(self, transaction: Transaction) -> None:
        t = transaction.data(JSON)
        with self.lock:
            assert transaction.transaction_id == self.marks[transaction.partition] + 1
            if "deposit" in t:
                self.balances[t["account"]] += t["deposit"]
            elif "amount" in t:
                self.balances[t["from"]] -= t["amount"]
                self.balances[t["to"]] += t["amount"]
            self.log.append((transaction.partition, transaction.transaction_id, t))
            self.marks[transaction.partition] = transaction.transaction_id


def account(n: int) -> PartitionLocalLock:
    return PartitionLocalLock("account", n)


class Transfer(TransactionContext):
    """Declines without the funds; `hold` (an event) makes the first execution wait after it read
    the balance, so another transfer can commit in between (a lock race made to happen)."""

    def __init__(
        self,
        bank: Bank,
        src: int,
        dst: int,
        amount: int,
        hold: threading.Event | None = None,
        holding: threading.Event | None = None,
    ) -> None:
        super().__init__()
        self.bank, self.src, self.dst, self.amount = bank, src, dst, amount
        self.hold, self.holding = hold, holding
        self.events: list[str] = []

    def execute(self, builder: TransactionBuilder) -> bool:
        with self.bank.lock:
            balance = self.bank.balances[self.src]
        if self.hold is not None:
            assert self.holding is not None
            self.holding.set()
            self.hold.wait(30)
            self.hold = None
        self.events.append(f"execute:{balance}")
        if balance < self.amount:
            return False
        builder.set_data({"from": self.src, "to": self.dst, "amount": self.amount}, JSON)
        builder.add_write_locks(account(self.src), account(self.dst))
        return True

    def on_completion(self, result: bool) -> None:
        self.events.append(f"completion:{result}")

    def on_lock_failure(self, transaction_id: int) -> None:
        self.events.append(f"lock_failure:{transaction_id}")


def scenario(make_client: Callable[[Bank], WaltzClient]) -> dict[str, Any]:
    """Two clients of one service on partition 0. What happened, comparable between runs."""
    a_bank, b_bank = Bank(), Bank()
    out: dict[str, Any] = {}
    with make_client(a_bank) as a, make_client(b_bank) as b:
        out["deposits"] = [
            a.append(0, {"account": 1, "deposit": 100}, serializer=JSON, append_locks=[account(1)]),
            b.append(0, {"account": 2, "deposit": 10}, serializer=JSON, append_locks=[account(2)]),
        ]
        a.flush()
        b.flush()
        # B reads account 1's balance, then A moves money out of it before B's transfer is sent:
        # B loses the lock race to A's transaction and runs again on the new balance.
        hold, holding = threading.Event(), threading.Event()
        slow = Transfer(b_bank, 1, 2, 80, hold=hold, holding=holding)
        result: dict[str, Any] = {}
        submitter = threading.Thread(target=lambda: result.setdefault("slow", b.submit(slow)))
        submitter.start()
        assert holding.wait(30)
        fast = Transfer(a_bank, 1, 3, 50)
        out["fast"] = a.submit(fast).result(30)
        a.flush()
        top = b.high_water_mark(0)
        while b_bank.marks[0] < top:
            threading.Event().wait(0.01)
        hold.set()
        submitter.join()
        out["slow"] = result["slow"].result(30)  # 50 left: 80 declined on the second execution
        out["fast_events"], out["slow_events"] = fast.events, slow.events
        a.flush()
        b.flush()
        while b_bank.marks[0] < a_bank.marks[0]:
            threading.Event().wait(0.01)
    out["balances"] = dict(sorted(a_bank.balances.items()))
    out["log"] = a_bank.log
    out["same_state"] = a_bank.log == b_bank.log and a_bank.balances == b_bank.balances
    return out
