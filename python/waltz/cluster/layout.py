"""Where each piece of cluster state lives in the metadata tree, and how it is encoded.

Every entry holds UTF-8 JSON with sorted keys (readable with `zkCli.sh get`); the spec's binary
encodings are replaced by JSON because no hot path reads them. See docs/internals.md for the
whole tree.
"""

from __future__ import annotations

import json
from typing import Any

from waltz.cluster.store import join

DEFAULT_ROOT = "/waltz"
FORMAT = 1


def cluster_root(name: str, base: str = DEFAULT_ROOT) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bad cluster name {name!r}: one path segment, not empty")
    return join(base, name)


class Paths:
    """The paths of one cluster, rooted at `root` (e.g. `/waltz/prod`)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.store = join(root, "store")
        self.partitions = join(self.store, "partition")
        self.replica_assignment = join(self.store, "assignment")
        self.groups = join(self.store, "group")
        self.connections = join(self.store, "connection")
        self.servers = join(root, "servers")
        self.assignment = join(root, "assignment")
        self.manager = join(root, "manager")
        self.counters = join(root, "counters")
        self.retention = join(root, "retention")
        self.clients = join(root, "clients")
        """Client ids bound to the certificate of the connection they were allocated to."""
        self.sink = join(root, "sink")
        """The Spark streaming sink's task entries (`waltz.spark.stream_sink`)."""

    def client_readable(self, path: str) -> bool:
        """What a client reads (per-role ZooKeeper ACLs): the cluster's info, the servers'
        registrations and the partition assignment; not store sessions, counters, replica
        placement nor anything else only servers and operators use."""
        return path in (self.root, self.store, self.servers, self.assignment) or path.startswith(self.servers + "/")

    def partition(self, partition_id: int) -> str:
        return join(self.partitions, partition_id)

    def server(self, server_id: int) -> str:
        return join(self.servers, server_id)

    def client(self, client_id: int) -> str:
        return join(self.clients, client_id)

    def counter(self, kind: str) -> str:
        return join(self.counters, kind)


def encode(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes, path: str) -> Any:
    from waltz import errors

    try:
        return json.loads(data.decode()) if data else None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise errors.MetadataError(f"{path}: not a Waltz metadata entry ({e})") from e
