"""The cost half of `kiln adopt --verify`: eager training steps of the original and the rewritten model.

Two fresh worker processes (`python -m kiln.adopt.verify_timing --worker SPEC`), one per module,
started together and stepped alternately so that load on the machine hits both alike: 2 warm-up
steps, then the median of 5.  Peak RSS is the high-water mark of each worker over its measured steps
(`kiln.bench.memory.PeakTracker`); "saved for backward" is counted exactly with
`torch.autograd.graph.saved_tensors_hooks`.  Everything else (configs, building, inputs) is verify.py's.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from kiln.adopt import verify as v


def timing(model_type: str, class_name: str, kind: str, overlay_path: str, size: dict | None = None) -> dict:
    """Median step ms and peak MiB for the original ("before") and the rewritten ("after") model."""
    size = v.TIMING_SIZE if size is None else size
    variants = {"before": None, "after": overlay_path}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (v._ROOT, env.get("PYTHONPATH")) if p)
    workers, logs = {}, {}
    try:
        for label, overlay in variants.items():
            logs[label] = tempfile.TemporaryFile(mode="w+")
            spec = json.dumps({"model_type": model_type, "class": class_name, "kind": kind, "overlay": overlay,
                               "size": size, "warmup": v.WARMUP_STEPS})
            workers[label] = subprocess.Popen(
                [sys.executable, "-m", "kiln.adopt.verify_timing", "--worker", spec], env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[label], start_new_session=True)
            _start_reader(workers[label])
        deadline = time.monotonic() + v.WORKER_TIMEOUT_S
        for label in variants:
            _reply(workers[label], label, logs[label], deadline)             # built and warmed up
        times: dict[str, list[float]] = {label: [] for label in variants}
        for i in range(v.MEASURED_STEPS):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for label in order:
                times[label].append(_ask(workers[label], "step", label, logs[label], deadline)["ms"])
        peaks = {label: _ask(workers[label], "stop", label, logs[label], deadline) for label in variants}
    finally:
        for proc in workers.values():
            if proc.poll() is None:      # done ("stop" answered) or failed: nothing more to wait for
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for f in logs.values():
            f.close()
    mib = {label: (p["peak_rss_bytes"] / 2**20 if p.get("peak_rss_bytes") else None) for label, p in peaks.items()}
    # The libraries' ~450 MiB and the model are in both peaks; what the steps add on top of the
    # built model (from the first warm-up step on) is step_memory_*.
    growth = {label: ((p["peak_rss_bytes"] - p["start_rss_bytes"]) / 2**20
                      if p.get("peak_rss_bytes") and p.get("start_rss_bytes") else None)
              for label, p in peaks.items()}
    saved = {label: (p["saved_bytes"] / 2**20 if p.get("saved_bytes") is not None else None)
             for label, p in peaks.items()}
    return {"step_time_before": statistics.median(times["before"]),
            "saved_for_backward_before": saved["before"], "saved_for_backward_after": saved["after"],
            "step_time_after": statistics.median(times["after"]),
            "peak_memory_before": mib["before"], "peak_memory_after": mib["after"],
            "step_memory_before": growth["before"], "step_memory_after": growth["after"],
            "step_times_ms": times, "memory_method": peaks["after"].get("memory_method"),
            "timing_size": size, "timing_steps": {"warmup": v.WARMUP_STEPS, "measured": v.MEASURED_STEPS}}


def _ask(proc, command: str, label: str, log, deadline: float) -> dict:
    try:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    except OSError:
        pass                    # it died: _reply says why
    return _reply(proc, label, log, deadline)


def _reply(proc, label: str, log, deadline: float) -> dict:
    """The worker's next `KILN {json}` line; other output (library prints) is skipped.

    Lines come through a queue filled by a reader thread, so a deadline holds even when the
    worker hangs (a select() on the pipe would miss lines already in the file's buffer)."""
    while True:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise v.VerifyError(f"timing worker ({label}) took over {v.WORKER_TIMEOUT_S:g} s") from None
        if line is None:
            proc.wait()
            log.seek(0)
            tail = " | ".join(log.read().strip().splitlines()[-3:])
            raise v.VerifyError(f"timing worker ({label}) exited with code {proc.returncode}: {tail}")
        if line.startswith("KILN "):
            reply = json.loads(line[5:])
            if "error" in reply:
                raise v.VerifyError(f"timing worker ({label}): {reply['error']}")
            return reply


def _start_reader(proc) -> None:
    """proc.lines: a queue of the worker's stdout lines, then None at its end."""
    proc.lines = queue.Queue()

    def read():
        for line in proc.stdout:
            proc.lines.put(line)
        proc.lines.put(None)
    threading.Thread(target=read, daemon=True).start()


def saved_for_backward_bytes(model, inputs: dict) -> int:
    """Bytes autograd keeps from the forward for the backward (distinct storages, parameters
    excluded): the activation memory of a training step, counted exactly rather than read from the
    process's noisy resident size."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = v.loss_of(model(**inputs))
    del loss
    return sum(seen.values())


def worker(spec: dict) -> int:
    """One variant's training steps, commanded line by line on stdin ("step", "stop")."""
    import torch
    from transformers.utils import logging as hf_logging

    from kiln.bench.memory import PeakTracker

    def say(obj):
        print("KILN " + json.dumps(obj), flush=True)

    hf_logging.set_verbosity_error()
    try:
        model_type = spec["model_type"]
        module = importlib.import_module(v.module_names(model_type)[0])
        if spec["overlay"]:
            module = v.load_overlay(model_type, spec["overlay"])
        cls = getattr(module, spec["class"])
        config = v.tiny_config(model_type, spec["size"])
        model = v.build(cls, config)
        inputs = v.make_inputs(model, config, spec["kind"], spec["size"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> float:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            v.loss_of(model(**inputs)).backward()
            opt.step()
            return (time.perf_counter() - start) * 1e3
        # The peak covers the warm-up too: the first steps are where the allocator grows to what a
        # step needs (afterwards freed pages are reused and the peak hardly moves).
        saved = saved_for_backward_bytes(model, inputs)
        tracker = PeakTracker()
        tracker.start()
        for _ in range(spec["warmup"]):
            step()
    except Exception as exc:
        say({"error": v._short(exc)})
        return 1
    say({"ready": True})
    for line in sys.stdin:
        if line.strip() == "step":
            say({"ms": step()})
        elif line.strip() == "stop":
            say({**tracker.stop(), "saved_bytes": saved})
            return 0
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(json.loads(sys.argv[2])))
    print("usage: kiln adopt --verify transformers:<model_type> (this module's command line is its "
          "timing worker)", file=sys.stderr)
    sys.exit(2)
