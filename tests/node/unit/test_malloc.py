"""The daemons' allocator setting (`waltz.malloc`), checked in a fresh process of its own."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A large block freed once lifts glibc's dynamic mmap threshold; 1 MiB buffers then come from the
# heap, and small long-lived blocks between them pin the heap so nothing is returned on free.
CHILD = """
import gc
from waltz.malloc import release_large_blocks

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

print(release_large_blocks())
lift = bytearray(4 << 20)
del lift
big, small = [], []
for _ in range(200):
    big.append(bytearray(1 << 20))
    small.append(bytearray(1000))
held = rss_mib()
del big
gc.collect()
print(held, rss_mib())
"""


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the setting is glibc's; other C libraries are left alone"
)
def test_freed_large_buffers_go_back_to_the_system() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    held, after = int(out[1]), int(out[2])
    assert held - after > 150, f"RSS {held} MiB with 200 MiB of buffers, {after} MiB after freeing them"
