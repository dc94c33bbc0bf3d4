"""Elementwise ops: arithmetic, activations, casts, selection. One block per op.

Broadcasting is handled by autodiff (a gradient is summed back to its input's shape), so these
rules are written as if all operands had the output's shape. Complex operands follow PyTorch's
convention (kiln/ops/spectral.py): a holomorphic f gets g * conj(f'(z)), a real input of a complex
result the real part; rules written for real operands only are wrapped in `_real` and decline complex
ones to the autograd fallback.
"""
from __future__ import annotations

import torch

from kiln.ops.common import ZERO, arg, cast
from kiln.ops.registry import Cast, Kind, defop, nondiff
from kiln.ops.spectral import conj, is_complex, real_part

aten = torch.ops.aten
P, F32 = Kind.POINTWISE, Cast.FP32


def _alpha(n):
    return conj(None, n.kwargs.get("alpha", 1))       # a complex alpha scales the gradient by its conjugate


def _scale(b, g, s):
    return g if s == 1 else b(aten.mul.Tensor, g, s)


def _times_conj(b, g, d):
    """g * conj(d): the chain rule through a holomorphic op whose derivative is d."""
    return b(aten.mul.Tensor, g, conj(b, d))


def _real(rule):
    """A rule written for real operands: it declines complex ones (the autograd fallback takes them)."""
    def guarded(b, n, *gs):
        if any(is_complex(v) for v in (*n.inputs, *n.outputs)):
            raise NotImplementedError("complex operands (the rule is written for real ones)")
        return rule(b, n, *gs)
    return guarded


# ---- arithmetic -------------------------------------------------------------------------------
# Tensor-Tensor arithmetic promotes mixed dtypes in its kernel (TensorIterator): under amp, a bf16 matmul
# output added to the fp32 residual stream is read as it is, not cast to fp32 first; the gradient of the
# bf16 operand is cast back to bf16 by autodiff, as the cast's own rule did
defop(aten.add.Tensor, lambda b, n, g: (g, _scale(b, g, _alpha(n))), P, promotes=True)
defop(aten.add.Scalar, lambda b, n, g: (g, None), P)
defop(aten.sub.Tensor, lambda b, n, g: (g, b(aten.mul.Tensor, g, -_alpha(n))), P, promotes=True)
defop(aten.sub.Scalar, lambda b, n, g: (g, None), P)
defop(aten.rsub.Scalar, lambda b, n, g: (b(aten.mul.Tensor, g, -_alpha(n)), None), P)
defop(aten.rsub.Tensor, lambda b, n, g: (b(aten.mul.Tensor, g, -_alpha(n)), g), P, promotes=True)


def vjp_mul(b, n, g):
    x, y = n.args
    gx = real_part(b, _times_conj(b, g, y), x)
    return gx, (real_part(b, _times_conj(b, g, x), y) if hasattr(y, "meta") else None)


defop((aten.mul.Tensor, aten.mul.Scalar), vjp_mul, P, promotes=True)


def vjp_div(b, n, g):
    x, y = n.args
    if not hasattr(y, "meta"):                      # div by a Python number
        return b(aten.div.Tensor, g, conj(b, y)), None
    gx = real_part(b, b(aten.div.Tensor, g, conj(b, y)), x)
    # d(x/y)/dy = -x / y^2 = -(x/y) / y
    gy = b(aten.neg.default, b(aten.div.Tensor, _times_conj(b, g, n.out), conj(b, y)))
    return gx, real_part(b, gy, y)


defop((aten.div.Tensor, aten.div.Scalar), vjp_div, P)
defop(aten.neg.default, lambda b, n, g: (b(aten.neg.default, g),), P)


def vjp_pow_scalar(b, n, g):
    x, e = n.args
    if e == 0:
        return (ZERO,)
    if e == 1:
        return (g,)
    if e == 2:
        return (_times_conj(b, g, b(aten.mul.Tensor, x, 2.0)),)
    return (_times_conj(b, g, b(aten.mul.Tensor, b(aten.pow.Tensor_Scalar, x, e - 1), e)),)


defop(aten.pow.Tensor_Scalar, vjp_pow_scalar, P, F32)


def vjp_pow_tensor(b, n, g):
    x, e = n.args
    # d/dx = e * x^(e-1), but 0 where e == 0 (else 0 * 0^-1 = nan at x == 0), as torch
    dx = b(aten.mul.Tensor, e, b(aten.pow.Tensor_Tensor, x, b(aten.sub.Tensor, e, 1)))
    gx = b(aten.mul.Tensor, g, b(aten.where.ScalarSelf, b(aten.eq.Scalar, e, 0), 0.0, dx))
    # d/de = x^e * log(x), 0 where x == 0 and e >= 0 (torch's convention; x == 0, e < 0 stays -inf)
    xp = cast(b, x, n.out.meta.dtype)
    flat = b(aten.logical_and.default, b(aten.eq.Scalar, x, 0), b(aten.ge.Scalar, e, 0))
    de = b(aten.where.ScalarSelf, flat, 0.0, b(aten.mul.Tensor, n.out, b(aten.log.default, xp)))
    return gx, b(aten.mul.Tensor, g, de)


