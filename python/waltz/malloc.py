"""The daemons' allocator setting: large buffers go back to the system when freed.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after
which buffers of that size come from the heap and stay there once freed: a server that had
queued and sent a flood of 1 MiB records held ~100 MiB more than its configured queues and
caches allow, and kept it. A fixed threshold turns that dynamic adjustment off, so every block
of 128 KiB or more is its own mapping and freeing it returns it. Small records never reach the
threshold; their allocations are unchanged."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 128 << 10
TRIM_THRESHOLD = 4 << 20


def release_large_blocks() -> bool:
    """Fixes glibc's mmap and trim thresholds for this process; True if set. Other C libraries
    (musl returns large blocks already) are left alone."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        )
    except (OSError, AttributeError) as e:
        log.warning(
            "could not set the allocator's thresholds (%s): memory freed after large records may stay with the process",
            e,
        )
        return False
    if not ok:
        log.warning(
            "mallopt refused the allocator thresholds: memory freed after large records may stay with the process"
        )
    return ok
