"""The least a Python asyncio server can add to a quorum write: issue 10's 1-client bound, tested.

Issue 10 asks for a 1-client p50 within 1.5 x (write + fdatasync p50 + 2 loopback round trips).
DESIGN.md puts the server in Python asyncio. This benchmark builds the smallest possible version of
that path and measures it on the same machine, in one run, beside the bound's own references:

- three "replicas", each a process with a blocking socket loop: read a 1 KiB frame, `pwrite` it
  into a file whose space was zero-filled and synced beforehand (the cheapest fsync there is,
  as the storage nodes' preallocation gets), `fdatasync`, answer 8 bytes;
- a relay on uvloop (the server's event loop): a frame from the client is written to the three
  replicas at once, and the second answer releases the client's reply; no parsing, no locks, no
  batching, no feed, no bookkeeping of any kind;
- one client, a blocking socket in this process, one frame in flight.

What it measures is a floor for any server written as DESIGN.md says, not a Waltz figure: Waltz
does everything here plus its protocol. `python benches/latency_floor.py [--seconds 10] [--json F]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from peers import loadgen  # noqa: E402

FRAME = 1024 + 40  # a 1 KiB transaction's encoded record, as in the fdatasync reference
ACK = 8
PREALLOCATED = 64 << 20

_REPLICA = """
import os, socket, sys
frame, ack, size = int(sys.argv[2]), b"\\0" * int(sys.argv[3]), int(sys.argv[4])
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"\\0" * size, 0)
os.fsync(fd)
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf, off = bytearray(frame), 0
while True:
    view, got = memoryview(buf), 0
    while got < frame:
        n = c.recv_into(view[got:])
        if not n:
            sys.exit(0)
        got += n
    os.pwrite(fd, buf, off)
    os.fdatasync(fd)
    off = (off + frame) % (size - frame)
    c.sendall(ack)
"""


class Relay(asyncio.Protocol):
    """Client side of the relay: each whole frame goes to every replica; the quorum-th answer
    (in order: one frame in flight per replica connection is answered in order) replies."""

    def __init__(self, replicas: list[asyncio.Transport], quorum: int) -> None:
        self.replicas, self.quorum = replicas, quorum
        self.buf = bytearray()
        self.waiting: collections.deque[list[int]] = collections.deque()
        self.client: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= FRAME:
            frame = bytes(self.buf[:FRAME])
            del self.buf[:FRAME]
            self.waiting.append([0, 0])  # per request: answers seen, and a bit per replica that answered
            for r in self.replicas:
                r.write(frame)

    def answered(self, replica: int) -> None:
        # Replica i's k-th answer is for request k; find the oldest request it has not answered.
        for req in self.waiting:
            if not req[1] & (1 << replica):
                req[1] |= 1 << replica
                req[0] += 1
                if req[0] == self.quorum and self.client is not None:
                    self.client.write(b"\1" * ACK)
                break
        while self.waiting and self.waiting[0][1] == (1 << len(self.replicas)) - 1:
            self.waiting.popleft()


class ReplicaLink(asyncio.Protocol):
    def __init__(self, index: int, relay: list[Relay]) -> None:
        self.index, self.relay, self.pending = index, relay, 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.pending += len(data)
        while self.pending >= ACK:
            self.pending -= ACK
            for r in self.relay:
                r.answered(self.index)


_RELAY_MAIN = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import uvloop
import latency_floor as lf

async def main(ports):
    loop = asyncio.get_running_loop()
    relays = []
    links = []
    for i, p in enumerate(ports):
        t, _ = await loop.create_connection(lambda i=i: lf.ReplicaLink(i, relays), "127.0.0.1", p)
        links.append(t)
    server = await loop.create_server(lambda: relays.append(lf.Relay(links, len(links) // 2 + 1)) or relays[-1],
                                      "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

uvloop.run(main([int(p) for p in sys.argv[2:]]))
"""


def _announced_port(proc: subprocess.Popen[str], what: str) -> str:
    """The port a helper process prints once it listens; its failure (its traceback went to
    stderr) is an error naming it rather than a parse error."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        raise RuntimeError(f"the {what} did not start (exit code {proc.poll()}); its error is above")
    return line


def measure(directory: pathlib.Path, seconds: float) -> dict[str, Any]:
    procs: list[subprocess.Popen[str]] = []
    directory.mkdir(parents=True, exist_ok=True)
    try:
        ports = []
        for i in range(3):
            p = loadgen.track(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _REPLICA,
                        str(directory / f"replica{i}"),
                        str(FRAME),
                        str(ACK),
                        str(PREALLOCATED),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
            procs.append(p)
            ports.append(_announced_port(p, f"replica {i}"))
        relay = loadgen.track(
            subprocess.Popen(
                [sys.executable, "-c", _RELAY_MAIN, str(pathlib.Path(__file__).resolve().parent), *ports],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        procs.append(relay)
        port = int(_announced_port(relay, "relay"))
        frame, out = os.urandom(FRAME), []
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            warm_until = time.perf_counter() + 1.0
            end = warm_until + seconds
            while (t0 := time.perf_counter()) < end:
                c.sendall(frame)
                got = 0
                while got < ACK:
                    n = len(c.recv(64))
                    if not n:
                        raise RuntimeError("the relay closed the connection")
                    got += n
                if t0 >= warm_until:
                    out.append(time.perf_counter() - t0)
        out.sort()
        return {
            "p50_us": loadgen.percentile(out, 0.5) * 1e6,
            "p99_us": loadgen.percentile(out, 0.99) * 1e6,
            "ops": len(out),
            "ops_per_s": len(out) / seconds,
        }
    finally:
        for p in procs:
            loadgen.stop_process(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time of the floor's closed loop")
    ap.add_argument("--rounds", type=int, default=3, help="floor runs, each between fresh references")
    ap.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = ap.parse_args()
    rows = []
    with loadgen.scratch_dir("waltz-floor-") as d:
        for r in range(args.rounds):
            fsync = loadgen.fdatasync_p50_us(d / f"raw{r}", 3000)
            rtt = loadgen.loopback_rtt_p50_us(3000)
            floor = measure(d / f"floor{r}", args.seconds)
            bound = 1.5 * (fsync["p50_us"] + 2 * rtt["p50_us"])
            rows.append(
                {
                    "fdatasync_p50_us": fsync["p50_us"],
                    "loopback_rtt_p50_us": rtt["p50_us"],
                    "bound_us": bound,
                    "floor": floor,
                }
            )
            loadgen.log(
                f"round {r + 1}: write + fdatasync p50 {fsync['p50_us']:.0f} us, loopback round trip "
                f"p50 {rtt['p50_us']:.0f} us, bound 1.5 x ({fsync['p50_us']:.0f} + 2 x {rtt['p50_us']:.0f}) "
                f"= {bound:.0f} us; floor p50 {floor['p50_us']:.0f} us (p99 {floor['p99_us']:.0f}, "
                f"{floor['ops_per_s']:.0f} ops/s) = {floor['p50_us'] / bound:.2f} x the bound"
            )
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
