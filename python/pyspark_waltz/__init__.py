"""The `waltz` Spark data source, found without `waltz.spark.register(spark)`: PySpark >= 4
looks through the installed top-level modules named `pyspark_*` and registers the
`DefaultSource` of each (`pyspark/sql/worker/lookup_data_sources.py`). So once the package
is installed, `spark.read.format("waltz")` works in any session. `register` still does more:
it turns on filter pushdown in the session (docs/spark.md)."""

from waltz.spark.datasource import WaltzDataSource as DefaultSource

__all__ = ["DefaultSource"]
