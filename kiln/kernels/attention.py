"""Attention's forward and backward as matrix products and native row passes: with bf16 inputs on a CPU with
AVX-512 BF16, one native pass each way over heads and tiles of 8 queries; elsewhere one group of heads at a time.

Same contracts as ATen's CPU flash-attention kernels (`aten._scaled_dot_product_flash_attention_for_cpu`: q, k,
v -> the output and its log-sum-exp per query; and its `_backward`: the output's gradient, q, k, v, the output
and the log-sum-exp -> the gradients of q, k and v), computed the textbook way:

    S = q k^T (fp32)   Z = S * scale + mask   lse = logsumexp(Z)   P = exp(Z - lse)   O = P v
    dV = P^T dO   dP = dO v^T (fp32)   dS = P * (dP - rowsum(dO * O)) * scale   dQ = dS k   dK = dS^T q

The scores and their gradient are fp32 products: on a CPU with AVX-512 BF16, of the bf16 inputs themselves
(native_attention.c `kiln_bf16_abt`: pair dot products into fp32, about 3.5x faster than ATen's fp32 product of
widened copies, which is what runs elsewhere; ATen has no bf16 product with an fp32 result on CPU). P and dS
are rounded once to the inputs' dtype, and the products with them run in that dtype (bf16 on AMX). The passes
from S to P (and the log-sum-exp) and from dP to dS are single native loops (`kiln_attn_softmax`,
`kiln_attn_probs`, `kiln_attn_dscores`); without them, ATen's elementwise ops. A group of heads is sized so
that its scores stay in cache (GROUP_BYTES), so nothing (tokens x tokens)-sized outlives a group. In bf16 where
the pair products run, `kiln_attn_forward_bf16` and `kiln_attn_backward_bf16` do the same arithmetic per head
and 8 queries, keeping even a group's scores out of memory, write ATen's flash layouts, and take a mask that
hides each query's later keys (what exported models pass instead of is_causal) as causal (`_causal`).

Where it pays is a matter of shape and machine (docs/bf16-history.md): the products are quadratic in the sequence and
the flash kernels are not, so at long sequences flash wins. The `attention` dialect (kiln/dialects/attention.py)
offers both as measured alternatives, so each runs only where the step's tuner measures it faster on the node's
shapes.
"""
from __future__ import annotations

import ctypes
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


def _setup(name: str, q: Tensor, k: Tensor, dropout_p: float, is_causal: bool, attn_mask: Tensor | None,
           scale: float | None, *others: Tensor):
    """(scale, the additive mask expanded to (b, h, t, s) or None, the native library or None)."""
    if dropout_p > 0:
        raise RuntimeError(f"{name} has no dropout")
    b, h, t, d = q.shape
    s = k.shape[-2]
    mask = _additive(attn_mask, is_causal, t, s, q)
    if mask is not None:
        mask = mask.expand(b, h, t, s)
    lib = native.usable(q, k, *others)
    if lib is not None and (s > native.ROW_MAX or (mask is not None and mask.stride(-1) != 1)):
        lib = None
    return (1.0 / math.sqrt(d) if scale is None else scale), mask, lib


