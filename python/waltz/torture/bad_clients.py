"""Misbehaving clients (issue 37 item 7): each of these faults of a torture run starts one as a
process of its own, next to the honest workers, for the fault's hold.

    dup-client-id    mounts each partition under the client id of a live honest worker, with another
               token: the server must refuse it (CLIENT_REFUSED) while the worker holds it
    oversized-locks  mounts under an id of its own and sends an Append declaring more locks than the
               server's max_transaction_locks: it must get APPEND_REJECTED, the append must
               never commit, and the connection must keep answering
    stalled-reader   mounts every partition from the first transaction and asks for the whole log's
               data again and again without ever reading an answer: the server's memory must
               stay bounded (it stops reading the connection), the honest clients go on

It speaks the client protocol frame by frame (nothing in `WaltzClient` would misbehave), prints
one JSON line of what it saw, and exits 1 with the finding on its last line when the server did
not hold. The nemesis adds the finding to the run's problems; the checker judges the honest
clients' histories as always, and the nemesis checks that they kept committing meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import random
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from waltz import client_protocol as cp
from waltz import clock

MODES = ("dup-client-id", "oversized-locks", "stalled-reader")
MAX_TRANSACTION_LOCKS = 4096
"""The servers' default [partition] max_transaction_locks (waltz.config), which a torture cluster keeps."""
ANSWER_BYTES = 1 << 20
"""The data each of the stalled reader's requests asks for (most answers are that large once the
log holds a few MiB)."""
RSS_GROWTH_LIMIT_MB = 64
"""How much a server may grow while a client does not read: its answers in flight are bounded
by REQUESTS_IN_FLIGHT (8) and WRITE_BUFFER_LIMIT, about 8 MiB per connection of answers this size."""


class _Stopped(Exception):
    """SIGTERM (the heal): raised where the process waits, so that it answers at once."""