defop(aten.pow.Tensor_Tensor, _real(vjp_pow_tensor), P, F32)
def vjp_pow_scalar_base(b, n, g):
    base, e = n.args
    if base == 0:   # d(0^e)/de: 0 where e >= 0 (not 0 * -inf = nan), -inf * 0^e elsewhere, as torch
        return None, b(aten.where.ScalarSelf, b(aten.ge.Scalar, e, 0), 0.0,
                       b(aten.mul.Tensor, b(aten.mul.Tensor, g, n.out), float("-inf")))
    return None, b(aten.mul.Tensor, b(aten.mul.Tensor, g, n.out), float(torch.log(torch.tensor(float(base)))))


defop(aten.pow.Scalar, _real(vjp_pow_scalar_base), P, F32)


# ---- unary math -------------------------------------------------------------------------------
defop(aten.exp.default, lambda b, n, g: (_times_conj(b, g, n.out),), P, F32)
defop(aten.log.default, lambda b, n, g: (b(aten.div.Tensor, g, conj(b, n.args[0])),), P, F32)
defop(aten.log1p.default, lambda b, n, g: (
    b(aten.div.Tensor, g, conj(b, b(aten.add.Tensor, n.args[0], 1.0))),), P, F32)
defop(aten.sqrt.default, lambda b, n, g: (b(aten.div.Tensor, g, conj(b, b(aten.mul.Tensor, n.out, 2.0))),), P, F32)
# d(x^-1/2) = -1/2 x^-3/2 = -1/2 * out^3
defop(aten.rsqrt.default, lambda b, n, g: (
    _times_conj(b, g, b(aten.mul.Tensor, b(aten.pow.Tensor_Scalar, n.out, 3), -0.5)),), P, F32)
defop(aten.reciprocal.default, lambda b, n, g: (
    _times_conj(b, g, b(aten.neg.default, b(aten.mul.Tensor, n.out, n.out))),), P, F32)
defop(aten.sin.default, lambda b, n, g: (_times_conj(b, g, b(aten.cos.default, n.args[0])),), P, F32)
defop(aten.cos.default, lambda b, n, g: (
    _times_conj(b, g, b(aten.neg.default, b(aten.sin.default, n.args[0]))),), P, F32)
# |z|: real g times z / |z| (torch's sgn), for real and complex z alike
defop(aten.abs.default, lambda b, n, g: (b(aten.mul.Tensor, g, b(aten.sgn.default, n.args[0])),), P)
defop(aten.erf.default, _real(lambda b, n, g: (b(aten.mul.Tensor, g, b(aten.mul.Tensor, b(aten.exp.default, b(
    aten.neg.default, b(aten.mul.Tensor, n.args[0], n.args[0]))), 2.0 / 3.141592653589793 ** 0.5)),)), P, F32)
# sign of a real x: piecewise constant; z / |z| of a complex z has a gradient (left to the fallback)
defop(aten.sgn.default, _real(lambda b, n, g: (ZERO,)), P)

# ---- activations (ATen has fused backward kernels for these) -----------------------------------
# (tanh_backward and sigmoid_backward conjugate for complex values; the others are for real ones)
defop(aten.tanh.default, lambda b, n, g: (b(aten.tanh_backward.default, g, n.out),), P)
defop(aten.sigmoid.default, lambda b, n, g: (b(aten.sigmoid_backward.default, g, n.out),), P)
defop(aten.relu.default, _real(lambda b, n, g: (b(aten.threshold_backward.default, g, n.out, 0),)), P)
defop(aten.gelu.default, _real(lambda b, n, g: (
    b(aten.gelu_backward.default, g, n.args[0], approximate=arg(n, 1, "approximate", "none")),)), P)
defop(aten.silu.default, _real(lambda b, n, g: (b(aten.silu_backward.default, g, n.args[0]),)), P)
defop(aten.hardtanh.default, _real(lambda b, n, g: (
    b(aten.hardtanh_backward.default, g, n.args[0], arg(n, 1, "min_val", -1.0), arg(n, 2, "max_val", 1.0)),)), P)
defop(aten.leaky_relu.default, _real(lambda b, n, g: (
    b(aten.leaky_relu_backward.default, g, n.args[0], arg(n, 1, "negative_slope", 0.01), False),)), P)
def vjp_elu(b, n, g):
    alpha, scale, in_scale = arg(n, 1, "alpha", 1.0), arg(n, 2, "scale", 1.0), arg(n, 3, "input_scale", 1.0)
    # from the output (the input can be freed) unless alpha < 0, where the output does not determine it
    if alpha >= 0:
        return (b(aten.elu_backward.default, g, alpha, scale, in_scale, True, n.out),)
    return (b(aten.elu_backward.default, g, alpha, scale, in_scale, False, n.args[0]),)


