"""Peak memory and speed under a memory budget: eager, torch.compile and Kiln, each run in its own process.

    .venv/bin/python benchmarks/memory_budget.py [--model gpt2|llama|bert] [--dtype fp32|bf16] [--json out.json]
        [--steps 5] [--threads 2] [--speed-rounds 12] [--peer-steps 1]

What it measures (the goals of the memory issue):
1. eager PyTorch at batch 8: its peak tensor memory, the *budget*;
2. Kiln at batch 16 without a budget, and with `memory_budget=` that budget: the peak, and tokens per second
   (the budgeted run against the unconstrained one);
3. torch.compile at batch 16 with `torch._functorch.config.activation_memory_budget` set to the same
   fraction (what Kiln's budget leaves for its step, over its unconstrained peak);
4. at batch 8 without budgets: Kiln's peak against torch.compile's;
5. with --speed-rounds N: Kiln at batch 16 with and without the budget in one process, steps alternated,
   for the throughput ratio (sequential runs drift with the machine's load).

Peak memory is the C allocator's count of what it holds (glibc `mallinfo2`: in-use heap chunks plus
mmapped ones), sampled every 0.2 ms by a thread during the measured steps, after a warm-up: tensors
(parameters, gradients, optimizer state, activations, the batch), not the interpreter and libraries that
a process's resident size adds (also reported: `rss_peak`, the kernel's high-water mark of the measured
steps). Kiln's prediction (`step.memory()`) is reported beside its measurement, and beside the *step peak*:
the sampled peak less the heap the process holds at rest beyond the persistent tensors (torch's and the
model's Python-side allocations), which the prediction does not model. Step times are medians
of --steps steps after the warm-up (Kiln: after its online tuning settled).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
MIB = 2 ** 20


class Sampler:
    """The allocator's largest count while it runs (a thread reading mallinfo2 every `every` seconds)."""

    def __init__(self, every: float = 2e-4):
        from kiln.runtime.memory import allocated
        self.read, self.every, self.peak, self._stop = allocated, every, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.every)

    def __enter__(self):
        self.peak = self.read()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.read())


def worker(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    from kiln.bench import memory as rss, zoo
    entry = zoo.get(args.model, "default", batch=args.batch)
    model = entry.build_model()
    batch = entry.build_batch(0)
    bf16 = args.dtype == "bf16"
    out: dict = dict(mode=args.worker, batch=args.batch, dtype=args.dtype, tokens=entry.items_per_batch)
    if args.worker == "kiln":
        import kiln
        budget = args.kiln_budget
        step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4, weight_decay=0.01),
                            amp="bf16" if bf16 else None, memory_budget=budget)

        def run():
            return step(**batch)
    else:
        if args.worker == "compile" and args.activation_budget is not None:
            import torch._functorch.config as functorch_config
            functorch_config.activation_memory_budget = args.activation_budget
            out["activation_memory_budget"] = args.activation_budget
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        fwd = torch.compile(model) if args.worker == "compile" else model

        def run():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = fwd(**batch).loss
            loss.backward()
            opt.step()
            return loss
    t0 = time.perf_counter()
    run()
    out["first_step_s"] = time.perf_counter() - t0
    for _ in range(args.warmup):
        run()
    if args.worker == "kiln":
        deadline = time.perf_counter() + args.settle
        step.tune_now()                    # the tuned steady state is measured: compile its kernels now
        while step.pending_tuning() and time.perf_counter() < deadline:
            run()
    times = []
    rss.reset_peak()
    out["at_rest"] = Sampler().read()      # between steps: parameters, optimizer state, the process's own heap
    with Sampler() as sampler:
        for _ in range(args.steps):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    out["peak"] = sampler.peak
    out["rss_peak"] = rss.peak_bytes()[0]
    out["step_s"] = statistics.median(times)
    out["tokens_per_s"] = entry.items_per_batch / out["step_s"]
    if args.worker == "kiln":
        rep = step.memory(measure=True)
        # the process's own heap (torch, Python-side objects) is what it holds at rest beyond the persistent
        # tensors; the step's peak measured from outside is the sampled peak less that
        out["step_peak"] = out["peak"] - (out["at_rest"] - rep.persistent)
        out.update(predicted_peak=rep.predicted_peak, measured_peak=rep.measured_peak, budget=rep.budget,
                   outside=rep.outside, unconstrained=rep.unconstrained,
                   recomputed=len(rep.recomputed), extra_flops=rep.extra_flops, report=str(rep))
        step.close()
    return out


