"""`waltz disk`: offline tools for a storage directory's files, used while no node runs on it.

`dump-control` and `dump-segment` decode one file as it is; `verify` checks a whole storage
directory: every segment and index, that segments chain, and every record read back through the
engine. Nothing here writes to the files (the engine is opened read-only).
"""

from __future__ import annotations

import datetime
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from waltz._extras import require

require("rich", "cli", "The waltz command")

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from waltz import errors
from waltz._native import Storage, inspect_control, inspect_segment
from waltz.cli.output import Failed, Output, pass_output, user_errors
from waltz.storage.scan import iter_scan

if TYPE_CHECKING:
    from waltz._native import _ControlReport, _ControlStruct, _RecordProblem, _SegmentReport

HEADER_LEN = 128
# Smaller partitions are read back in about a second: no progress bar for them.
PROGRESS_FROM_BYTES = 256 << 20

_json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
_max_record_option = click.option(
    "--max-record-size",
    type=click.IntRange(1, 1 << 30),
    default=16 << 20,
    show_default=True,
    help="The node's max_record_size: a record claiming more reads as damaged.",
)


@click.group()
def disk() -> None:
    """Inspect and verify storage files offline (no node running)."""


def _time(ms: int) -> str:
    try:
        t = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return str(ms)
    return f"{ms} ({t.isoformat(timespec='milliseconds')})"


def _struct(s: _ControlStruct) -> list[str]:
    return [
        f"{s['session_id']} / {s['low_water_mark']} / {s['local_low_water_mark']}",
        "ok" if s["checksum_ok"] else "BAD",
    ]


@disk.command("dump-control")
@click.argument("path", type=click.Path(path_type=pathlib.Path))
@_json_option
@pass_output
@user_errors
def dump_control(out: Output, path: pathlib.Path, as_json: bool) -> None:
    """Show a control file: PATH is a storage directory or its waltz-storage.ctl."""
    r = inspect_control(path)

    def human() -> None:
        out.kv(
            f"Control file {r['path']}",
            [
                ("format version", r["version"]),
                ("created", _time(r["creation_time_ms"])),
                ("cluster key", r["cluster_key"]),
                ("partition count", r["partition_count"]),
                ("file length", r["file_length"]),
                *(("problem", p) for p in r["problems"]),
            ],
        )
        out.table(
            "Partitions (struct: session id / low-water mark / local low-water mark)",
            ["partition", "stored id", "current", "struct 1", "checksum 1", "struct 2", "checksum 2"],
            [
                [
                    e["partition"],
                    e["stored_partition_id"],
                    e["current"] or "none",
                    *_struct(e["structs"][0]),
                    *_struct(e["structs"][1]),
                ]
                for e in r["partitions"]
            ],
        )

    out.emit(r, human)


def _torn_write(p: _RecordProblem, low_water_mark: int | None) -> bool:
    """A bad record of the last segment with valid records after it that recovery cuts as a torn
    write: unwritten space in the hole, nothing past the writer's unsynced bound, above the
    low-water mark (committed records are never cut so; docs/internals.md, "Torn writes with
    survivors")."""
    return p["may_be_torn_write"] and p["txid"] > (-1 if low_water_mark is None else low_water_mark)


def _record_problem(p: _RecordProblem, torn_write: bool = False) -> str:
    if p["torn_tail"]:
        return f"torn tail at offset {p['offset']} (transaction {p['txid']}): {p['reason']}; nothing valid follows"
    if torn_write:
        return (
            f"torn write at offset {p['offset']} (transaction {p['txid']}): {p['reason']}; valid records follow "
            f"from offset {p['next_valid_offset']}, after unwritten space and within what the writer leaves unsynced: "
            "never synced, cut by the next writable open"
        )
    return (
        f"corruption at offset {p['offset']} (transaction {p['txid']}): {p['reason']}; "
        f"a valid record follows at offset {p['next_valid_offset']}"
    )


def _header_problems(r: _SegmentReport) -> list[str]:
    h = r["header"]
    out = []
    if h["first_txid"] != r["name_txid"]:
        out.append(f"header says first transaction {h['first_txid']}, the file name says {r['name_txid']}")
    if not h["reserved_zero"]:
        out.append("reserved header bytes 40..128 are not zero")
    return out


