"""Rows/s of `df.write.format("waltz")` into a local cluster (issue 36, item 2).

    python benches/spark_write.py [--rows N] [--size BYTES] [--rounds R]

Starts a local cluster (1 server, 3 storage nodes, 2 partitions, fsync on) and a `local[2]`
SparkSession, then appends N rows of BYTES random bytes each, R times after a warm-up of N/10,
and prints the best rows/s. Each row is one transaction, so the cluster's append path bounds
it; what the sink changes is the Python cost per row on top of it (a `Row` object and its
fields, or columns of an Arrow batch).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

from waltz.local import LocalCluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    from waltz.spark import register

    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        cluster = LocalCluster.create(pathlib.Path(tmp) / "c", partitions=2, storage_nodes=3, servers=1)
        cluster.start()
        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        try:

            def frame(n: int) -> object:
                return spark.range(n, numPartitions=2).selectExpr(
                    "CAST(id % 2 AS INT) AS partition", f"CAST(randstr({args.size}, 0) AS BINARY) AS data"
                )

            def write(n: int) -> float:
                df = frame(n).cache()
                df.count()
                t = time.perf_counter()
                df.write.format("waltz").option("metadata", str(cluster.metadata_url)).option(
                    "cluster", cluster.cluster
                ).mode("append").save()
                elapsed = time.perf_counter() - t
                df.unpersist()
                return n / elapsed

            write(max(1, args.rows // 10))
            best = max(write(args.rows) for _ in range(args.rounds))
            print(f"rows={args.rows} size={args.size} best of {args.rounds}: {best:,.0f} rows/s")
        finally:
            spark.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
