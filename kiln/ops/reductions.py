"""Reductions. One block per op; each gradient broadcasts back over the reduced dimensions."""
from __future__ import annotations

import math

import torch

from kiln.ops.common import ZERO, arg, cast, norm_dims, shape
from kiln.ops.registry import Cast, Kind, defop, nondiff

aten = torch.ops.aten
R, F32 = Kind.REDUCTION, Cast.FP32


def _unreduce(b, g, x, dims, keepdim):
    """Broadcast a reduced gradient back to x's shape."""
    ndim = len(shape(x))
    if not keepdim and ndim:
        for d in norm_dims(dims, ndim):
            g = b(aten.unsqueeze.default, g, d)
    return b(aten.expand.default, g, shape(x))


def vjp_sum(b, n, g):
    x = n.args[0]
    dims = None if n.target is aten.sum.default else arg(n, 1, "dim")
    keep = False if n.target is aten.sum.default else arg(n, 2, "keepdim", False)
    return (cast(b, _unreduce(b, g, x, dims or None, keep), x.meta.dtype),)


defop((aten.sum.default, aten.sum.dim_IntList), vjp_sum, R, F32)


def vjp_mean(b, n, g):
    x = n.args[0]
    dims = None if n.target is aten.mean.default else arg(n, 1, "dim")
    keep = False if n.target is aten.mean.default else arg(n, 2, "keepdim", False)
    count = x.meta.numel // max(n.out.meta.numel, 1)
    g = b(aten.div.Tensor, g, count)
    return (cast(b, _unreduce(b, g, x, dims or None, keep), x.meta.dtype),)


defop((aten.mean.default, aten.mean.dim), vjp_mean, R, F32)


def vjp_var(b, n, g):
    x = n.args[0]
    dims, corr, keep = arg(n, 1, "dim") or None, n.kwargs.get("correction"), n.kwargs.get("keepdim", False)
    corr = 1 if corr is None else corr                 # correction=None means Bessel's correction
    count = x.meta.numel // max(n.out.meta.numel, 1)
    mean = b(aten.mean.dim, x, norm_dims(dims, len(shape(x))), True)
    centered = b(aten.sub.Tensor, x, mean)
    g = _unreduce(b, g, x, dims, keep)
    # count <= correction: the forward divides by zero too; keep the same inf/nan as torch
    factor = 2.0 / (count - corr) if count != corr else float("inf")
    return (b(aten.mul.Tensor, b(aten.mul.Tensor, g, centered), factor),)


defop(aten.var.correction, vjp_var, R, F32)


def vjp_amax(b, n, g):
    x, dims, keep = n.args[0], arg(n, 1, "dim", []), arg(n, 2, "keepdim", False)
    out = _unreduce(b, n.out, x, dims or None, keep)
    hit = b(aten.eq.Tensor, x, out)
    # ties share the gradient evenly, as torch does
    count = b(aten.sum.dim_IntList, b(aten._to_copy.default, hit, dtype=x.meta.dtype),
              norm_dims(dims or None, len(shape(x))), True)
    g = b(aten.div.Tensor, _unreduce(b, g, x, dims or None, keep), count)
    return (b(aten.where.ScalarOther, hit, g, 0.0),)


defop((aten.amax.default, aten.amin.default), vjp_amax, R)


def vjp_logsumexp(b, n, g):
    x, dims, keep = n.args[0], n.args[1], arg(n, 2, "keepdim", False)
    if x.meta.dtype.is_complex:
        raise NotImplementedError("logsumexp of a complex input (the autograd fallback takes it)")
    p = b(aten.exp.default, b(aten.sub.Tensor, x, _unreduce(b, n.out, x, dims, keep)))
    return (b(aten.mul.Tensor, p, _unreduce(b, g, x, dims, keep)),)


defop(aten.logsumexp.default, vjp_logsumexp, R, F32)


def vjp_cumsum(b, n, g):
    dim = n.args[1]
    flipped = b(aten.cumsum.default, b(aten.flip.default, g, [dim]), dim)
    return (cast(b, b(aten.flip.default, flipped, [dim]), n.args[0].meta.dtype),)


defop(aten.cumsum.default, vjp_cumsum, R, F32)
defop(aten.flip.default, lambda b, n, g: (b(aten.flip.default, g, n.args[1]),), Kind.INDEX)


