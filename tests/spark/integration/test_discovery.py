"""issue 36, item 4: `format("waltz")` in a session where `waltz.spark.register` is never
called, found by PySpark through the installed top-level module `pyspark_waltz`."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from test_batch import planted

pytestmark = pytest.mark.spark

SESSION = textwrap.dedent(
    """
    import json, os, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.driver.host", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.read.format("waltz").option("minPartitions", "1").load(sys.argv[1])
    counts = {r.partition: r["count"] for r in df.groupBy("partition").count().collect()}
    where = df.where("partition = 1 AND transaction_id >= 70").count()
    print(json.dumps({"counts": counts, "where": where,
                      "pushdown": spark.conf.get("spark.sql.python.filterPushdown.enabled")}))
    spark.stop()
    """
)


def test_a_new_session_finds_the_source_without_register(tmp_path: pathlib.Path) -> None:
    d = planted(tmp_path, 100, 79)
    script = tmp_path / "session.py"
    script.write_text(SESSION)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, str(script), str(d)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # Committed only: 0..79 of each partition; the filter is Spark's (pushdown is off by default).
    assert got == {"counts": {"0": 80, "1": 80}, "where": 10, "pushdown": "false"}
