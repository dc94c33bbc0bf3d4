"""The `onednn` dialect: matrix products through oneDNN (mkldnn) on CPU, only where that beats ATen here.

ATen's CPU `linear` calls MKL/oneDNN GEMM already; oneDNN's inner-product primitive wins on some CPUs
and shapes and loses on others. The kernels are therefore `measured`: for each distinct (shapes, strides,
dtypes) the step's tuner times both kernels once per machine (`kiln.dialects.measure`) and keeps oneDNN
only when it takes at most 95 % of ATen's time.

- `linear`. On an AVX2-only machine (AMD EPYC, 2 cores, fp32, 2048 tokens) oneDNN took 1.05-1.4x ATen's
  time on every transformer shape, so there it is never chosen; bf16 inner products are not available
  at all without native bf16 instructions, and the checker declines them.
- `addmm(bias, x, w)` with a bias of w's columns (GPT-2's Conv1D, `x @ w + b`): the same inner product
  with w transposed (a view: oneDNN reads it as it is) and the bias added to the fp32 sums before the one
  rounding, as ATen's addmm. ATen's CPU addmm first copies the bias into every row of its output and then
  accumulates the product onto it: a write and a read of the whole output more. Measured on an EPYC with
  AVX-512 BF16 (bf16, 2048 tokens, one call each after a cold cache): 512x1536 8.60 against 7.83 ms,
  512x2048 11.35 against 10.50, 2048x512 10.63 against 10.23, 512x512 2.89 against 2.86; bit for bit ATen's
  result on all four.
- `mm(a, b)` in fp32 (the backward's products, and any matrix product the forward keeps): the inner product
  of `b.t()`, a view; and the fused loss's logits and grad_hidden products (`kiln.linear_cross_entropy_grads`
  with `onednn=True`). ATen's fp32 products are MKL's, and on an AVX-512 CPU oneDNN's can be much faster
  (EPYC Zen 4, 2 threads, medians of 7, ms: (2048, 512) x (512, 2048) 20.99 against 29.94, (512, 512) x (512,
  8192) 20.91 against 25.42, (2048, 2048) x (2048, 512) 20.83 against 22.25; with `a` transposed sometimes
  slower: 28.26 against 23.62). fp32 `addmm` is measured too. These sums run in another order than MKL's:
  differences of about 1e-7 of the result's scale, as `linear`'s. Half-type `mm` stays ATen's, whose bf16
  product is oneDNN's matmul already (the inner product was 0.93-1.49x its time on the same shapes).
"""
from __future__ import annotations

import functools

import torch

from kiln.dialects.registry import dialect, kernel
from kiln.ir.symbolic import hint, same
from kiln.kernels._common import inner_product
from kiln.kernels.cross_entropy import linear_cross_entropy_grads

aten = torch.ops.aten

ONEDNN = dialect("onednn", priority=4, devices=("cpu",),
                 doc="oneDNN linear (inner product), fp32 mm, addmm with a bias vector and the fused loss's fp32 "
                 "products, per shape where measured faster than ATen on this machine")


def onednn_linear(x, w, b=None):
    return aten.linear(x, w, b) if x.shape[-1] == 0 else inner_product(x, w, b)     # (an empty sum: ATen's)


def _linear_ok(n) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    x, w = n.args[0], n.args[1]
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    if x.meta is None or w.meta is None or len(w.meta.shape) != 2 or len(x.meta.shape) < 2:
        return False
    dtype = x.meta.dtype
    return _native_dtype(dtype) and w.meta.dtype == dtype and (b is None or b.meta.dtype == dtype)


def _native_dtype(dtype) -> bool:
    """fp32, or a half type this CPU multiplies natively and oneDNN runs its inner product in here (`native_half`)."""
    return dtype == torch.float32 or native_half(dtype)


@functools.lru_cache(maxsize=None)
def native_half(dtype) -> bool:
    """Whether oneDNN's inner product takes `dtype` (bf16/fp16) here on native instructions. The CPU's flags
    (`cpu_has_native`) are not enough: oneDNN may be held below them (ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 BF16
    machine, the AVX2 test pass), and then it cannot create the primitive at all; so one tiny product is tried."""
    from kiln.passes.amp import cpu_has_native
    if dtype not in (torch.bfloat16, torch.float16) or not cpu_has_native(dtype):
        return False
    try:
        inner_product(torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype))
    except (RuntimeError, NotImplementedError):         # no primitive here, or no oneDNN at all
        return False
    return True