def _products(a: Tensor, b: Tensor, out: Tensor | None = None, kn: bool = False, causal: bool = False,
              at: bool = False) -> Tensor:
    """a @ b^T in fp32 for (g, m, k) a and (g, n, k) b of one dtype (`kn`: a @ b for a (g, k, n) b; `at`: a^T @ b
    for a (g, k, m) a and a (g, k, n) b), into `out` (g, m, n, dense; fp32, or bf16 for bf16 inputs: the fp32
    sums rounded once) if given. `causal` (a query i sees keys j <= i) lets the native kernel skip what the
    causal mask makes irrelevant: for a @ b^T (scores) entries j > i may be 0 instead; for a @ b (kn:
    probabilities, exactly 0 past the diagonal, times keys' rows) row i sums over j <= i only; for a^T @ b (at:
    probabilities or their gradients, 0 past the diagonal, transposed, times queries' rows) key i sums over
    queries c >= i only. Exact either way."""
    lib = _bf16_products() if a.dtype == torch.bfloat16 else None
    if lib is not None:
        a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
        n = b.shape[2] if kn or at else b.shape[1]
        m = a.shape[2] if at else a.shape[1]
        out = torch.empty(a.shape[0], m, n, dtype=torch.float32) if out is None else out
        native.check(lib.kiln_bf16_abt(native.ptr(a), a.stride(0), a.stride(1), int(at), native.ptr(b), b.stride(0),
                                       b.stride(1), int(kn or at), int(causal), native.ptr(out),
                                       int(out.dtype == torch.bfloat16), a.shape[0], m, n, a.shape[1 if at else 2],
                                       int(native.amx_tiles()), native.threads()), "bf16 products")
        return out
    if a.dtype != torch.float32:
        a, b = a.float(), b.float()
    if at:
        a = a.transpose(1, 2)
    if out is not None and out.dtype != torch.float32:
        return out.copy_(torch.bmm(a, b if kn or at else b.transpose(1, 2)))
    return torch.bmm(a, b if kn or at else b.transpose(1, 2), out=out)


def _bf16_products():
    return native.bf16_products() if native.enabled() else None


def _skips_causal() -> bool:
    """Whether the bf16 products with bf16 results (dQ, dK, dV) go to `_products` to skip a causal mask's zeros:
    on the pair dot products, yes; on AMX tiles, ATen's bmm (oneDNN's, on the same tiles) is faster even
    computing them all (B8 H8 T256 d64: dK's product 0.78 against 1.22 ms, docs/kernels.md)."""
    return _bf16_products() is not None and not native.amx_tiles()




def _native_mask(mask: Tensor | None, is_causal: bool) -> tuple:
    """The native row passes' mask arguments: the head group's fp32 mask (pointer, head and query strides; its
    last dimension dense) and the causal flag, under which the passes leave the mask (causal and nothing else
    here) aside and compute only keys j <= i."""
    if is_causal or mask is None:
        return None, 0, 0, int(is_causal)
    return native.ptr(mask), mask.stride(0), mask.stride(1), 0


