"""The exactly-once streaming sink under real kills (issue 36, item 1: "prove it by killing
executors and the driver mid-epoch and counting rows"): a Spark driver in a subprocess
(tests/support/stream_sink_session.py) writes a file stream to a real local cluster; a task
announces itself once some of its rows are handed to the client, the test waits until the log
holds some but not all of them, and SIGKILLs the Python worker running the task, or the whole
driver. At the end each input row is in the log once."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import LEAKED_TASK, Live
from support import script
from test_stream_sink import _rows_of, _write_input

pytestmark = pytest.mark.spark


class Driver:
    """A driver process in its own process group (the JVM and the Python workers it starts are
    in it too), its output in files: a pipe nobody reads while the test waits could fill up and
    stall it."""

    def __init__(
        self, live: Live, tmp_path: pathlib.Path, name: str, master: str, pause: int, files_per_batch: int = 1
    ) -> None:
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        args = [live.url, live.cluster.cluster, *(str(tmp_path / d) for d in ("in", "checkpoint", "markers"))]
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    str(script("stream_sink_session.py")),
                    *args,
                    master,
                    str(pause),
                    str(files_per_batch),
                ],
                stdout=out,
                stderr=err,
                env={**os.environ, "PYSPARK_PYTHON": sys.executable},
                cwd=tmp_path,
                start_new_session=True,
            )

    def wait_for_file(self, path: pathlib.Path, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.process.poll() is None, f"the driver exited before {path.name}:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no {path.name} within {timeout} s:\n{self.stderr()}"
            time.sleep(0.05)
        return path.read_text()

    def finish(self, timeout: float = 300) -> dict[str, Any]:
        """The session's outcome once it exits by itself (it must)."""
        self.process.wait(timeout=timeout)
        assert self.process.returncode == 0, self.stderr()
        # a worker's stderr reaches the driver's: no RPC link task left pending (issue 36, item 7)
        assert LEAKED_TASK not in self.err.read_text(errors="replace"), f"asyncio tasks leaked: see {self.err}"
        return json.loads(self.out.read_text().strip().splitlines()[-1])

    def kill_all(self) -> None:
        """SIGKILL to every process of the driver's group, and wait until none is left."""
        group = self.process.pid
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive := _live_members(group):
            assert time.monotonic() < deadline, f"still running after SIGKILL: {alive}"
            time.sleep(0.1)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")[-4000:]


def _live_members(group: int) -> list[int]:
    """Pids of the processes of a group that have not exited (zombies have)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _parent_of(pid: int) -> int:
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _committed(live: Live, tag: str, rows: range) -> list[int]:
    return [d["row"] for ps in live.written().values() for _, d in ps if d.get("tag") == tag and d["row"] in rows]


def _wait_until_some_committed(live: Live, tag: str, rows: range, more_than: int = 0, timeout: float = 60) -> list[int]:
    """The rows of `rows` in the log, once there are more than `more_than`."""
    deadline = time.monotonic() + timeout
    while len(found := _committed(live, tag, rows)) <= more_than:
        assert time.monotonic() < deadline, f"no more than {more_than} of rows {rows} committed within {timeout} s"
        time.sleep(0.02)
    return found


def _inputs(tmp_path: pathlib.Path, tag: str, *files: range) -> None:
    """One parquet file per range, taken by the stream in this order."""
    source = tmp_path / "in"
    source.mkdir()
    (tmp_path / "markers").mkdir()
    now = time.time()
    for i, rows in enumerate(files):
        _write_input(source, f"f{i}", tag, rows)
        # Spark takes files in modification-time order; a minute apart, the order is certain
        then = now - 60 * (len(files) - i)
        os.utime(source / f"f{i}.parquet", (then, then))


@pytest.fixture
def drivers() -> Iterator[list[Driver]]:
    started: list[Driver] = []
    yield started
    for d in started:
        d.kill_all()  # whatever a failed test left running


def test_an_executor_killed_mid_task_is_retried_and_each_row_is_written_once(
    live: Live, tmp_path: pathlib.Path, drivers: list[Driver]
) -> None:
    """The Python worker running batch 0's task is SIGKILLed after some of the task's rows are
    committed (others may be in flight); Spark retries the task (local[2,3]) and the retry finds
    the killed attempt's rows and writes only the others."""
    tag = uuid.uuid4().hex
    _inputs(tmp_path, tag, range(0, 40), range(40, 60))
    markers = tmp_path / "markers"
    driver = Driver(live, tmp_path, "driver", "local[2,3]", pause=0)
    drivers.append(driver)

    worker = int(driver.wait_for_file(markers / "batch-0-task-0-attempt-0.pid"))
    # the task runs in a Python worker forked by pyspark's daemon, not in the driver
    assert worker != driver.process.pid
    assert b"pyspark.daemon" in pathlib.Path(f"/proc/{_parent_of(worker)}/cmdline").read_bytes()
    before = _wait_until_some_committed(live, tag, range(0, 40))
    assert len(before) < 40, "killed mid-task: some of its rows are not written yet"
    os.kill(worker, signal.SIGKILL)

    assert driver.finish() == {"exception": None}
    rows = _rows_of(live, tag, 60)
    assert sorted(r for _, r in rows) == list(range(60))  # each row once, none lost
    assert not (markers / "batch-0-task-0-attempt-0.json").exists(), "the first attempt never returned"
    retry = json.loads((markers / "batch-0-task-0-attempt-1.json").read_text())
    assert retry["written"] + retry["found"] == 40
    assert retry["found"] >= len(before), retry  # what the killed attempt committed, and no more written


