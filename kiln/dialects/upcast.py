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
        up = [x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW else x for x in flat]
        uargs, ukwargs = pytree.tree_unflatten(up, spec)
        out = op(*uargs, **ukwargs)
        leaves, out_spec = pytree.tree_flatten(out)
        leaves = [o.to(dt) if isinstance(o, torch.Tensor) and dt is not None and o.dtype != dt else o
                  for o, dt in zip(leaves, native_dtypes[signature])]
        return pytree.tree_unflatten(leaves, out_spec)

    name = getattr(op, "__name__", "op")
    run.__name__ = run.__qualname__ = f"upcast_{name.replace('.', '_')}"
    run.op = op
    return run


def _register() -> None:
    targets = [t for op in all_ops() if op.cast is Cast.LOWER for t in op.targets] + list(BACKWARD_KERNELS)
    for target in dict.fromkeys(targets):
        kernel(UPCAST, target, upcast_kernel(target), checker=_wanted, name="fp32")


_register()
