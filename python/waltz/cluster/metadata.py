"""Typed access to one cluster's metadata: cluster info, partition metadata, replica assignment,
storage groups and admin endpoints, server registrations, the partition-to-server assignment and
id counters. Every multi-entry change is one metadata transaction guarded by versions, so two
administrators racing cannot leave a half-applied change."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from waltz import clock, errors
from waltz.cluster.layout import FORMAT, Paths, decode, encode
from waltz.cluster.store import Create, DataWatch, MetadataStore, SetData, Stat

UNRESOLVED = -1
"""ReplicaState.closing_high_water_mark while the session it belongs to is open."""


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    name: str
    cluster_key: uuid.UUID
    partitions: int
    replicas: int
    created_ms: int


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    session_id: int
    """The store session this replica is engaged in."""
    closing_high_water_mark: int = UNRESOLVED


@dataclasses.dataclass(frozen=True)
class PartitionMetadata:
    generation: int = 0
    session_id: int = -1
    replicas: dict[str, ReplicaState] = dataclasses.field(default_factory=dict)
    """Replica (storage node `host:port`) → its state."""
    members: tuple[str, ...] = ()
    """The write set of the last session that recorded clean replicas: the electorate of the
    next recovery vote (empty before the first)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "session_id": self.session_id,
            "replicas": {k: dataclasses.asdict(v) for k, v in sorted(self.replicas.items())},
            "members": list(self.members),
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> PartitionMetadata:
        return PartitionMetadata(
            generation=int(d["generation"]),
            session_id=int(d["session_id"]),
            replicas={
                k: ReplicaState(int(v["session_id"]), int(v["closing_high_water_mark"]))
                for k, v in d["replicas"].items()
            },
            members=tuple(str(m) for m in d.get("members", ())),
        )


@dataclasses.dataclass(frozen=True)
class StorageNodeInfo:
    address: str
    """`host:port` of the storage protocol: the replica's identity."""
    admin_port: int
    group: int
    partitions: tuple[int, ...]

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def admin_address(self) -> str:
        return f"{self.host}:{self.admin_port}"


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    server_id: int
    host: str
    port: int
    preferred: tuple[int, ...] = ()
    serving: dict[int, int] = dataclasses.field(default_factory=dict)
    """Partition → generation the server is serving right now (it reports this itself)."""
    started_ms: int = 0
    session: int = 0
    """The metadata session owning the registration (from the entry's stat, not its data): a
    server that lost its session and registered again is a new incarnation."""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        return {
            "server_id": self.server_id,
            "host": self.host,
            "port": self.port,
            "preferred": list(self.preferred),
            "serving": {str(k): v for k, v in sorted(self.serving.items())},
            "started_ms": self.started_ms,
        }

    @staticmethod
    def from_json(d: dict[str, Any], session: int = 0) -> ServerInfo:
        return ServerInfo(
            server_id=int(d["server_id"]),
            host=str(d["host"]),
            port=int(d["port"]),
            preferred=tuple(int(p) for p in d.get("preferred", ())),
            serving={int(k): int(v) for k, v in d.get("serving", {}).items()},
            started_ms=int(d.get("started_ms", 0)),
            session=session,
        )


@dataclasses.dataclass(frozen=True)
class PartitionAssignment:
    server: int | None
    """Server id, or None while unassigned (no live server, or being handed over)."""
    generation: int
    session: int = 0
    """The owner's metadata session when it was given the partition: after losing its session
    a server serves nothing until the leader assigns again to its new incarnation."""


Assignment = dict[int, PartitionAssignment]


def assignment_to_json(a: Assignment) -> dict[str, Any]:
    return {
        "partitions": {
            str(p): {"server": x.server, "generation": x.generation, "session": x.session} for p, x in sorted(a.items())
        }
    }


def assignment_from_json(d: dict[str, Any]) -> Assignment:
    return {
        int(p): PartitionAssignment(v["server"], int(v["generation"]), int(v.get("session", 0)))
        for p, v in d["partitions"].items()
    }


def parse_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ClusterError(f"bad storage node address {address!r}: expected host:port")
    return f"{host}:{int(port)}"


