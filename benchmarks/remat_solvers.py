"""What the rematerialization plan recomputes under a budget, chosen by the greedy pass alone and with the
covering integer program (kiln/passes/remat.py), on the bench models.

    .venv/bin/python benchmarks/remat_solvers.py [--models llama,gpt2,bert] [--fractions 0.9,0.8,0.7,0.6]
        [--batch 16]

Each model is compiled twice per budget (a fraction of its unconstrained predicted peak), once with the
program switched off; the report is the plan's recomputed ops and FLOPs, its predicted peak against the
budget, and which solver the plan kept. Nothing is timed but compilation.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_compare  # noqa: E402  (the bench models' configs)

import kiln  # noqa: E402
from kiln.passes import remat  # noqa: E402


def plan_of(args, model_name: str, fraction: float, with_program: bool) -> str:
    cfg = argparse.Namespace(model=model_name, vocab=8192, hidden=512, intermediate=1408, layers=4, heads=8, seq=256)
    model = step_compare.build(cfg)
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=torch.Generator().manual_seed(0))
    real = remat._cheapest_cover
    if not with_program:
        remat._cheapest_cover = lambda *a: None
    t = time.perf_counter()
    try:
        step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4), memory_budget=fraction)
        step(input_ids=ids, labels=ids)
    except kiln.KilnError as e:
        return f"cannot be met ({str(e).split(':')[1].strip()[:60]})"
    finally:
        remat._cheapest_cover = real
    p = step.last.memory
    return (f"{len(p.chosen):3d} ops {p.extra_flops / 1e9:7.2f} GFLOP, peak {p.after / 2**20:5.0f} of "
            f"{p.budget / 2**20:5.0f} MiB, kept: {p.solver:6s} ({time.perf_counter() - t:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama,gpt2,bert")
    ap.add_argument("--fractions", default="0.9,0.8,0.7,0.6")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    print(f"{'model':6s} {'budget':>6s}  {'greedy pass alone':52s}  with the covering program")
    for name in args.models.split(","):
        for frac in (float(f) for f in args.fractions.split(",")):
            print(f"{name:6s} {frac:6.2f}  {plan_of(args, name, frac, False):52s}  {plan_of(args, name, frac, True)}",
                  flush=True)


if __name__ == "__main__":
    main()
