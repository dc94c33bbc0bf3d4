"""The `upcast` dialect: low-precision matmul, convolution and attention on CPUs without bf16/fp16
matrix instructions.

A CPU without AVX-512 BF16 / AMX (or AVX-512 FP16 for fp16) has no low-precision dot product, and
ATen's bf16 `mm` there runs an emulated kernel at about 1/50 of the fp32 rate (measured on this
project's AVX2 machines: 1.6 against 80 GFLOP/s; `F.linear` 14 GFLOP/s). This dialect runs each such
op on fp32 copies of its low-precision inputs and rounds its outputs back once. That is the contract
of a native bf16 GEMM too (bf16 operands, fp32 accumulation, one rounding of the result), so the
mixed-precision program keeps its numerics: values between ops, saved activations and gradients stay
bf16/fp16 and only the products themselves are computed in fp32.

The checker declines on CPUs that have the native instructions (then the ATen kernels are faster)
and on other devices. Which outputs are rounded back follows the native op: its output dtypes on
low-precision inputs are read once per dtype signature from a meta-tensor run (the flash-attention
log-sum-exp, fp32 natively, stays fp32).
"""
from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from kiln.dialects.registry import dialect, kernel
from kiln.dialects.sdpa import SAFE_KERNELS
from kiln.ops.registry import Cast, all_ops

aten = torch.ops.aten
LOW = (torch.bfloat16, torch.float16)

UPCAST = dialect("upcast", priority=20, devices=("cpu",),
                 doc="bf16/fp16 matmul, conv and attention computed on fp32 copies on CPUs without "
                     "native low-precision matrix instructions (same rounding contract as native)")

# backward kernels emitted by VJP rules of LOWER ops (they are not ops of their own in the registry)
BACKWARD_KERNELS = (aten.convolution_backward.default,
                    aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


@functools.cache
def _lacks_native(dtype: torch.dtype) -> bool:
    from kiln.passes.amp import cpu_has_native
    return cpu_has_native(dtype) is False


def low_dtype_of(node) -> torch.dtype | None:
    """The low-precision float dtype among node's tensor inputs, if any."""
    return next((v.meta.dtype for v in node.inputs if v.meta is not None and v.meta.dtype in LOW), None)


def _wanted(node) -> bool:
    low = low_dtype_of(node)
    return low is not None and _lacks_native(low)


def upcast_kernel(op):
    """`op` run on fp32 copies of its low-precision tensor inputs; outputs rounded to the dtypes the
    native op would return for the original inputs."""
    native_dtypes: dict[tuple, list] = {}

    def run(*args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        signature = tuple(x.dtype if isinstance(x, torch.Tensor) else None for x in flat)
        if signature not in native_dtypes:
            meta = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in flat]
            margs, mkwargs = pytree.tree_unflatten(meta, spec)
            native_dtypes[signature] = [o.dtype if isinstance(o, torch.Tensor) else None
                                        for o in pytree.tree_leaves(op(*margs, **mkwargs))]
        uargs, ukwargs = pytree.tree_unflatten([_up(x) for x in flat], spec)
        out = op(*uargs, **ukwargs)
        leaves, out_spec = pytree.tree_flatten(out)
        leaves = [o.to(dt) if isinstance(o, torch.Tensor) and dt is not None and o.dtype != dt else o
                  for o, dt in zip(leaves, native_dtypes[signature])]
        return pytree.tree_unflatten(leaves, out_spec)

    name = getattr(op, "__name__", "op")
    run.__name__ = run.__qualname__ = f"upcast_{name.replace('.', '_')}"
    return run


# Products whose fp32 copies (operands and result) would exceed this are computed in slices of rows,
# so the copies stay small: a native bf16 matmul makes none, and the vocabulary projection (tokens x
# vocab logits, and their gradient) would otherwise cost transient fp32 copies of the whole logits.
SLICE_BYTES = 16 * 2 ** 20


def _up(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in LOW else t


def _row_slices(m: int, per_row_bytes: int):
    rows = max(1, SLICE_BYTES // max(1, per_row_bytes))
    return [(s, min(m, s + rows)) for s in range(0, m, rows)]


def upcast_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D a (M, K), b (K, N), one of them low precision: fp32 products rounded once. Big
    products go in slices of rows of a, or, for a long reduction (a weight gradient g^T @ x), in
    slices of K accumulated in fp32."""
    low = a.dtype if a.dtype in LOW else b.dtype
    (m, k), n = a.shape, b.shape[1]
    if 4 * m * (k + n) <= SLICE_BYTES:
        return torch.mm(_up(a), _up(b)).to(low)
    bf = _up(b)
    if m >= k:
        out = torch.empty(m, n, dtype=low, device=a.device)
        for s, e in _row_slices(m, 4 * (k + n)):
            out[s:e] = torch.mm(_up(a[s:e]), bf)
        return out
    depth = max(1, SLICE_BYTES // (4 * m))
    acc = torch.mm(_up(a[:, :depth]), bf[:depth])
    for s in range(depth, k, depth):
        acc.addmm_(_up(a[:, s:s + depth]), bf[s:s + depth])
    return acc.to(low)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with fp32 products rounded once; big inputs go in slices of rows."""
    low = next(t.dtype for t in (x, weight, bias) if isinstance(t, torch.Tensor) and t.dtype in LOW)
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k if k else 0
    if 4 * rows * (k + n) <= SLICE_BYTES:
        return torch.nn.functional.linear(_up(x), _up(weight), _up(bias)).to(low)
    x2 = x.reshape(rows, k)
    wf, bf = _up(weight), _up(bias)
    out = torch.empty(rows, n, dtype=low, device=x.device)
    for s, e in _row_slices(rows, 4 * (k + n)):
        out[s:e] = torch.nn.functional.linear(_up(x2[s:e]), wf, bf)
    return out.reshape(*x.shape[:-1], n)


def upcast_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """bias + a @ b (beta/alpha as aten.addmm); rows of a in slices when big."""
    if beta != 1 or alpha != 1:
        return _addmm_scaled(bias, a, b, beta=beta, alpha=alpha)
    low = next(t.dtype for t in (a, b, bias) if t.dtype in LOW)
    (m, k), n = a.shape, b.shape[1]
    bf, bb = _up(b), _up(bias)
    if 4 * m * (k + n) <= SLICE_BYTES:
        return torch.addmm(bb, _up(a), bf).to(low)
    out = torch.empty(m, n, dtype=low, device=a.device)
    for s, e in _row_slices(m, 4 * (k + n)):
        out[s:e] = torch.addmm(bb if bb.dim() < 2 or bb.shape[0] == 1 else bb[s:e], _up(a[s:e]), bf)
    return out


_addmm_scaled = upcast_kernel(aten.addmm.default)      # beta/alpha != 1: unsliced, rare
SLICED = {aten.mm.default: upcast_mm, aten.linear.default: upcast_linear, aten.addmm.default: upcast_addmm}


def _register() -> None:
    targets = [t for op in all_ops() if op.cast is Cast.LOWER for t in op.targets] + list(BACKWARD_KERNELS)
    for target in dict.fromkeys(targets):
        fn = SLICED.get(target) or upcast_kernel(SAFE_KERNELS.get(target, target))
        kernel(UPCAST, target, fn, checker=_wanted, name="fp32")


_register()
