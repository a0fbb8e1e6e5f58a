"""Resident memory of a long-running process (the server): keep freed tensor memory from staying resident.

glibc serves allocations above a *dynamic* threshold from its heap arenas, and raises that threshold every
time a large block is freed; after a few training steps and publishes, megabyte-sized tensors live in the
arenas, and their freed space stays resident (fragmentation: measured +1.8 GB on the bundled pair after one
learner update). A fixed 1 MiB threshold sends every tensor-sized block to its own mapping, returned to the
system when freed. Linux/glibc only; a no-op elsewhere.
"""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_freed_memory_to_the_system(threshold_bytes: int = 1 << 20) -> bool:
    """Fix glibc's mmap threshold (allocations above it are unmapped when freed); True if applied."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes) == 1)


def trim() -> bool:
    """Give free heap pages back to the system now (after a big transient, e.g. publishing a draft)."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def process_memory(pid: int | str = "self") -> dict:
    """{"rss_bytes", "peak_rss_bytes"} of a process (Linux /proc; {} elsewhere)."""
    keys = {"VmRSS:": "rss_bytes", "VmHWM:": "peak_rss_bytes"}
    out = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            name = line.split(maxsplit=1)[0]
            if name in keys:
                out[keys[name]] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def system_rss_bytes() -> int:
    """Resident bytes of every process on the machine (what a set of new processes adds is the difference)."""
    import os

    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                total += int(open(f"/proc/{entry}/statm").read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                pass
    return total
