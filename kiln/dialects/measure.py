"""Measured kernel choices: time two implementations on inputs of a node's shapes, once per machine.

A dialect that is only sometimes faster than ATen (Inductor regions, oneDNN linear) asks here instead
of guessing: both implementations run interleaved (a warm-up, then 5 runs each) on tensors with the
node's shapes, strides and dtypes, and the medians are kept in a small JSON file per key under
`cache_dir()`, so each distinct case is timed once per machine and torch version. Files are written
atomically (temp file + rename): a reader never sees half a file, and a cache that cannot be written
only costs a later run the measurement again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("kiln")

KEEP_IF_FASTER = 0.95      # a kernel replaces ATen's only if it takes at most 95 % of its time
MIN_SAVING_MS = 0.05       # ... and saves at least this much per call: less is noise, and not worth
                           # loading a compiler's runtime at start-up (Inductor's takes about a second)


def keep() -> str:
    """Which measured kernels replace ATen's: "faster" (default: those measured faster here, by the two
    thresholds above) or "all" ($KILN_KEEP=all: every one, e.g. to test their numerics)."""
    value = os.environ.get("KILN_KEEP", "faster")
    if value not in ("faster", "all"):
        raise ValueError(f"KILN_KEEP must be 'faster' or 'all', got {value!r}")
    return value


def worth_it(new_ms: float, aten_ms: float) -> bool:
    return keep() == "all" or (new_ms <= KEEP_IF_FASTER * aten_ms and aten_ms - new_ms >= MIN_SAVING_MS)


def faster_than_aten(impl, node) -> bool:
    """Whether `impl`'s kernel beats the op's ATen kernel on this node's shapes, strides and dtypes
    (measured once per machine; the decision is logged)."""
    from kiln.ir.graph import Value, tree_map_values
    sig = tree_map_values(lambda v: (v.meta.shape, str(v.meta.dtype), v.meta.stride) if v.meta else None,
                          (node.args, node.kwargs))
    key = hashlib.sha256(repr((impl.label, str(node.target), sig)).encode()).hexdigest()[:24]
    folder = cache_dir("kernels")
    known = (folder / f"{key}.timing.json").exists()

    def run() -> dict:
        args, kwargs = tree_map_values(lambda v: example(v.meta), (node.args, node.kwargs))
        return medians({"new_ms": lambda: impl.kernel(*args, **kwargs), "aten_ms": lambda: node.target(*args, **kwargs)})
    try:
        timing = timed_once(folder, key, run)
    except Exception as exc:     # a kernel that cannot even be measured is not used
        log.warning("kiln: %s could not be measured on %s (%s: %s); using ATen", impl.label, node.op.name,
                    type(exc).__name__, exc)
        return False
    chosen = worth_it(timing["new_ms"], timing["aten_ms"])
    if not known:
        shapes = ", ".join(str(v.meta) for v in node.inputs if isinstance(v, Value) and v.meta is not None)
        log.info("kiln: %s %s(%s): %.2f ms, ATen %.2f ms: %s", impl.label, node.op.name, shapes, timing["new_ms"],
                 timing["aten_ms"], "used" if chosen else "ATen kept")
    return chosen


def cache_dir(kind: str) -> Path:
    """$KILN_CACHE_DIR/<kind>/torch-<version> (default ~/.cache/kiln/...)."""
    root = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    return root / kind / f"torch-{torch.__version__}"


def example(meta) -> torch.Tensor:
    """A tensor with `meta`'s shape, strides (broadcast zeros included), dtype and device: normal floats,
    ones otherwise."""
    size = 1 + sum((n - 1) * st for n, st in zip(meta.shape, meta.stride) if n > 0)
    if any(n == 0 for n in meta.shape):
        size = 0
    flat = torch.empty(size, dtype=meta.dtype, device=meta.device)
    flat = flat.normal_() if meta.dtype.is_floating_point else flat.fill_(1)
    return flat.as_strided(meta.shape, meta.stride)


def medians(fns: dict[str, Callable[[], object]], runs: int = 5) -> dict[str, float]:
    """Median milliseconds of each zero-argument function, interleaved, after one warm-up round (3 runs
    instead of `runs` when a round takes over 50 ms: big GEMMs do not need more to be told apart)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in fns}
    i = 0
    while i <= runs:
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if i:
                times[name].append((time.perf_counter() - t) * 1e3)
        if i == 1 and sum(v[0] for v in times.values()) > 50:
            runs = min(runs, 3)
        i += 1
    return {name: statistics.median(v) for name, v in times.items()}


def read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomic(folder: Path, name: str, text: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / name)
    except OSError as exc:
        log.warning("kiln: cannot write the cache %s (%s)", folder, exc)


def timed_once(folder: Path, key: str, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The cached timing under `key`, measured by `measure()` the first time."""
    path = folder / f"{key}.timing.json"
    got = read_json(path)
    if isinstance(got, dict) and got and all(isinstance(v, (int, float)) for v in got.values()):
        return got
    got = measure()
    write_atomic(folder, path.name, json.dumps(got))
    return got
