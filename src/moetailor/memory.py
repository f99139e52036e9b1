"""Peak resident memory of this process, as the verbs report it."""
from __future__ import annotations

import resource
import sys


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (GiB; Linux reports ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (GiB), or None where there is no /proc."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None
