"""One benchmark measurement, run in a fresh process: ``python -m kiln.bench.worker SPEC.json``.

Each mode gets its own interpreter so that one mode's compiled code, caches,
allocator state and memory high-water mark cannot leak into another's figures,
and so that a crash or hang in one mode cannot take the harness down.

The spec is a JSON object (a file path on argv, or ``-`` for stdin):

* ``mode``, ``model``, ``size``, ``overrides``, ``seed``, ``steps``,
  ``warmup``, ``budget_s`` (0 = no budget), ``settle_s`` (how long Kiln modes may
  keep tuning online before the measured steps, 0 = not at all);
* ``out``: where to write the result JSON (it is also printed as the last line
  of stdout); ``progress``: a file the worker rewrites with its current phase;
* ``fault`` (tests only): ``"raise"``, ``"exit"`` or ``"hang"`` to simulate a
  broken mode.

Result ``status`` is ``"ok"``, ``"unavailable"`` (with ``reason``) or
``"failed"`` (with ``error``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


class _Progress:
    """Write the current phase where the parent's progress display can read it."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, text: str) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)  # atomic: the reader never sees half a line


def _quantile(sorted_values: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default method).
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _stop_early(elapsed: float, last_step: float, budget: float) -> bool:
    """True when the next step would take the phase past its time budget."""
    return budget > 0 and elapsed + last_step > budget


def run_mode(spec: dict, progress: _Progress) -> dict:
    import torch

    from kiln.bench import memory, modes, zoo

    fault = spec.get("fault")
    progress("building model")
    entry = zoo.get(spec["model"], spec.get("size", "default"), spec.get("seed", 0),
                    **spec.get("overrides", {}))
    model = entry.build_model()
    steps, warmup = int(spec["steps"]), max(1, int(spec.get("warmup", 3)))
    budget = float(spec.get("budget_s") or 0)
    # A few distinct batches, built before timing: every mode sees the same data.
    batches = [entry.build_batch(i) for i in range(min(4, steps + warmup))]
    known = modes.MODES.get(spec["mode"])  # None: make_step below reports the bad name
    result = {"params": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads(),
              # Other work on the machine skews timings; keep the evidence per mode.
              "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
              "dtype": known.dtype if known else None,
              "unit": entry.unit, "items_per_batch": entry.items_per_batch,
              "flops_per_step": entry.flops_per_step}

    progress("compiling + first step" if known and known.compiles else "first step")
    start = time.perf_counter()
    try:
        step = modes.make_step(spec["mode"], model, memory_budget=spec.get("memory_budget"))
        if fault == "raise":
            raise RuntimeError("injected fault: this mode always fails")
        if fault == "exit":
            os._exit(3)
        if fault == "hang":
            time.sleep(10_000)
        loss_first = float(step(**batches[0]))
    except modes.Unavailable as exc:
        return {**result, "status": "unavailable", "reason": str(exc)}
    except NotImplementedError as exc:
        if spec["mode"].startswith("kiln"):  # the compiler says it cannot do this (yet)
            return {**result, "status": "unavailable", "reason": f"NotImplementedError: {exc}"}
        raise
    ttfs = time.perf_counter() - start
    pending = getattr(step, "pending_tuning", None)    # Kiln's online tuning, below
    if hasattr(step, "tune_now"):                      # steady state is measured: its kernels compile now
        step.tune_now()
    tuned_at_first = callable(pending) and not pending()

    # Warm-up: the first steps of a fresh process pay page faults and allocator
    # growth; they are run but not measured.  The first step counts as one.
    # With a time budget, warm-up gets half of it; the first step of a compiling
    # mode is no estimate of a step, so such modes always warm up a second step.
    done, warm_start, losses, warm_times = 1, time.perf_counter(), [loss_first], []

    def unmeasured_step() -> None:
        nonlocal done
        t = time.perf_counter()
        losses.append(float(step(**batches[done % len(batches)])))
        warm_times.append(time.perf_counter() - t)
        done += 1

    while done < warmup:
        last = warm_times[-1] if warm_times else None if known.compiles else ttfs
        if last is not None and _stop_early(time.perf_counter() - warm_start, last, budget / 2):
            break
        progress(f"warm-up {done + 1}/{warmup}")
        unmeasured_step()

    # Online tuning (Kiln on CPU): kernels compile in the background and are measured on the step's own
    # calls for a few steps after the first. Time steady state, not that transient, and report when
    # it ended ("tuned_s", from the start like ttfs, as seen between steps) and what the steps until
    # then took beyond the steady state ("tuning_excess_s").
    tuning = {}
    if callable(pending):
        left, limit = pending(), time.perf_counter() + float(spec.get("settle_s", 0) or 0)
        while left and time.perf_counter() < limit:
            progress(f"tuning step {done + 1}: {len(left)} kernel choices pending")
            unmeasured_step()
            left = pending()
        tuned = ttfs if tuned_at_first else None if left else time.perf_counter() - start
        tuning = {"tuned_s": tuned, "still_tuning": left}

    tracker = memory.PeakTracker()
    tracker.start()
    times: list[float] = []
    measure_start = time.perf_counter()
    loss = loss_first
    for i in range(steps):
        if times and _stop_early(time.perf_counter() - measure_start, times[-1], budget):
            break
        progress(f"step {i + 1}/{steps}")
        t = time.perf_counter()
        # float() forces the loss, so the step is really finished when the clock stops.
        loss = float(step(**batches[(done + i) % len(batches)]))
        times.append(time.perf_counter() - t)
        losses.append(loss)
    mem = tracker.stop()

    ordered = sorted(times)
    median = statistics.median(ordered)
    if tuning:
        tuning["tuning_excess_s"] = sum(t - median for t in warm_times)
    return {**result, **mem, **tuning, "status": "ok", "ttfs_s": ttfs, "warmup_steps": done,
            "warmup_step_times_s": warm_times,
            "measured_steps": len(times), "budget_truncated": len(times) < steps,
            "step_times_s": times, "step_median_s": median, "step_min_s": ordered[0],
            "step_max_s": ordered[-1], "step_q1_s": _quantile(ordered, 0.25),
            "step_q3_s": _quantile(ordered, 0.75),
            "items_per_s": entry.items_per_batch / median,
            "achieved_flops_per_s": entry.flops_per_step / median,
            "loss_first": loss_first, "loss_last": loss, "losses": losses,
            # --cold-cache: the empty compile caches this mode started from (None: the machine's own)
            "compile_caches": {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "KILN_CACHE_DIR")}
            if spec.get("cold_cache") else None,
            "heap": _heap()}


def _heap() -> str:
    """How this process's heap treated freed memory (Kiln's policy, or glibc's own: docs/memory.md)."""
    from kiln.runtime import heap
    return heap.describe()


def run(spec: dict) -> dict:
    """Run one spec and return its result dict; never raises."""
    progress = _Progress(spec.get("progress"))
    base = {"mode": spec.get("mode")}
    try:
        return {**base, **run_mode(spec, progress)}
    except Exception as exc:
        tb = traceback.format_exc(limit=-6)
        return {**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": tb}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kiln.bench.worker SPEC.json|-", file=sys.stderr)
        return 2
    text = sys.stdin.read() if argv[0] == "-" else open(argv[0]).read()
    spec = json.loads(text)
    result = run(spec)
    line = json.dumps(result)
    if spec.get("out"):
        with open(spec["out"], "w") as f:
            f.write(line)
    sys.stdout.flush()
    print(line, flush=True)
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
