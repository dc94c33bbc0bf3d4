"""The `onednn` dialect: linear layers through oneDNN (mkldnn) on CPU, only where that beats ATen here.

ATen's CPU `linear` calls MKL/oneDNN GEMM already; oneDNN's inner-product primitive wins on some CPUs
and shapes (bf16 on CPUs with AVX512-BF16/AMX) and loses on others. The kernel is therefore
`measured`: for each distinct (shapes, strides, dtypes) the step's tuner times both kernels once per
machine (`kiln.dialects.measure`) and keeps oneDNN only when it takes at most 95 % of ATen's time.

Measured on the development machine (AMD EPYC, 2 cores, AVX2, fp32, 2048 tokens): oneDNN took
1.05-1.4x ATen's time on every transformer shape, so there it is never chosen; bf16 inner products
are not available at all without native bf16 instructions, and the checker declines them.
"""
from __future__ import annotations

import torch

from kiln.dialects.registry import dialect, kernel

aten = torch.ops.aten

ONEDNN = dialect("onednn", priority=4, devices=("cpu",),
                 doc="oneDNN linear (inner product), per shape where measured faster than ATen on this machine")


def onednn_linear(x, w, b=None):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _linear_ok(n) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    x, w = n.args[0], n.args[1]
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    if x.meta is None or w.meta is None or len(w.meta.shape) != 2 or len(x.meta.shape) < 2:
        return False
    dtype = x.meta.dtype
    if dtype != torch.float32:
        from kiln.passes.amp import cpu_has_native
        if dtype not in (torch.bfloat16, torch.float16) or not cpu_has_native(dtype):
            return False       # oneDNN has no low-precision inner product without the instructions
    return w.meta.dtype == dtype and (b is None or b.meta.dtype == dtype)


kernel(ONEDNN, aten.linear.default, onednn_linear, checker=_linear_ok, name="linear", measured=True)
