"""The AVX-512 intrinsic loops (kiln/kernels/native_vec512.c) against the same library built as plain C, in one
process, calls interleaved: SwiGLU forward and backward in bf16 (Llama's MLP, 2048 x 1408) and the loss's
softmax - onehot over a chunk of logits (bf16 1024 x 8192 and fp32 512 x 8192, the bench models' chunks).

    .venv/bin/python benchmarks/exp_loops.py [--rounds 40]

Both libraries are compiled here from the checkout's sources with the AVX-512 flags (native_build.py), the
plain one with -DKILN_PLAIN_LOOPS; each prints the minimum and median of its calls in ms. The outputs are
compared too: SwiGLU's must be equal bit for bit. Needs a CPU with AVX-512 and a C compiler.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.kernels import native, native_build  # noqa: E402


def build(out_dir: str, plain: bool) -> ctypes.CDLL:
    flags = native_build.flags("AVX512") + (["-DKILN_PLAIN_LOOPS"] if plain else [])
    path = os.path.join(out_dir, "plain.so" if plain else "vec512.so")
    compiler = shutil.which(os.environ.get("CC") or "cc")          # as kiln/kernels/native.py finds it
    if compiler is None:
        sys.exit("no C compiler ($CC, else cc): the two builds cannot be made here")
    native_build.compile_library(compiler, flags, path)
    lib = ctypes.CDLL(path)
    for name in ("kiln_swiglu", "kiln_swiglu_backward", "kiln_ce_grads"):
        getattr(lib, name).argtypes = native._SIGNATURES[name]
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    if not all(native.cpu_flag(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        sys.exit("this benchmark needs a CPU with AVX-512 (the intrinsic loops are built only for it)")
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    rows, cols = 2048, 1408
    gate, up, grad = (torch.randn(rows, cols) * 3).bfloat16(), torch.randn(rows, cols).bfloat16(), \
        torch.randn(rows, cols).bfloat16()
    logits = {"bf16": ((torch.randn(1024, 8192) * 2).bfloat16(), 1), "fp32": (torch.randn(512, 8192) * 2, 0)}
    labels = torch.randint(0, 8192, (1024,))
    per_token, lse = torch.empty(1024), torch.empty(1024)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"plain C": build(tmp, plain=True), "intrinsics": build(tmp, plain=False)}
        outs, times = {}, {name: {} for name in libs}

        def run(name, lib, what):
            if what == "swiglu":
                o = torch.empty_like(gate)
                f = lambda: lib.kiln_swiglu(gate.data_ptr(), 1, cols, up.data_ptr(), 1, cols, o.data_ptr(), 1, cols,  # noqa: E731
                                            rows, cols, threads)
                result = (o,)
            elif what == "swiglu_backward":
                og, ou = torch.empty_like(gate), torch.empty_like(gate)
                f = lambda: lib.kiln_swiglu_backward(grad.data_ptr(), 1, cols, gate.data_ptr(), 1, cols,  # noqa: E731
                                                     up.data_ptr(), 1, cols, og.data_ptr(), 1, cols, ou.data_ptr(), 1,
                                                     cols, rows, cols, threads)
                result = (og, ou)
            else:
                z0, code = logits[what.split()[-1]]
                z = z0.clone()                                  # written in place
                f = lambda: lib.kiln_ce_grads(z.data_ptr(), code, z.shape[1], labels.data_ptr(), -100,  # noqa: E731
                                              per_token.data_ptr(), lse.data_ptr(), z.shape[0], z.shape[1], None,
                                              None, threads)
                result = (z, per_token[:z.shape[0]].clone())
            t = time.perf_counter()
            f()
            times[name].setdefault(what, []).append(time.perf_counter() - t)
            return result

        kinds = ("swiglu", "swiglu_backward", "softmax - onehot bf16", "softmax - onehot fp32")
        for i in range(args.rounds):
            for what in kinds:
                for name in (list(libs) if i % 2 == 0 else list(libs)[::-1]):
                    outs[name, what] = run(name, libs[name], what)
    print(f"{threads} threads, {args.rounds} interleaved calls each; ms (minimum / median)")
    for what in kinds:
        cells = [f"{name} {min(times[name][what]) * 1e3:.3f} / {statistics.median(times[name][what]) * 1e3:.3f}"
                 for name in libs]
        same = all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
                   for a, b in zip(outs["plain C", what], outs["intrinsics", what]))
        print(f"{what:24s} " + "   ".join(cells) + f"   {'same bits' if same else 'values differ'}")


if __name__ == "__main__":
    main()
