"""Attention's backward from the forward's log-sum-exp, on matrix products and two native row passes.

Same contract as ATen's CPU flash-attention backward (`aten._scaled_dot_product_flash_attention_for_cpu_backward`:
the output's gradient, q, k, v, the output and its log-sum-exp -> the gradients of q, k and v), computed the
textbook way one group of heads at a time:

    S = q k^T (fp32)      P = exp(S * scale + mask - lse)     dV = P^T dO
    dP = dO v^T (fp32)    dS = P * (dP - rowsum(dO * O)) * scale      dQ = dS k     dK = dS^T q

The scores and their gradient are fp32 products (of fp32 copies of a head group's q, k, v and dO: ATen has no
bf16 product with an fp32 result on CPU), P and dS are rounded once to the inputs' dtype, and the products
with them run in that dtype (bf16 on AMX). The passes from S to P and from dP to dS are single native loops
(native.c `kiln_attn_probs`, `kiln_attn_dscores`); without them, ATen's elementwise ops. A group of heads is
sized so that its scores stay in cache (GROUP_BYTES), so nothing (tokens x tokens)-sized outlives a group.

Where it pays (the Xeon of docs/bf16.md, inputs laid out as projections make them, medians): in bf16 at B8 H8
d64, 7.6 against ATen's 13.7 ms at 128 tokens, 16.3 against 18.3 at 256, but 50.6 against 36.1 at 1024; in fp32
it never wins. The `attention` dialect (kiln/dialects/attention.py) offers it as a measured alternative, so it
runs only where the step's tuner measures it faster on the node's shapes.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kiln.kernels import native

GROUP_BYTES = 1 << 21          # fp32 scores of one head group: 2 MiB (T = S = 256: 8 heads)


def _additive(mask: Tensor | None, is_causal: bool, t: int, s: int, like: Tensor) -> Tensor | None:
    """The mask as fp32 to add to the scores (a boolean one: 0 where attended, -inf elsewhere)."""
    if is_causal:
        causal = torch.ones(t, s, dtype=torch.bool, device=like.device).triu(1)
        mask = torch.zeros(t, s, dtype=torch.float32, device=like.device).masked_fill_(causal, float("-inf"))
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def flash_backward_math(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, logsumexp: Tensor,
                        dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask: Tensor | None = None,
                        scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if dropout_p > 0:
        raise RuntimeError("flash_backward_math has no dropout")
    b, h, t, d = q.shape
    s = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = _additive(attn_mask, is_causal, t, s, q)
    if mask is not None:
        mask = mask.expand(b, h, t, s)
    lib = native.usable(q, k, v, grad_out, out)
    if lib is not None and (s > native.ROW_MAX or (mask is not None and mask.stride(-1) != 1)):
        lib = None
    dq = torch.empty(q.shape, dtype=q.dtype)            # dense: each head group's slice is written in place
    dk, dv = torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)
    group = max(1, min(h, GROUP_BYTES // max(1, t * s * 4)))
    lse = logsumexp.float()
    for bi in range(b):
        for h0 in range(0, h, group):
            sl = (bi, slice(h0, min(h, h0 + group)))
            qg, kg, vg, gg = q[sl].contiguous(), k[sl].contiguous(), v[sl].contiguous(), grad_out[sl].contiguous()
            gf = gg.float()
            delta = (gf * out[sl].float()).sum(-1)                       # (g, t)
            scores = torch.bmm(qg.float(), kg.float().transpose(1, 2))    # (g, t, s) fp32
            mg, lg = (None if mask is None else mask[sl]), lse[sl].contiguous()
            if lib is not None:
                p = torch.empty(scores.shape, dtype=q.dtype)
                rows = scores.shape[0] * t              # row r: head r // t of the group, query r % t
                native.check(lib.kiln_attn_probs(
                    native.ptr(scores), native.ptr(p), native.code(p), native.ptr(lg), native.ptr(mg),
                    mg.stride(0) if mg is not None else 0, mg.stride(1) if mg is not None else 0, t, rows, s,
                    scale, native.threads()), "attention probabilities")
                torch.bmm(p.transpose(1, 2), gg, out=dv[sl])
                dp = torch.bmm(gf, vg.float().transpose(1, 2), out=scores)
                native.check(lib.kiln_attn_dscores(native.ptr(p), native.code(p), native.ptr(dp), native.ptr(delta),
                                                   rows, s, scale, native.threads()), "attention score gradients")
                ds = p
            else:                                       # ATen's elementwise ops (no native loops here)
                z = scores * scale
                if mg is not None:
                    z = z + mg
                pf = torch.exp(z - lg.unsqueeze(-1))
                pf = torch.where(torch.isneginf(lg).unsqueeze(-1), torch.zeros_like(pf), pf)
                p = pf.to(q.dtype)
                torch.bmm(p.transpose(1, 2), gg, out=dv[sl])
                dp = torch.bmm(gf, vg.float().transpose(1, 2))
                ds = (p.float() * (dp - delta.unsqueeze(-1)) * scale).to(q.dtype)
            torch.bmm(ds, kg, out=dq[sl])
            torch.bmm(ds.transpose(1, 2), qg, out=dk[sl])
    return dq, dk, dv

