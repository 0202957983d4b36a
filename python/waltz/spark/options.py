"""The `waltz` source's options, parsed once on the driver into plain values (they travel to
executors pickled). Offsets follow Spark's Kafka source: an offset is the next transaction id to
read, so a range is `[start, end)` (start == end: empty, start > end: an error); in JSON, -2
means earliest and -1 latest."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import warnings
from collections.abc import Collection, Mapping

EARLIEST, LATEST = -2, -1
MAX_BATCH_BYTES = (1 << 31) - 1
"""Arrow's binary column has 32-bit offsets: a batch's data must fit them."""

log = logging.getLogger("waltz.spark")

OffsetSpec = str | dict[int, int]
""""earliest", "latest", or partition → offset (which may be EARLIEST or LATEST)."""


class OptionError(ValueError):
    """An option of the `waltz` data source is missing or malformed."""


class DataLossError(OptionError):
    """startingOffsets asks for transactions no directory (or replica) holds any more, and
    failOnDataLoss is true."""


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name}={value!r}: expected true or false")


def _positive(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise OptionError(f"option {name}={value!r}: expected a positive integer") from None
    if n <= 0:
        raise OptionError(f"option {name}={value!r}: expected a positive integer")
    return n


def _batch_bytes(value: str) -> int:
    n = _positive("maxBytesPerBatch", value)
    if n > MAX_BATCH_BYTES:
        raise OptionError(f"option maxBytesPerBatch={value!r}: at most {MAX_BATCH_BYTES} (Arrow's 32-bit offsets)")
    return n


def parse_offsets(name: str, value: str) -> OffsetSpec:
    v = value.strip()
    if v in ("earliest", "latest"):
        return v
    try:
        d = json.loads(v)
    except json.JSONDecodeError:
        raise OptionError(
            f'option {name}={value!r}: expected earliest, latest or JSON such as {{"0": 42, "1": -2}}'
        ) from None
    if not isinstance(d, dict):
        raise OptionError(f"option {name}={value!r}: the JSON must be an object of partition → transaction id")
    out: dict[int, int] = {}
    for k, off in d.items():
        try:
            p = int(k)
        except ValueError:
            raise OptionError(f"option {name}: partition {k!r} is not a number") from None
        if not isinstance(off, int) or isinstance(off, bool) or off < EARLIEST:
            raise OptionError(
                f"option {name}: partition {p}: offset {off!r} must be a transaction id, -2 (earliest) or -1 (latest)"
            )
        out[p] = off
    return out


def parse_partitions(value: str) -> tuple[int, ...]:
    try:
        ids = tuple(sorted({int(x) for x in value.replace(" ", "").split(",") if x}))
    except ValueError:
        raise OptionError(f"option partitions={value!r}: expected comma-separated partition ids") from None
    if not ids or ids[0] < 0:
        raise OptionError(f"option partitions={value!r}: expected comma-separated non-negative partition ids")
    return ids


@dataclasses.dataclass(frozen=True)
class Options:
    paths: tuple[str, ...] = ()
    """Storage directories (a node's whole directory, or copies holding some partitions)."""
    metadata: str | None = None
    """The cluster's metadata URL, when the cluster is to be asked (bounds, streaming)."""
    cluster: str = "default"
    """The cluster's name in the metadata store, as `ClientConfig.cluster` and `waltz --cluster`."""
    partitions: tuple[int, ...] | None = None
    starting: OffsetSpec = "earliest"
    ending: OffsetSpec = "latest"
    committed_only: bool = True
    min_partitions: int = 1
    """At least this many input partitions: large partitions are split by id ranges."""
    max_per_split: int = 1_000_000
    batch_bytes: int = 1 << 20
    """Transaction data per Arrow batch read from files: small enough that a batch is still in
    the CPU's cache when the worker sends it to the JVM (see docs/performance.md)."""
    max_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    """An explicit startingOffsets below the first id held fails the read (false: starts at the
    first id held, with a warning)."""
    tls: tuple[str, str, str] | None = None
    timeout: float = 30.0

    @staticmethod
    def parse(options: Mapping[str, str], *, streaming: bool = False) -> Options:
        check_names(options, NAMES)
        o = {k.lower(): v for k, v in options.items()}
        o = _deprecated_spellings(o)
        raw_paths = o.get("paths") or o.get("path") or ""
        paths = _paths(raw_paths)
        sources = [n for n in ("metadata", "zookeeper") if o.get(n)]
        if len(sources) > 1:
            raise OptionError(f"give only one of metadata and zookeeper (got {', '.join(sources)})")
        metadata = o.get("metadata")
        if o.get("zookeeper"):
            metadata = "zk://" + o["zookeeper"].removeprefix("zk://")
        if metadata is not None and not _is_metadata_url(metadata):
            raise OptionError(
                f"option metadata={metadata!r}: expected a metadata URL, zk://host:port[/chroot] or "
                "embedded:/path/metadata.db"
            )
        if streaming and metadata is None:
            raise OptionError(
                "streams and writes need a live cluster: set option metadata (a metadata URL) or zookeeper (host:port)"
            )
        if streaming and paths:
            raise OptionError(
                f"option path={raw_paths!r} applies to batch reads only: a stream reads the live cluster, not files"
            )
        if not streaming and not paths and metadata is None:
            raise OptionError(
                "set path (storage directories, comma-separated) or metadata (the cluster's metadata URL) to read from"
            )
        tls_values = [o.get(n) for n in ("tlsca", "tlscert", "tlskey")]
        if any(tls_values) and not all(tls_values):
            raise OptionError("mutual TLS needs all of tlsCa, tlsCert and tlsKey")
        ending = parse_offsets("endingOffsets", o.get("endingoffsets", "latest"))
        if streaming and "endingoffsets" in o:
            raise OptionError("endingOffsets applies to batch reads only")
        try:
            timeout = float(o.get("timeout", "30"))
        except ValueError:
            raise OptionError(f"option timeout={o['timeout']!r}: expected seconds") from None
        return Options(
            paths=paths,
            metadata=metadata,
            cluster=o.get("cluster", "default"),
            partitions=parse_partitions(o["partitions"]) if o.get("partitions") else None,
            starting=parse_offsets("startingOffsets", o.get("startingoffsets", "latest" if streaming else "earliest")),
            ending=ending,
            committed_only=_bool("committedOnly", o.get("committedonly", "true")),
            min_partitions=_positive("minPartitions", o["minpartitions"])
            if "minpartitions" in o
            else (os.cpu_count() or 1),
            max_per_split=_positive("maxTransactionsPerSplit", o.get("maxtransactionspersplit", "1000000")),
            batch_bytes=_batch_bytes(o.get("maxbytesperbatch", str(Options.batch_bytes))),
            max_per_trigger=_positive("maxTransactionsPerTrigger", o["maxtransactionspertrigger"])
            if "maxtransactionspertrigger" in o
            else None,
            fail_on_data_loss=_bool("failOnDataLoss", o.get("failondataloss", "true")),
            tls=(str(tls_values[0]), str(tls_values[1]), str(tls_values[2])) if all(tls_values) else None,
            timeout=timeout,
        )

    def wants(self, partition: int) -> bool:
        return self.partitions is None or partition in self.partitions


NAMES = (
    "path",
    "paths",
    "metadata",
    "zookeeper",
    "cluster",
    "partitions",
    "startingOffsets",
    "endingOffsets",
    "committedOnly",
    "minPartitions",
    "maxTransactionsPerSplit",
    "maxTransactionsPerTrigger",
    "maxBytesPerBatch",
    "failOnDataLoss",
    "tlsCa",
    "tlsCert",
    "tlsKey",
    "timeout",
)
"""Every option of a read, as docs/spark.md spells it (Spark matches them ignoring case)."""

DEPRECATED = {"clustername": "cluster"}
"""Old spellings still taken, with a warning. `cluster` used to be the metadata URL: a value
that is one still works that way (a cluster's name is never a URL), with a warning."""

_HINTS = {"kafka.bootstrap.servers": "metadata", "subscribe": "partitions", "assign": "partitions"}
"""Names from Spark's Kafka source whose counterpart is not spelled alike."""


def check_names(options: Mapping[str, str], names: Collection[str]) -> None:
    """Refuses an option not in `names`, echoed as given, with the nearest valid name."""
    canonical = {n.lower(): n for n in names} | {old: old for old in DEPRECATED if DEPRECATED[old] in names}
    unknown = [k for k in options if k.lower() not in canonical]
    if not unknown:
        return
    shown = []
    for k in unknown:
        near = _HINTS.get(k.lower()) or next(
            iter(difflib.get_close_matches(k.lower(), [n.lower() for n in names], n=1)), None
        )
        shown.append(f"{k!r}" + (f" (did you mean {canonical[near.lower()]!r}?)" if near else ""))
    raise OptionError(f"unknown option {', '.join(shown)} of the waltz source; it takes {', '.join(names)}")


def _is_metadata_url(value: str) -> bool:
    return value.startswith(("zk://", "embedded:"))


def _deprecated_spellings(o: dict[str, str]) -> dict[str, str]:
    """`o` (lower-case keys) with the old spellings turned into today's, each with a warning."""
    o = dict(o)
    cluster = o.get("cluster")
    if cluster is not None and _is_metadata_url(cluster):
        if o.get("metadata") or o.get("zookeeper"):
            raise OptionError(
                f"option cluster={cluster!r} is a metadata URL, and metadata or zookeeper is set too: "
                "cluster is the cluster's name (option metadata takes the URL)"
            )
        _deprecation(
            "option cluster as the metadata URL is deprecated: use option metadata for the URL "
            "(cluster is now the cluster's name, as in ClientConfig and `waltz --cluster`)"
        )
        o["metadata"] = o.pop("cluster")
    for old, new in DEPRECATED.items():
        if old in o:
            if new in o:
                raise OptionError(f"give only one of {new} and its deprecated spelling clusterName")
            _deprecation(f"option clusterName is deprecated: use option {new} (the cluster's name)")
            o[new] = o.pop(old)
    return o


def _deprecation(message: str) -> None:
    # Spark's Python workers do not show warnings: the log says it too (driver's log).
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    log.warning("waltz: %s", message)


def _paths(value: str) -> tuple[str, ...]:
    v = value.strip()
    if v.startswith("["):
        try:
            items = json.loads(v)
        except json.JSONDecodeError:
            raise OptionError(f"option path={value!r}: malformed JSON list") from None
        return tuple(str(i) for i in items)
    return tuple(p.strip() for p in v.split(",") if p.strip())


def _requested(spec: OffsetSpec, partition: int, missing: int) -> int:
    """What `spec` asks of `partition`: EARLIEST, LATEST or a transaction id."""
    if spec == "earliest":
        return EARLIEST
    if spec == "latest":
        return LATEST
    assert isinstance(spec, dict)
    return spec.get(partition, missing)


def resolve(spec: OffsetSpec, partition: int, earliest: int, latest: int, *, missing: int) -> int:
    """The offset `spec` gives `partition` within `[earliest, latest]`: explicit ids outside it
    are clamped (committed data never extends past `latest`); a partition the JSON leaves out
    gets `missing` (EARLIEST or LATEST)."""
    off = _requested(spec, partition, missing)
    if off == EARLIEST:
        return earliest
    if off == LATEST:
        return latest
    return min(max(off, earliest), latest)


def check_partitions(name: str, spec: OffsetSpec, read: Collection[int]) -> None:
    """A JSON offset for a partition that is not read is a typo or a stale plan, never meant."""
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(read))
        if unknown:
            reading = ", ".join(str(p) for p in sorted(read)) or "none"
            raise OptionError(f"option {name}: partition {unknown[0]} is not among the partitions read ({reading})")


