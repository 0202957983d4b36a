"""Harnesses for the replicated stores `benches/cluster.py` compares Waltz with (etcd, ZooKeeper),
and the one closed-loop load generator that drives all of them (`loadgen`)."""
