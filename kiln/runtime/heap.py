"""The process heap between training steps: keep freed step memory for the next step, or return it.

A training step allocates and frees the same large buffers every step (activations, logits, gradients:
hundreds of MiB on the bench models). glibc serves every allocation above its mmap threshold (at most
32 MiB) with a fresh `mmap` and unmaps it on free, and trims the heap's top back to the OS; the next
step then page-faults all of it again, and the kernel zeroes every page. Measured on the 4-layer
Llama bench model (batch 8, length 256, 2 threads, AVX2 EPYC): 64-97 thousand minor faults and
0.15-0.3 s of system time per step, 5-18 % of the step (docs/memory.md, "The heap between steps").

Policies (`$KILN_HEAP`, read when a step first runs):
- "keep" (the default without a memory budget): `mallopt(M_MMAP_MAX, 0)` and a 2 GiB trim threshold,
  so freed memory stays in the heap and is reused. The cost: the resident set stays at the heap's
  high-water mark, which fragmentation puts above the live peak (a dynamic-shape GPT-2 run: 2.3 GiB
  resident against 1.6 GiB returning memory). This is a process-wide allocator setting, the same as
  starting Python with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647.
- "system" (the default when `memory_budget=` is given: a budget means resident memory matters): glibc's
  own behaviour; a step that finds "keep" in force puts glibc's defaults back and trims the heap.
Left alone: C libraries other than glibc, a preloaded allocator (jemalloc, tcmalloc: it has its own
policy), and glibc settings from the environment (MALLOC_*_ or GLIBC_TUNABLES): the user chose.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading

from kiln.errors import KilnError

POLICIES = ("keep", "system")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4         # glibc's malloc.h
_GLIBC_MMAP_MAX, _GLIBC_TRIM = 65536, 128 * 1024  # glibc's defaults (put back by "system")
_KEEP_TRIM = 2 ** 31 - 1                          # mallopt takes an int: the top 2 GiB free stay
_USER_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

# the same as "keep", for a process started by someone else (benchmarks give it to eager PyTorch alike)
KEEP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(_KEEP_TRIM)}

_lock = threading.Lock()
_applied: list[str] = []                          # the policy Kiln set in this process, if any


def policy(memory_budget=None) -> str:
    """The heap policy for a step: $KILN_HEAP if set, else "system" under a memory budget, else "keep"."""
    value = os.environ.get("KILN_HEAP", "").strip().lower()
    if not value:
        return "system" if memory_budget is not None else "keep"
    if value not in POLICIES:
        raise KilnError(f"KILN_HEAP must be one of {', '.join(POLICIES)}, got {os.environ['KILN_HEAP']!r}: "
                        "'keep' reuses the memory a step frees in the next step (faster), 'system' returns it "
                        "to the OS (a lower resident set)")
    return value


@functools.lru_cache(maxsize=None)
def _glibc():
    """glibc's mallopt/malloc_trim, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None


def left_alone() -> str | None:
    """Why Kiln does not touch the heap in this process, or None when it does."""
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return "a preloaded allocator (LD_PRELOAD) decides"
    if any(v in os.environ for v in _USER_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "glibc's malloc settings come from the environment"
    if _glibc() is None:
        return "not glibc's allocator"
    return None


def apply(wanted: str) -> str:
    """Put `wanted` in force for this process (idempotent) and return a line describing what holds."""
    why = left_alone()
    if why is not None:
        return f"heap: left alone ({why})"
    with _lock:
        mallopt, malloc_trim = _glibc()
        if wanted == "keep" and _applied != ["keep"]:
            if mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM):
                _applied[:] = ["keep"]
        elif wanted == "system" and _applied == ["keep"]:
            mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
            mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM)
            malloc_trim(0)
            _applied[:] = ["system"]
    return describe()


def describe() -> str:
    why = left_alone()
    if why is not None:
        return f"heap: left alone ({why})"
    if _applied == ["keep"]:
        return ("heap: keep (memory a step frees stays in the process for the next step instead of being "
                "page-faulted in again; KILN_HEAP=system returns it to the OS)")
    return "heap: system (glibc returns freed memory to the OS; KILN_HEAP=keep reuses it, faster)"
