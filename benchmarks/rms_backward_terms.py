"""RMSNorm's backward of a two-term output gradient (kiln:rms_norm_backward_of_sum): the two terms read by the
kernel against `torch.add` and the one-term kernel, the calls interleaved in one process.

    python benchmarks/rms_backward_terms.py [--rows 2048 --dim 512 --calls 800]

The bench Llama's case: bf16 terms (the gate and up projections' input gradients), fp32 input and grad_sum (the
residual stream's gradient), a bf16 copy of the result. Prints the minimum, 10th percentile and median ms of each
(the minimum is the steadiest figure on a shared machine). To compare two versions of the kernel, run this from
each checkout in alternating processes (`PYTHONPATH=<checkout>`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kiln.kernels import native, norms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--calls", type=int, default=800)
    args = ap.parse_args()
    if native.library() is None:
        sys.exit("the native library is not available here (no C compiler, or KILN_NATIVE=0): nothing to measure")
    torch.manual_seed(0)
    r, d = args.rows, args.dim
    g1, g2 = torch.randn(r, d).bfloat16(), torch.randn(r, d).bfloat16()
    x, grad_sum, w = torch.randn(r, d), torch.randn(r, d), torch.rand(d) + 0.5
    rstd = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    total = torch.add(g1, g2)
    cases = {
        "torch.add": lambda: torch.add(g1, g2),
        "kernel, one term": lambda: norms._rms_backward_native(total, (None, None), grad_sum, x, w, rstd,
                                                                       torch.bfloat16),
        "kernel, two terms": lambda: norms._rms_backward_native(g1, (g2, None), grad_sum, x, w, rstd,
                                                                        torch.bfloat16),
    }
    times = {name: [] for name in cases}
    for _ in range(args.calls):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    print(f"({r}, {d}), {torch.get_num_threads()} threads, {args.calls} calls each; ms")
    for name, ts in times.items():
        ts.sort()
        print(f"  {name:18s} min {ts[0] * 1e3:.3f}  p10 {ts[len(ts) // 10] * 1e3:.3f}  "
              f"median {statistics.median(ts) * 1e3:.3f}")


if __name__ == "__main__":
    main()
