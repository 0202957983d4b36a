"""`WaltzDataSource`, the `waltz` format: batch and streaming reads (`waltz.spark.source`) and
the append-only sinks (`waltz.spark.sink`; `waltz.spark.stream_sink`, exactly once); options in
docs/spark.md."""

from __future__ import annotations

import sys

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from waltz.spark.options import OptionError, Options
from waltz.spark.schema import SCHEMA
from waltz.spark.sink import WaltzWriter
from waltz.spark.source import WaltzFilteringReader, WaltzReader, WaltzStreamReader
from waltz.spark.stream_sink import WaltzStreamWriter


class WaltzDataSource(DataSource):
    """`spark.read.format("waltz")`, `spark.readStream.format("waltz")`, `df.write.format("waltz")`;
    options in docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "waltz"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = Options.parse(self.options)
        return WaltzFilteringReader(opts) if _pushing_filters() else WaltzReader(opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return WaltzStreamReader(Options.parse(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise OptionError("a waltz log is append-only: use mode('append')")
        return WaltzWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if overwrite:
            raise OptionError("a waltz log is append-only: use outputMode('append')")
        return WaltzStreamWriter(self.options, schema)


_PUSHDOWN_WORKER = "pyspark.sql.worker.data_source_pushdown_filters"


def _pushing_filters() -> bool:
    """Whether Spark asks for this reader to push filters into it. Spark plans a read in that
    worker when `spark.sql.python.filterPushdown.enabled` is true, and otherwise refuses a
    reader that defines `pushFilters` (DATA_SOURCE_PUSHDOWN_DISABLED), while `reader` is not
    told which: so the caller is looked at. A Spark that plans elsewhere gets a reader without
    pushdown, which reads the same rows (Spark applies the filters), only more of them."""
    frame = sys._getframe(1)
    while frame is not None:
        spec = frame.f_globals.get("__spec__")  # the worker may run as __main__ (python -m)
        if _PUSHDOWN_WORKER in (frame.f_globals.get("__name__"), getattr(spec, "name", None)):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
