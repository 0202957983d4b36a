"""Reading a replica's files after a run holds one partition's files open at a time: an open
partition holds every segment's files, and after an hour of the torture's small segments a node's
two partitions together took LazyFS past its descriptor limit (seed 68), failing a run whose
history was sound."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid

from waltz.storage import RecordBatch, ReqId, Storage

RECORDS = 200  # per partition, about three to a 4 KiB segment: some 130 files


def test_a_replica_with_more_segments_than_the_descriptor_limit_allows_twice_is_read_whole(
    tmp_path: pathlib.Path,
) -> None:
    data = tmp_path / "storage-0"
    s = Storage.create(data, uuid.uuid4(), 2, segment_size=4096)
    for p in (0, 1):
        s.add_partition(p)
        part = s.partition(p)
        for i in range(RECORDS):
            part.append_next(RecordBatch([(ReqId(1, 1, p, i), 0, bytes([i % 256]) * 1500)]))
    s.close()
    # Room for one partition's files (plus the interpreter's own), not for both at once.
    files = len(os.listdir(data / "0"))
    assert files >= 100 and len(os.listdir(data / "1")) == files
    limit = files + 60
    code = f"""
import pathlib, resource
from waltz.torture.drain import record_from_bytes
from waltz.torture.run import _drain_files
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
problems, lagging = [], []
out = _drain_files(pathlib.Path({str(data)!r}), {{0: {RECORDS - 1}, 1: {RECORDS - 1}}}, "storage-0", lagging, problems)
assert problems == [], problems
assert lagging == [], lagging
assert [len(out[p]) for p in (0, 1)] == [{RECORDS}, {RECORDS}], [len(out[p]) for p in (0, 1)]
assert [r.txid for r in out[0]] == [r.txid for r in out[1]] == list(range({RECORDS}))
assert all(r == record_from_bytes(r.txid, bytes([r.txid % 256]) * 1500) for p in (0, 1) for r in out[p])
print("read whole")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "read whole" in done.stdout
