"""A Spark driver writing a file stream to `format("waltz")`, run as its own process by
tests/spark/integration/test_stream_sink_kills.py, which SIGKILLs one of its Python workers or
the whole driver in the middle of a micro-batch.

`python stream_sink_session.py METADATA CLUSTER SOURCE CHECKPOINT MARKERS MASTER PAUSE FILES`

Each micro-batch reads FILES files of SOURCE (one task each, as they are small).

- Every task attempt that returns writes `MARKERS/batch-B-task-T-attempt-A.json` with its rows
  written and found (already committed by an earlier attempt).
- The first attempt of task 0 of micro-batch PAUSE (-1: none) stops after the rows of its first
  Arrow batch are handed to the client, writes its pid to `MARKERS/batch-B-task-0-attempt-0.pid`
  and waits there to be killed: the test watches the log until some of those rows are
  committed, then kills. Not killed within the wait, it fails the task.
- The last line on stdout is `{"exception": ...}`, the query's failure or null.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

WAIT_TO_BE_KILLED = 180.0


def main() -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers must import this venv's waltz
    from pyspark import TaskContext
    from pyspark.sql import SparkSession
    from waltz.spark.datasource import WaltzDataSource
    from waltz.spark.stream_sink import WaltzStreamWriter

    metadata, cluster, source, checkpoint, markers, master, pause, files = sys.argv[1:]

    def paused(batches: Iterator[Any], pid_file: pathlib.Path) -> Iterator[Any]:
        for i, b in enumerate(batches):
            if i == 1:  # the first batch's rows are with the client: announce, wait for the kill
                partial = pid_file.with_suffix(".partial")
                partial.write_text(str(os.getpid()))
                partial.rename(pid_file)  # the test never reads half a pid
                time.sleep(WAIT_TO_BE_KILLED)
                raise RuntimeError("the test did not kill this worker (test)")
            yield b

    class Announcing(WaltzStreamWriter):
        def write(self, iterator: Iterator[Any]) -> Any:
            task = TaskContext.get()
            batch = int(task.getLocalProperty("streaming.sql.batchId"))
            name = f"batch-{batch}-task-{task.partitionId()}-attempt-{task.attemptNumber()}"
            if batch == int(pause) and task.partitionId() == 0 and task.attemptNumber() == 0:
                iterator = paused(iterator, pathlib.Path(markers, f"{name}.pid"))
            began = time.monotonic()
            message = super().write(iterator)
            seconds = round(time.monotonic() - began, 2)
            pathlib.Path(markers, f"{name}.json").write_text(
                json.dumps({"written": message.written, "found": message.found, "seconds": seconds})
            )
            return message

    class Killable(WaltzDataSource):
        @classmethod
        def name(cls) -> str:
            return "killablewaltz"

        def streamWriter(self, schema: Any, overwrite: bool) -> Any:
            return Announcing(self.options, schema)

    spark = (
        SparkSession.builder.master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "10")  # a task gets several batches
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(Killable)
    query = (
        spark.readStream.schema("data binary, partition int, header int")
        .option("maxFilesPerTrigger", files)
        .parquet(source)
        .writeStream.format("killablewaltz")
        .option("metadata", metadata)
        .option("cluster", cluster)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    failure = query.exception()
    print(json.dumps({"exception": str(failure) if failure else None}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