kernel(ONEDNN, aten.linear.default, onednn_linear, checker=_linear_ok, name="linear", measured=True)


def onednn_addmm(bias, x, w, *, beta=1, alpha=1):
    """aten.addmm(bias, x, w) for a bias of w's columns, beta = alpha = 1 (`_addmm_ok`): x @ w + bias."""
    return aten.addmm(bias, x, w) if x.shape[1] == 0 else inner_product(x, w.t(), bias)


def _addmm_ok(n) -> bool:
    """addmm(bias, x, w): x and w matrices, bias a vector of w's columns, one half type this CPU multiplies
    natively, beta and alpha 1."""
    if not torch.backends.mkldnn.is_available() or len(n.args) != 3:
        return False
    if any(n.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
        return False
    bias, x, w = n.args
    metas = [getattr(v, "meta", None) for v in (bias, x, w)]
    if any(m is None for m in metas) or len(metas[1].shape) != 2 or len(metas[2].shape) != 2:
        return False
    if len(metas[0].shape) != 1 or not same(metas[0].shape[0], metas[2].shape[1]):
        return False
    if len({m.dtype for m in metas}) != 1 or any(m.device.type != "cpu" for m in metas):
        return False
    # in half types oneDNN's result is ATen's bit for bit (both are oneDNN's product); fp32 addmm is MKL's,
    # summed in another order (as `linear`: measured, the module docstring)
    return _native_dtype(metas[1].dtype)


kernel(ONEDNN, aten.addmm.default, onednn_addmm, checker=_addmm_ok, name="addmm", measured=True)


def onednn_mm(a, b):
    """aten.mm(a, b): oneDNN's inner product of a and b.t() (a view); ATen's zeros for an empty sum."""
    return aten.mm(a, b) if a.shape[1] == 0 else inner_product(a, b.t())


def _mm_ok(n) -> bool:
    """mm(a, b): two fp32 CPU matrices (not half types: timing them would only spend trials, above)."""
    if not torch.backends.mkldnn.is_available() or len(n.args) != 2:
        return False
    metas = [getattr(v, "meta", None) for v in n.args]
    if any(m is None or len(m.shape) != 2 or m.device.type != "cpu" for m in metas):
        return False
    return metas[0].dtype == metas[1].dtype == torch.float32


kernel(ONEDNN, aten.mm.default, onednn_mm, checker=_mm_ok, name="mm", measured=True)


def onednn_linear_cross_entropy_grads(hidden, weight, labels, ignore_index, reduction, chunk_size, bias=None):
    """kiln.linear_cross_entropy_grads with its logits' and grad_hidden's products oneDNN's (the kernel's
    `onednn=True`): in fp32 chunks that is (512, 512) x (512, 8192) 21.0 ms against MKL's 27.5-29.2, and
    (512, 8192) x (8192, 512) 20.8-20.9 against 22.8-23.1 on the EPYC above."""
    return linear_cross_entropy_grads(hidden, weight, labels, ignore_index, reduction, chunk_size, bias, onednn=True)


def _loss_ok(n) -> bool:
    """The fused loss in fp32 on the CPU, with something to sum in its products (hidden and vocabulary sizes
    above 0). Half types: ATen's products are oneDNN's already (`_mm_ok`)."""
    if not torch.backends.mkldnn.is_available():
        return False
    metas = [getattr(v, "meta", None) for v in n.args[:2]]
    if any(m is None or len(m.shape) != 2 or m.device.type != "cpu" or m.dtype != torch.float32 for m in metas):
        return False
    return all(hint(size) > 0 for size in metas[1].shape)


kernel(ONEDNN, torch.ops.kiln.linear_cross_entropy_grads.default, onednn_linear_cross_entropy_grads, checker=_loss_ok,
       name="linear_cross_entropy_grads", measured=True)
