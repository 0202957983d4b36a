"""The server's per-append Python, alone: CPU (and, under callgrind, instructions) per committed
append of `ServerPartition` driven as the client port drives it, over a stand-in store session.

    python benches/append_path.py [APPENDS]
    valgrind --tool=callgrind python benches/append_path.py 500    # and 2500: the difference / 2000

32 closed-loop appenders on uvloop, each making the Append message, the partition's request,
queueing it with its answer callback and waiting for the outcome, as `ClientConnection` does;
the store session commits each batch on the next loop turn, so no network, no replicas and no
feed are involved: what is measured is the request objects, the queue, the lock table, ids,
the batch and the outcomes. CPU per append moves with the machine's load; the instruction
count of callgrind does not (issue 33: 86,295 instructions per append before its first step,
64,990 after). It also runs against the partition before issue 33 (no `enqueue_nowait`), for
an A/B with `PYTHONPATH` pointing at the older tree.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from typing import Any

import uvloop
import waltz.client_protocol as cp
from waltz._native import RecordBatch, ReqId
from waltz.server import partition as P

CLIENTS = 32


class CommitNextTurn:
    """A store session whose every batch commits on the next loop turn."""

    high_water_mark = -1
    failed = None
    successor_wanted = None
    on_successor_wanted = None

    def __init__(self) -> None:
        self._next = 0

    def append(self, batch: RecordBatch, listener: Any = None) -> asyncio.Future[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        first, self._next = self._next, self._next + len(batch)
        last = self._next - 1

        def commit() -> None:
            fut.set_result((first, last))
            if listener is not None:
                listener(fut)

        loop.call_soon(commit)
        return fut

    async def close(self, drain_seconds: float = 0) -> None:
        pass


async def run(appends: int) -> tuple[int, float]:
    p = P.ServerPartition(0, 1, CommitNextTurn())  # type: ignore[arg-type]
    await p.start()
    payload = bytes(1024)
    done = 0
    nowait = hasattr(p, "enqueue_nowait")

    def answered(msg: cp.Append, f: asyncio.Future[Any]) -> None:
        pass

    async def client(cid: int) -> None:
        nonlocal done
        seq, pending = 0, []
        while done < appends:
            seq += 1
            msg = cp.Append((cid, 1, 0, seq), p.high_water_mark, 0, payload)
            r = P.AppendRequest(ReqId(*msg.req_id), msg.client_high_water_mark, msg.header, msg.data, (), (), ())
            if nowait:
                fut = p.enqueue_nowait(r, functools.partial(answered, msg))
                assert fut is not None
            else:  # before issue 33: a coroutine to queue, a done callback to answer
                fut = await p.enqueue(r)
                fut.add_done_callback(functools.partial(answered, msg))
            pending.append(fut)
            await fut
            pending.remove(fut)
            done += 1

    t0 = time.process_time()
    await asyncio.gather(*(client(c) for c in range(CLIENTS)))
    cpu = time.process_time() - t0
    await p.close()
    return done, cpu


def main() -> int:
    appends = int(sys.argv[1]) if len(sys.argv) > 1 else 30_000
    done, cpu = uvloop.run(run(appends))
    print(f"{done} appends committed, {cpu / done * 1e6:.1f} µs of CPU each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