def _groups(q: Tensor, k: Tensor):
    """(batch, head slice) of each cache-sized head group: its fp32 scores fit GROUP_BYTES."""
    b, h, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    group = max(1, min(h, GROUP_BYTES // max(1, t * s * 4)))
    for bi in range(b):
        for h0 in range(0, h, group):
            yield bi, slice(h0, min(h, h0 + group))


def _kv_heads(q: Tensor, k: Tensor, v: Tensor) -> int:
    """How many query heads share each key/value head: ATen's flash kernels take k and v with fewer heads than q
    (grouped- or multi-query attention, as Falcon passes it), query head i reading key/value head i // that."""
    hq, hk = q.shape[1], k.shape[1]
    if v.shape[1] != hk or hk == 0 or hq % hk:
        raise RuntimeError(f"attention: {hq} query heads cannot share {hk} key and {v.shape[1]} value heads evenly")
    return hq // hk


def flash_forward_math(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, is_causal: bool = False, *,
                       attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    out, lse, _ = _forward_math(q, k, v, dropout_p, is_causal, attn_mask, scale, keep=False)
    return out, lse


def _forward_math(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, is_causal: bool, attn_mask: Tensor | None,
                  scale: float | None, keep: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(output, log-sum-exp, the probabilities where `keep` asks for them and the one-pass kernels that read
    them again run: bf16, at least as many (batch, head) slices as threads; else None)."""
    rep = _kv_heads(q, k, v)
    if rep > 1:                     # the kernels below take one key/value head per query head
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale, mask, lib = _setup("flash_forward_math", q, k, dropout_p, is_causal, attn_mask, scale, v)
    b, h, t, s = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    fused = _bf16_products() if lib is not None and s > 0 else None
    if fused is not None and q.dtype == k.dtype == v.dtype == torch.bfloat16:
        probs = (torch.empty(probs_shape(q.shape, k.shape), dtype=torch.bfloat16)
                 if keep and b * h >= native.threads() else None)
        out, lse = _forward_bf16(fused, q, k, v, None if is_causal else mask, _causal(fused, mask, is_causal), scale,
                                 probs)
        return out, lse, probs
    out = torch.empty(b, t, h, v.shape[-1], dtype=q.dtype).transpose(1, 2)    # ATen's flash layout
    lse = torch.empty(b, h, t, dtype=torch.float32)
    # unnormalized probabilities exp(z - max) (the largest exactly 1), in bf16 where the products take bf16,
    # times v into fp32, scaled by 1 / sum per row and rounded once, as the flash kernel does (normalized
    # probabilities were further from float64: 1.3x flash's mean error in bf16, 1.4x in fp32)
    low = q.dtype == torch.bfloat16 and lib is not None and _bf16_products() is not None
    for sl in _groups(q, k):
        qg, kg, vg = q[sl], k[sl], v[sl]
        scores = _products(qg, kg, causal=is_causal)            # (g, t, s) fp32
        mg = None if mask is None else mask[sl]
        if lib is not None:
            p = torch.empty(scores.shape, dtype=q.dtype if low else torch.float32)
            rowscale = torch.empty(scores.shape[:2])
            native.check(lib.kiln_attn_softmax(
                native.ptr(scores), native.ptr(p), native.code(p), native.ptr(lse[sl]), native.ptr(rowscale),
                *_native_mask(mg, is_causal), t, scores.shape[0] * t, s, scale, native.threads()), "attention softmax")
        else:                                                   # ATen's elementwise ops
            z = scores.mul_(scale) if mg is None else scores.mul_(scale).add_(mg)
            top = z.amax(-1, keepdim=True)
            masked = torch.isneginf(top)                        # every key masked: P 0 and lse 0, as ATen's
            p = torch.exp(z.sub_(top.masked_fill(masked, 0.0)))
            total = p.sum(-1, keepdim=True)
            lse[sl] = torch.where(masked, 0.0, top + total.log()).squeeze(-1)
            rowscale = torch.where(masked, 0.0, 1.0 / total).squeeze(-1)
        o = _products(p, vg, kn=True, causal=is_causal) if low else torch.bmm(p, vg.to(p.dtype))
        out[sl].copy_(o.mul_(rowscale.unsqueeze(-1)))
    return out, lse, None


def _causal(lib, mask: Tensor | None, is_causal: bool) -> bool:
    """Whether the one-pass kernels may skip each query's later keys: is_causal, or an additive mask that hides
    exactly those (and leaves each query a key): what Hugging Face models pass once exported, a materialized
    causal mask (with padding, if any, still added to the keys that remain). Checked natively on each call (b
    slices of t x s floats at most; stride-0 dimensions once)."""
    if is_causal or mask is None:
        return is_causal
    b, h, t, s = mask.shape
    return bool(lib.kiln_attn_mask_is_causal(native.ptr(mask), native.strides(mask), b, h, t, s))


def _forward_bf16(lib, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                  scale: float, probs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The bf16 forward as one native pass (`kiln_attn_forward_bf16`): for each head and 8 of its queries at a
    time, the head-group loop's products, row pass and scaling, the same arithmetic in the same order, with the
    8 queries' scores and probabilities in cache instead of a (heads x queries x keys) buffer between them.
    Given `probs` (`probs_shape`, bf16, dense), the normalized probabilities are also written there, rounded
    once, for `_backward_bf16` to read instead of computing them again."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    b, h, t, d = q.shape
    s, dv = k.shape[2], v.shape[3]
    out = torch.empty(b, t, h, dv, dtype=q.dtype).transpose(1, 2)    # ATen's flash layout: a view of (b, t, h, dv)
    lse = torch.empty(b, h, t, dtype=torch.float32)
    native.check(lib.kiln_attn_forward_bf16(
        native.ptr(q), native.strides(q), native.ptr(k), native.strides(k), native.ptr(v), native.strides(v),
        native.ptr(mask), native.strides(mask), int(is_causal), native.ptr(out), native.strides(out), native.ptr(lse),
        native.ptr(probs), b, h, t, s, d, dv, scale, native.threads()), "attention forward")
    return out, lse


def flash_backward_math(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, logsumexp: Tensor,
                        dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask: Tensor | None = None,
                        scale: float | None = None, probs: Tensor | None = None,
                        grads: tuple | None = None, one_pass: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """`probs`: what `forward_keeping_probs` kept, read by the one-pass bf16 backward where it has the layout
    `probs_shape` gives (else, an empty tensor among them, not read: the probabilities are computed again).
    `grads`: three tensors of q's, k's and v's shapes and dtypes (any layout with a dense last dimension) the
    gradients are written into and returned as (the one-pass kernel writes them there; other paths copy).
    In bf16 on AVX-512 BF16 the one-pass kernel runs (at least as many heads as threads), except on a CPU whose
    AMX tiles run `_products` when nothing causal can be skipped: there the head-group loop on the tiles'
    products is the faster (B8 H8 T256 d64 without a mask on the 2-core Xeon of docs/kernels.md: 10.0-12.7 ms
    against the flash kernel's 14.6-15.7 and the one-pass kernel's 17.3-19.6; under a causal mask, materialized
    or not, the one-pass kernel's 9.7-11.5 against the loop's 12.2-15.6). `one_pass=False` runs the loop
    wherever it could."""
    rep = _kv_heads(q, k, v)
    if rep > 1:                     # per query head, then each key/value head's gradients summed over its queries'
        dq, dk, dv = flash_backward_math(grad_out, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), out,
                                         logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale,
                                         probs=probs, one_pass=one_pass)
        summed = (dq, dk.unflatten(1, (k.shape[1], rep)).sum(2), dv.unflatten(1, (v.shape[1], rep)).sum(2))
        return _into(summed, grads)
    scale, mask, lib = _setup("flash_backward_math", q, k, dropout_p, is_causal, attn_mask, scale, v, grad_out,
                              out)
    t, s = q.shape[2], k.shape[2]
    fused = _bf16_products() if lib is not None and s > 0 and one_pass else None
    if fused is not None and q.dtype == k.dtype == v.dtype == grad_out.dtype == out.dtype == torch.bfloat16 and \
            q.shape[0] * q.shape[1] >= native.threads():
        causal = _causal(fused, mask, is_causal)
        kept = probs is not None and probs.dtype == torch.bfloat16 and probs.is_contiguous() and \
            tuple(probs.shape) == probs_shape(q.shape, k.shape)
        # on AMX tiles, without a causal mask to skip, the head-group loop on the tiles' products is the faster
        if causal or kept or not native.amx_tiles():
            return _backward_bf16(fused, grad_out, q, k, v, out, logsumexp, None if is_causal else mask, causal,
                                  scale, probs if kept else None, grads)
    dq = torch.empty(q.shape, dtype=q.dtype)            # dense: each head group's slice is written in place
    dk, dv = torch.empty(k.shape, dtype=k.dtype), torch.empty(v.shape, dtype=v.dtype)
    lse = logsumexp.float()
    for sl in _groups(q, k):
        qg, kg, vg, gg = q[sl], k[sl], v[sl], grad_out[sl]              # strided rows: the products read them as they are
        delta = (gg.float() * out[sl].float()).sum(-1)                   # (g, t)
        scores = _products(qg, kg, causal=is_causal)                     # (g, t, s) fp32
        mg, lg = (None if mask is None else mask[sl]), lse[sl].contiguous()
        if lib is not None:
            p = torch.empty(scores.shape, dtype=q.dtype)
            rows = scores.shape[0] * t                  # row r: head r // t of the group, query r % t
            native.check(lib.kiln_attn_probs(
                native.ptr(scores), native.ptr(p), native.code(p), native.ptr(lg), *_native_mask(mg, is_causal), t,
                rows, s, scale, native.threads()), "attention probabilities")
            _transposed_products(p, gg, dv[sl], is_causal)
            dp = _products(gg, vg, out=scores, causal=is_causal)
            native.check(lib.kiln_attn_dscores(native.ptr(p), native.code(p), native.ptr(dp), native.ptr(delta),
                                               int(is_causal), t, rows, s, scale, native.threads()),
                         "attention score gradients")
            ds = p
        else:                                           # ATen's elementwise ops (no native loops here)
            z = scores * scale
            if mg is not None:
                z = z + mg
            pf = torch.exp(z - lg.unsqueeze(-1))
            pf = torch.where(torch.isneginf(lg).unsqueeze(-1), torch.zeros_like(pf), pf)
            p = pf.to(q.dtype)
            torch.bmm(p.transpose(1, 2), gg, out=dv[sl])
            dp = _products(gg, vg, causal=is_causal)
            ds = (p.float() * (dp - delta.unsqueeze(-1)) * scale).to(q.dtype)
        if is_causal and ds.dtype == torch.bfloat16 and _skips_causal():
            _products(ds, kg, out=dq[sl], kn=True, causal=True)         # row i: keys j <= i only
        else:
            torch.bmm(ds, kg, out=dq[sl])
        _transposed_products(ds, qg, dk[sl], is_causal)
    if grads is None and any(x.stride() != y.stride() for x, y in zip((q, k, v), (dq, dk, dv))):
        grads = tuple(torch.empty_like(x) for x in (q, k, v))   # the inputs' layouts, as ATen's flash backward
    return _into((dq, dk, dv), grads)


def _into(computed: tuple, grads: tuple | None) -> tuple:
    """`computed` copied into `grads` (and those returned), or `computed` itself without them."""
    if grads is None:
        return computed
    for g, c in zip(grads, computed):
        g.copy_(c)
    return tuple(grads)


def _backward_bf16(lib, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, logsumexp: Tensor,
                   mask: Tensor | None, is_causal: bool, scale: float, probs: Tensor | None = None,
                   grads: tuple | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The bf16 backward as one native pass (`kiln_attn_backward_bf16`), a head per thread (so at least as many
    heads as threads): for 8 queries at a time rowsum(dO * O), the scores, probabilities and their gradients in
    cache, dQ rounded once per tile, dK and dV summed in fp32 per head and rounded once at its end. With the
    forward's `probs`, the scores and probabilities are read from there instead (one product of five and an exp
    per score fewer)."""
    grad_out, q, k, v, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (grad_out, q, k, v, out))
    b, h, t, d = q.shape
    s, dv = k.shape[2], v.shape[3]
    if grads is not None and any(g.stride(-1) != 1 for g in grads):     # the kernel writes rows of d values
        return _into(_backward_bf16(lib, grad_out, q, k, v, out, logsumexp, mask, is_causal, scale, probs), grads)
    # their layouts, as ATen's flash backward, unless given
    dq, dk, dvv = grads if grads is not None else (torch.empty_like(x) for x in (q, k, v))
    strides = (ctypes.c_int64 * 9)(*dq.stride()[:3], *dk.stride()[:3], *dvv.stride()[:3])
    lse = logsumexp.float().contiguous()
    native.check(lib.kiln_attn_backward_bf16(
        native.ptr(grad_out), native.strides(grad_out), native.ptr(q), native.strides(q), native.ptr(k),
        native.strides(k), native.ptr(v), native.strides(v), native.ptr(out), native.strides(out), native.ptr(lse),
        native.ptr(probs), native.ptr(mask), native.strides(mask), int(is_causal), native.ptr(dq), native.ptr(dk),
        native.ptr(dvv), strides,
        b, h, t, s, d, dv, scale, native.threads()), "attention backward")
    return dq, dk, dvv


# ---- the probabilities kept from the forward for the backward ---------------------------------------------
def probs_shape(q_shape, k_shape) -> tuple:
    """The layout of the probabilities `forward_keeping_probs` keeps: (batch, query heads, queries, keys rounded
    up to even), dense bf16 (the one-pass kernels read keys in pairs)."""
    b, h, t = q_shape[:3]
    s = k_shape[-2]
    return (b, h, t, (s + 1) // 2 * 2)


def keeps_probs_here() -> bool:
    """Whether this machine runs the one-pass bf16 kernels that keep and read the probabilities: AVX-512 BF16's
    pair products (`native.bf16_products`). Not on a CPU with AMX, whose bf16 tiles may make ATen's flash
    kernels the faster choice there: the measured choice between flash and the products stays."""
    return _bf16_products() is not None and not native.cpu_flag("amx_bf16")


def forward_keeping_probs(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, is_causal: bool = False, *,
                          attn_mask: Tensor | None = None,
                          scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`flash_forward_math`'s output and log-sum-exp, and the normalized probabilities P = exp(z - lse) rounded
    once to bf16 (`probs_shape`) for `backward_from_probs`, which then reads them instead of computing the
    scores and their exps again. Where the one-pass bf16 kernels do not run (another dtype, fewer heads than
    threads, KILN_NATIVE=0) the probabilities are an empty tensor and the backward computes them itself."""
    out, lse, probs = _forward_math(q, k, v, dropout_p, is_causal, attn_mask, scale, keep=True)
    return out, lse, q.new_empty(0, dtype=torch.bfloat16) if probs is None else probs


def backward_from_probs(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, logsumexp: Tensor,
                        probs: Tensor, dropout_p: float = 0.0, is_causal: bool = False, *,
                        attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`flash_backward_math`'s gradients, reading the probabilities `forward_keeping_probs` kept (the same
    values the backward would compute, up to the last bit of the rounding: P = exp(z - max) / sum instead of
    exp(z - lse)). Probabilities of any other shape, dtype or layout (an empty tensor: none were kept) are not
    read: the backward computes them, as `flash_backward_math`."""
    return flash_backward_math(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask,
                               scale=scale, probs=probs)


def backward_packed(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, logsumexp: Tensor,
                    probs: Tensor, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask: Tensor | None = None,
                    scale: float | None = None, order: tuple = (0, 1, 2)) -> tuple[Tensor]:
    """(packed,): `backward_from_probs`'s three gradients in one (batch, tokens, sum of heads x head size) tensor,
    each transposed to (batch, tokens, heads x head size) and placed along the last dimension in `order` (indices
    into (dq, dk, dv)): the concatenation a model that splits one joined q/k/v projection (GPT-2's `c_attn`) makes
    for that projection's backward, `cat([g.transpose(1, 2).reshape(b, t, -1) for g in ...], -1)`. The one-pass
    bf16 kernel writes each gradient into its columns directly (the same values; no (b, heads, t, d) gradients
    and no concatenation: GPT-2 bench model, 0.45 ms a layer); other paths compute them and copy them in.
    kiln/passes/keep_probs.py puts it in place of the backward and the concatenation."""
    b, t = q.shape[0], q.shape[2]
    parts = (q, k, v)
    widths = [parts[i].shape[1] * parts[i].shape[3] for i in order]
    packed = torch.empty(b, t, sum(widths), dtype=q.dtype)
    grads: list = [None, None, None]
    col = 0
    for i, w in zip(order, widths):
        x = parts[i]
        grads[i] = packed[:, :, col:col + w].view(b, t, x.shape[1], x.shape[3]).transpose(1, 2)
        col += w
    flash_backward_math(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale,
                        probs=probs, grads=tuple(grads))
    return (packed,)


def _transposed_products(a: Tensor, b: Tensor, out: Tensor, is_causal: bool) -> None:
    """out = a^T @ b for a head group's probabilities or score gradients a (g, t, s) and its queries' rows b (g,
    t, d): dV and dK. Under a causal mask a is 0 past the diagonal, so key i sums over queries c >= i only (the
    native bf16 kernel skips the rest; ATen's bmm of a transposed view computes it all)."""
    if is_causal and a.dtype == torch.bfloat16 and _skips_causal():
        _products(a, b, out=out, at=True, causal=True)
    else:
        torch.bmm(a.transpose(1, 2), b, out=out)

