"""What the non-finite guard costs: a bench model trained with nonfinite="raise" and "ignore",
interleaved in one process, medians of the step times.

    python benchmarks/guard_cost.py [--model llama] [--size default] [--steps 7] [--warmup 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import kiln
from kiln.bench import zoo


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=zoo.MODELS)
    ap.add_argument("--size", default="default", choices=tuple(zoo.SIZES))
    ap.add_argument("--steps", type=int, default=7, help="measured steps per mode (default 7)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps per mode first (default 3)")
    args = ap.parse_args(argv)
    entry = zoo.get(args.model, args.size)
    batch = entry.build_batch(0)
    modes = ("raise", "ignore")
    steps = {}
    for mode in modes:
        torch.manual_seed(0)
        steps[mode] = kiln.compile(entry.build_model().train(), optimizer=kiln.optim.AdamW(lr=1e-4),
                                   tuning="ahead", nonfinite=mode)
    times = {m: [] for m in modes}
    for i in range(args.warmup + args.steps):
        for mode in modes if i % 2 == 0 else reversed(modes):      # interleaved, alternating order
            t0 = time.perf_counter()
            steps[mode](**batch)
            if i >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
        print(f"round {i + 1}/{args.warmup + args.steps}", flush=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    guard = sum(t for n, t in zip(steps["raise"].graph.nodes, steps["raise"].profile())
                if n.op.name == "kiln.check_finite")
    print(f"{args.model}/{args.size}: nonfinite='raise' {med['raise']:.4f} s, 'ignore' {med['ignore']:.4f} s "
          f"(median of {args.steps}); ratio {med['raise'] / med['ignore']:.4f}; the check node itself "
          f"{guard * 1e3:.2f} ms = {100 * guard / med['ignore']:.2f} % of a step (profile)")


if __name__ == "__main__":
    main()
