"""`waltz disk`: dump-control, dump-segment and verify on storage directories the engine wrote."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from click.testing import CliRunner, Result
from support.engine_helpers import append_range, flip_byte, payload, record_offsets, segment_files
from waltz.cli.main import main
from waltz.storage import Storage

RECORDS = 200
ENTRY_STRUCT_1 = 128 + 4  # partition 0's struct 1 in the control file


def run(*args: str | os.PathLike[str]) -> Result:
    # Wide enough that rich never wraps a table cell this test looks for.
    return CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": "400"})


def run_json(*args: str | os.PathLike[str]) -> tuple[Result, dict]:
    r = run("--json", *args)
    return r, json.loads(r.stdout)


@pytest.fixture
def written(data_dir, cluster_key) -> pathlib.Path:
    """Partition 0 with records 0..199 over several segments, two session info updates, closed."""
    s = Storage.create(data_dir, cluster_key, 2, segment_size=4096, checkpoint_interval=16)
    s.add_partition(0)
    p = s.partition(0)
    for t in range(0, RECORDS, 10):
        append_range(p, t, 10)
    s.set_partition_info(0, 4, 100, 90)
    s.set_partition_info(0, 5, 150, 140)
    s.close()
    assert len(segment_files(data_dir / "0")) >= 3
    return data_dir


def one_error_line(r: Result) -> str:
    assert r.exit_code == 1, r.output
    assert r.stdout == ""
    assert "Traceback" not in r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("waltz: "), r.stderr
    return lines[0]


# --- verify -------------------------------------------------------------------------------------


def test_verify_passes_a_healthy_storage(written):
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 0, r.output
    assert doc["ok"] is True
    assert doc["partition_count"] == 2
    assert doc["control"] == {
        "path": str(written / "waltz-storage.ctl"),
        "result": "ok",
        "problems": [],
        "warnings": [],
    }
    [p] = doc["partitions"]
    assert p == {
        "partition": 0,
        "result": "ok",
        "segments": len(segment_files(written / "0")),
        "bytes": sum(f.stat().st_size for f in segment_files(written / "0")),
        "records": RECORDS,
        "first_txid": 0,
        "max_txid": RECORDS - 1,
        "low_water_mark": 150,
        "problems": [],
        "warnings": [],
    }
    r = run("disk", "verify", written)
    assert r.exit_code == 0
    assert "verify: passed (0 warnings)" in r.stdout
    assert f"0..{RECORDS - 1}" in r.stdout
    assert r.stderr == ""


def test_the_progress_bar_stays_off_stdout(written, monkeypatch):
    import waltz.cli.disk

    monkeypatch.setattr(waltz.cli.disk, "PROGRESS_FROM_BYTES", 0)
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 0 and doc["partitions"][0]["records"] == RECORDS
    r = run("disk", "verify", written)
    assert r.exit_code == 0 and "verify: passed (0 warnings)" in r.stdout


@pytest.mark.parametrize("which", ["sealed", "last"])
def test_a_flipped_byte_in_a_middle_record_fails_naming_file_and_offset(written, which):
    segs = segment_files(written / "0")
    seg = segs[1] if which == "sealed" else segs[-1]
    offs = record_offsets(written / "0", seg)
    assert len(offs) >= 3
    # Every record committed: in the last segment, too, the damage cannot be a torn write.
    s = Storage.open(written)
    s.set_partition_info(0, 6, RECORDS - 1, RECORDS - 1)
    s.close()
    flip_byte(seg, offs[1] + 36)  # the first data byte of the segment's second record

    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 1
    assert doc["ok"] is False
    [p] = doc["partitions"]
    assert p["result"] == "fail"
    expected = f"0/{seg.name}: corruption at offset {offs[1]} (transaction {int(seg.stem) + 1}): data checksum mismatch"
    assert any(x.startswith(expected) for x in p["problems"]), p["problems"]
    assert f"a valid record follows at offset {offs[2]}" in " ".join(p["problems"])
    # The engine reading the partition finds it too, naming the same file and offset.
    assert any(x.startswith("engine: ") and seg.name in x and str(offs[1]) in x for x in p["problems"]), p["problems"]
    assert r.stderr.startswith("waltz: verify found ")

    r = run("disk", "verify", written)
    assert r.exit_code == 1
    assert f"FAIL partition 0: 0/{seg.name}: corruption at offset {offs[1]}" in r.stdout
    assert len(r.stderr.splitlines()) == 1


def test_a_torn_write_with_valid_records_after_it_is_a_warning(written):
    """Above the low-water mark (150), a hole in the last segment with valid records after it and
    nothing further than the writer leaves unsynced: what a power loss leaves (torture seed 61)."""
    last = segment_files(written / "0")[-1]
    offs = record_offsets(written / "0", last)
    first = int(last.stem)
    assert first > 150
    with open(last, "r+b") as f:  # a block the disk never wrote: the zeros it held
        f.seek(offs[1])
        f.write(bytes(offs[2] - offs[1]))

    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 0, r.output
    [p] = doc["partitions"]
    assert p["result"] == "warn" and p["problems"] == [], p
    assert any(
        w.startswith(f"0/{last.name}: torn write at offset {offs[1]} (transaction {first + 1}): ")
        and f"valid records follow from offset {offs[2]}" in w
        for w in p["warnings"]
    ), p["warnings"]


def test_a_torn_tail_is_a_warning(written):
    last = segment_files(written / "0")[-1]
    offs = record_offsets(written / "0", last)
    os.truncate(last, last.stat().st_size - 5)

    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 0, r.output
    [p] = doc["partitions"]
    assert p["result"] == "warn" and p["problems"] == []
    assert p["max_txid"] == RECORDS - 2 and p["records"] == RECORDS - 1
    # The index's entry for the torn record goes with the torn tail, not reported apart.
    assert p["warnings"] == [
        f"0/{last.name}: torn tail at offset {offs[-1]} (transaction {RECORDS - 1}): "
        f"record needs {40 + len(payload(RECORDS - 1))} bytes but only {40 + len(payload(RECORDS - 1)) - 5} remain; "
        "nothing valid follows",
    ]
    r = run("disk", "verify", written)
    assert r.exit_code == 0
    assert "verify: passed (1 warning)" in r.stdout
    assert f"warn partition 0: 0/{last.name}: torn tail at offset {offs[-1]}" in r.stdout


def test_a_torn_tail_in_a_sealed_segment_fails(written):
    seg = segment_files(written / "0")[0]
    os.truncate(seg, seg.stat().st_size - 5)
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 1
    [p] = doc["partitions"]
    assert p["problems"][0].startswith(f"0/{seg.name}: torn tail at offset ")
    assert p["warnings"] == []


def test_records_missing_at_the_end_of_a_sealed_segment_break_the_chain(written):
    seg, nxt = segment_files(written / "0")[:2]
    offs = record_offsets(written / "0", seg)
    os.truncate(seg, offs[-1])  # the last record gone whole: every remaining record is valid
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 1
    problems = doc["partitions"][0]["problems"]
    assert problems[:2] == [
        f"0/{seg.name}: index holds {len(offs)} entries for {len(offs) - 1} valid records",
        f"0/{nxt.name} starts at transaction {int(nxt.stem)}, the previous segment ends at {int(nxt.stem) - 2}",
    ]
    assert problems[2].startswith(f"engine: corruption in {seg}")
    r = run("disk", "verify", written)
    assert f"FAIL partition 0: 0/{nxt.name} starts at transaction {int(nxt.stem)}" in r.stdout


def test_a_wrong_index_entry_fails(written):
    seg = segment_files(written / "0")[1]
    offs = record_offsets(written / "0", seg)
    idx = seg.with_suffix(".idx")
    flip_byte(idx, 128 + 8 * 2 + 7)
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 1
    assert doc["partitions"][0]["problems"] == [
        f"0/{seg.name}: index entry 2 (offset {128 + 16} of the index) says {offs[2] ^ 0xFF}, the record is at offset "
        f"{offs[2]}"
    ]


# --- dump-control -------------------------------------------------------------------------------


def test_dump_control_shows_both_structs_and_a_damaged_one(written, cluster_key):
    r, doc = run_json("disk", "dump-control", written)
    assert r.exit_code == 0, r.output
    assert doc["path"] == str(written / "waltz-storage.ctl")
    assert (doc["version"], doc["partition_count"], doc["cluster_key"]) == (1, 2, str(cluster_key))
    assert doc["file_length"] == 128 + 2 * 60
    p0 = doc["partitions"][0]
    # Fresh entries start on struct 1, so the updates went to struct 2, then struct 1.
    assert p0["structs"] == [
        {"session_id": 5, "low_water_mark": 150, "local_low_water_mark": 140, "checksum_ok": True},
        {"session_id": 4, "low_water_mark": 100, "local_low_water_mark": 90, "checksum_ok": True},
    ]
    assert (p0["stored_partition_id"], p0["current"]) == (0, 1)
    # The control file itself, not only its directory.
    assert run_json("disk", "dump-control", written / "waltz-storage.ctl")[1] == doc

    flip_byte(written / "waltz-storage.ctl", ENTRY_STRUCT_1 + 9)
    r = run("disk", "dump-control", "--json", written)
    p0 = json.loads(r.stdout)["partitions"][0]
    assert p0["structs"][0]["checksum_ok"] is False
    assert p0["structs"][0]["low_water_mark"] != 150
    assert p0["structs"][1] == {"session_id": 4, "low_water_mark": 100, "local_low_water_mark": 90, "checksum_ok": True}
    assert p0["current"] == 2

    r = run("disk", "dump-control", written)
    assert r.exit_code == 0
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ 0 "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:3] == ["0", "0", "2"]
    assert cells[4:] == ["BAD", "4 / 100 / 90", "ok"]

    # Verify: one damaged struct is the last update lost (a warning); the other one is used.
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 0, r.output
    assert doc["control"]["warnings"] == [
        "partition 0: struct 1 fails its checksum, struct 2 is used (the last update is lost)"
    ]
    assert doc["partitions"][0]["low_water_mark"] == 100

    flip_byte(written / "waltz-storage.ctl", ENTRY_STRUCT_1 + 28 + 3)
    r, doc = run_json("disk", "verify", written)
    assert r.exit_code == 1
    assert doc["control"]["problems"] == ["partition 0: both info structs fail their checksum"]
    assert run_json("disk", "dump-control", written)[1]["partitions"][0]["current"] is None


# --- dump-segment -------------------------------------------------------------------------------


def test_dump_segment_json_and_human(written, cluster_key):
    seg = segment_files(written / "0")[1]
    first = int(seg.stem)
    offs = record_offsets(written / "0", seg)
    r, doc = run_json("disk", "dump-segment", seg, "--limit", "3")
    assert r.exit_code == 0, r.output
    assert doc["header"] == {
        "version": 1,
        "creation_time_ms": doc["header"]["creation_time_ms"],
        "cluster_key": str(cluster_key),
        "partition_id": 0,
        "first_txid": first,
        "reserved_zero": True,
    }
    assert doc["record_count"] == len(offs)
    assert (doc["first_txid"], doc["last_txid"]) == (first, first + len(offs) - 1)
    assert doc["valid_end"] == doc["file_length"] == seg.stat().st_size
    assert doc["problem"] is None
    assert len(doc["records"]) == 3
    assert doc["records"][1] == {
        "offset": offs[1],
        "txid": first + 1,
        "client_id": 7,
        "generation": 1,
        "partition_id": 0,
        "sequence": first + 1,
        "header": (first + 1) % 1000,
        "data_length": len(payload(first + 1)),
    }
    ix = doc["index"]
    assert ix["path"] == str(seg.with_suffix(".idx"))
    assert (ix["header_matches"], ix["entries"], ix["extra_entries"], ix["mismatch"]) == (True, len(offs), 0, None)
    # --limit bounds the JSON listing too; the default lists 50.
    assert len(run_json("disk", "dump-segment", seg, "--limit", "1000")[1]["records"]) == len(offs)
    assert len(run_json("disk", "dump-segment", segment_files(written / "0")[-1])[1]["records"]) == min(
        50, RECORDS - int(segment_files(written / "0")[-1].stem)
    )

    r = run("disk", "dump-segment", seg, "--limit", "2")
    assert r.exit_code == 0
    assert f"Records (first 2 of {len(offs)})" in r.stdout
    assert f"│ {offs[1]} " in r.stdout and f"│ {first + 1} " in r.stdout
    assert f"{first}..{first + len(offs) - 1}" in r.stdout


def test_an_open_partitions_preallocated_space_is_reported_not_damage(data_dir, cluster_key):
    s = Storage.create(data_dir, cluster_key, 1, checkpoint_interval=16, preallocate=64 << 10)
    s.add_partition(0)
    append_range(s.partition(0), 0, 10)
    [seg] = segment_files(data_dir / "0")
    assert seg.stat().st_size == 64 << 10  # zeros ahead of the records while it is open
    r, doc = run_json("disk", "dump-segment", seg)
    assert r.exit_code == 0, r.output
    assert doc["record_count"] == 10 and doc["problem"] is None
    assert doc["preallocated_bytes"] == doc["file_length"] - doc["valid_end"] > 0
    r = run("disk", "dump-segment", seg)
    assert f"preallocated (zeros after the records) │ {doc['preallocated_bytes']}" in r.stdout
    r, doc = run_json("disk", "verify", data_dir)
    assert r.exit_code == 0 and doc["ok"] is True, r.output
    s.close()
    # A close cuts the zeros off.
    assert seg.stat().st_size == run_json("disk", "dump-segment", seg)[1]["valid_end"]
    assert run_json("disk", "dump-segment", seg)[1]["preallocated_bytes"] == 0


def test_dump_segment_reports_damage(written):
    seg = segment_files(written / "0")[0]
    offs = record_offsets(written / "0", seg)
    flip_byte(seg, offs[2] + 4)  # inside the transaction id
    r, doc = run_json("disk", "dump-segment", seg)
    assert r.exit_code == 0
    assert doc["record_count"] == 2
    assert doc["valid_end"] == offs[2]
    assert doc["problem"]["offset"] == offs[2] and doc["problem"]["torn_tail"] is False
    assert doc["problem"]["next_valid_offset"] == offs[3]
    assert doc["problem"]["reason"].startswith("expected transaction id 2, found ")
    assert doc["index"]["extra_entries"] == len(offs) - 2
    assert doc["index"]["mismatch"] is None
    r = run("disk", "dump-segment", seg)
    assert f"corruption at offset {offs[2]} (transaction 2): expected transaction id 2" in r.stdout


# --- a user's mistakes --------------------------------------------------------------------------


def test_mistakes_are_one_line_and_exit_1(written, tmp_path):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    seg = segment_files(written / "0")[0]
    assert "No such file" in one_error_line(run("disk", "dump-control", missing))
    assert "not a Waltz storage directory" in one_error_line(run("disk", "dump-control", empty))
    assert "is a segment file" in one_error_line(run("disk", "dump-control", seg))
    assert "No such file" in one_error_line(run("disk", "dump-segment", missing.with_name("0000000000000000000.seg")))
    assert "not a segment data file" in one_error_line(run("disk", "dump-segment", seg.with_suffix(".idx")))
    assert "not a segment data file" in one_error_line(run("disk", "dump-segment", written / "waltz-storage.ctl"))
    assert "not a segment data file" in one_error_line(run("disk", "dump-segment", written))
    assert "no such directory" in one_error_line(run("disk", "verify", missing))
    assert "not a directory" in one_error_line(run("disk", "verify", seg))
    assert "not a Waltz storage directory" in one_error_line(run("--json", "disk", "verify", empty))
