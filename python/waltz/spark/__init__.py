"""PySpark integration (`pip install waltz[spark]`): the `waltz` data source.

    from waltz.spark import register
    register(spark)
    spark.read.format("waltz").load("/var/lib/waltz/storage")

Batch scans read storage directories through the native reader as Arrow record batches;
streaming reads follow a live cluster; writes append rows as transactions. See docs/spark.md.
Options and planning import without PySpark; the data source itself needs it.
"""

from __future__ import annotations

from typing import Any

from waltz.spark.options import OptionError, Options

SCHEMA = "partition int, transaction_id long, header int, client_id int, generation int, sequence int, data binary"


def register(spark: Any) -> None:
    """Makes `format("waltz")` available in `spark` (a SparkSession)."""
    from waltz.spark.source import WaltzDataSource

    spark.dataSource.register(WaltzDataSource)


def __getattr__(name: str) -> Any:
    if name == "WaltzDataSource":
        from waltz.spark.source import WaltzDataSource

        return WaltzDataSource
    raise AttributeError(name)


__all__ = ["SCHEMA", "OptionError", "Options", "WaltzDataSource", "register"]
