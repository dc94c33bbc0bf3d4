"""Measure this machine's peak matrix-multiply rate per dtype.

"Fraction of peak" needs a denominator measured on the same machine in the
same run, not a datasheet number: turbo, thread count and the kernels PyTorch
picks for a dtype all move it.  On CPUs without native bf16 instructions, for
example, bf16 matmuls run tens of times slower than fp32.

The rate is the best of ``torch.mm`` and ``F.linear`` (they can dispatch to
different kernels: oneDNN for linear, BLAS for mm) and, for low-precision
dtypes, of the product of fp32 copies rounded back once (how Kiln's ``upcast``
dialect multiplies bf16 operands on CPUs without bf16 instructions), each the
median of a few repetitions on square matrices.  The size grows until one product takes about
``target_s`` so tiny sizes do not understate the rate, and stays small where
the dtype is slow so the measurement stays short.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _median_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: first call pays packing, allocation and kernel selection
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(dtype: str, target_s: float = 0.05, max_n: int = 4096, reps: int = 5) -> dict:
    """Peak matmul FLOP/s for ``dtype`` ("fp32" or "bf16") and how it was measured. Each way of
    multiplying gets its own size: the fast ones need big matrices to show their rate, the slow
    (emulated) ones would take seconds there."""
    torch_dtype = DTYPES[dtype]
    candidates = {"mm": torch.mm, "linear": lambda a, b: F.linear(a, b)}
    if torch_dtype != torch.float32:
        candidates["upcast"] = lambda a, b: torch.mm(a.float(), b.float()).to(torch_dtype)
    rates, sizes = {}, {}
    for op, fn in candidates.items():
        gen = torch.Generator().manual_seed(0)
        n = 256
        while True:
            a = torch.randn(n, n, generator=gen).to(torch_dtype)
            b = torch.randn(n, n, generator=gen).to(torch_dtype)
            single = _median_time(lambda: fn(a, b), reps=1)
            if single >= target_s or n >= max_n:
                break
            n *= 2
        rates[op], sizes[op] = 2 * n ** 3 / _median_time(lambda: fn(a, b), reps), n
    best = max(rates, key=rates.get)
    return {"flops_per_s": rates[best], "op": best, "n": sizes[best], "rates": rates, "sizes": sizes,
            "reps": reps, "threads": torch.get_num_threads()}


def measure_all(dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict:
    return {d: measure(d) for d in dtypes}
