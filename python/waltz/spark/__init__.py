"""PySpark integration (`pip install 'waltz-log[spark]'`): the `waltz` data source.

    from waltz.spark import register
    register(spark)
    spark.read.format("waltz").load("/var/lib/waltz/storage")

Batch scans read storage directories through the native reader as Arrow record batches;
streaming reads follow a live cluster; writes append rows as transactions. See docs/spark.md.
Options and planning import without PySpark; the data source itself needs it.
"""

from __future__ import annotations

import logging
from typing import Any

from waltz.spark.options import OptionError, Options
from waltz.spark.schema import SCHEMA

log = logging.getLogger("waltz.spark")

# Spark >= 4.1 setting for the link between Python workers and the JVM; it is read when the
# session starts, so a source can only point at it, never turn it on.
UNIX_SOCKETS = "spark.python.unix.domain.socket.enabled"
FILTER_PUSHDOWN = "spark.sql.python.filterPushdown.enabled"
"""Off by default (Spark 4.3): without it `WHERE partition = ... AND transaction_id >= ...`
scans every transaction and Spark drops the rows after reading them."""


def register(spark: Any) -> None:
    """Makes `format("waltz")` available in `spark` (a SparkSession; an installed package
    already is through `pyspark_waltz`) and turns on filter pushdown for Python data sources
    in it, unless the session sets `spark.sql.python.filterPushdown.enabled` itself."""
    from waltz.spark.datasource import WaltzDataSource

    spark.dataSource.register(WaltzDataSource)
    try:
        if spark.conf.get(FILTER_PUSHDOWN, None) is None:  # set by nobody: a choice of the user's stays
            spark.conf.set(FILTER_PUSHDOWN, "true")
            log.info(
                "waltz: %s set to true: reads take WHERE conditions on partition and transaction_id", FILTER_PUSHDOWN
            )
    except Exception:  # a Spark without the setting
        log.info(
            "waltz: this Spark has no %s: reads scan every transaction and Spark filters the rows", FILTER_PUSHDOWN
        )
    try:
        transport = str(spark.conf.get(UNIX_SOCKETS, "false")).lower()
    except Exception:  # a Spark without the setting, or a Connect session that hides it
        return
    if transport != "true":
        # Every Python data source's batches cross this link; over loopback TCP it costs about as
        # much as Parquet's whole scan (docs/performance.md, "Unix domain sockets").
        log.info(
            "waltz: %s is off: batch scans move their Arrow batches to the JVM over TCP, 10-30 %% "
            "slower than over Unix domain sockets (set it when the session starts; docs/spark.md)",
            UNIX_SOCKETS,
        )


def __getattr__(name: str) -> Any:
    if name == "WaltzDataSource":
        from waltz.spark.datasource import WaltzDataSource

        return WaltzDataSource
    raise AttributeError(name)


__all__ = ["SCHEMA", "OptionError", "Options", "WaltzDataSource", "register"]
