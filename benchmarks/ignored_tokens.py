"""The vocabulary projection and its loss, forward + backward, when some labels are ignored (padding).

    .venv/bin/python benchmarks/ignored_tokens.py [--tokens 936] [--hidden 512] [--vocab 8192]
        [--ignored 0,0.33] [--reps 12]

Eager PyTorch (`F.cross_entropy(F.linear(h, w), y)`) against Kiln's two kernels, which compute no logits
for tokens whose label is -100: `kiln.linear_cross_entropy_grads` (the gradients computed in the forward,
what Kiln's compiled steps use) and the chunked `kiln.linear_cross_entropy` (the logits computed again in
the backward, what `kiln.kernels.linear_cross_entropy` runs). The modes are interleaved in one
process, fp32; medians of --reps after 2 warm-up rounds. The default is a batch of 8 dynamically padded
sequences of 32..128 tokens (936 = 8 x 117, the expected longest) on the 4-layer bench models' head.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln.*)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=936)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ignored", default="0,0.33", help="fractions of labels set to -100, comma-separated")
    p.add_argument("--reps", type=int, default=12)
    args = p.parse_args()
    fractions = [float(f) for f in args.ignored.split(",")]
    if args.reps < 1 or min(args.tokens, args.hidden, args.vocab) < 1 or not all(0 <= f <= 1 for f in fractions):
        p.error("need positive sizes and --reps, and --ignored fractions in [0, 1]")
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    print(f"{args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab}, fp32, {torch.get_num_threads()} "
          f"threads, {torch.backends.cpu.get_cpu_capability()}; forward + backward, median ms")
    print(f"{'ignored':>8} {'eager':>9} {'grads':>10} {'chunked':>9}")
    for frac in fractions:
        y = torch.randint(0, args.vocab, (args.tokens,))
        y[torch.rand(args.tokens) < frac] = -100
        modes = {"eager": lambda: F.cross_entropy(F.linear(h, w), y),
                 "grads": lambda: torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 0)[0],
                 "chunked": lambda: torch.ops.kiln.linear_cross_entropy(h, w, y, -100, "mean", 0)[0]}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.reps + 2):
            for m, fn in modes.items():
                t0 = time.perf_counter()
                fn().backward()
                if r >= 2:
                    times[m].append(time.perf_counter() - t0)
                h.grad = w.grad = None
        med = {m: statistics.median(t) * 1000 for m, t in times.items()}
        print(f"{frac:8.2f} {med['eager']:8.1f} {med['grads']:10.1f} {med['chunked']:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
