"""The `upcast` dialect: low-precision matmul, convolution and attention on CPUs without bf16/fp16
matrix instructions.

A CPU without AVX-512 BF16 / AMX (or AVX-512 FP16 for fp16) has no low-precision dot product, and
ATen's bf16 `mm` there runs an emulated kernel at about 1/50 of the fp32 rate (measured on this
project's AVX2 machines: 1.6 against 80 GFLOP/s; `F.linear` 14 GFLOP/s). This dialect runs each such
op on fp32 copies of its low-precision inputs and rounds its outputs back once. That is the contract
of a native bf16 GEMM too (bf16 operands, fp32 accumulation, one rounding of the result), so the
mixed-precision program keeps its numerics: values between ops, saved activations and gradients stay
bf16/fp16 and only the products themselves are computed in fp32.

On CPUs without the native instructions the dialect takes every such op. On CPUs that have them, its
matrix products (`mm`, `bmm`, `linear`, `addmm`, convolutions, Kiln's fused GEMM ops and its fused loss)
are `measured` instead: a native instruction does not make the native kernel faster everywhere. On an Intel Xeon that
reports AVX-512 BF16 but no AMX (2 cores, oneDNN's `brg_matmul:avx512_core_bf16`), ATen's bf16 products
took 1.7-1.9x the time of the same products on fp32 copies, casts included (2048 x 512 x 1408: 14.5
against 8.1 ms): the flags say the instructions are there, the timing says they do not pay. On AMX or on
an AMD EPYC Zen 4 the native kernel wins by 2-4x. Each product shape is timed once per machine
against ATen's kernel (online during training, or ahead) and the faster kept, as for the other measured
dialects. Attention stays with the `attention` dialect, which has its own fp32 candidate.

Which outputs are rounded back follows the native op: its output dtypes on low-precision inputs are
read once per dtype signature from a meta-tensor run (the flash-attention log-sum-exp, fp32 natively,
stays fp32).
"""
from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from kiln.dialects.registry import dialect, kernel
from kiln.dialects.sdpa import SAFE_KERNELS
from kiln.ops.registry import Cast, Kind, all_ops

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


def _worth_measuring(node) -> bool:
    """A low-precision product on a CPU that has (or may have) the native instructions."""
    low = low_dtype_of(node)
    return low is not None and not _lacks_native(low)


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


# Products are computed in slices of SLICE_ROWS rows (or, for a long reduction, of that depth), so each
# slice's fp32 copies are rounded or read while still in cache: on the Xeon of the module docstring a
# (2048, 512) x (512, 512) product on fp32 copies took 3.5-3.6 ms in slices of 512 rows against 4.3-4.7
# unsliced (fp32 inputs alone: 3.7-4.2), and the wider ones of Llama's MLP 0-5 % less. Slices also bound
# the transient fp32 copies (SLICE_BYTES): a native bf16 matmul makes none, and the vocabulary projection
# (tokens x vocab logits, and their gradient) would otherwise copy the whole logits.
SLICE_ROWS = 512
SLICE_BYTES = 16 * 2 ** 20


def _up(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in LOW else t


def _slices(m: int, per_row_bytes: int):
    """[(start, end)] over m rows: SLICE_ROWS each, fewer where a slice's fp32 copies would pass SLICE_BYTES."""
    rows = max(1, min(SLICE_ROWS, SLICE_BYTES // max(1, per_row_bytes)))
    return [(s, min(m, s + rows)) for s in range(0, m, rows)]


def upcast_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D a (M, K), b (K, N), one of them low precision: fp32 products rounded once, in slices of
    rows of a, or, for a long reduction (a weight gradient g^T @ x), in slices of K accumulated in fp32."""
    low = a.dtype if a.dtype in LOW else b.dtype
    (m, k), n = a.shape, b.shape[1]
    if m >= k:
        parts = _slices(m, 4 * (k + n))
        if len(parts) == 1:
            return torch.mm(_up(a), _up(b)).to(low)
        bf = _up(b)
        out = torch.empty(m, n, dtype=low, device=a.device)
        for s, e in parts:
            out[s:e] = torch.mm(_up(a[s:e]), bf)
        return out
    parts = _slices(k, 4 * (m + n))
    acc = torch.mm(_up(a[:, :parts[0][1]]), _up(b[:parts[0][1]]))
    for s, e in parts[1:]:
        acc.addmm_(_up(a[:, s:e]), _up(b[s:e]))
    return acc.to(low)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with fp32 products rounded once, in slices of rows."""
    low = next(t.dtype for t in (x, weight, bias) if isinstance(t, torch.Tensor) and t.dtype in LOW)
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k if k else 0
    parts = _slices(rows, 4 * (k + n))
    if len(parts) <= 1:
        return torch.nn.functional.linear(_up(x), _up(weight), _up(bias)).to(low)
    x2 = x.reshape(rows, k)
    wf, bf = _up(weight), _up(bias)
    out = torch.empty(rows, n, dtype=low, device=x.device)
    for s, e in parts:
        out[s:e] = torch.nn.functional.linear(_up(x2[s:e]), wf, bf)
    return out.reshape(*x.shape[:-1], n)


def upcast_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """bias + a @ b (beta/alpha as aten.addmm), in slices of rows of a."""
    if beta != 1 or alpha != 1:
        return _addmm_scaled(bias, a, b, beta=beta, alpha=alpha)
    low = next(t.dtype for t in (a, b, bias) if t.dtype in LOW)
    (m, k), n = a.shape, b.shape[1]
    bf, bb = _up(b), _up(bias)
    parts = _slices(m, 4 * (k + n))
    if len(parts) == 1:
        return torch.addmm(bb, _up(a), bf).to(low)
    out = torch.empty(m, n, dtype=low, device=a.device)
    for s, e in parts:
        out[s:e] = torch.addmm(bb if bb.dim() < 2 or bb.shape[0] == 1 else bb[s:e], _up(a[s:e]), bf)
    return out


_addmm_scaled = upcast_kernel(aten.addmm.default)      # beta/alpha != 1: unsliced, rare
SLICED = {aten.mm.default: upcast_mm, aten.linear.default: upcast_linear, aten.addmm.default: upcast_addmm}


def _register() -> None:
    lower = [op for op in all_ops() if op.cast is Cast.LOWER]
    products = {t for op in lower if op.kind is not Kind.ATTENTION for t in op.targets}
    products.add(aten.convolution_backward.default)
    for target in dict.fromkeys([t for op in lower for t in op.targets] + list(BACKWARD_KERNELS)):
        fn = SLICED.get(target) or upcast_kernel(SAFE_KERNELS.get(target, target))
        kernel(UPCAST, target, fn, checker=_wanted, name="fp32")
        if target in products:
            kernel(UPCAST, target, fn, checker=_worth_measuring, name="fp32", measured=True)


_register()