class _Conn:
    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.messages = cp.MessageReader()
        self.seq = 0
        self.send(cp.Hello())
        if not isinstance(self.next(), cp.HelloOk):
            raise ConnectionError(f"{endpoint}: no HelloOk")

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send(self, msg: cp.Message) -> None:
        self.sock.sendall(msg.frame())

    def next(self, timeout: float = 10.0) -> cp.Message | None:
        self.sock.settimeout(timeout)
        while (m := self.messages.next_message()) is None:
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                return None
            if not data:
                raise ConnectionError("closed by the server")
            self.messages.feed(data)
        return m

    def until(self, want: type[cp.Message], seq: int, timeout: float = 10.0) -> cp.Message | None:
        """The answer to request `seq` (a `want`, or a Failure), skipping feed frames."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            m = self.next(left)
            if m is None:
                return None
            if isinstance(m, (want, cp.Failure)) and getattr(m, "seq", None) in (seq, -1):
                return m
        return None

    def close(self) -> None:
        self.sock.close()


def _owner(servers: list[str], partition: int) -> tuple[_Conn, int] | None:
    """A connection to the server holding `partition`, and its high-water mark."""
    for endpoint in servers:
        try:
            c = _Conn(endpoint)
        except OSError:
            continue
        seq = c.next_seq()
        c.send(cp.HighWaterMarkRequest(seq, partition))
        try:
            m = c.until(cp.HighWaterMarkResponse, seq)
        except OSError:
            m = None
        if isinstance(m, cp.HighWaterMarkResponse):
            return c, m.high_water_mark
        c.close()
    return None


def _mount(c: _Conn, partition: int, client_id: int, hwm: int, token: bytes) -> cp.Message | None:
    seq = c.next_seq()
    c.send(cp.Mount(seq, partition, client_id, hwm, clock.time_ns() // 1000, token))
    return c.until(cp.MountResponse, seq)


def dup_id(spec: dict[str, Any], rng: random.Random, stop: threading.Event) -> dict[str, Any]:
    ids: list[int] = []
    while not ids and not stop.is_set():  # the workers publish their ids once they have joined
        ids = sorted(int(t) for p in pathlib.Path(spec["clients_dir"]).glob("worker-*.id") if (t := p.read_text()))
        if not ids:
            stop.wait(0.2)
    if not ids:
        return {"skipped": "no honest client had published its id"}
    victim = rng.choice(ids)
    seen: dict[str, Any] = {"victim": victim, "refused": 0, "accepted": 0, "unanswered": 0}
    with _until_stopped():
        _borrow(spec, victim, seen, stop)
    # A live worker mounts every partition it writes: its id is held on the servers nearly all
    # the time, and a short gap (a reconnect under another fault) can let one attempt through,
    # never every one.
    if seen["accepted"] >= 2 and seen["refused"] == 0:
        seen["finding"] = (
            f"dup-client-id: {seen['accepted']} mounts under live client {victim}'s id with another token were "
            "accepted, none refused"
        )
    return seen


def _borrow(spec: dict[str, Any], victim: int, seen: dict[str, Any], stop: threading.Event) -> None:
    while not stop.is_set():
        for p in range(spec["partitions"]):
            found = _owner(spec["servers"], p)
            if found is None:
                continue
            c, hwm = found
            try:
                m = _mount(c, p, victim, hwm, secrets.token_bytes(cp.TOKEN_BYTES))
            except OSError:
                m = None
            finally:
                c.close()  # an accepted intruder lets go at once: the honest client must get its id back
            if isinstance(m, cp.Failure) and m.kind == cp.FailureKind.CLIENT_REFUSED:
                seen["refused"] += 1
            elif isinstance(m, cp.MountResponse):
                seen["accepted"] += 1
            else:
                seen["unanswered"] += 1
        stop.wait(0.5)


def big_locks(spec: dict[str, Any], rng: random.Random, stop: threading.Event) -> dict[str, Any]:
    p = rng.randrange(spec["partitions"])
    own = (1 << 31) - 1 - rng.randrange(1 << 20)
    locks = MAX_TRANSACTION_LOCKS + 1 + rng.randrange(100)
    seen: dict[str, Any] = {"partition": p, "client": own, "locks": locks}
    with _until_stopped():
        return _too_many_locks(spec, p, own, locks, seen, stop)
    seen.setdefault("skipped", "stopped before a verdict")
    return seen


def _too_many_locks(
    spec: dict[str, Any], p: int, own: int, locks: int, seen: dict[str, Any], stop: threading.Event
) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while not stop.is_set() and time.monotonic() < deadline:
        found = _owner(spec["servers"], p)
        if found is None:
            stop.wait(0.5)
            continue
        c, hwm = found
        try:
            m = _mount(c, p, own, hwm, secrets.token_bytes(cp.TOKEN_BYTES))
            if not (isinstance(m, cp.MountResponse) and m.status == cp.MountStatus.READY):
                c.close()
                stop.wait(0.5)
                continue
            seq = c.next_seq()
            req = (own, m.generation, p, seq)
            c.send(cp.Append(req, m.high_water_mark, 0, b"bad-clients oversized-locks", tuple(range(locks))))
            answer: cp.Message | None = None
            until = time.monotonic() + 10
            while answer is None and (left := until - time.monotonic()) > 0:
                got = c.next(left)
                if got is None:
                    break
                if isinstance(got, cp.Failure) and got.seq == seq:
                    answer = got
                elif isinstance(got, cp.FeedData) and any(tuple(e.req_id) == req for e in got.entries):
                    answer = got
            if isinstance(answer, cp.Failure) and answer.kind == cp.FailureKind.APPEND_REJECTED:
                seen["rejected"] = answer.message
                seq = c.next_seq()
                c.send(cp.HighWaterMarkRequest(seq, p))  # the connection must keep answering
                if not isinstance(c.until(cp.HighWaterMarkResponse, seq), (cp.HighWaterMarkResponse, cp.Failure)):
                    seen["finding"] = "oversized-locks: the connection stopped answering after the rejection"
            elif isinstance(answer, cp.FeedData):
                seen["finding"] = f"oversized-locks: an append with {locks} locks was committed"
            elif isinstance(answer, cp.Failure) and answer.kind != cp.FailureKind.APPEND_REJECTED:
                seen["other"] = f"{answer.kind.name}: {answer.message}"  # e.g. the store unavailable: no verdict
                stop.wait(0.5)
                continue
            else:
                seen["finding"] = f"oversized-locks: an append with {locks} locks got no rejection within 10 s"
            return seen
        except OSError as e:
            seen["closed"] = str(e)
            if "rejected" not in seen:
                stop.wait(0.5)
                continue
            return seen
        finally:
            c.close()
    seen.setdefault("skipped", "no server held the partition ready")
    return seen


@contextlib.contextmanager
def _until_stopped() -> Iterator[None]:
    try:
        yield
    except _Stopped:
        pass


def _rss_mb(pid: int) -> float:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def no_read(spec: dict[str, Any], rng: random.Random, stop: threading.Event) -> dict[str, Any]:
    own = (1 << 30) + rng.randrange(1 << 20)
    token = secrets.token_bytes(cp.TOKEN_BYTES)
    before = {pid: _rss_mb(pid) for pid in spec["server_pids"]}
    # On the partition's own server, mounted at its mark (a feed from the first transaction would
    # fill the socket by itself): what piles up is the answers to the requests below.
    conns: list[tuple[_Conn, int]] = []
    for p in range(spec["partitions"]):
        found = _owner(spec["servers"], p)
        if found is not None:
            c, hwm = found
            c.send(cp.Mount(c.next_seq(), p, own, hwm, clock.time_ns() // 1000, token))
            conns.append((c, p))
    sent = [0]
    peak = dict(before)
    with _until_stopped():
        _flood(conns, before, peak, sent, stop)
    for c, _ in conns:
        c.close()
    growth = {pid: round(peak[pid] - before[pid], 1) for pid in before if before[pid]}
    seen: dict[str, Any] = {"requests": sent[0], "rss_growth_mb": growth, "open_at_end": len(conns)}
    worst = max(growth.values(), default=0.0)
    if worst > RSS_GROWTH_LIMIT_MB:
        seen["finding"] = (
            f"stalled-reader: a server grew {worst:.0f} MiB while a client sent {sent[0]} data requests "
            f"and read nothing (limit {RSS_GROWTH_LIMIT_MB} MiB)"
        )
    return seen


def _flood(
    conns: list[tuple[_Conn, int]],
    before: dict[int, float],
    peak: dict[int, float],
    sent: list[int],
    stop: threading.Event,
) -> None:
    while not stop.is_set() and conns:
        for c, p in list(conns):
            c.sock.setblocking(False)
            try:
                for _ in range(64):  # until the socket is full: the server stopped reading
                    # A different range each time: equal answers may share one encoded frame.
                    first = (c.seq // 2) % 1024
                    ask = cp.TransactionDataRangeRequest(c.next_seq(), p, first, cp.MAX_DATA_RANGE_COUNT, ANSWER_BYTES)
                    c.sock.send(ask.frame())
                    sent[0] += 1
            except BlockingIOError:
                pass  # the server stopped reading us: the back pressure this mode is after
            except OSError:
                conns.remove((c, p))  # closed by the server: also a way to hold
        for pid in peak:
            peak[pid] = max(peak[pid], _rss_mb(pid))
        if max((peak[pid] - before[pid] for pid in before), default=0.0) > RSS_GROWTH_LIMIT_MB:
            break  # found: a server that keeps growing would take the machine's memory with it
        stop.wait(0.05)


def main(mode: str, spec: dict[str, Any]) -> int:
    stop = threading.Event()

    def term(*_: Any) -> None:
        stop.set()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Stopped

    signal.signal(signal.SIGTERM, term)
    backstop = threading.Timer(spec["seconds"], stop.set)
    backstop.daemon = True  # the process ends when its mode returns, not when the backstop fires
    backstop.start()
    rng = random.Random(spec["seed"])
    seen = {"dup-client-id": dup_id, "oversized-locks": big_locks, "stalled-reader": no_read}[mode](spec, rng, stop)
    print(json.dumps({"mode": mode, **seen}), flush=True)
    if "finding" in seen:
        print(seen["finding"], flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