def vjp_vector_norm(b, n, g):
    """The gradient of ||x||_p for every ord, with torch's conventions at 0 (and ties for inf)."""
    x, p = n.args[0], float(arg(n, 1, "ord", 2))
    dims, keep = arg(n, 2, "dim") or None, arg(n, 3, "keepdim", False)     # dim=[]: all dims
    norm = _unreduce(b, n.out, x, dims, keep)
    g = _unreduce(b, g, x, dims, keep)
    if p == 0:                                   # counts non-zeros: piecewise constant
        return (ZERO,)
    sgn = b(aten.sgn.default, x)
    if p == 1:
        return (b(aten.mul.Tensor, g, sgn),)
    if p == 2:                                   # x / ||x||, 0 where the norm is 0
        safe = b(aten.masked_fill.Scalar, norm, b(aten.eq.Scalar, norm, 0), 1.0)
        return (b(aten.mul.Tensor, g, b(aten.div.Tensor, x, safe)),)
    ax = b(aten.abs.default, x)
    if math.isinf(p):                            # max |x|: ties (and nans) share the gradient evenly
        hit = b(aten.logical_or.default, b(aten.eq.Tensor, ax, norm), b(aten.isnan.default, ax))
        count = b(aten.sum.dim_IntList, b(aten._to_copy.default, hit, dtype=g.meta.dtype),
                  norm_dims(dims, len(shape(x))), True)
        return (b(aten.mul.Tensor, sgn, b(aten.where.ScalarOther, hit, b(aten.div.Tensor, g, count), 0.0)),)
    if p < 1:                                    # sgn(x) |x|^(p-1) ||x||^(1-p), 0 at x == 0
        xs = b(aten.where.ScalarSelf, b(aten.eq.Scalar, x, 0), 0.0, b(aten.pow.Tensor_Scalar, ax, p - 1))
        return (b(aten.mul.Tensor, b(aten.mul.Tensor, b(aten.mul.Tensor, sgn, xs), g),
                  b(aten.pow.Tensor_Scalar, norm, 1 - p)),)
    # 1 < p: x |x|^(p-2) / ||x||^(p-1) (sgn(x) |x|^(p-1) below 2, no negative power of 0), 0 where ||x|| == 0
    xs = b(aten.mul.Tensor, sgn, b(aten.pow.Tensor_Scalar, ax, p - 1)) if p < 2 else \
        b(aten.mul.Tensor, x, b(aten.pow.Tensor_Scalar, ax, p - 2))
    scale = b(aten.div.Tensor, g, b(aten.pow.Tensor_Scalar, norm, p - 1))
    scale = b(aten.masked_fill.Scalar, scale, b(aten.eq.Scalar, norm, 0), 0.0)
    return (b(aten.mul.Tensor, xs, scale),)


defop(aten.linalg_vector_norm.default, vjp_vector_norm, R, F32)

nondiff([aten.any.default, aten.any.dim, aten.all.default, aten.all.dim],
        kind=R)


# ---- selections: values picked by an index the op also returns; the gradient goes back to those places ----
def _selected_dim(n, i: int, name: str, default=-1) -> int:
    return arg(n, i, name, default) % max(len(shape(n.args[0])), 1)


def vjp_select_k(b, n, g, gi=None):
    """topk / sort: each value came from x at its index along dim (distinct indices): scatter back."""
    x = n.args[0]
    # topk(x, k, dim); sort(x, dim); sort.stable(x, *, stable, dim): dim is keyword-only there
    position = {aten.topk.default: 2, aten.sort.default: 1}.get(n.target, len(n.args))
    dim = _selected_dim(n, position, "dim")
    if not shape(x):                       # a 0-dim input: the only value is x itself
        return (g,)
    zeros = b(aten.zeros.default, shape(x), dtype=g.meta.dtype, device=g.meta.device)
    return (b(aten.scatter.src, zeros, dim, n.outputs[1], g),)


defop((aten.topk.default, aten.sort.default, aten.sort.stable), vjp_select_k, Kind.INDEX)


def vjp_select_one(b, n, g, gi=None):
    """max.dim / min.dim / kthvalue / median.dim / mode: one value per slice, taken at its index."""
    x = n.args[0]
    with_k = n.target is aten.kthvalue.default
    dim = _selected_dim(n, 2 if with_k else 1, "dim")
    keep = arg(n, 3 if with_k else 2, "keepdim", False)
    if not shape(x):
        return (g,)
    return (b(aten.value_selecting_reduction_backward.default, g, dim, n.outputs[1], shape(x), keep),)


defop((aten.max.dim, aten.min.dim, aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default),
      vjp_select_one, R)


def vjp_cum_select(b, n, g, gi=None):
    """cummax / cummin: position i took x at indices[i]; several positions may share one source."""
    x, dim = n.args[0], _selected_dim(n, 1, "dim", 0)
    if not shape(x):
        return (g,)
    zeros = b(aten.zeros.default, shape(x), dtype=g.meta.dtype, device=g.meta.device)
    return (b(aten.scatter_add.default, zeros, dim, n.outputs[1], g),)


defop((aten.cummax.default, aten.cummin.default), vjp_cum_select, R)


def vjp_full_extreme(b, n, g):
    """max() / min() / median() over every element: ties share the gradient evenly (as torch)."""
    x = n.args[0]
    hit = b(aten.eq.Tensor, x, n.out)
    count = b(aten.sum.default, b(aten._to_copy.default, hit, dtype=x.meta.dtype))
    return (b(aten.where.ScalarOther, hit, b(aten.div.Tensor, g, count), 0.0),)


defop((aten.max.default, aten.min.default), vjp_full_extreme, R)
nondiff([aten.argsort.default, aten.argsort.stable], kind=R)
