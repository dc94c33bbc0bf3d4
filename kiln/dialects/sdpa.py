"""The `sdpa` dialect: PyTorch's fused attention kernels (flash attention on CPU), forward and backward.

scaled_dot_product_attention is lowered to the fused forward kernel, which also returns the
log-sum-exp that its fused backward kernel needs, so attention probabilities are never stored.
"""
from __future__ import annotations

import torch

from kiln.dialects.aten import expand_kv_heads, sdpa_args
from kiln.dialects.registry import dialect, kernel, lowering
from kiln.ir.graph import Role, depends_on
from kiln.ir.symbolic import same

aten = torch.ops.aten

SDPA = dialect("sdpa", priority=10, devices=("cpu",),
               doc="PyTorch fused attention: flash attention forward/backward kernels")


def _flash_cpu_ok(n) -> bool:
    q, k, v, mask, p, causal, scale, gqa = sdpa_args(n)
    if p > 0:                 # the CPU flash kernel has no dropout
        return False
    if causal and mask is not None:
        return False
    if mask is not None and depends_on(mask, {Role.PARAM}):
        return False          # a learned bias in the mask (T5): the fused backward gives it no gradient
    floats = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if not (same(q.meta.shape[-1], k.meta.shape[-1]) and same(k.meta.shape[-1], v.meta.shape[-1])):
        return False          # the CPU kernel needs one head size (MLA attention has a wider q/k than v)
    return len(q.meta.shape) == 4 and q.meta.dtype in floats and k.meta.dtype == q.meta.dtype


def sdpa_flash_cpu(b, n):
    q, k, v, mask, p, causal, scale, gqa = sdpa_args(n)
    if gqa:
        k, v = expand_kv_heads(b, q, k, v)
    if mask is not None and mask.meta.dtype == torch.bool:
        # the kernel takes an additive mask of the query's dtype
        mask = b(aten.where.ScalarSelf, mask, 0.0, b(aten.full.default, [], float("-inf"), dtype=q.meta.dtype,
                                                         device=q.meta.device))
    elif mask is not None and mask.meta.dtype != q.meta.dtype:
        mask = b(aten._to_copy.default, mask, dtype=q.meta.dtype)
    out, _lse = b(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, causal,
                  attn_mask=mask, scale=scale)
    return [out]


def _dense_last(t):
    """`t` with unit stride in its last dimension (a copy only where it has not)."""
    return t if t.dim() == 0 or t.stride(-1) == 1 or t.size(-1) == 1 else t.contiguous()


def flash_forward(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """ATen's CPU flash attention, given q/k/v whose last dimension is dense. The kernel reads them as if it
    were and returns garbage otherwise (B2 H16 T4 D9 with a head-dim stride of 4: 2.2 off the math path,
    the backward 15), where eager `F.scaled_dot_product_attention` checks and takes the math path. Layouts
    in Kiln's graph are predictions, so the check is made on the tensors, at run time: attention over
    channels (Florence-2's DaViT: q/k/v permuted so that tokens are the last dimension) trained to NaN."""
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        _dense_last(q), _dense_last(k), _dense_last(v), dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def flash_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """The backward kernel, with the same check on every tensor it reads per head dimension."""
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        _dense_last(grad_out), _dense_last(q), _dense_last(k), _dense_last(v), _dense_last(out), logsumexp,
        dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


# the ATen flash kernels -> the versions safe for any layout (the upcast dialect runs these too)
SAFE_KERNELS = {aten._scaled_dot_product_flash_attention_for_cpu.default: flash_forward,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_backward}

lowering(SDPA, aten.scaled_dot_product_attention.default, sdpa_flash_cpu, checker=_flash_cpu_ok, name="flash")
# the fused kernels the lowering emits (and the VJP rule's backward kernel) belong to this dialect
for _op, _safe in SAFE_KERNELS.items():
    kernel(SDPA, _op, _safe, name="flash")
