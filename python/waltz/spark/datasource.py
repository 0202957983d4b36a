"""`WaltzDataSource`, the `waltz` format: batch and streaming reads (`waltz.spark.source`) and
the append-only sink (`waltz.spark.sink`); options in docs/spark.md."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, DataSourceWriter
from pyspark.sql.types import StructType

from waltz.spark.options import OptionError, Options
from waltz.spark.schema import SCHEMA
from waltz.spark.sink import WaltzWriter
from waltz.spark.source import WaltzReader, WaltzStreamReader


class WaltzDataSource(DataSource):
    """`spark.read.format("waltz")`, `spark.readStream.format("waltz")`, `df.write.format("waltz")`;
    options in docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "waltz"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return WaltzReader(Options.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return WaltzStreamReader(Options.parse(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise OptionError("a waltz log is append-only: use mode('append')")
        return WaltzWriter(self.options, schema)