class ClusterMetadata:
    """One cluster's metadata, under `root` in `store`."""

    def __init__(self, store: MetadataStore, root: str) -> None:
        self.store = store
        self.paths = Paths(root)

    # -- the cluster -----------------------------------------------------------------------
    def exists(self) -> bool:
        return self.store.exists(self.paths.store) is not None

    def create(
        self, name: str, partitions: int, replicas: int, cluster_key: uuid.UUID | None = None
    ) -> tuple[ClusterInfo, bool]:
        """Creates the cluster (with `cluster_key`, or a new one) with everything under it in one
        transaction. Returns (info, created); an existing cluster with the same shape (and key,
        when one is given) is returned as is. A deployment names the key so that its storage
        nodes, configured before the cluster exists, can create their directories with it."""
        if partitions < 1 or replicas < 1:
            raise errors.ClusterError("a cluster needs at least one partition and one replica")
        if self.exists():
            info = self.info()
            if (info.partitions, info.replicas) != (partitions, replicas):
                raise errors.ClusterError(
                    f"cluster {info.name} exists with {info.partitions} partitions and {info.replicas} replicas; "
                    f"not changing it to {partitions} and {replicas}"
                )
            if cluster_key is not None and info.cluster_key != cluster_key:
                raise errors.ClusterError(f"cluster {info.name} exists with another cluster key than the one given")
            return info, False
        info = ClusterInfo(name, cluster_key or uuid.uuid4(), partitions, replicas, clock.now_ms())
        p = self.paths
        self.store.ensure_path(p.root)
        ops: list[Any] = [
            Create(
                p.store,
                encode(
                    {
                        "format": FORMAT,
                        "name": name,
                        "cluster_key": str(info.cluster_key),
                        "partitions": partitions,
                        "replicas": replicas,
                        "created_ms": info.created_ms,
                    }
                ),
            ),
            Create(p.partitions),
            *[Create(p.partition(i), encode(PartitionMetadata().to_json())) for i in range(partitions)],
            Create(p.replica_assignment, encode({"replicas": replicas, "nodes": {}})),
            Create(p.groups, encode({})),
            Create(p.connections, encode({})),
            Create(p.servers),
            Create(
                p.assignment, encode(assignment_to_json({i: PartitionAssignment(None, 0) for i in range(partitions)}))
            ),
            Create(p.manager),
            Create(p.counters),
            Create(p.counter("client"), encode(0)),
            Create(p.counter("server"), encode(0)),
        ]
        try:
            self.store.transaction(ops)
        except errors.MetadataTransactionError as e:
            if isinstance(e.cause, errors.MetadataExistsError) and e.index == 0:
                return self.create(name, partitions, replicas, cluster_key)  # someone else created it just now
            raise
        return info, True

    def set_role_acls(self, secrets: Mapping[str, str]) -> int:
        """Per-role ZooKeeper access lists on the whole cluster tree (`secrets`: the server, admin
        and client secrets, each its digest user's password): servers and admins may do
        everything, only admins change access lists, clients read `Paths.client_readable` only.
        Entries created later take their parent's list. Returns how many entries it set."""
        return self.store.set_role_acls(self.paths.root, self.paths.client_readable, secrets)

    def info(self) -> ClusterInfo:
        d = self._read(self.paths.store)[0]
        return ClusterInfo(
            d["name"], uuid.UUID(d["cluster_key"]), int(d["partitions"]), int(d["replicas"]), int(d["created_ms"])
        )

    def delete(self) -> None:
        self.store.delete(self.paths.root, recursive=True)

    def _read(self, path: str, watch: Any = None) -> tuple[Any, Stat]:
        try:
            data, stat = self.store.get(path, watch=watch)
        except errors.MetadataNotFoundError as e:
            if path != self.paths.store and self.exists():
                raise
            raise errors.ClusterError(f"no cluster at {self.paths.root} in {self.store.description}") from e
        return decode(data, path), stat

    # -- partition metadata (store sessions; written by servers' recovery) -------------------
    def partition_metadata(self, partition_id: int) -> tuple[PartitionMetadata, int]:
        self._check_partition(partition_id)
        d, stat = self._read(self.paths.partition(partition_id))
        return PartitionMetadata.from_json(d), stat.version

    def set_partition_metadata(self, partition_id: int, meta: PartitionMetadata, version: int) -> int:
        """Compare-and-set; raises `MetadataVersionError` if someone wrote it since `version`."""
        return self.store.set(self.paths.partition(partition_id), encode(meta.to_json()), version=version).version

    def _check_partition(self, partition_id: int) -> None:
        n = self.info().partitions
        if not 0 <= partition_id < n:
            raise errors.ClusterError(
                f"partition {partition_id} does not exist (the cluster has partitions 0..{n - 1})"
            )

    # -- storage nodes: replica assignment, groups, admin endpoints ---------------------------
    def storage_nodes(self) -> list[StorageNodeInfo]:
        (ra, _), (groups, _), (conns, _) = self._storage_state()
        return [
            StorageNodeInfo(a, int(conns.get(a, 0)), int(groups.get(a, 0)), tuple(sorted(ra["nodes"].get(a, []))))
            for a in sorted(set(ra["nodes"]) | set(groups) | set(conns))
        ]

    def storage_node(self, address: str) -> StorageNodeInfo:
        address = parse_address(address)
        for n in self.storage_nodes():
            if n.address == address:
                return n
        raise errors.ClusterError(
            f"storage node {address} is not part of the cluster (add it with `waltz storage add-node`)"
        )

    def replicas_of(self, partition_id: int) -> list[StorageNodeInfo]:
        return [n for n in self.storage_nodes() if partition_id in n.partitions]

    def _storage_state(self) -> tuple[tuple[Any, Stat], tuple[Any, Stat], tuple[Any, Stat]]:
        p = self.paths
        return self._read(p.replica_assignment), self._read(p.groups), self._read(p.connections)

    def _change_storage(self, change: Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], bool]) -> bool:
        """Applies `change(assignment, groups, connections)` to copies and writes all three in one
        versioned transaction, retrying on a concurrent change. Returns what `change` returned
        (False: nothing to write)."""
        p = self.paths
        for _ in range(50):
            (ra, ra_stat), (groups, g_stat), (conns, c_stat) = self._storage_state()
            if not change(ra, groups, conns):
                return False
            try:
                self.store.transaction(
                    [
                        SetData(p.replica_assignment, encode(ra), ra_stat.version),
                        SetData(p.groups, encode(groups), g_stat.version),
                        SetData(p.connections, encode(conns), c_stat.version),
                    ]
                )
                return True
            except errors.MetadataTransactionError as e:
                if isinstance(e.cause, errors.MetadataVersionError):
                    continue
                raise
        raise errors.ClusterError("storage metadata keeps changing under us; try again")

    def add_storage_node(self, address: str, admin_port: int, group: int = 0) -> bool:
        """Adds (or, idempotently, confirms) a storage node. Returns False when nothing changed."""
        address = parse_address(address)
        if not 0 < admin_port < 65536:
            raise errors.ClusterError(f"bad admin port {admin_port}")

        def change(ra: dict[str, Any], groups: dict[str, Any], conns: dict[str, Any]) -> bool:
            if address in conns:
                if (conns[address], groups.get(address)) == (admin_port, group):
                    return False
                raise errors.ClusterError(
                    f"storage node {address} is already in the cluster with admin port {conns[address]} and group "
                    f"{groups.get(address)}; remove it first to change them"
                )
            conns[address] = admin_port
            groups[address] = group
            ra["nodes"].setdefault(address, [])
            return True

        return self._change_storage(change)

    def remove_storage_node(self, address: str) -> bool:
        address = parse_address(address)

        def change(ra: dict[str, Any], groups: dict[str, Any], conns: dict[str, Any]) -> bool:
            if address not in conns and address not in ra["nodes"]:
                return False
            if ra["nodes"].get(address):
                raise errors.ClusterError(
                    f"storage node {address} still holds partitions {sorted(ra['nodes'][address])}; unassign them first"
                )
            conns.pop(address, None)
            groups.pop(address, None)
            ra["nodes"].pop(address, None)
            return True

        return self._change_storage(change)

    def assign_partition(self, address: str, partition_id: int) -> bool:
        address = parse_address(address)
        self._check_partition(partition_id)

        def change(ra: dict[str, Any], groups: dict[str, Any], conns: dict[str, Any]) -> bool:
            if address not in conns:
                raise errors.ClusterError(
                    f"storage node {address} is not part of the cluster (add it with `waltz storage add-node`)"
                )
            held = ra["nodes"][address]
            if partition_id in held:
                return False
            held.append(partition_id)
            held.sort()
            return True

        return self._change_storage(change)

    def unassign_partition(self, address: str, partition_id: int) -> bool:
        address = parse_address(address)
        self._check_partition(partition_id)

        def change(ra: dict[str, Any], groups: dict[str, Any], conns: dict[str, Any]) -> bool:
            held = ra["nodes"].get(address, [])
            if partition_id not in held:
                return False
            held.remove(partition_id)
            return True

        return self._change_storage(change)

    def auto_assign(self, group: int) -> dict[str, list[int]]:
        """Gives every partition without a replica in the group one, on the group's least loaded
        node. Never removes a placement: unassigning several replicas at once would silently
        leave partitions with fewer copies (nodes added without `--group` all sit in group 0),
        and a replica is moved one at a time, after the new one is filled (docs/operations.md).
        Returns the group's placement."""
        info = self.info()
        result: dict[str, list[int]] = {}

        def change(ra: dict[str, Any], groups: dict[str, Any], conns: dict[str, Any]) -> bool:
            members = sorted(a for a, g in groups.items() if g == group)
            if not members:
                raise errors.ClusterError(f"group {group} has no storage nodes")
            placed = {a: [p for p in ra["nodes"].get(a, []) if p < info.partitions] for a in members}
            covered = {p for ps in placed.values() for p in ps}
            added = False
            for p in range(info.partitions):
                if p not in covered:
                    a = min(members, key=lambda m: (len(placed[m]), m))
                    placed[a].append(p)
                    added = True
            result.clear()
            result.update({a: sorted(v) for a, v in placed.items()})
            if not added:
                return False
            for a in members:
                ra["nodes"][a] = sorted(set(ra["nodes"].get(a, [])) | set(result[a]))
            return True

        self._change_storage(change)
        return result

    # -- servers and the partition-to-server assignment --------------------------------------
    def servers(self) -> list[ServerInfo]:
        out = []
        try:
            names = self.store.children(self.paths.servers)
        except errors.MetadataNotFoundError as e:
            raise errors.ClusterError(f"no cluster at {self.paths.root} in {self.store.description}") from e
        for name in names:
            try:
                data, stat = self.store.get(self.paths.server(int(name)))
            except (errors.MetadataNotFoundError, ValueError):
                continue  # left while we listed
            out.append(ServerInfo.from_json(decode(data, self.paths.server(int(name))), stat.ephemeral_owner))
        return out

    def partition_server(self, partition_id: int) -> tuple[ServerInfo, int]:
        """The registered server assigned the partition and its generation; raises
        `PartitionNotServedError` when there is none."""
        assignment, _ = self.assignment()
        a = assignment.get(partition_id)
        if a is None or a.server is None:
            raise errors.PartitionNotServedError(f"partition {partition_id} is not assigned to a server")
        for s in self.servers():
            if s.server_id == a.server:
                return s, a.generation
        raise errors.PartitionNotServedError(f"partition {partition_id}'s server {a.server} is not registered")

    def assignment(self, watch: Any = None) -> tuple[Assignment, int]:
        d, stat = self._read(self.paths.assignment, watch)
        return assignment_from_json(d), stat.version

    def set_assignment(self, assignment: Assignment, version: int) -> int:
        return self.store.set(self.paths.assignment, encode(assignment_to_json(assignment)), version=version).version

    def watch_assignment(self, fn: Callable[[Assignment], None]) -> DataWatch:
        """Calls `fn(assignment)` now and after every change (an empty dict while the cluster is absent)."""

        def on_data(data: bytes | None, _stat: Stat | None) -> None:
            fn(assignment_from_json(decode(data, self.paths.assignment)) if data else {})

        return DataWatch(self.store, self.paths.assignment, on_data)

    def bind_client_id(self, client_id: int, certificate_sha256: str) -> None:
        """Records that `client_id` was allocated over a connection with this certificate: only
        a connection with the same certificate may mount it."""
        self.store.create(
            self.paths.client(client_id), encode({"certificate_sha256": certificate_sha256}), make_parents=True
        )

    def client_id_binding(self, client_id: int) -> str | None:
        """The certificate digest `client_id` is bound to, or None (a fixed id, or one allocated
        without TLS)."""
        try:
            data, _ = self.store.get(self.paths.client(client_id))
        except errors.MetadataNotFoundError:
            return None
        return str(decode(data, self.paths.client(client_id))["certificate_sha256"])

    def next_id(self, kind: str) -> int:
        """A new id for a client or a server: never handed out twice in this cluster."""
        if kind not in ("client", "server"):
            raise ValueError(kind)
        path = self.paths.counter(kind)
        issued: list[int] = []

        def bump(data: bytes) -> bytes:
            issued[:] = [int(decode(data, path)) + 1]
            return encode(issued[0])

        try:
            self.store.update(path, bump)
        except errors.MetadataNotFoundError as e:
            raise errors.ClusterError(f"no cluster at {self.paths.root} in {self.store.description}") from e
        return issued[0]


__all__ = [
    "UNRESOLVED",
    "Assignment",
    "ClusterInfo",
    "ClusterMetadata",
    "PartitionAssignment",
    "PartitionMetadata",
    "ReplicaState",
    "ServerInfo",
    "StorageNodeInfo",
]