def interleaved(args) -> dict:
    """Kiln at batch 16 without a budget and with one, in one process, their steps alternated (after both
    settled their tuning): the throughput ratio, free of the drift between sequential runs. Both run under
    the budget's heap policy (`KILN_HEAP` is process-wide; Kiln's static step hardly depends on it). The
    budgeted step is compiled first, so its plan is the one a process of its own gets."""
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["KILN_HEAP"] = "system"      # the budget's policy, for both steps
    import kiln
    from kiln.bench import zoo
    entry = zoo.get(args.model, "default", batch=args.batch)
    batch = entry.build_batch(0)
    steps, kiln_steps = {}, []
    # the budgeted step first, alone: a byte budget covers the whole process, and the other step's model
    # and state (built after it planned, and re-planned after its first step) must not change its plan
    for name, budget in (("budget", args.kiln_budget), ("free", None)):
        torch.manual_seed(0)
        step = kiln.compile(entry.build_model(), optimizer=kiln.optim.AdamW(lr=1e-4, weight_decay=0.01),
                            amp="bf16" if args.dtype == "bf16" else None, memory_budget=budget)
        steps[name] = functools.partial(step, **batch)
        kiln_steps.append(step)
        for _ in range(1 + args.warmup):
            steps[name]()
    if args.activation_budget is not None:     # torch.compile with the same fraction, alternated too
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = args.activation_budget
        torch.manual_seed(0)
        model = entry.build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        fwd = torch.compile(model)

        def compiled():
            opt.zero_grad(set_to_none=True)
            fwd(**batch).loss.backward()
            opt.step()
        steps["compile"] = compiled
        for _ in range(1 + args.warmup):
            compiled()
    deadline = time.perf_counter() + args.settle
    for s in kiln_steps:
        s.tune_now()                       # the tuned steady state is measured: compile its kernels now
    while any(s.pending_tuning() for s in kiln_steps) and time.perf_counter() < deadline:
        for s in kiln_steps:
            s(**batch)
    times: dict = {name: [] for name in steps}
    for i in range(args.steps):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            t = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(t) for name, t in times.items()}
    rep = kiln_steps[0].memory()
    return dict(step_s=med, ratio=med["free"] / med["budget"], recomputed=len(rep.recomputed),
                extra_flops=rep.extra_flops, rounds=args.steps, activation_budget=args.activation_budget)


def launch(args, mode: str, batch: int, **extra) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, __file__, "--worker", mode, "--out", path, "--model", args.model, "--dtype", args.dtype,
           "--batch", str(batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--settle", str(args.settle)]
    for k, v in extra.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    if mode in ("eager", "compile") and args.peer_steps:     # slow peers (bf16 without native matmul): fewer steps
        cmd[cmd.index("--steps") + 1], cmd[cmd.index("--warmup") + 1] = str(args.peer_steps), "1"
    print(f"{mode} batch {batch} {extra or ''}...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode:
        return dict(mode=mode, batch=batch, failed=proc.returncode)
    with open(path) as f:
        got = json.load(f)
    os.unlink(path)
    if "peak" in got:
        print(f"  peak {got['peak'] / MIB:.0f} MiB, {got['step_s']:.3f} s/step", file=sys.stderr, flush=True)
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "bert"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--settle", type=float, default=300.0, help="seconds Kiln may tune before measuring")
    p.add_argument("--peer-steps", type=int, default=0,
                   help="eager and torch.compile: one warm-up step and N measured ones (for bf16 on a CPU that "
                        "emulates it, where their steps take a minute)")
    p.add_argument("--speed-rounds", type=int, default=0,
                   help="then Kiln batch 16 with and without the budget in one process, N alternated steps each")
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--kiln-budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--activation-budget", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        result = interleaved(args) if args.worker == "interleaved" else worker(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    runs = {}
    runs["eager_b8"] = launch(args, "eager", 8)
    budget = runs["eager_b8"]["peak"]
    runs["kiln_b16"] = launch(args, "kiln", 16)
    runs["kiln_b16_budget"] = launch(args, "kiln", 16, kiln_budget=budget)
    # the same fraction for torch.compile: what the budget left for Kiln's step (the process's own heap
    # taken out) over its peak without a budget
    got = runs["kiln_b16_budget"]
    fraction = (min(1.0, (got["budget"] - got["outside"]) / got["unconstrained"])
                if got.get("unconstrained") else None)
    runs["compile_b16_budget"] = launch(args, "compile", 16, activation_budget=round(fraction, 3) if fraction else None)
    runs["kiln_b8"] = launch(args, "kiln", 8)
    runs["compile_b8"] = launch(args, "compile", 8)
    if args.speed_rounds:
        args.steps = args.speed_rounds
        same = round(fraction, 3) if fraction and args.dtype == "fp32" else None   # bf16 compile: emulated, slow
        runs["interleaved_b16"] = launch(args, "interleaved", 16, kiln_budget=budget, activation_budget=same)
    print(f"\n{args.model} {args.dtype}: budget = eager's peak at batch 8 = {budget / MIB:.0f} MiB "
          f"(fraction for torch.compile: {fraction if fraction is None else round(fraction, 3)})")
    print(f"{'run':22} {'peak MiB':>9} {'step peak':>9} {'predicted':>9} {'s/step':>8} {'tokens/s':>9}")
    for k, r in runs.items():
        if "failed" in r:
            print(f"{k:22} failed (exit {r['failed']})")
            continue
        if k == "interleaved_b16":
            print(f"Kiln batch 16, alternated in one process ({r['rounds']} steps each): {r['step_s']['free']:.3f} s "
                  f"without the budget, {r['step_s']['budget']:.3f} s with it: {r['ratio']:.3f} of the unconstrained "
                  f"speed ({r['recomputed']} ops recomputed, {r['extra_flops'] / 1e9:.2f} GFLOP)")
            if "compile" in r["step_s"]:
                print(f"  torch.compile, activation_memory_budget {r['activation_budget']}, alternated with them: "
                      f"{r['step_s']['compile']:.3f} s: Kiln with the budget is "
                      f"{r['step_s']['compile'] / r['step_s']['budget']:.3f}x its speed")
            continue
        pred = f"{r['predicted_peak'] / MIB:9.0f}" if "predicted_peak" in r else f"{'-':>9}"
        own = f"{r['step_peak'] / MIB:9.0f}" if "step_peak" in r else f"{'-':>9}"
        print(f"{k:22} {r['peak'] / MIB:9.0f} {own} {pred} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, dtype=args.dtype, budget=budget, fraction=fraction, runs=runs,
                           command=" ".join(sys.argv), load=os.getloadavg()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
