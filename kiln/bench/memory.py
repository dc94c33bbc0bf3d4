"""Peak resident memory of the current process, resettable between phases.

Linux keeps the RSS high-water mark in ``VmHWM`` (``/proc/self/status``).
Writing ``5`` to ``/proc/self/clear_refs`` resets it to the current RSS
(kernel >= 4.0), which lets the benchmark measure the peak of the *measured*
steps only, not of model construction or the first (compiling) step.

Where that file cannot be written (other kernels, some sandboxes) the reader
falls back to the unreset high-water mark and says so in ``method``, so a
report never silently mixes two kinds of number.  ``ru_maxrss`` is the last
resort where ``/proc`` is missing (macOS): never resettable.
"""
from __future__ import annotations

import re
import resource
import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            match = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def current_rss_bytes() -> int | None:
    """Resident set size now, in bytes (None where /proc is unavailable)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the RSS high-water mark to the current RSS; False if not permitted."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_bytes() -> tuple[int | None, str]:
    """(high-water RSS in bytes, how it was read)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024, "VmHWM"
    try:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None, "unavailable"
    # ru_maxrss is KiB on Linux but bytes on macOS.
    return (maxrss if sys.platform == "darwin" else maxrss * 1024), "ru_maxrss"


class PeakTracker:
    """Measure the RSS peak of a phase: ``start()`` before it, ``stop()`` after."""

    def __init__(self) -> None:
        self.reset_ok = False
        self.start_rss: int | None = None

    def start(self) -> None:
        self.reset_ok = reset_peak()
        self.start_rss = current_rss_bytes()

    def stop(self) -> dict:
        peak, how = peak_bytes()
        method = f"{how} after clear_refs reset" if self.reset_ok else f"{how} (not resettable: whole-process peak)"
        return {"peak_rss_bytes": peak, "start_rss_bytes": self.start_rss, "memory_method": method}


class Usage:
    """What a phase cost the process beyond wall time: CPU seconds in user and system (page faults are
    system time), minor page faults, and the resident-set high-water mark at its end."""

    def __init__(self) -> None:
        self.before = resource.getrusage(resource.RUSAGE_SELF)

    def stop(self) -> dict:
        now = resource.getrusage(resource.RUSAGE_SELF)
        peak, _ = peak_bytes()
        return {"user_s": now.ru_utime - self.before.ru_utime, "sys_s": now.ru_stime - self.before.ru_stime,
                "minor_faults": now.ru_minflt - self.before.ru_minflt,
                "max_rss_mib": None if peak is None else peak / 2 ** 20}