def _shown(requested: int, value: int) -> str:
    return {EARLIEST: f"earliest ({value})", LATEST: f"latest ({value})"}.get(requested, str(requested))


def select(
    starting: OffsetSpec,
    ending: OffsetSpec,
    partition: int,
    earliest: int,
    latest: int,
    *,
    fail_on_data_loss: bool,
    holder: str = "any directory",
) -> tuple[int, int]:
    """`[start, end)` of `partition` the offsets select within `[earliest, latest]` (`holder`
    holds `earliest..latest-1`). A start past `latest` reads nothing; a start below `earliest`
    asks for lost transactions (see `failOnDataLoss`); a start after the end is an error, as in
    Kafka's source: start == end is the empty range (say, starting at latest)."""
    start_req, end_req = _requested(starting, partition, EARLIEST), _requested(ending, partition, LATEST)
    if start_req >= 0 and end_req >= 0 and start_req > end_req:
        raise OptionError(_after(partition, str(start_req), str(end_req)))
    upto = min(earliest, end_req) if end_req >= 0 else earliest
    if 0 <= start_req < upto:
        _lost(partition, start_req, upto - 1, earliest, holder, fail_on_data_loss)
    start = resolve(starting, partition, earliest, latest, missing=EARLIEST)
    end = resolve(ending, partition, earliest, latest, missing=LATEST)
    if start > end:
        raise OptionError(_after(partition, _shown(start_req, start), _shown(end_req, end)))
    return start, end


def _after(partition: int, start: str, end: str) -> str:
    return (
        f"partition {partition}: startingOffsets {start} is after endingOffsets {end} "
        "(a range is [start, end): start == end reads nothing, start > end is an error)"
    )


def _lost(partition: int, first: int, last: int, earliest: int, holder: str, fail: bool) -> None:
    lost = f"transactions {first}..{last} of partition {partition} are no longer in {holder}"
    if fail:
        raise DataLossError(
            f"option startingOffsets: {lost} (the first held is {earliest}): "
            f"start at {earliest} or later, or set failOnDataLoss=false to skip them"
        )
    log.warning("waltz: option startingOffsets: %s: starting at %d (failOnDataLoss=false)", lost, earliest)
