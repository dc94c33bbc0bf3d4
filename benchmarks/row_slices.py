"""Budgets below what rematerialization alone reaches: how far row slices (kiln/passes/chunk.py) lower the
smallest peak, and what a step under such a budget costs, on the bench models.

    .venv/bin/python benchmarks/row_slices.py [--models llama,gpt2,bert] [--dtypes fp32,bf16] [--batch 16]
        [--steps 6]

Per model and dtype, all in one process:
1. Kiln without a budget: its predicted peak;
2. the smallest peak rematerialization reaches without slices (slices switched off, a budget nothing meets);
3. the same with slices (2, 4, 8, 16 tried, as the step does);
4. a step under a budget 1 % above (3), when (3) is below (2): its predicted and measured peak (the
   allocator on a replay, `step.memory(measure=True)`) and its time against the unconstrained step, the two
   alternated, medians of --steps after warm-up.
MiB; the budget is a fraction of the unconstrained peak, so the process's other heap does not enter it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_compare  # noqa: E402  (the bench models' configs)

import kiln  # noqa: E402
from kiln.passes import remat  # noqa: E402
from kiln.passes import chunk  # noqa: E402

MIB = 2 ** 20


def _floor(model, ids, amp, slices: bool) -> tuple[int, int]:
    """(the unconstrained predicted peak, the smallest peak reached) as the remat pass sees them."""
    saved = chunk.CHUNKS
    if not slices:
        chunk.CHUNKS = ()
    try:
        kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4), amp=amp, memory_budget=1e-6)(input_ids=ids, labels=ids)
    except remat.BudgetUnmet as e:
        return e.plan.before, e.plan.floor
    finally:
        chunk.CHUNKS = saved
    raise AssertionError("a budget of a millionth of the peak was met")


def measure(name: str, dtype: str, args) -> str:
    cfg = argparse.Namespace(model=name, vocab=8192, hidden=512, intermediate=1408, layers=4, heads=8, seq=256)
    torch.manual_seed(0)
    model = step_compare.build(cfg)
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=torch.Generator().manual_seed(0))
    amp = "bf16" if dtype == "bf16" else None
    t = time.perf_counter()
    peak, plain = _floor(model, ids, amp, slices=False)
    _, sliced = _floor(model, ids, amp, slices=True)
    probe = time.perf_counter() - t
    line = (f"{name:6s} {dtype:5s} peak {peak / MIB:6.0f}  remat floor {plain / MIB:6.0f}  with slices "
            f"{sliced / MIB:6.0f} ({(plain - sliced) / MIB:+.0f}; probes {probe:.0f} s)")
    if sliced >= plain:
        return line + "  slices do not lower it"
    free = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4), amp=amp)
    tight = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4), amp=amp, memory_budget=sliced * 1.01 / peak)
    times = {"free": [], "tight": []}
    for i in range(args.steps + 2):                 # alternated; the first two rounds warm up
        for key, step in (("free", free), ("tight", tight)):
            t = time.perf_counter()
            step(input_ids=ids, labels=ids)
            if i >= 2:
                times[key].append(time.perf_counter() - t)
    rep = tight.memory(measure=True)
    f, s = statistics.median(times["free"]), statistics.median(times["tight"])
    return (line + f"\n       under {rep.budget / MIB:.0f}: predicted {rep.predicted_peak / MIB:.0f}, measured "
            f"{rep.measured_peak / MIB:.0f}; {tight.last.memory.chunking.chunks} slices; "
            f"{f * 1e3:.0f} -> {s * 1e3:.0f} ms a step ({f / s:.2f} of unconstrained speed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,gpt2,bert")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            print(measure(name, dtype, args), flush=True)


if __name__ == "__main__":
    main()
