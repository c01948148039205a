"""What this machine has, read without torch."""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes of host memory available to new processes (Linux's MemAvailable, else the free
    pages); None where neither can be read."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1
