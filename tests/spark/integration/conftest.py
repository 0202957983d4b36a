"""Spark tests: a real `local[2]` SparkSession for the whole session, and a real local cluster.

Marked `spark`; the main suite runs without PySpark (`-m "not spark"`), `.ci/run` installs the
`spark` extra and runs them (WALTZ_REQUIRE_SPARK=1 turns a missing PySpark into a failure)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

if importlib.util.find_spec("pyspark") is None:
    if os.environ.get("WALTZ_REQUIRE_SPARK"):
        raise pytest.UsageError("PySpark is not installed but WALTZ_REQUIRE_SPARK is set: pip install -e '.[spark]' (scripts/setup.sh installs every extra)")
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers must import this venv's waltz
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from waltz.spark import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("waltz-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


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
