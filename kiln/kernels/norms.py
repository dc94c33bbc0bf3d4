"""Normalization kernels: RMSNorm (optionally with the residual add fused in) and
dropout + residual add + LayerNorm.

What the backward keeps: RMSNorm saves its normalized input and one fp32 `rstd` per row, never the
normalized activations (eager autograd of the usual `x * rsqrt(mean(x^2) + eps) * w` keeps the
squared input and `x * rstd`). The dropout kernel keeps a bool mask, the residual sum (which is an
output the caller keeps anyway) and LayerNorm's per-row mean/rstd.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from kiln.kernels import native
from kiln.kernels._common import acc_dtype, empty_like_absent, gpu_impl

aten = torch.ops.aten


# ---- RMSNorm ----------------------------------------------------------------------------------
def _stat_shape(x: Tensor) -> tuple:
    return tuple(x.shape[:-1]) + (1,)


def _rms_forward(s: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """out = s * rstd * weight with rstd = 1/sqrt(mean(s^2) + eps), statistics in fp32."""
    sf = s.to(acc_dtype(s.dtype))
    # eager's own formula (a transient copy of s*s): the norm squared back (vector_norm, no copy) rounds
    # otherwise, which an ill-conditioned weight gradient turned into 3e-5 of the largest gradient beyond
    # eager's own float32 error (cpmant's layer norms, against float64)
    rstd = sf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    out = torch.mul(sf, rstd)
    out = out.mul_(weight) if out.dtype == torch.promote_types(out.dtype, weight.dtype) else out * weight
    return out.to(torch.promote_types(s.dtype, weight.dtype)).contiguous(), rstd


def _out_dtype(s_dtype: torch.dtype, weight: Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The normalized output's dtype: `out_dtype` when given (a cast folded into the kernel), else promoted."""
    return out_dtype if out_dtype is not None else torch.promote_types(s_dtype, weight.dtype)


def _rms_native(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, out_dtype: Optional[torch.dtype]):
    """(out, sum or None, rstd) by native.c's single pass, or None where it does not apply.

    A float32 sum keeps eager's own statistics: rstd is bitwise `s.pow(2).mean(-1)` as ATen computes it, so the
    output is bitwise eager's `s * rsqrt(mean(s^2) + eps) * w` (then rounded once to `out_dtype`). Any other
    summation order rounds rstd differently, and an ill-conditioned weight gradient (cpmant's) amplified a single
    pass's rounding to 3e-5 of its largest entry beyond eager's own float32 error against float64 (1.2e-5 with
    eager's statistics). The pass sums the squares in ATen's own order where this machine's ATen was checked to
    sum that way (`_aten_lanes`: rows of at least 16, more than one row); elsewhere ATen computes the statistics
    first (and a float32 output, where that pass would save nothing, runs the composition). Half-type sums,
    rounded far more coarsely, are reduced in double."""
    d = x.shape[-1] if x.dim() else 0
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    o_dtype = _out_dtype(s_dtype, weight, out_dtype)
    given = s_dtype == torch.float32
    lib = native.usable(x, residual, weight) if native.supports(o_dtype) else None
    if lib is None or not 0 < d <= native.ROW_MAX or weight.numel() != d:
        return None
    rows = x.numel() // d
    lanes = _aten_lanes() if given and d >= LANES_MIN_D and rows > 1 else None
    if given and lanes is None and o_dtype == torch.float32:
        return None
    x, w = x.contiguous(), weight.contiguous()
    s = None
    if residual is not None:
        if given and lanes is None:                  # eager's fp32 add, read below as the input
            s = torch.add(x, residual)
            x, residual = s, None
        else:
            residual = residual.contiguous()
            s = torch.empty(x.shape, dtype=s_dtype)
    src = s if s is not None else x
    stats = 0 if not given else (lanes or 1)
    rstd = (src.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_() if stats == 1
            else torch.empty(_stat_shape(x), dtype=torch.float32))
    out = torch.empty(x.shape, dtype=o_dtype)
    writes_sum = residual is not None
    native.check(lib.kiln_rms_forward(
        x.data_ptr(), native.code(x), native.ptr(residual), native.code(residual) if writes_sum else 0,
        w.data_ptr(), native.code(w), out.data_ptr(), native.code(out), native.ptr(s) if writes_sum else None,
        native.code(s) if writes_sum else 0, rstd.data_ptr(), stats, rows, d, float(eps),
        native.threads()), "rms_norm")
    return out, s, rstd


