"""The rows of the `waltz` data source, one per transaction (PySpark DDL; importable without
PySpark)."""

SCHEMA = "partition int, transaction_id long, header int, client_id int, generation int, sequence int, data binary"
