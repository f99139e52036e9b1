"""Peak resident memory of this process, as the verbs report it."""
from __future__ import annotations

import resource
import sys
from contextlib import suppress


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (GiB; Linux reports ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (GiB), or None where there is no /proc."""
    with suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return None


def free_module(module) -> None:
    """Return a materialised module's weights to the meta device and hand the freed memory back to
    the system (glibc keeps freed heap chunks otherwise, so resident memory would grow per layer)."""
    module.to("meta")
    release_memory()


def release_memory() -> None:
    import ctypes
    import gc

    gc.collect()
    with suppress(OSError, AttributeError):   # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