LANES_MIN_D = 16            # shorter rows: ATen sums them another way (its scalar loop), not checked here
_PROBE_D = (16, 17, 31, 64, 100, 511, 512, 1000, 1408, 2048, 4096, 5003, 8192)


@functools.lru_cache(maxsize=None)
def _aten_lanes() -> Optional[int]:
    """The lane width (8 or 16) with which native.c's ordered sum of squares gives, bit for bit, this process's
    ATen statistics `x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()` of float32 rows; None if neither does
    (another torch, another vector build): eager's statistics are then computed by ATen. Checked once per
    process on rows of several lengths and magnitudes, with the kernel itself."""
    lib = native.library()
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(20261207)
    cases = []
    for d in _PROBE_D:
        scale = torch.logspace(-4, 4, 5, dtype=torch.float64).to(torch.float32).unsqueeze(1)
        x = torch.randn(5, d, generator=gen) * scale
        x[2, : d // 3] = 0.0                                      # a row with exact zeros
        cases.append(x)
    w = torch.ones(max(_PROBE_D))
    for lanes in (8, 16):
        ok = True
        for x in cases:
            for eps in (1e-6, 1e-5):
                want = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
                got = torch.empty_like(want)
                out = torch.empty_like(x)
                rows, d = x.shape
                status = lib.kiln_rms_forward(x.data_ptr(), 0, None, 0, w.data_ptr(), 0, out.data_ptr(), 0, None, 0,
                                              got.data_ptr(), lanes, rows, d, eps, native.threads())
                ok = ok and status == 0 and torch.equal(got, want)
        if ok:
            return lanes
    return None


@torch.library.custom_op("kiln::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(out, rstd): RMSNorm of x over the last dimension; rstd is fp32 (fp64 for fp64 x), shape (..., 1).
    `out_dtype`: the output's dtype (computed in fp32, rounded once); default: x's and weight's promoted."""
    impl = gpu_impl("rms_norm", x)
    if impl is not None:
        out, rstd = impl(x, weight, eps)
        return out.to(_out_dtype(out.dtype, weight, out_dtype)), rstd
    done = _rms_native(x, None, weight, eps, out_dtype)
    if done is not None:
        return done[0], done[2]
    out, rstd = _rms_forward(x, weight, eps)
    return out.to(_out_dtype(out.dtype, weight, out_dtype)), rstd


@rms_norm_op.register_fake
def _(x, weight, eps, out_dtype=None):
    out = x.new_empty(x.shape, dtype=_out_dtype(x.dtype, weight, out_dtype))
    return out, x.new_empty(_stat_shape(x), dtype=acc_dtype(x.dtype))


@torch.library.custom_op("kiln::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                    out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out, sum, rstd) with sum = x + residual and out = RMSNorm(sum) (in `out_dtype` when given)."""
    impl = gpu_impl("add_rms_norm", x)
    if impl is not None:
        out, s, rstd = impl(x, residual, weight, eps)
        return out.to(_out_dtype(out.dtype, weight, out_dtype)), s, rstd
    _same_shape(x, residual)
    done = _rms_native(x, residual, weight, eps, out_dtype)
    if done is not None:
        return done
    s = torch.add(x, residual).contiguous()
    out, rstd = _rms_forward(s, weight, eps)
    return out.to(_out_dtype(out.dtype, weight, out_dtype)), s, rstd


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps, out_dtype=None):
    _same_shape(x, residual)
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    out = s.new_empty(s.shape, dtype=_out_dtype(s.dtype, weight, out_dtype))
    return out, s, s.new_empty(_stat_shape(s), dtype=acc_dtype(s.dtype))


@torch.library.custom_op("kiln::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(grad_out: Optional[Tensor], grad_sum: Optional[Tensor], input: Tensor, weight: Tensor,
                         rstd: Tensor, low_dtype: Optional[torch.dtype] = None, grad_out2: Optional[Tensor] = None,
                         grad_out3: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_input, grad_weight, grad_input_low) of out = RMSNorm(input). `grad_sum` (the gradient reaching the
    residual sum of add_rms_norm through its other uses) is added to grad_input in place. `low_dtype`: the
    third output is grad_input rounded to it as well (a narrowing cast of a gradient that is also read in its
    own dtype, folded into the kernel); else it is empty. `grad_out2` (grad_out's dtype and shape): the output
    gradient is grad_out + grad_out2, summed as `torch.add` sums them (rounded once to their dtype) where the
    graph added them (the input gradients of two projections reading the norm's output: Llama's gate and up);
    `grad_out3` (with grad_out2): (grad_out + grad_out2) + grad_out3, each add rounded so (Llama's q, k and v)."""
    _check_terms(grad_out, grad_out2, grad_out3)
    impl = gpu_impl("rms_norm_backward", input)
    if impl is not None:
        gi, gw = impl(_summed(grad_out, grad_out2, grad_out3), grad_sum, input, weight, rstd)
        return gi, gw, _low_copy(gi, low_dtype)
    if grad_out is None:
        gi = grad_sum.to(input.dtype, copy=True) if grad_sum is not None else torch.zeros_like(input)
        return gi.contiguous(), torch.zeros_like(weight), _low_copy(gi, low_dtype)
    done = _rms_backward_native(grad_out, (grad_out2, grad_out3), grad_sum, input, weight, rstd, low_dtype)
    if done is not None:
        return done
    grad_out = _summed(grad_out, grad_out2, grad_out3)
    acc = torch.promote_types(acc_dtype(input.dtype), weight.dtype)
    d = input.shape[-1]
    sf, gf = input.to(acc), grad_out.to(acc)
    # grad_weight = sum over rows of g * s * rstd: one N-sized product, then a matrix-vector product
    prod = gf * sf
    grad_weight = prod.reshape(-1, d).t().mv(rstd.reshape(-1)).to(weight.dtype)
    # dot_i = sum_j g_ij weight_j s_ij, from the same product: a second matrix-vector product, no N-sized
    # temporary (a batched (1 x d) @ (d x 1) bmm per row took 1.2 ms at 2048 x 512 where this takes 0.1)
    dot = prod.reshape(-1, d).mv(weight.to(acc).reshape(-1)).reshape(_stat_shape(input))
    gw = torch.mul(gf, weight, out=prod)             # reuse the buffer: g * weight = dL/d(normalized)
    # grad_s = rstd * (gw - s * rstd^2 * dot / d)
    coef = dot.mul_(rstd.square()).div_(d)
    grad = gw.addcmul_(sf, coef, value=-1).mul_(rstd)
    if grad_sum is not None:
        grad = grad.add_(grad_sum)
    gi = grad.to(input.dtype).contiguous()
    return gi, grad_weight.reshape(weight.shape), _low_copy(gi, low_dtype)


def _check_terms(grad_out: Optional[Tensor], grad_out2: Optional[Tensor], grad_out3: Optional[Tensor]) -> None:
    if grad_out3 is not None and grad_out2 is None:
        raise ValueError("rms_norm_backward: grad_out3 needs grad_out2 (the terms are summed in order)")
    for name, term in (("grad_out2", grad_out2), ("grad_out3", grad_out3)):
        if term is not None and (grad_out is None or term.dtype != grad_out.dtype or term.shape != grad_out.shape):
            what = "None" if grad_out is None else f"{grad_out.dtype} {tuple(grad_out.shape)}"
            raise ValueError(f"rms_norm_backward: {name} ({term.dtype} {tuple(term.shape)}) must have grad_out's "
                             f"dtype and shape ({what})")


def _summed(grad_out: Optional[Tensor], *terms: Optional[Tensor]) -> Optional[Tensor]:
    """grad_out plus the given terms, added in order as the graph added them (each add rounded to their dtype)."""
    for term in terms:
        if term is not None:
            grad_out = torch.add(grad_out, term)
    return grad_out


def _low_copy(gi: Tensor, low_dtype: Optional[torch.dtype]) -> Tensor:
    return gi.to(low_dtype).contiguous() if low_dtype is not None else empty_like_absent(gi)


def _rms_backward_native(grad_out: Tensor, terms: tuple, grad_sum: Optional[Tensor], input: Tensor, weight: Tensor,
                         rstd: Tensor, low_dtype: Optional[torch.dtype]):
    """(grad_input, grad_weight, grad_input_low) by native.c's single pass, or None where it does not apply.
    terms: (grad_out2, grad_out3), either None."""
    d = input.shape[-1] if input.dim() else 0
    lib = (native.usable(grad_out, *terms, grad_sum, input, weight)
           if low_dtype is None or native.supports(low_dtype) else None)
    if (lib is None or not 0 < d <= native.ROW_MAX or weight.numel() != d or rstd.dtype != torch.float32
            or grad_out.shape != input.shape or (grad_sum is not None and grad_sum.shape != input.shape)):
        return None
    g, s, w, k = grad_out.contiguous(), input.contiguous(), weight.contiguous(), rstd.contiguous()
    g2, g3 = (t.contiguous() if t is not None else None for t in terms)
    gs = grad_sum.contiguous() if grad_sum is not None else None
    gi = torch.empty(input.shape, dtype=input.dtype)
    gw = torch.empty(weight.shape, dtype=weight.dtype)
    low = torch.empty(input.shape, dtype=low_dtype) if low_dtype is not None else None
    n = native.threads()
    partial = torch.empty(n * d, dtype=torch.float64)
    native.check(lib.kiln_rms_backward(
        g.data_ptr(), native.code(g), native.ptr(g2), native.ptr(g3), native.ptr(gs),
        native.code(gs) if gs is not None else 0,
        s.data_ptr(), native.code(s), w.data_ptr(), native.code(w), k.data_ptr(), gi.data_ptr(), native.code(gi),
        gw.data_ptr(), native.code(gw), native.ptr(low), native.code(low) if low is not None else 0,
        partial.data_ptr(), input.numel() // d, d, n), "rms_norm_backward")
    return gi, gw, low if low is not None else empty_like_absent(gi)


@rms_norm_backward_op.register_fake
def _(grad_out, grad_sum, input, weight, rstd, low_dtype=None, grad_out2=None, grad_out3=None):
    _check_terms(grad_out, grad_out2, grad_out3)
    low = input.new_empty(input.shape, dtype=low_dtype) if low_dtype is not None else input.new_empty((0,))
    return input.new_empty(input.shape), torch.empty_like(weight), low


def _rms_setup(ctx, inputs, output):
    x, weight = inputs[0], inputs[1]
    out, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)     # absent output gradients stay None: no zero-filled buffers
    ctx.save_for_backward(x, weight, rstd)


def _rms_backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    gx, gw, _ = torch.ops.kiln.rms_norm_backward(grad_out, None, x, weight, rstd)
    return gx, gw, None, None


def _add_rms_setup(ctx, inputs, output):
    out, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)     # the backward op takes None for an unused output
    # the backward needs the sum, which is an output the caller keeps as its residual stream anyway
    ctx.save_for_backward(s, inputs[2], rstd)


def _add_rms_backward(ctx, grad_out, grad_sum, _grad_rstd):
    s, weight, rstd = ctx.saved_tensors
    gs, gw, _ = torch.ops.kiln.rms_norm_backward(grad_out, grad_sum, s, weight, rstd)
    return gs, gs, gw, None, None  # d(x + residual)/dx = d(x + residual)/d residual = 1


def _same_shape(x: Tensor, residual: Tensor) -> None:
    # no broadcasting: the residual stream and the branch output always have one shape, and a
    # broadcast would need a reduction in the backward that these kernels exist to avoid
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")


rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)
add_rms_norm_op.register_autograd(_add_rms_backward, setup_context=_add_rms_setup)


# ---- dropout + residual add + LayerNorm -------------------------------------------------------
@torch.library.custom_op("kiln::dropout_add_layer_norm", mutates_args=())
def dropout_add_layer_norm_op(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                              p: float, eps: float, training: bool
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, sum, mean, rstd, mask): sum = dropout(x) + residual, out = LayerNorm(sum) over the last
    dimension. mask is the bool keep-mask drawn here (empty when no dropout ran)."""
    impl = gpu_impl("dropout_add_layer_norm", x)
    if impl is not None:
        return impl(x, residual, weight, bias, p, eps, training)
    _same_shape(x, residual)
    if training and p > 0:
        mask = keep_mask(x.shape, p, x.device)
        s = torch.addcmul(residual, x, mask, value=dropout_scale(p))   # dropout and residual add: one pass
    else:
        mask = empty_like_absent(x).bool()
        s = torch.add(x, residual)
    s = s.contiguous()
    out, mean, rstd = aten.native_layer_norm(s, [s.shape[-1]], weight, bias, eps)
    return out, s, mean, rstd, mask


@dropout_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, p, eps, training):
    _same_shape(x, residual)
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    out, mean, rstd = aten.native_layer_norm(s, [s.shape[-1]], weight, bias, eps)
    mask = x.new_empty(x.shape if training and p > 0 else (0,), dtype=torch.bool)
    return out, s, mean, rstd, mask


@torch.library.custom_op("kiln::dropout_add_layer_norm_backward", mutates_args=())
def dropout_add_layer_norm_backward_op(grad_out: Optional[Tensor], grad_sum: Optional[Tensor], sum: Tensor,
                                       weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                                       rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_sum_total, grad_weight, grad_bias): LayerNorm's backward plus, in place, the gradient that
    reached the residual sum directly. grad_weight/grad_bias are empty when weight/bias is None.
    grad_sum_total is the residual's gradient; x's is `native_dropout_backward(grad_sum_total, mask, scale)`."""
    impl = gpu_impl("dropout_add_layer_norm_backward", sum)
    if impl is not None:
        return impl(grad_out, grad_sum, sum, weight, bias, mean, rstd)
    if grad_out is None:
        gs = grad_sum.to(sum.dtype, copy=True) if grad_sum is not None else torch.zeros_like(sum)
        gw = torch.zeros_like(weight) if weight is not None else empty_like_absent(sum)
        gb = torch.zeros_like(bias) if bias is not None else empty_like_absent(sum)
        return gs, gw, gb
    gs, gw, gb = aten.native_layer_norm_backward(grad_out, sum, [sum.shape[-1]], mean, rstd, weight, bias,
                                                 [True, weight is not None, bias is not None])
    if grad_sum is not None:
        gs = gs.add_(grad_sum)       # accumulate in place instead of autograd's out-of-place add
    return (gs.contiguous(), gw if gw is not None else empty_like_absent(sum),
            gb if gb is not None else empty_like_absent(sum))


@dropout_add_layer_norm_backward_op.register_fake
def _(grad_out, grad_sum, sum, weight, bias, mean, rstd):
    return (sum.new_empty(sum.shape), torch.empty_like(weight) if weight is not None else sum.new_empty((0,)),
            torch.empty_like(bias) if bias is not None else sum.new_empty((0,)))


# ---- LayerNorm's backward between the residual stream's gradient sums ---------------------------
@torch.library.custom_op("kiln::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(grad_out: Tensor, grad_out2: Optional[Tensor], input: Tensor, mean: Tensor, rstd: Tensor,
                           weight: Optional[Tensor], bias: Optional[Tensor], grad_sum: Optional[Tensor] = None,
                           low_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_input, grad_weight, grad_bias, grad_input_low): `aten.native_layer_norm_backward` over the last
    dimension of `grad_out` (+ `grad_out2`, added as aten.add adds them: the output gradient was a sum of two,
    the residual stream's and its branch's), with `grad_sum` (the gradient reaching `input` through its other
    uses) added to grad_input, and grad_input rounded to `low_dtype` as well where a cast of it was folded in
    (else the fourth output is empty). grad_weight/grad_bias are empty without weight/bias. On the CPU one
    native pass per row (native_norms.c); elsewhere, or for rows above native.ROW_MAX, ATen's ops."""
    return _layer_norm_backward(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum, low_dtype)


@torch.library.custom_op("kiln::layer_norm_backward_sums", mutates_args=())
def layer_norm_backward_sums_op(grad_out: Tensor, grad_out2: Optional[Tensor], input: Tensor, mean: Tensor,
                                rstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                                grad_sum: Optional[Tensor] = None, low_dtype: Optional[torch.dtype] = None
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`layer_norm_backward`'s four outputs and the sum of grad_input_low over every dimension but the last, in
    low_dtype (which must be given): the gradient of the bias of the linear layer whose output gradient
    grad_input_low is, which the graph sums in a pass of its own (kiln/passes/accumulate.py `fold_column_sums`
    folds it here). The native pass sums the rounded values in fp32 blocks added in double, as it sums
    grad_weight; ATen's ops sum them in fp32."""
    if low_dtype is None:
        raise ValueError("layer_norm_backward_sums sums grad_input's low-precision copy: give low_dtype")
    return _layer_norm_backward(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum, low_dtype, True)


def _layer_norm_backward(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum, low_dtype, low_sums=False):
    _check_layer_norm_backward(grad_out, grad_out2, input, mean, rstd, weight, grad_sum)
    done = _ln_backward_native(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum, low_dtype, low_sums)
    if done is not None:
        return done
    acc = acc_dtype(input.dtype)                       # computed as the native pass computes: in fp32
    g = (grad_out if grad_out2 is None else torch.add(grad_out, grad_out2)).to(acc)   # a bf16 gradient: exact
    gi, gw, gb = aten.native_layer_norm_backward(g, input.to(acc), [input.shape[-1]], mean.to(acc), rstd.to(acc),
                                                 weight, bias, [True, weight is not None, bias is not None])
    if grad_sum is not None:
        gi = torch.add(gi, grad_sum)
    gi = gi.to(input.dtype).contiguous()
    low = _low_copy(gi, low_dtype)
    out = (gi, gw if gw is not None else empty_like_absent(input), gb if gb is not None else empty_like_absent(input),
           low)
    if low_sums:
        out += (low.float().sum(tuple(range(low.dim() - 1))).to(low_dtype),)
    return out


def _check_layer_norm_backward(grad_out, grad_out2, input, mean, rstd, weight, grad_sum) -> None:
    for name, t in (("grad_out", grad_out), ("grad_out2", grad_out2), ("grad_sum", grad_sum)):
        if t is not None and t.shape != input.shape:
            raise ValueError(f"layer_norm_backward: {name} {tuple(t.shape)} must have input's shape {tuple(input.shape)}")
    if input.dim() == 0 or (weight is not None and weight.shape != input.shape[-1:]):
        raise ValueError(f"layer_norm_backward normalizes input's last dimension: input {tuple(input.shape)}, "
                         f"weight {None if weight is None else tuple(weight.shape)}")
    if mean.numel() * max(input.shape[-1], 1) != input.numel() or rstd.numel() != mean.numel():
        raise ValueError(f"layer_norm_backward: mean {tuple(mean.shape)} and rstd {tuple(rstd.shape)} need one "
                         f"value per row of input {tuple(input.shape)}")


def _ln_backward_native(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum, low_dtype, low_sums=False):
    """The four outputs (five with `low_sums`) by native_norms.c's pass, or None where it does not apply."""
    d = input.shape[-1]
    lib = native.usable(grad_out, grad_out2, input, weight, grad_sum)
    if (lib is None or not 0 < d <= native.ROW_MAX or (low_dtype is not None and not native.supports(low_dtype))
            or mean.dtype != torch.float32 or rstd.dtype != torch.float32
            or (weight is not None and weight.dtype != torch.float32) or (bias is not None and bias.dtype != torch.float32)):
        return None
    g, x = grad_out.contiguous(), input.contiguous()
    g2 = grad_out2.contiguous() if grad_out2 is not None else None
    gs = grad_sum.contiguous() if grad_sum is not None else None
    w, mu, k = (weight.contiguous() if weight is not None else None), mean.contiguous(), rstd.contiguous()
    gi = torch.empty(input.shape, dtype=input.dtype)
    low = torch.empty(input.shape, dtype=low_dtype) if low_dtype is not None else None
    gw = torch.empty(d, dtype=torch.float32) if weight is not None else None
    gb = torch.empty(d, dtype=torch.float32) if bias is not None else None
    sums = torch.empty(d, dtype=torch.float32) if low_sums and low is not None else None
    n = native.threads()
    partial = torch.empty(3 * n * d, dtype=torch.float64) if any(t is not None for t in (gw, gb, sums)) else None
    native.check(lib.kiln_ln_backward(
        g.data_ptr(), native.code(g), native.ptr(g2), native.code(g2) if g2 is not None else 0, x.data_ptr(),
        native.code(x), mu.data_ptr(), k.data_ptr(), native.ptr(w), native.code(w) if w is not None else 0,
        native.ptr(gs), native.code(gs) if gs is not None else 0, gi.data_ptr(), native.code(gi), native.ptr(low),
        native.code(low) if low is not None else 0, native.ptr(gw), native.ptr(gb), native.ptr(sums),
        native.ptr(partial), input.numel() // d, d, n), "layer_norm_backward")
    out = (gi, gw if gw is not None else empty_like_absent(input), gb if gb is not None else empty_like_absent(input),
           low if low is not None else empty_like_absent(gi))
    return out + (sums.to(low_dtype),) if sums is not None else out


def _layer_norm_backward_fake(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum=None, low_dtype=None):
    _check_layer_norm_backward(grad_out, grad_out2, input, mean, rstd, weight, grad_sum)
    low = input.new_empty(input.shape, dtype=low_dtype) if low_dtype is not None else input.new_empty((0,))
    return (input.new_empty(input.shape), torch.empty_like(weight) if weight is not None else input.new_empty((0,)),
            torch.empty_like(bias) if bias is not None else input.new_empty((0,)), low)


layer_norm_backward_op.register_fake(_layer_norm_backward_fake)


@layer_norm_backward_sums_op.register_fake
def _(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum=None, low_dtype=None):
    if low_dtype is None:
        raise ValueError("layer_norm_backward_sums sums grad_input's low-precision copy: give low_dtype")
    outs = _layer_norm_backward_fake(grad_out, grad_out2, input, mean, rstd, weight, bias, grad_sum, low_dtype)
    return outs + (input.new_empty(input.shape[-1:], dtype=low_dtype),)

# Dropout draws 16 random bits per element: 4 elements from one 64-bit draw, which is ~5x faster than
# the float per element of bernoulli_ (measured: 9 vs 48 ms for 4M elements). The drop probability is
# thereby rounded to a multiple of 1/65536 (flash-attention rounds to 1/256), and the scale uses the
# rounded value, so E[dropout(x)] = x exactly.
_LANES = 1 << 16


def _drop_count(p: float) -> int:
    return min(_LANES, max(0, round(p * _LANES)))


def dropout_scale(p: float) -> float:
    """The factor kept elements are multiplied by: 1 / (1 - p) for the rounded p (0 if all dropped)."""
    k = _drop_count(p)
    return _LANES / (_LANES - k) if k < _LANES else 0.0


def keep_mask(shape, p: float, device) -> Tensor:
    """Bool keep-mask with P(keep) = 1 - p (p rounded to 1/65536), from the default generator."""
    n, k = math.prod(shape), _drop_count(p)
    if k >= _LANES:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    # the full int64 range, so every 16-bit lane of a draw is uniform on [-32768, 32767]
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-2 ** 63, 2 ** 63 - 1)
    lanes = bits.view(torch.int16)[:n]
    return (lanes >= k - _LANES // 2).reshape(shape)      # P(lane < -32768 + k) = k / 65536


def _dal_setup(ctx, inputs, output):
    x, residual, weight, bias, p, eps, training = inputs
    out, s, mean, rstd, mask = output
    ctx.mark_non_differentiable(mean, rstd, mask)
    ctx.set_materialize_grads(False)     # else a zero gradient is allocated for each of them
    ctx.save_for_backward(s, weight, bias, mean, rstd, mask)
    ctx.p = p


def _dal_backward(ctx, grad_out, grad_sum, *_stats):
    s, weight, bias, mean, rstd, mask = ctx.saved_tensors
    gs, gw, gb = torch.ops.kiln.dropout_add_layer_norm_backward(grad_out, grad_sum, s, weight, bias, mean, rstd)
    # the mask drawn by the forward, never a new draw
    gx = aten.native_dropout_backward(gs, mask, dropout_scale(ctx.p)) if mask.numel() else gs
    return (gx, gs, gw if weight is not None else None,
            gb if bias is not None else None, None, None, None)


dropout_add_layer_norm_op.register_autograd(_dal_backward, setup_context=_dal_setup)