defop(aten.elu.default, _real(vjp_elu), P)


# ---- casts and copies -------------------------------------------------------------------------
defop(aten._to_copy.default, lambda b, n, g: (cast(b, real_part(b, g, n.args[0]), n.args[0].meta.dtype),), P)
# type_as(x, other) = x cast to other's dtype; other's values do not matter
defop(aten.type_as.default, lambda b, n, g: (cast(b, real_part(b, g, n.args[0]), n.args[0].meta.dtype), ZERO), P)
defop(aten.clone.default, lambda b, n, g: (g,), P)
defop(aten.alias.default, lambda b, n, g: (g,), Kind.VIEW)
# x.detach(), and what capture puts after a `with torch.no_grad():` block: no gradient flows through
nondiff(aten.detach.default, Kind.VIEW)
# broadcast_tensors(xs): each output is its input expanded; autodiff sums a gradient back to its input
defop(aten.broadcast_tensors.default, lambda b, n, *gs: ([ZERO if g is None else g for g in gs],), Kind.VIEW)
defop(aten.lift_fresh_copy.default, lambda b, n, g: (g,), P)
# copy(dst, src): the result is src (broadcast into dst's shape and dtype); dst's values are gone
defop(aten.copy.default, lambda b, n, g: (ZERO, cast(b, real_part(b, g, n.args[1]), n.args[1].meta.dtype)), P)
defop((aten.fill.Scalar, aten.fill.Tensor), lambda b, n, g: (ZERO, None if not hasattr(n.args[1], "meta")
                                                             else b(aten.sum.default, g)), P)


# ---- selection --------------------------------------------------------------------------------
def vjp_where(b, n, g):
    cond, x, y = n.args
    gx = b(aten.where.ScalarOther, cond, g, 0.0) if hasattr(x, "meta") else None
    gy = b(aten.where.ScalarSelf, cond, 0.0, g) if hasattr(y, "meta") else None
    return None, gx, gy


defop((aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf), vjp_where, P)
defop(aten.masked_fill.Scalar, lambda b, n, g: (b(aten.masked_fill.Scalar, g, n.args[1], 0.0), None, None), P)
defop(aten.masked_fill.Tensor, lambda b, n, g: (
    b(aten.masked_fill.Scalar, g, n.args[1], 0.0), None,
    b(aten.sum.default, b(aten.where.ScalarOther, n.args[1], g, 0.0))), P)


def _minmax(pick_x):
    """maximum/minimum: the gradient goes to the selected input; ties split it evenly (as torch)."""
    def rule(b, n, g):
        x, y = n.args
        half = b(aten.mul.Tensor, g, 0.5)
        tie = b(aten.eq.Tensor, x, y)
        x_wins = b(pick_x, x, y)
        gx = b(aten.where.self, tie, half, b(aten.where.ScalarOther, x_wins, g, 0.0))
        gy = b(aten.where.self, tie, half, b(aten.where.ScalarSelf, x_wins, 0.0, g))
        return gx, gy
    return rule


defop((aten.maximum.default, aten.max.other), _real(_minmax(aten.gt.Tensor)), P)
defop((aten.minimum.default, aten.min.other), _real(_minmax(aten.lt.Tensor)), P)


def vjp_clamp(b, n, g):
    x, lo, hi = n.args[0], arg(n, 1, "min"), arg(n, 2, "max")
    keep = None
    if lo is not None:
        keep = b(aten.ge.Scalar, x, lo)
    if hi is not None:
        le = b(aten.le.Scalar, x, hi)
        keep = le if keep is None else b(aten.logical_and.default, keep, le)
    return (g if keep is None else b(aten.where.ScalarOther, keep, g, 0.0),)


defop(aten.clamp.default, vjp_clamp, P)
defop(aten.clamp_min.default, lambda b, n, g: (b(aten.where.ScalarOther, b(aten.ge.Scalar, n.args[0], n.args[1]), g, 0.0),), P)
defop(aten.clamp_max.default, lambda b, n, g: (b(aten.where.ScalarOther, b(aten.le.Scalar, n.args[0], n.args[1]), g, 0.0),), P)
defop(aten.triu.default, lambda b, n, g: (b(aten.triu.default, g, arg(n, 1, "diagonal", 0)),), P)
defop(aten.tril.default, lambda b, n, g: (b(aten.tril.default, g, arg(n, 1, "diagonal", 0)),), P)

# ---- no gradient: comparisons, logic, integer math, rounding ------------------------------------
nondiff([aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
         aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
         aten.logical_and.default, aten.logical_or.default, aten.logical_not.default,
         aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default,
         aten.__and__.Tensor, aten.__or__.Tensor, aten.isinf.default, aten.isnan.default, aten.isfinite.default,
         aten.sign.default, aten.floor.default, aten.ceil.default, aten.round.default,
         aten.trunc.default, aten.floor_divide.default, aten.remainder.Scalar, aten.remainder.Tensor,
         aten.argmax.default, aten.argmin.default])
