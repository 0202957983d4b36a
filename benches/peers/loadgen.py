"""One closed-loop load generator for every system `benches/cluster.py` measures, the references
measured in the same run (raw fdatasync, a loopback round trip), and process helpers.

A system plugs in a `Session` factory: `open_session(i)` connects client i, `op(payload)`
performs one write and returns once it is committed (durable on a majority, as the system
defines it), with the number of retries it needed. `closed_loop` runs N sessions on one asyncio
loop, each with exactly one operation in flight, for a warm-up and then a measured window
(`threaded_closed_loop` the same with blocking sessions, a thread each):

- latency: submit → commit of every operation that started inside the window (clients finish
  the one they have in flight at the end, so slow tail operations are not dropped);
- throughput: operations that completed inside the window, divided by its length; MB/s counts
  payload bytes only;
- CPU: utime + stime from `/proc/PID/stat` of every process of the system under test plus this
  one (which runs the clients) at the start and end of the window, per committed operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

TICKS = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class PeerUnavailable(RuntimeError):
    """A peer cannot be installed or started here; the harness reports it and goes on."""


# ---- processes ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads), 0 once it is gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SPAWNED: list[subprocess.Popen[Any]] = []
# Processes started with `start_new_session`, whose descendants (the Erlang VM under the
# rabbitmq-server script) share their process group and may outlive them.
_GROUPS: set[int] = set()


def track(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    """Remembers a process this run started, and whether it leads a group, for `kill_leftovers`."""
    _SPAWNED.append(proc)
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(proc.pid) == proc.pid:
            _GROUPS.add(proc.pid)
    return proc


def _kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL to the process and, when it leads a group of its own, to everything in that group
    (even once the leader itself is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if proc.pid in _GROUPS:
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()


def kill_leftovers() -> int:
    """SIGKILL to every tracked process still running, with its group (the last line of cleanup
    after an error or an interrupt); returns how many tracked processes were still running."""
    n = 0
    for p in _SPAWNED:
        n += p.poll() is None
        _kill(p)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    _SPAWNED.clear()
    _GROUPS.clear()
    return n


def stop_process(proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait(timeout=10)


class PeerProcesses:
    """The processes of one peer system the harness starts: each spawned into its own log file
    under `directory` and tracked for `kill_leftovers`, polled until the system is ready (failing
    at once, with the log's tail, when one exits), and stopped with SIGTERM."""

    label = "member"
    """How an error names process i: "{label} {i} exited"."""
    log_name = "m{i}/peer.log"
    """Process i's log file, relative to `directory`."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, i: int, argv: list[str], **popen: Any) -> None:
        with open(self.directory / self.log_name.format(i=i), "wb") as logf:
            self.procs.append(
                track(
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        **popen,
                    )
                )
            )

    def log_text(self, i: int) -> str:
        try:
            return (self.directory / self.log_name.format(i=i)).read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, i: int) -> str:
        return self.log_text(i)[-1500:] or "(no log)"

    def check_alive(self, only: Collection[int] | None = None) -> None:
        for i, p in enumerate(self.procs):
            if (only is None or i in only) and p.poll() is not None:
                raise PeerUnavailable(f"{self.label} {i} exited: {self.log_tail(i)}")

    def poll_ready(self, timeout: float, what: str, probe: Callable[[], str | None]) -> None:
        """Calls `probe` every 0.2 s until it returns None (ready); otherwise it returns, or raises
        as OSError or ValueError, what it saw, named in the error after `timeout`."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                state = probe()
            except (OSError, ValueError) as e:
                state = str(e)
            if state is None:
                return
            last = state
            time.sleep(0.2)
        raise PeerUnavailable(f"{what} not ready after {timeout:.0f} s: {last}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to all at once (they shut down in parallel), then each waited for."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            stop_process(p, timeout=timeout)


def ensure_installed(what: str, present: Callable[[], bool], apt_packages: list[str]) -> None:
    """Installs Debian packages when `present()` says the peer is missing: as root with apt-get
    (services the packages would start are held back by a temporary policy-rc.d), else a clear
    error."""
    if present():
        return
    hint = f"apt-get install -y {' '.join(apt_packages)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PeerUnavailable(f"{what} is not installed and this is not root with apt-get: run `{hint}` as root")
    log(f"{what} is missing: {hint}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = pathlib.Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:  # keep the package from starting a system-wide daemon on the default ports
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", *apt_packages]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if own_policy:
            policy.unlink(missing_ok=True)
    if r.returncode != 0 or not present():
        raise PeerUnavailable(f"`{hint}` failed: {(r.stderr or r.stdout)[-800:]}")


# ---- the load generator ---------------------------------------------------------------------


class Session(Protocol):
    async def op(self, payload: bytes) -> int:
        """One write, returning once it is committed; the number of retries it took."""

    async def close(self) -> None: ...


class BlockingSession(Protocol):
    """A `Session` for `threaded_closed_loop`: blocking calls, one thread each."""

    def op(self, payload: bytes) -> int: ...

    def close(self) -> None: ...


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def closed_loop(
    open_session: Callable[[int], Awaitable[Session]],
    clients: int,
    seconds: float,
    processes: dict[str, int],
    *,
    warmup: float = 0.5,
    payload_size: int = 1024,
) -> dict[str, Any]:
    """`clients` sessions, each with one operation in flight, for `warmup` + `seconds`.

    `processes` names the system's processes (name → pid); this process is added as "clients"."""
    sessions = await asyncio.gather(*(open_session(i) for i in range(clients)))
    w = _Window(processes, warmup, seconds, payload_size)

    async def mark(name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        w.mark(name)

    async def client(s: Session) -> None:
        while (t0 := time.perf_counter()) < w.end:
            retries = await s.op(w.payload)
            w.spans.append((t0, time.perf_counter(), retries))

    try:
        await asyncio.gather(mark("start", w.start), mark("end", w.end), *(client(s) for s in sessions))
    finally:
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
    return w.summary(clients)


def threaded_closed_loop(
    open_session: Callable[[int], BlockingSession],
    clients: int,
    seconds: float,
    processes: dict[str, int],
    *,
    warmup: float = 0.5,
    payload_size: int = 1024,
) -> dict[str, Any]:
    """`closed_loop` with blocking sessions, one thread each and no event loop: what Python
    threads that each wait for their own write cost, measured as `closed_loop` measures."""
    sessions = [open_session(i) for i in range(clients)]
    w = _Window(processes, warmup, seconds, payload_size)

    def mark(name: str, at: float) -> None:
        time.sleep(max(0.0, at - time.perf_counter()))
        w.mark(name)

    failed: list[BaseException] = []

    def client(s: BlockingSession) -> None:
        try:
            while (t0 := time.perf_counter()) < w.end:
                retries = s.op(w.payload)
                w.spans.append((t0, time.perf_counter(), retries))
        except BaseException as e:  # raised below, as `closed_loop`'s gather raises a client's error
            failed.append(e)

    threads = [threading.Thread(target=mark, args=(name, at)) for name, at in (("start", w.start), ("end", w.end))]
    threads += [threading.Thread(target=client, args=(s,), daemon=True) for s in sessions]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in sessions:
            with contextlib.suppress(OSError):
                s.close()
    if failed:
        raise failed[0]
    return w.summary(clients)


class _Window:
    """A closed loop's measured window: when it starts and ends, the operations' (start, end,
    retries), and the CPU of every process at its two ends."""

    def __init__(self, processes: dict[str, int], warmup: float, seconds: float, payload_size: int) -> None:
        self.procs = {"clients": os.getpid(), **processes}
        self.payload = os.urandom(payload_size)
        self.spans: list[tuple[float, float, int]] = []
        now = time.perf_counter()
        self.start, self.end = now + warmup, now + warmup + seconds
        self.marks: dict[str, tuple[float, dict[str, float]]] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = (time.perf_counter(), {k: cpu_seconds(p) for k, p in self.procs.items()})

    def summary(self, clients: int) -> dict[str, Any]:
        (w0, cpu0), (w1, cpu1) = self.marks["start"], self.marks["end"]
        window = w1 - w0
        committed = sum(1 for _, t1, _ in self.spans if w0 <= t1 < w1)
        measured = [(t1 - t0, r) for t0, t1, r in self.spans if w0 <= t0 < w1]
        lat = sorted(x for x, _ in measured)
        cpu = {k: cpu1[k] - cpu0[k] for k in self.procs}
        per = max(committed, 1)
        return {
            "clients": clients,
            "seconds": round(window, 3),
            "committed": committed,
            "tx_per_s": committed / window,
            "mb_per_s": committed * len(self.payload) / window / 1e6,
            "p50_ms": percentile(lat, 0.50) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3,
            "p999_ms": percentile(lat, 0.999) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
            "retries": sum(r for _, r in measured),
            "cpu_us_per_tx": sum(cpu.values()) / per * 1e6,
            "cpu_us_per_tx_by_process": {k: round(v / per * 1e6) for k, v in cpu.items()},
        }


# ---- references measured in the same run ----------------------------------------------------


def fdatasync_p50_us(directory: pathlib.Path, calls: int) -> dict[str, float]:
    """write + fdatasync of one 1 KiB record (its encoded size: 40 + 1024 bytes) in a native loop."""
    from waltz._native import raw_append_loop

    directory.mkdir(parents=True, exist_ok=True)
    raw_append_loop(str(directory / "warm"), os.urandom(1064), 50)
    ns = sorted(raw_append_loop(str(directory / "raw"), os.urandom(1064), calls))
    return {"p50_us": percentile(ns, 0.5) / 1e3, "p99_us": percentile(ns, 0.99) / 1e3, "calls": calls}


def fdatasync_majority_p50_us(directory: pathlib.Path, calls: int, writers: int = 3) -> dict[str, float]:
    """The same loop in `writers` threads at once, a file each: what one call takes while three
    replicas on this one disk sync together, as they do for every commit (not in the issue's
    bound, which counts one fsync)."""
    from concurrent.futures import ThreadPoolExecutor

    from waltz._native import raw_append_loop

    directory.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(1064)
    with ThreadPoolExecutor(writers) as pool:  # the native loop runs without the GIL
        runs = list(pool.map(lambda i: raw_append_loop(str(directory / f"w{i}"), payload, calls), range(writers)))
    ns = sorted(x for r in runs for x in r)
    return {
        "p50_us": percentile(ns, 0.5) / 1e3,
        "p99_us": percentile(ns, 0.99) / 1e3,
        "calls": calls,
        "writers": writers,
    }


_ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    c.sendall(b)
"""


def loopback_rtt_p50_us(round_trips: int, size: int = 1024, cpus: tuple[int, int] | None = None) -> dict[str, float]:
    """A TCP round trip of `size` bytes between this process and another (blocking sockets).
    `cpus`: this process and the echo pinned to these CPUs for the measurement (the same one
    twice, or two); unpinned, the scheduler places them, and on a small VM the two placements
    differ by 4x (a wake-up across cores goes through an idle vCPU: 12 against 54 us)."""
    mine = os.sched_getaffinity(0)
    pin_echo = None if cpus is None else (lambda: os.sched_setaffinity(0, {cpus[1]}))
    proc = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True, preexec_fn=pin_echo)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            msg = os.urandom(size)
            out = []
            for i in range(round_trips + 100):
                t0 = time.perf_counter()
                c.sendall(msg)
                got = 0
                while got < size:
                    got += len(c.recv(1 << 16))
                if i >= 100:
                    out.append(time.perf_counter() - t0)
        out.sort()
        return {"p50_us": percentile(out, 0.5) * 1e6, "p99_us": percentile(out, 0.99) * 1e6, "round_trips": round_trips}
    finally:
        os.sched_setaffinity(0, mine)
        proc.kill()
        proc.wait()


def loopback_rtt_placed_us(round_trips: int) -> dict[str, float] | None:
    """The round trip with both ends on one core and on two (p50 each), beside the unpinned
    reference, which lands on one or the other as the scheduler places the echo; None on a
    machine with one usable CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    one = loopback_rtt_p50_us(round_trips, cpus=(cpus[0], cpus[0]))["p50_us"]
    two = loopback_rtt_p50_us(round_trips, cpus=(cpus[0], cpus[1]))["p50_us"]
    return {"one_core_p50_us": one, "two_cores_p50_us": two}


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[pathlib.Path]:
    """A temp dir on a real disk (/var/tmp: tmpfs would ignore fsync), removed afterwards."""
    base = next((d for d in ("/var/tmp", "/work") if os.path.isdir(d) and os.access(d, os.W_OK)), None)
    d = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
