"""Spark tests: a real `local[2]` SparkSession for the whole session, and a real local cluster.

Marked `spark`; the main suite runs without PySpark (`-m "not spark"`), `.ci/run` installs the
`spark` extra and runs them (WALTZ_REQUIRE_SPARK=1 turns a missing PySpark into a failure)."""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("pyspark") is None:
    if os.environ.get("WALTZ_REQUIRE_SPARK"):
        raise pytest.UsageError(
            "PySpark is not installed but WALTZ_REQUIRE_SPARK is set: pip install -e '.[spark]' (scripts/setup.sh "
            "installs every extra)"
        )
    collect_ignore_glob = ["test_*.py"]


LEAKED_TASK = "Task was destroyed but it is pending"
"""What asyncio logs when an event loop goes away with a task still running: the task never
finished its cleanup (issue 36, item 7: the RPC link's reader task in streaming logs)."""


class _StderrOfSpark:
    """The JVM's stderr, and with it every Python worker's (Spark copies theirs into it), goes
    to a file, so a test can fail on what an executor's Python printed."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path, self.seen = path, 0

    def new(self) -> str:
        text = self.path.read_bytes()[self.seen :].decode(errors="replace")
        self.seen += len(text.encode())
        return text


_spark_stderr: _StderrOfSpark | None = None


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    global _spark_stderr
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers must import this venv's waltz
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    from waltz.spark import register

    stderr = _StderrOfSpark(tmp_path_factory.mktemp("spark-stderr") / "stderr.log")
    saved = os.dup(2)
    with stderr.path.open("ab") as f:
        os.dup2(f.fileno(), 2)  # the JVM inherits this descriptor when it starts
        try:
            session = (
                SparkSession.builder.master("local[2]")
                .appName("waltz-tests")
                .config("spark.ui.enabled", "false")
                .config("spark.sql.shuffle.partitions", "2")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.driver.host", "127.0.0.1")
                .getOrCreate()
            )
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    _spark_stderr = stderr
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
    _spark_stderr = None
    assert LEAKED_TASK not in stderr.new(), f"an executor leaked an asyncio task (see {stderr.path})"


class _Leaks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if LEAKED_TASK in record.getMessage():
            self.found.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_leaked_tasks() -> Iterator[None]:
    """Fails a test after which asyncio reports a task destroyed while pending, in this process
    or in a Spark worker (their stderr reaches the file `spark` points the JVM's at)."""
    leaks = _Leaks()
    logging.getLogger("asyncio").addHandler(leaks)
    try:
        yield
        gc.collect()  # a task caught in a reference cycle is only destroyed by the collector
    finally:
        logging.getLogger("asyncio").removeHandler(leaks)
    worker_output = _spark_stderr.new() if _spark_stderr is not None else ""
    found = leaks.found + [line for line in worker_output.splitlines() if LEAKED_TASK in line]
    assert not found, "asyncio tasks leaked (destroyed while pending):\n" + "\n".join(found)


class Live:
    """A running local cluster (1 server, 3 storage nodes, 2 partitions) and a client writing
    JSON payloads; `written[p]` is what the client's own feed applied, in id order."""

    def __init__(self, directory: pathlib.Path) -> None:
        from support.client_app import MemoryApp
        from waltz.client import WaltzClient
        from waltz.local import LocalCluster

        self.cluster = LocalCluster.create(directory, partitions=2, storage_nodes=3, servers=1)
        self.cluster.start()
        self.app = MemoryApp()
        self.client = WaltzClient(self.app, self.cluster.client_config())

    @property
    def url(self) -> str:
        return str(self.cluster.metadata_url)

    def storage_dir(self, i: int) -> pathlib.Path:
        return self.cluster.directory / "data" / f"storage-{i}"

    def write(self, name: str, n: int) -> None:
        from support.client_app import Write

        for f in [self.client.submit(Write(f"{name}-{i}", partition=i % 2, header=i)) for i in range(n)]:
            assert f.result(timeout=60)
        self.client.flush()

    def written(self) -> dict[int, list[tuple[int, Any]]]:
        """Partition → (id, decoded JSON data) of everything committed, from the client's feed."""
        with self.app.lock:
            return {p: list(rows) for p, rows in self.app.applied.items()}

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = Live(tmp_path_factory.mktemp("spark-cluster") / "c")
    try:
        yield cluster
    finally:
        cluster.close()