def test_a_driver_killed_mid_batch_is_restarted_and_each_row_is_written_once(
    live: Live, tmp_path: pathlib.Path, drivers: list[Driver]
) -> None:
    """The whole driver (Python, its JVM, the Python workers) is SIGKILLed in batch 1, two files
    and so two tasks: task 1 has finished, task 0 has committed some of its rows, the batch is not
    in the commit log. A new driver on the same checkpoint replays batch 1: task 1 finds all its
    rows, task 0 those committed, and each writes only the others; then batch 2."""
    tag = uuid.uuid4().hex
    batches = [(range(0, 30), range(30, 50)), (range(50, 90), range(90, 110)), (range(110, 130), range(130, 150))]
    _inputs(tmp_path, tag, *(rows for batch in batches for rows in batch))
    markers, checkpoint = tmp_path / "markers", tmp_path / "checkpoint"
    first = Driver(live, tmp_path, "first", "local[2]", pause=1, files_per_batch=2)
    drivers.append(first)

    first.wait_for_file(markers / "batch-1-task-0-attempt-0.pid")
    done = json.loads(first.wait_for_file(markers / "batch-1-task-1-attempt-0.json", timeout=60))
    assert done["found"] == 0 and done["written"] in (20, 40), done  # one file each
    batch_1 = range(50, 110)
    before = _wait_until_some_committed(live, tag, batch_1, more_than=done["written"])
    assert len(before) < len(batch_1), "killed mid-batch: some of task 0's rows are not written yet"
    assert sorted(_committed(live, tag, range(0, 50))) == list(range(50))
    assert (checkpoint / "commits" / "0").exists() and (checkpoint / "offsets" / "1").exists()
    assert not (checkpoint / "commits" / "1").exists()
    first.kill_all()
    assert first.process.returncode == -signal.SIGKILL
    assert not (checkpoint / "commits" / "1").exists(), "batch 1 is replayed by the next driver"

    second = Driver(live, tmp_path, "second", "local[2]", pause=-1, files_per_batch=2)
    drivers.append(second)
    assert second.finish() == {"exception": None}
    rows = _rows_of(live, tag, 150)
    assert sorted(r for _, r in rows) == list(range(150))  # each row once, none lost
    # the second driver's attempts (the first's task 0 never returned, its task 1 json is replaced)
    finished = json.loads((markers / "batch-1-task-1-attempt-0.json").read_text())
    assert (finished["written"], finished["found"]) == (0, done["written"])
    replay = json.loads((markers / "batch-1-task-0-attempt-0.json").read_text())
    assert replay["written"] + replay["found"] == len(batch_1) - done["written"]
    assert replay["found"] >= len(before) - done["written"], replay
    after = [json.loads((markers / f"batch-2-task-{t}-attempt-0.json").read_text()) for t in (0, 1)]
    assert sorted((a["written"], a["found"]) for a in after) == [(20, 0), (20, 0)]
