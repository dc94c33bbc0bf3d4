"""Run the benchmark: one fresh worker process per mode, then gather the figures.

The parent never imports torch's heavy machinery for measuring; it only starts
workers (``python -m kiln.bench.worker``), shows which one is running and for
how long, kills one that overruns its timeout, and turns whatever came back
(or did not) into a result row.  A mode that fails never stops the others.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# The directory holding the `kiln` package: workers must import this very copy.
_ROOT = str(Path(__file__).resolve().parents[2])

Tick = Callable[[str, float], None]  # (phase text, seconds elapsed)


def machine() -> dict:
    """Describe the machine for the JSON: CPU model, cores, memory, versions, date."""
    cpu, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu is None:
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    cpu = cpu or platform.processor() or "unknown"
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    import torch  # only for its version and thread count

    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "torch_threads": torch.get_num_threads(), "memory_bytes": mem_total,
            # Which bf16 matmul instructions exist decides whether bf16 can be fast at all.
            "bf16_instructions": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(),
            # Other work on the machine skews every figure; keep the evidence.
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def run_worker(spec: dict, timeout_s: float, tick: Tick | None = None) -> dict:
    """Run one worker spec in a fresh process; always returns a result dict."""
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        spec = {**spec, "out": os.path.join(tmp, "result.json"), "progress": os.path.join(tmp, "progress")}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        if spec.get("cold_cache"):   # compile caches that start empty and go with the worker
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor-cache")
            env["KILN_CACHE_DIR"] = os.path.join(tmp, "kiln-cache")
        if spec.get("baseline_heap") == "keep" and not str(spec.get("mode")).startswith("kiln"):
            from kiln.runtime.heap import KEEP_ENV
            env.update(KEEP_ENV)          # the heap Kiln's steps keep, for a like-for-like comparison
        log_path = os.path.join(tmp, "log.txt")
        start = time.monotonic()
        with open(log_path, "w") as log:
            # Own session: on timeout the whole group (compile workers too) is killed.
            proc = subprocess.Popen([sys.executable, "-m", "kiln.bench.worker", spec_path],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            timed_out = False
            try:
                while proc.poll() is None:
                    elapsed = time.monotonic() - start
                    if elapsed > timeout_s:
                        timed_out = True
                        break
                    if tick:
                        tick(_read(spec["progress"]) or "starting", elapsed)
                    time.sleep(0.2)
            finally:
                # Timeout, Ctrl-C or an error here: the worker's own session does
                # not get the terminal's SIGINT, so end its group explicitly.
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall = time.monotonic() - start
        base = {"mode": spec.get("mode"), "wall_s": wall}
        if timed_out:
            return {**base, "status": "failed", "error": f"timed out after {timeout_s:g} s "
                    f"(during: {_read(spec['progress']) or 'start-up'})"}
        text = _read(spec["out"])
        if text:
            try:
                return {**json.loads(text), "wall_s": wall}
            except json.JSONDecodeError:
                pass
        tail = (_read(log_path) or "").strip().splitlines()[-8:]
        return {**base, "status": "failed",
                "error": f"worker exited with code {proc.returncode} and no result",
                "traceback": "\n".join(tail)}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _ratios(results: list[dict], baseline: str, peak: dict) -> None:
    """Add speed-up, memory ratio and fraction of peak to each successful result."""
    base = next((r for r in results if r["mode"] == baseline and r["status"] == "ok"), None)
    for r in results:
        if r["status"] != "ok":
            continue
        rate = (peak.get(r.get("dtype")) or {}).get("flops_per_s")
        r["peak_fraction"] = r["achieved_flops_per_s"] / rate if rate else None
        r["speedup_vs_baseline"] = base["step_median_s"] / r["step_median_s"] if base else None
        both = base and base.get("peak_rss_bytes") and r.get("peak_rss_bytes")
        r["memory_vs_baseline"] = r["peak_rss_bytes"] / base["peak_rss_bytes"] if both else None


def run(config: dict, timeout_s: float, on_start: Callable[[str], None] | None = None,
        tick: Tick | None = None, on_done: Callable[[dict], None] | None = None,
        measure_peak: bool = True) -> dict:
    """Run every mode in ``config["modes"]`` and return the full report dict.

    ``config`` holds model, size, overrides, seed, steps, warmup, budget_s,
    settle_s, modes and baseline (see ``kiln.bench.cli``).  ``on_start(label)`` is called
    before each subprocess, ``tick(phase, elapsed)`` while it runs and
    ``on_done(result)`` after it.  ``config["faults"]`` ({mode: {"fault": ...}})
    injects failures, for tests.
    """
    report = {"schema": "kiln-bench/1", "machine": machine(), "config": dict(config)}
    peak: dict = {}
    if measure_peak:
        # In this process, before any worker starts: a few seconds of big matmuls
        # do not need a fresh interpreter, and a worker would add its start-up.
        on_start and on_start("peak matmul rate")
        from kiln.bench import peak as peak_rate

        try:
            peak = peak_rate.measure_all()
            got = {"status": "ok"}
        except Exception as exc:  # a broken dtype must not cost the whole benchmark
            peak = {"error": f"{type(exc).__name__}: {exc}"}
            got = {"status": "failed"}
        on_done and on_done(got)
    report["peak_matmul"] = peak
    common = {k: config[k] for k in ("model", "size", "overrides", "seed", "steps", "warmup", "budget_s")}
    common["settle_s"] = config.get("settle_s", 0)
    common["cold_cache"] = bool(config.get("cold_cache"))
    common["memory_budget"] = config.get("memory_budget")
    common["baseline_heap"] = config.get("baseline_heap", "system")
    results = []
    for mode in config["modes"]:
        on_start and on_start(mode)
        spec = {"mode": mode, **common, **config.get("faults", {}).get(mode, {})}
        results.append(run_worker(spec, timeout_s, tick))
        on_done and on_done(results[-1])
    _ratios(results, config["baseline"], peak)
    report["results"] = results
    # Modes cut short by the budget ran fewer steps; compare losses at a step all reached.
    reached = [len(r["losses"]) for r in results if r["status"] == "ok" and r.get("losses")]
    if reached:
        report["config"]["loss_step"] = min(reached)
        for r in results:
            if r["status"] == "ok" and r.get("losses"):
                r["loss_at_loss_step"] = r["losses"][min(reached) - 1]
    ok = next((r for r in results if r["status"] in ("ok", "unavailable") and "params" in r), None)
    if ok:  # model facts are the same in every mode; lift them into the config
        report["config"].update({k: ok[k] for k in ("params", "unit", "items_per_batch", "flops_per_step")})
    return report