def _index_findings(r: _SegmentReport, last: bool) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a segment's index. Entries missing at the end are the normal
    state of an index not yet checkpointed; past the valid records, or an incomplete entry, they
    are what a crash leaves in the last segment (recovery cuts them) and damage in a sealed one."""
    ix = r["index"]
    if ix is None:
        return [], ["no index file (the next writable open rebuilds it)"]
    problems: list[str] = []
    warnings: list[str] = []
    if not ix["header_matches"]:
        problems.append("index header differs from the data file's")
    if ix["mismatch"] is not None:
        pos, found, real = ix["mismatch"]
        problems.append(
            f"index entry {pos} (offset {HEADER_LEN + 8 * pos} of the index) says {found}, "
            f"the record is at offset {real}"
        )
    tail = warnings if last else problems
    # Entries past a bad record are for records the walk could not reach: part of that damage.
    if ix["extra_entries"] and r["problem"] is None:
        tail.append(f"index holds {ix['entries']} entries for {r['record_count']} valid records")
    if ix["partial_bytes"]:
        tail.append(f"index ends with {ix['partial_bytes']} bytes of an incomplete entry")
    return problems, warnings


@disk.command("dump-segment")
@click.argument("path", type=click.Path(path_type=pathlib.Path))
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True, help="How many records to list.")
@_max_record_option
@_json_option
@pass_output
@user_errors
def dump_segment(out: Output, path: pathlib.Path, limit: int, max_record_size: int, as_json: bool) -> None:
    """Show a segment data file (<first id>.seg): header, records, damage, and its index."""
    r = inspect_segment(path, limit, max_record_size=max_record_size)

    def human() -> None:
        h = r["header"]
        span = "none" if r["first_txid"] is None else f"{r['first_txid']}..{r['last_txid']}"
        rows: list[tuple[str, Any]] = [
            ("format version", h["version"]),
            ("created", _time(h["creation_time_ms"])),
            ("cluster key", h["cluster_key"]),
            ("partition id", h["partition_id"]),
            ("first transaction id", h["first_txid"]),
            ("file length", r["file_length"]),
            ("records", r["record_count"]),
            ("transaction ids", span),
            ("valid records end at", r["valid_end"]),
            *(
                (("preallocated (zeros after the records)", r["preallocated_bytes"]),)
                if r["preallocated_bytes"]
                else ()
            ),
            *(("problem", p) for p in _header_problems(r)),
        ]
        if r["problem"] is not None:
            rows.append(("problem", _record_problem(r["problem"])))
        out.kv(f"Segment {r['path']}", rows)
        ix = r["index"]
        if ix is None:
            out.line("No index file.")
        else:
            problems, warnings = _index_findings(r, last=True)
            out.kv(
                f"Index {ix['path']}",
                [
                    ("header matches", "yes" if ix["header_matches"] else "NO"),
                    ("entries", ix["entries"]),
                    ("file length", ix["file_length"]),
                    *(("problem", p) for p in problems + warnings),
                ],
            )
        shown = r["records"]
        if not shown:
            return
        out.table(
            f"Records (first {len(shown)} of {r['record_count']})",
            ["offset", "txid", "client", "gen", "partition", "seq", "header", "length"],
            [
                [
                    x["offset"],
                    x["txid"],
                    x["client_id"],
                    x["generation"],
                    x["partition_id"],
                    x["sequence"],
                    x["header"],
                    x["data_length"],
                ]
                for x in shown
            ],
        )

    out.emit(r, human)


@dataclass
class _Row:
    """One line of the verify table: the control file or a partition."""

    name: str
    partition: int | None = None
    segments: int | None = None
    bytes: int | None = None
    records: int | None = None
    first_txid: int | None = None
    max_txid: int | None = None
    low_water_mark: int | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def result(self) -> str:
        return "FAIL" if self.problems else "warn" if self.warnings else "ok"

    def document(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "result": self.result.lower(),
            "segments": self.segments,
            "bytes": self.bytes,
            "records": self.records,
            "first_txid": self.first_txid,
            "max_txid": self.max_txid,
            "low_water_mark": self.low_water_mark,
            "problems": self.problems,
            "warnings": self.warnings,
        }


def _check_control(ctl: _ControlReport) -> tuple[_Row, dict[int, int]]:
    """The control file's row and each partition's current low-water mark."""
    row = _Row("control", problems=list(ctl["problems"]))
    marks = {}
    for e in ctl["partitions"]:
        pid = e["partition"]
        bad = [i + 1 for i, s in enumerate(e["structs"]) if not s["checksum_ok"]]
        if e["stored_partition_id"] != pid:
            row.problems.append(f"the entry of partition {pid} names partition {e['stored_partition_id']}")
        elif e["current"] is None:
            row.problems.append(f"partition {pid}: both info structs fail their checksum")
        else:
            marks[pid] = e["structs"][e["current"] - 1]["low_water_mark"]
            if bad:
                row.warnings.append(
                    f"partition {pid}: struct {bad[0]} fails its checksum, struct {e['current']} is used "
                    "(the last update is lost)"
                )
    return row, marks


def _check_files(part_dir: pathlib.Path, pid: int, cluster_key: str, max_record_size: int, row: _Row) -> bool:
    """Inspects every segment and index of a partition folder into `row` (segments, records,
    first and max id the files hold). Returns whether a truncation intent was found."""
    intent = False
    segs: dict[int, pathlib.Path] = {}
    idxs: set[str] = set()
    for f in sorted(part_dir.iterdir()):
        stem, ext = f.stem, f.suffix
        if ext in (".seg", ".idx") and len(stem) == 19 and stem.isdigit():
            if ext == ".seg":
                segs[int(stem)] = f
            else:
                idxs.add(stem)
        elif f.name == "truncate.intent":
            intent = True
            row.warnings.append("an interrupted truncation (truncate.intent) is finished on the next writable open")
        elif f.name.endswith(".tmp"):
            row.warnings.append(f"leftover temporary file {f.name} (deleted on the next writable open)")
        else:
            row.warnings.append(f"foreign file {f.name}")
    for stem in sorted(idxs - {p.stem for p in segs.values()}):
        row.warnings.append(f"leftover index {stem}.idx without a data file (deleted on the next writable open)")
    if not segs:
        row.problems.append("no segment files")
        return intent
    row.segments = len(segs)
    row.first_txid = min(segs)
    row.max_txid = row.first_txid - 1
    row.records = 0
    row.bytes = 0
    expected_first: int | None = None
    firsts = sorted(segs)
    for n, first in enumerate(firsts):
        rel = f"{pid}/{segs[first].name}"
        last = n == len(firsts) - 1
        # After a bad record (already reported) the count is short: the chain is not checked.
        if expected_first is not None and first != expected_first:
            row.problems.append(
                f"{rel} starts at transaction {first}, the previous segment ends at {expected_first - 1}"
            )
        try:
            r = inspect_segment(segs[first], 0, max_record_size=max_record_size)
        except errors.WaltzError as e:
            row.problems.append(f"{rel}: {e}")
            expected_first = None
            continue
        h = r["header"]
        found = _header_problems(r)
        if h["partition_id"] != pid:
            found.append(f"header names partition {h['partition_id']}")
        if h["cluster_key"] != cluster_key:
            found.append(f"header names cluster {h['cluster_key']}, the control file {cluster_key}")
        row.problems += [f"{rel}: {p}" for p in found]
        p = r["problem"]
        if p is not None:
            torn = last and (p["torn_tail"] or _torn_write(p, row.low_water_mark))
            (row.warnings if torn else row.problems).append(f"{rel}: {_record_problem(p, torn)}")
        problems, warnings = _index_findings(r, last)
        row.problems += [f"{rel}: {q}" for q in problems]
        row.warnings += [f"{rel}: {w}" for w in warnings]
        row.records += r["record_count"]
        row.bytes += r["file_length"]
        expected_first = first + r["record_count"] if p is None else None
        if r["last_txid"] is not None:
            row.max_txid = r["last_txid"]
    return intent


def _scan(storage: Storage, pid: int, row: _Row, compare: bool, show_progress: bool) -> None:
    """Reads every record of the partition through the engine, which checks both checksums, and
    compares what it holds with what the files showed (unless a truncation intent changes it)."""
    progress = None
    if show_progress:
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        progress.start()
    try:
        part = storage.partition(pid)
        first, last = part.first_transaction_id, part.max_transaction_id
        task = progress.add_task(f"partition {pid}", total=last - first + 1) if progress else None
        scanned = 0
        for chunk in iter_scan(part):
            scanned += len(chunk)
            if progress is not None and task is not None:
                progress.advance(task, len(chunk))
    except errors.WaltzError as e:
        row.problems.append(f"engine: {e}")
        return
    finally:
        if progress is not None:
            progress.stop()
    if scanned != last - first + 1:
        row.problems.append(f"engine read {scanned} records, the partition holds {first}..{last}")
    if compare and (row.first_txid, row.max_txid) != (first, last):
        row.problems.append(f"engine sees transactions {first}..{last}, the files {row.first_txid}..{row.max_txid}")


@disk.command("verify")
@click.argument("path", type=click.Path(path_type=pathlib.Path))
@_max_record_option
@_json_option
@pass_output
@user_errors
def verify(out: Output, path: pathlib.Path, max_record_size: int, as_json: bool) -> None:
    """Check a storage directory: control file, every segment and index, that segments chain,
    and every record read back through the engine. Exits 1 on any problem; a torn tail of the
    last segment (what a crash leaves, cut by the next open) is only a warning."""
    if not path.is_dir():
        raise Failed(f"{path} is not a directory" if path.exists() else f"{path}: no such directory")
    ctl = inspect_control(path)
    control, marks = _check_control(ctl)
    try:
        storage: Storage | None = Storage.open(path, read_only=True, max_record_size=max_record_size)
    except errors.WaltzError as e:
        control.problems.append(f"the engine cannot open the storage: {e}")
        storage = None
    rows: list[_Row] = []
    pids = sorted(int(d.name) for d in path.iterdir() if d.is_dir() and d.name.isdigit() and str(int(d.name)) == d.name)
    for d in sorted(path.iterdir()):
        if d.is_dir() and d.name.endswith((".unassigned", ".deleting")):
            control.warnings.append(f"{d.name}: not an assigned partition, not verified")
    try:
        for pid in pids:
            row = _Row(str(pid), partition=pid, low_water_mark=marks.get(pid))
            rows.append(row)
            if pid >= ctl["partition_count"]:
                row.problems.append(f"folder {pid} is outside the partition count {ctl['partition_count']}")
                continue
            intent = _check_files(path / str(pid), pid, ctl["cluster_key"], max_record_size, row)
            if storage is not None:
                large = (row.bytes or 0) >= PROGRESS_FROM_BYTES
                _scan(storage, pid, row, compare=not intent, show_progress=large and not out.as_json)
    finally:
        if storage is not None:
            storage.close()

    failures = len(control.problems) + sum(len(r.problems) for r in rows)
    warnings = len(control.warnings) + sum(len(r.warnings) for r in rows)
    document = {
        "path": str(path),
        "cluster_key": ctl["cluster_key"],
        "partition_count": ctl["partition_count"],
        "ok": failures == 0,
        "control": {
            "path": ctl["path"],
            "result": control.result.lower(),
            "problems": control.problems,
            "warnings": control.warnings,
        },
        "partitions": [r.document() for r in rows],
    }

    def human() -> None:
        def txids(r: _Row) -> str:
            if r.first_txid is None or r.max_txid is None:
                return ""
            return "empty" if r.max_txid < r.first_txid else f"{r.first_txid}..{r.max_txid}"

        def findings(r: _Row) -> str:
            n, w = len(r.problems), len(r.warnings)
            return ", ".join(
                x for x in (n and f"{n} problem{'s' * (n != 1)}", w and f"{w} warning{'s' * (w != 1)}") if x
            )

        out.table(
            f"Storage {path} (cluster {ctl['cluster_key']}, {ctl['partition_count']} partitions)",
            ["partition", "result", "segments", "records", "txids", "low-water mark", "findings"],
            [
                [r.name, r.result, r.segments, r.records, txids(r), r.low_water_mark, findings(r)]
                for r in [control, *rows]
            ],
        )
        # Whole lines, never wrapped into a table cell: they name files and offsets.
        for r in [control, *rows]:
            where = r.name if r.partition is None else f"partition {r.name}"
            for text in r.problems:
                out.line(f"FAIL {where}: {text}")
            for text in r.warnings:
                out.line(f"warn {where}: {text}")
        if not failures:
            out.line(f"verify: passed ({warnings} warning{'s' * (warnings != 1)})")

    out.emit(document, human)
    if failures:
        raise Failed(f"verify found {failures} problem{'s' * (failures != 1)} in {path}")
