"""Hand-written VJP checks against torch.autograd, for the ops and arguments OpInfo does not reach.

Each case is one ATen call (built from a dtype) checked in float64 and float32: Kiln's gradient
(hand-built graph, Kiln autodiff, generated code) against torch.autograd.grad of the same call.
Cases cover broadcasting, non-contiguous (transposed) inputs, negative dims, keepdim, ties, optional
arguments left out, and the rare arguments where a rule declines and the logged fallback takes over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from kiln.ops.registry import lookup
from tests.ops.helpers import check_vjp

aten = torch.ops.aten
TOL = {torch.float64: dict(rtol=1e-7, atol=1e-7), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@dataclass
class Case:
    id: str
    target: object
    make: Callable[[torch.dtype], tuple]          # dtype -> (args, kwargs)
    seed: int | None = None                       # random ops: the same draws for Kiln and torch
    tol32: dict = field(default_factory=dict)     # float32 only: looser where the kernels accumulate differently
    outputs: tuple | None = None                  # outputs that get a cotangent (default: all floating ones)
    ref: Callable | None = None                   # torch side, where autograd has no formula for the op
    fallback: bool = False                        # the rule declines these arguments (logged fallback)


def R(*shape, d, lo=None, hi=None):
    """Random tensor; uniform in [lo, hi) when given, else standard normal."""
    if lo is not None:
        return torch.rand(shape, dtype=torch.float64).mul(hi - lo).add(lo).to(d)
    return torch.randn(shape, dtype=torch.float64).to(d)


def NC(*shape, d, lo=None, hi=None):
    """Non-contiguous tensor of the given shape (the transpose of a contiguous one)."""
    if len(shape) < 2:
        return R(shape[0] * 2, d=d, lo=lo, hi=hi)[::2]
    return R(*shape[:-2], shape[-1], shape[-2], d=d, lo=lo, hi=hi).transpose(-1, -2)


def P(*shape, d):
    """Positive tensor, away from 0."""
    return R(*shape, d=d, lo=0.5, hi=2.0)


def I(*shape, high):
    return torch.randint(0, high, shape)


def with_ties(d):
    """A tensor with repeated values (max/min/clamp ties)."""
    return torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 4.0, 4.0]], dtype=d)


def _other(d):
    return torch.float32 if d == torch.float64 else torch.float64


def _src_block_ref(op):
    """torch's scatter/scatter_add backward returns an index-shaped src gradient and autograd rejects
    it when src is larger than index; the op reads only that leading block of src, so the reference
    passes exactly that block (the rest of src gets a zero gradient through the slicing)."""
    def ref(x, dim, index, src):
        return op(x, dim, index, src[tuple(slice(0, s) for s in index.shape)])
    return ref


def _copy_ref(dst, src, non_blocking=False):
    """aten.copy has no autograd formula; copy_ into a clone is the same function and has one."""
    return dst.clone().copy_(src)


def _var_all_ref(x, dim, **kwargs):
    """torch's var backward reads dim=[] as 'no dims' (count 1, inf gradient) while its forward
    reduces over all dims; the reference is the same full reduction spelled dim=None."""
    return aten.var.correction(x, None, **kwargs)


def _dropout_train_ref(x, p, train):
    """torch's autograd formula for native_dropout(train=None) scales by 1 while its forward (which
    trains) scales by 1/(1-p); the reference is the same draw with train=True."""
    return aten.native_dropout.default(x, p, True)


def _bool(*shape):
    return torch.rand(shape) > 0.5


CASES = [
    # ---- arithmetic (incl. broadcasting and alpha) ----
    Case("add.Tensor-bcast-alpha", aten.add.Tensor, lambda d: ((R(3, 4, d=d), NC(1, 4, d=d)), dict(alpha=2.5))),
    Case("add.Tensor-0dim", aten.add.Tensor, lambda d: ((R(3, 4, d=d), R(d=d)), {})),
    Case("add.Scalar", aten.add.Scalar, lambda d: ((NC(3, 4, d=d), 2.0), dict(alpha=3))),
    Case("sub.Tensor-bcast-alpha", aten.sub.Tensor, lambda d: ((R(2, 1, 4, d=d), R(3, 1, d=d)), dict(alpha=-0.5))),
    Case("sub.Scalar", aten.sub.Scalar, lambda d: ((R(3, 4, d=d), 1.5), dict(alpha=2))),
    Case("rsub.Scalar", aten.rsub.Scalar, lambda d: ((R(3, 4, d=d), 1.5), dict(alpha=2))),
    Case("rsub.Tensor", aten.rsub.Tensor, lambda d: ((R(3, 4, d=d), R(4, d=d)), dict(alpha=3))),
    Case("mul.Tensor-bcast", aten.mul.Tensor, lambda d: ((NC(3, 4, d=d), R(3, 1, d=d)), {})),
    Case("mul.Scalar", aten.mul.Scalar, lambda d: ((NC(3, 4, d=d), -1.5), {})),
    Case("div.Tensor-bcast", aten.div.Tensor, lambda d: ((R(3, 4, d=d), P(4, d=d)), {})),
    Case("div.Scalar", aten.div.Scalar, lambda d: ((R(3, 4, d=d), 4.0), {})),
    # mixed dtypes: the op promotes, autodiff casts each gradient back to its input's dtype
    Case("add.Tensor-mixed-dtype", aten.add.Tensor, lambda d: ((R(3, 4, d=d), R(4, d=_other(d))), {})),
    Case("mul.Tensor-mixed-dtype", aten.mul.Tensor, lambda d: ((NC(3, 4, d=d), R(3, 4, d=_other(d))), {})),
    Case("mul.Tensor-0dim-other-dtype", aten.mul.Tensor, lambda d: ((R(3, 4, d=d), R(d=_other(d))), {})),
    Case("div.Tensor-mixed-dtype", aten.div.Tensor, lambda d: ((R(3, 4, d=_other(d)), P(3, 1, d=d)), {})),
    Case("div.Tensor-int-numerator", aten.div.Tensor, lambda d: ((I(3, 4, high=5), P(4, d=d)), {})),
    Case("where.self-mixed-dtype", aten.where.self, lambda d: ((_bool(3, 4), R(3, 4, d=d), R(4, d=_other(d))), {})),
    Case("neg", aten.neg.default, lambda d: ((NC(3, 4, d=d),), {})),
    # ---- pow ----
    *[Case(f"pow.Tensor_Scalar-{e}", aten.pow.Tensor_Scalar, lambda d, e=e: ((P(3, 4, d=d), e), {}))
      for e in (0, 1, 2, 3, 0.5, -1.5, 2.5)],
    Case("pow.Tensor_Scalar-neg-base", aten.pow.Tensor_Scalar, lambda d: ((R(3, 4, d=d), 3), {})),
    Case("pow.Tensor_Tensor-bcast", aten.pow.Tensor_Tensor, lambda d: ((P(3, 4, d=d), R(4, d=d)), {})),
    Case("pow.Tensor_Tensor-zero-base", aten.pow.Tensor_Tensor,
         lambda d: ((torch.tensor([0.0, 1.5, 2.0], dtype=d), torch.tensor([2.0, 3.0, 0.5], dtype=d)), {})),
    Case("pow.Tensor_Tensor-zero-base-zero-exp", aten.pow.Tensor_Tensor,
         lambda d: ((torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=d), torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=d)), {})),
    Case("pow.Scalar-zero-base", aten.pow.Scalar, lambda d: ((0.0, torch.tensor([0.0, 1.0, 2.5, -1.0], dtype=d)), {})),
    Case("pow.Scalar", aten.pow.Scalar, lambda d: ((2.5, R(3, 4, d=d)), {})),
    Case("pow.Scalar-int-base", aten.pow.Scalar, lambda d: ((3, NC(3, 4, d=d)), {})),
    Case("pow.Scalar-small-base", aten.pow.Scalar, lambda d: ((0.5, R(5, d=d)), {})),
    # ---- unary math and activations ----
    Case("exp", aten.exp.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("log", aten.log.default, lambda d: ((P(3, 4, d=d),), {})),
    Case("log1p", aten.log1p.default, lambda d: ((P(3, 4, d=d),), {})),
    Case("sqrt", aten.sqrt.default, lambda d: ((P(3, 4, d=d),), {})),
    Case("rsqrt", aten.rsqrt.default, lambda d: ((P(3, 4, d=d),), {})),
    Case("rsqrt-nc", aten.rsqrt.default, lambda d: ((NC(2, 3, 4, d=d, lo=0.2, hi=3.0),), {})),
    Case("reciprocal", aten.reciprocal.default, lambda d: ((P(3, 4, d=d),), {})),
    Case("sin", aten.sin.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("cos", aten.cos.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("abs", aten.abs.default, lambda d: ((torch.cat([R(5, d=d), torch.zeros(2, dtype=d)]),), {})),
    Case("erf", aten.erf.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("tanh", aten.tanh.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("sigmoid", aten.sigmoid.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("relu", aten.relu.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("gelu", aten.gelu.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("gelu-tanh", aten.gelu.default, lambda d: ((R(3, 4, d=d),), dict(approximate="tanh"))),
    Case("silu", aten.silu.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("hardtanh", aten.hardtanh.default, lambda d: ((R(3, 4, d=d) * 2, -0.5, 1.5), {})),
    Case("leaky_relu", aten.leaky_relu.default, lambda d: ((NC(3, 4, d=d), 0.2), {})),
    Case("elu", aten.elu.default, lambda d: ((R(3, 4, d=d), 1.3, 1.1, 0.9), {})),
    Case("elu-neg-alpha", aten.elu.default, lambda d: ((R(3, 4, d=d), -0.5), {})),
    # ---- casts and copies ----
    Case("_to_copy-dtype", aten._to_copy.default,
         lambda d: ((NC(3, 4, d=d),), dict(dtype=torch.float32 if d == torch.float64 else torch.float64))),
    Case("clone", aten.clone.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("alias", aten.alias.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("lift_fresh_copy", aten.lift_fresh_copy.default, lambda d: ((R(3, 4, d=d),), {})),
    Case("copy-bcast", aten.copy.default, lambda d: ((R(3, 4, d=d), NC(1, 4, d=d)), {}), ref=_copy_ref),
    Case("copy-dtype", aten.copy.default, lambda d: ((R(3, 4, d=d), R(3, 4, d=torch.float64 if d == torch.float32
                                                                         else torch.float32)), {}), ref=_copy_ref),
    Case("fill.Scalar", aten.fill.Scalar, lambda d: ((R(3, 4, d=d), 2.0), {})),
    Case("fill.Tensor", aten.fill.Tensor, lambda d: ((R(3, 4, d=d), R(d=d)), {})),
    # ---- selection ----
    Case("where.self-bcast", aten.where.self, lambda d: ((_bool(3, 4), R(3, 1, d=d), NC(4, 4, d=d)[:3]), {})),
    Case("where.ScalarOther", aten.where.ScalarOther, lambda d: ((_bool(3, 4), R(4, d=d), 0.5), {})),
    Case("where.ScalarSelf", aten.where.ScalarSelf, lambda d: ((_bool(3, 4), 0.5, NC(3, 4, d=d)), {})),
    Case("masked_fill.Scalar-bcast", aten.masked_fill.Scalar, lambda d: ((NC(3, 4, d=d), _bool(4), -1.0), {})),
    Case("masked_fill.Tensor", aten.masked_fill.Tensor, lambda d: ((R(3, 4, d=d), _bool(3, 1), R(d=d)), {})),
    Case("maximum-ties", aten.maximum.default, lambda d: ((with_ties(d), with_ties(d).flip(1)), {})),
    Case("minimum-bcast", aten.minimum.default, lambda d: ((R(3, 4, d=d), R(4, d=d)), {})),
    Case("max.other", aten.max.other, lambda d: ((with_ties(d), with_ties(d).flip(0)), {})),
    Case("min.other", aten.min.other, lambda d: ((with_ties(d), with_ties(d).flip(1)), {})),
    Case("clamp-both", aten.clamp.default, lambda d: ((R(4, 5, d=d), -0.5, 0.5), {})),
    Case("clamp-min-only", aten.clamp.default, lambda d: ((NC(4, 5, d=d), -0.5), {})),
    Case("clamp-max-kw", aten.clamp.default, lambda d: ((R(4, 5, d=d),), dict(max=0.3))),
    Case("clamp-ties", aten.clamp.default, lambda d: ((with_ties(d), 0.5, 3.0), {})),
    Case("clamp_min", aten.clamp_min.default, lambda d: ((with_ties(d), 0.5), {})),
    Case("clamp_max", aten.clamp_max.default, lambda d: ((NC(4, 5, d=d), 0.1), {})),
    Case("triu", aten.triu.default, lambda d: ((NC(4, 5, d=d), 1), {})),
    Case("tril", aten.tril.default, lambda d: ((R(2, 4, 5, d=d), -1), {})),
    # ---- views and shape ops ----
    Case("view", aten.view.default, lambda d: ((R(2, 3, 4, d=d), [6, -1]), {})),
    Case("_unsafe_view", aten._unsafe_view.default, lambda d: ((R(2, 3, 4, d=d), [4, 6]), {})),
    Case("reshape-nc", aten.reshape.default, lambda d: ((NC(2, 3, 4, d=d), [-1]), {})),
    Case("squeeze.dim", aten.squeeze.dim, lambda d: ((R(3, 1, 4, d=d), -2), {})),
    Case("squeeze.dims", aten.squeeze.dims, lambda d: ((R(1, 3, 1, 4, d=d), [0, 2]), {})),
    Case("squeeze.default", aten.squeeze.default, lambda d: ((NC(1, 3, 1, 4, d=d),), {})),
    Case("flatten", aten.flatten.using_ints, lambda d: ((NC(2, 3, 4, 5, d=d), 1, 2), {})),
    Case("unsqueeze-neg", aten.unsqueeze.default, lambda d: ((NC(3, 4, d=d), -1), {})),
    Case("unsqueeze-0", aten.unsqueeze.default, lambda d: ((R(3, 4, d=d), 0), {})),
    Case("expand-new-dims", aten.expand.default, lambda d: ((R(3, 1, d=d), [2, 3, 4]), {})),
    Case("expand-minus1", aten.expand.default, lambda d: ((NC(1, 4, d=d), [3, -1]), {})),
    Case("transpose", aten.transpose.int, lambda d: ((R(2, 3, 4, d=d), 0, -1), {})),
    Case("t", aten.t.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("permute-neg", aten.permute.default, lambda d: ((R(2, 3, 4, d=d), [-1, 0, 1]), {})),
    Case("permute-nc", aten.permute.default, lambda d: ((NC(2, 3, 4, d=d), [1, 2, 0]), {})),
    Case("slice-step", aten.slice.Tensor, lambda d: ((R(5, 7, d=d), 1, 1, None, 2), {})),
    Case("slice-neg", aten.slice.Tensor, lambda d: ((NC(6, 4, d=d), 0, -4, -1), {})),
    Case("slice-defaults", aten.slice.Tensor, lambda d: ((R(6, 4, d=d),), {})),
    Case("slice-big-end", aten.slice.Tensor, lambda d: ((R(6, 4, d=d), -1, 1, 100), {})),
    Case("select-neg", aten.select.int, lambda d: ((NC(3, 4, d=d), 1, -1), {})),
    Case("narrow", aten.narrow.default, lambda d: ((R(5, 4, d=d), 0, 1, 3), {})),
    Case("narrow-neg-start", aten.narrow.default, lambda d: ((NC(5, 4, d=d), -1, -1, 1), {})),
    Case("narrow-neg-start-2", aten.narrow.default, lambda d: ((R(5, 4, d=d), 0, -3, 2), {})),
    Case("split-uneven", aten.split.Tensor, lambda d: ((R(7, 3, d=d), 3), {})),
    Case("split-dim-neg", aten.split.Tensor, lambda d: ((NC(3, 5, d=d), 2, -1), {})),
    Case("split_with_sizes", aten.split_with_sizes.default, lambda d: ((R(3, 6, d=d), [1, 3, 2], 1), {})),
    Case("split-unused-piece", aten.split.Tensor, lambda d: ((R(7, 3, d=d), 3), {}), outputs=(1,)),
    Case("split_with_sizes-zero", aten.split_with_sizes.default, lambda d: ((NC(5, 3, d=d), [2, 0, 3]), {})),
    Case("unbind-unused", aten.unbind.int, lambda d: ((R(3, 4, d=d),), {}), outputs=(0, 2)),
    Case("unbind", aten.unbind.int, lambda d: ((NC(3, 4, d=d), 1), {})),
    Case("cat", aten.cat.default, lambda d: (([R(2, 3, d=d), NC(4, 3, d=d)],), {})),
    Case("cat-neg-dim", aten.cat.default, lambda d: (([R(2, 3, d=d), R(2, 1, d=d), NC(2, 2, d=d)], -1), {})),
    Case("cat-legacy-empty", aten.cat.default, lambda d: (([R(2, 3, d=d), torch.zeros(0, dtype=d)], 0), {})),
    # XLM/Flaubert: a legacy empty tensor first, concatenated along dim 1 (it has no dim 1)
    Case("cat-legacy-empty-dim1", aten.cat.default,
         lambda d: (([torch.zeros(0, dtype=d), R(2, 3, d=d), NC(2, 2, d=d)], 1), {})),
    Case("cat-single", aten.cat.default, lambda d: (([NC(2, 3, d=d)], 1), {})),
    Case("stack-dim0", aten.stack.default, lambda d: (([R(3, d=d), R(3, d=d), R(3, d=d)],), {})),
    Case("stack", aten.stack.default, lambda d: (([R(2, 3, d=d), NC(2, 3, d=d)], -1), {})),
    Case("constant_pad_nd", aten.constant_pad_nd.default, lambda d: ((NC(2, 3, 4, d=d), [1, 2, 0, 1], 0.5), {})),
    Case("constant_pad_nd-crop", aten.constant_pad_nd.default, lambda d: ((R(2, 5, 4, d=d), [-1, 2, 1, -2]), {})),
    Case("repeat", aten.repeat.default, lambda d: ((NC(2, 3, d=d), [2, 1, 3]), {})),
    Case("flip", aten.flip.default, lambda d: ((NC(2, 3, 4, d=d), [0, -1]), {})),
    # ---- reductions ----
    Case("sum", aten.sum.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("sum-dtype", aten.sum.default, lambda d: ((R(3, 4, d=d),), dict(dtype=torch.float64))),
    Case("sum.dim-keepdim", aten.sum.dim_IntList, lambda d: ((NC(2, 3, 4, d=d), [0, -1], True), {})),
    Case("sum.dim", aten.sum.dim_IntList, lambda d: ((R(2, 3, 4, d=d), [1]), {})),
    Case("sum.dim-None", aten.sum.dim_IntList, lambda d: ((R(2, 3, d=d), None, True), {})),
    Case("sum.dim-empty", aten.sum.dim_IntList, lambda d: ((R(2, 3, d=d), []), {})),
    Case("sum.dim-dtype", aten.sum.dim_IntList, lambda d: ((R(2, 3, d=d), [1], False), dict(dtype=torch.float64))),
    Case("mean", aten.mean.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("mean.dim-keepdim", aten.mean.dim, lambda d: ((NC(2, 3, 4, d=d), [-1], True), {})),
    Case("mean-dtype", aten.mean.dim, lambda d: ((R(2, 3, d=d), [1]), dict(dtype=torch.float64))),
    Case("mean.dim-none", aten.mean.dim, lambda d: ((R(2, 3, 4, d=d), None), {})),
    Case("mean.dim-two", aten.mean.dim, lambda d: ((R(2, 3, 4, d=d), [0, 2]), {})),
    Case("var-dims", aten.var.correction, lambda d: ((NC(2, 3, 4, d=d), [1, 2]), dict(correction=0, keepdim=True))),
    Case("var-correction-None", aten.var.correction, lambda d: ((R(3, 5, d=d), [1]), dict(correction=None))),
    Case("var-correction-float", aten.var.correction, lambda d: ((R(3, 5, d=d), [0]), dict(correction=0.5))),
    Case("var-all", aten.var.correction, lambda d: ((R(3, 4, d=d),), {})),
    Case("var-dim-neg", aten.var.correction, lambda d: ((R(3, 5, d=d), [-1]), dict(correction=1))),
    Case("amax-ties", aten.amax.default, lambda d: ((with_ties(d), [1]), {})),
    Case("amin-keepdim", aten.amin.default, lambda d: ((with_ties(d), [0], True), {})),
    Case("amax-all", aten.amax.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("logsumexp", aten.logsumexp.default, lambda d: ((NC(2, 3, 4, d=d), [-1]), {})),
    Case("amax-empty-dims", aten.amax.default, lambda d: ((R(2, 3, d=d), []), {})),
    Case("mean.dim-empty", aten.mean.dim, lambda d: ((R(2, 3, d=d), []), {})),
    Case("var-empty-dims", aten.var.correction, lambda d: ((R(2, 3, d=d), []), {}), ref=_var_all_ref),
    Case("var-count-equals-correction", aten.var.correction, lambda d: ((R(3, 1, d=d), [1]), {})),
    Case("vector_norm-empty-dims", aten.linalg_vector_norm.default, lambda d: ((R(2, 3, d=d), 2, []), {})),
    Case("cumsum-0dim", aten.cumsum.default, lambda d: ((R(d=d), 0), {})),
    Case("logsumexp-keepdim", aten.logsumexp.default, lambda d: ((R(2, 3, 4, d=d), [0, 1], True), {})),
    Case("cumsum", aten.cumsum.default, lambda d: ((NC(3, 4, d=d), -1), {})),
    Case("cumsum-dim0", aten.cumsum.default, lambda d: ((R(3, 4, d=d), 0), {})),
    Case("cumsum-dtype", aten.cumsum.default, lambda d: ((R(3, 4, d=d), 1), dict(dtype=torch.float64))),
    Case("vector_norm", aten.linalg_vector_norm.default, lambda d: ((NC(3, 4, d=d),), {})),
    Case("vector_norm-dim-keepdim", aten.linalg_vector_norm.default, lambda d: ((R(3, 4, d=d), 2, [1], True), {})),
    Case("vector_norm-dtype", aten.linalg_vector_norm.default, lambda d: ((R(3, 4, d=d), 2, [0]),
                                                                          dict(dtype=torch.float64))),
    Case("vector_norm-zero-row", aten.linalg_vector_norm.default,
         lambda d: ((torch.cat([R(2, 4, d=d), torch.zeros(1, 4, dtype=d)]), 2, [1]), {})),
    *[Case(f"vector_norm-ord{p}", aten.linalg_vector_norm.default,
           lambda d, p=p: ((torch.cat([NC(3, 4, d=d), torch.zeros(1, 4, dtype=d)]), p, [1]), {}))
      for p in (0, 1, 0.5, 1.5, 3, -1.5)],
    Case("vector_norm-inf-ties", aten.linalg_vector_norm.default,
         lambda d: ((torch.cat([with_ties(d), -with_ties(d)]), float("inf"), [1], True), {})),
    Case("vector_norm-neg-inf", aten.linalg_vector_norm.default, lambda d: ((with_ties(d), float("-inf")), {})),
    Case("vector_norm-ord3-0dim", aten.linalg_vector_norm.default, lambda d: ((R(d=d), 3), {})),
    # ---- indexing ----
    Case("embedding", aten.embedding.default, lambda d: ((R(10, 4, d=d), I(3, 5, high=10)), {})),
    Case("embedding-padding_idx", aten.embedding.default,
         lambda d: ((R(10, 4, d=d), torch.tensor([[0, 2, 2], [5, 0, 9]]), 2), {})),
    Case("embedding-scale_grad_by_freq", aten.embedding.default,
         lambda d: ((R(10, 4, d=d), torch.tensor([1, 1, 3, 1, 7]), -1, True), {})),
    Case("index.Tensor", aten.index.Tensor, lambda d: ((R(5, 4, d=d), [torch.tensor([0, 2, 2, 4])]), {})),
    Case("index.Tensor-None", aten.index.Tensor, lambda d: ((NC(3, 5, d=d), [None, torch.tensor([4, 0, 4])]), {})),
    Case("index.Tensor-2idx", aten.index.Tensor,
         lambda d: ((R(4, 5, 3, d=d), [torch.tensor([[0], [3]]), torch.tensor([1, 1, 4])]), {})),
    # (a bool-mask index has a data-dependent shape that meta inference cannot build; capture turns it
    # into nonzero() + long indices, which is this case)
    Case("index.Tensor-mask-as-nonzero", aten.index.Tensor,
         lambda d: ((R(4, 5, d=d), list(_bool(4, 5).nonzero().unbind(1))), {})),
    Case("index_select", aten.index_select.default, lambda d: ((NC(4, 5, d=d), 1, torch.tensor([0, 4, 4])), {})),
    Case("gather", aten.gather.default, lambda d: ((R(3, 5, d=d), 1, I(3, 4, high=5)), {})),
    Case("gather-nc-dim0", aten.gather.default, lambda d: ((NC(4, 3, d=d), 0, I(2, 3, high=4)), {})),
    Case("scatter.src", aten.scatter.src, lambda d: ((R(3, 5, d=d), 1, torch.tensor([[0, 1], [2, 3], [4, 0]]),
                                                      R(3, 2, d=d)), {})),
    Case("scatter.value", aten.scatter.value, lambda d: ((NC(3, 5, d=d), 1, torch.tensor([[0], [2], [4]]), 0.5), {})),
    Case("scatter_add", aten.scatter_add.default, lambda d: ((R(3, 5, d=d), 1, I(3, 4, high=5), R(3, 4, d=d)), {})),
    Case("scatter_add-src-larger-than-index", aten.scatter_add.default,
         lambda d: ((R(3, 5, d=d), 1, I(2, 3, high=5), R(3, 4, d=d)), {}), ref=_src_block_ref(aten.scatter_add.default)),
    Case("scatter.src-larger-than-index", aten.scatter.src,
         lambda d: ((R(3, 5, d=d), 1, torch.tensor([[0, 1], [2, 3]]), R(3, 4, d=d)), {}),
         ref=_src_block_ref(aten.scatter.src)),
    Case("gather-int32-index-bigger-input", aten.gather.default, lambda d: ((R(4, 5, d=d), 1, I(2, 3, high=5)), {})),
    Case("embedding-int32", aten.embedding.default, lambda d: ((R(10, 4, d=d), I(3, 5, high=10).int()), {})),
    Case("index.Tensor-int32", aten.index.Tensor, lambda d: ((R(5, 4, d=d), [torch.tensor([0, 2, 2, 4]).int()]), {})),
    Case("index_put", aten.index_put.default, lambda d: ((R(5, 3, d=d), [torch.tensor([0, 3])], R(2, 3, d=d)), {})),
    Case("index_put-accumulate-dups", aten.index_put.default,
         lambda d: ((R(5, 3, d=d), [torch.tensor([1, 1, 4])], R(3, 3, d=d), True), {})),
    Case("index_put-bcast-value", aten.index_put.default,
         lambda d: ((NC(5, 3, d=d), [torch.tensor([0, 2])], R(3, d=d)), {})),
    # x[mask] = values (boolean mask): values full length, broadcast along the mask, or a scalar
    Case("index_put-mask-values-full", aten.index_put.default,
         lambda d: ((R(5, 3, d=d), [torch.tensor([True, False, True, True, False])], R(3, 3, d=d)), {})),
    Case("index_put-mask-2d-values-row", aten.index_put.default,
         lambda d: ((NC(4, 3, 2, d=d), [_bool(4, 3)], R(2, d=d)), {})),
    Case("index_put-mask-2d-values-1row", aten.index_put.default,
         lambda d: ((R(4, 3, 2, d=d), [_bool(4, 3)], R(1, 2, d=d)), {})),
    Case("index_put-mask-2d-values-full", aten.index_put.default,
         lambda d: ((R(3, 3, 2, d=d), [torch.eye(3, dtype=torch.bool)], R(3, 2, d=d)), {})),
    Case("index_put-mask-scalar-accumulate", aten.index_put.default,
         lambda d: ((R(4, 5, d=d), [_bool(4, 5)], R(d=d), True), {})),
    Case("index_put-mask-values-len1", aten.index_put.default,
         lambda d: ((R(5, 3, d=d), [torch.tensor([True, False, True, True, False])], R(1, 3, d=d)), {})),
    Case("index_put-mask-none-selected", aten.index_put.default,
         lambda d: ((R(5, 3, d=d), [torch.zeros(5, dtype=torch.bool)], R(3, d=d)), {})),
    Case("slice_scatter", aten.slice_scatter.default, lambda d: ((R(6, 4, d=d), R(6, 2, d=d), 1, 1, 4, 2), {})),
    Case("slice_scatter-defaults", aten.slice_scatter.default, lambda d: ((R(6, 4, d=d), NC(3, 4, d=d)),
                                                                          dict(start=2, end=5))),
    Case("slice_scatter-dim0-only", aten.slice_scatter.default, lambda d: ((R(6, 4, d=d), R(6, 4, d=d)), {})),
    Case("select_scatter", aten.select_scatter.default, lambda d: ((R(3, 4, d=d), R(3, d=d), 1, -1), {})),
    Case("select_scatter-nc", aten.select_scatter.default, lambda d: ((NC(3, 4, d=d), R(4, d=d), 0, 1), {})),
    # ---- matmuls ----
    Case("mm-nc", aten.mm.default, lambda d: ((NC(3, 4, d=d), R(4, 5, d=d)), {})),
    Case("bmm-nc", aten.bmm.default, lambda d: ((R(2, 3, 4, d=d), NC(2, 4, 5, d=d)), {})),
    Case("linear-3d", aten.linear.default, lambda d: ((R(2, 3, 4, d=d), R(5, 4, d=d), R(5, d=d)), {})),
    Case("linear-nobias", aten.linear.default, lambda d: ((R(3, 4, d=d), NC(5, 4, d=d)), {})),
    Case("linear-4d-nc", aten.linear.default, lambda d: ((NC(2, 2, 3, 4, d=d), R(5, 4, d=d), R(5, d=d)), {})),
    Case("linear-1d-weight", aten.linear.default, lambda d: ((R(3, 4, d=d), R(4, d=d)), {})),
    Case("linear-1d", aten.linear.default, lambda d: ((R(4, d=d), R(5, 4, d=d), R(5, d=d)), {})),
    Case("addmm", aten.addmm.default, lambda d: ((R(5, d=d), R(3, 4, d=d), NC(4, 5, d=d)), {})),
    Case("addmm-beta-alpha", aten.addmm.default, lambda d: ((R(3, 5, d=d), NC(3, 4, d=d), R(4, 5, d=d)),
                                                            dict(beta=0.5, alpha=2.0))),
    # ---- convolution ----
    Case("conv2d-stride-pad", aten.convolution.default,
         lambda d: ((R(2, 3, 7, 6, d=d), R(4, 3, 3, 3, d=d), R(4, d=d), [2, 1], [1, 0], [1, 1], False, [0, 0], 1), {})),
    Case("conv2d-groups-nobias", aten.convolution.default,
         lambda d: ((R(2, 4, 6, 6, d=d), R(6, 2, 3, 3, d=d), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 2), {})),
    Case("conv2d-dilation", aten.convolution.default,
         lambda d: ((R(1, 2, 8, 8, d=d), R(3, 2, 3, 3, d=d), R(3, d=d), [1, 1], [2, 2], [2, 2], False, [0, 0], 1), {})),
    Case("conv1d-depthwise", aten.convolution.default,
         lambda d: ((R(2, 4, 9, d=d), R(4, 1, 3, d=d), R(4, d=d), [1], [1], [1], False, [0], 4), {})),
    Case("conv_transpose2d-groups-nobias", aten.convolution.default,
         lambda d: ((R(1, 4, 4, 4, d=d), R(4, 3, 2, 2, d=d), None, [1, 2], [0, 1], [1, 1], True, [0, 1], 2), {})),
    Case("conv2d-nc-input", aten.convolution.default,
         lambda d: ((NC(2, 3, 6, 5, d=d), R(2, 3, 3, 3, d=d), R(2, d=d), [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {})),
    Case("conv_transpose2d", aten.convolution.default,
         lambda d: ((R(2, 4, 5, 5, d=d), R(4, 3, 3, 3, d=d), R(3, d=d), [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {})),
    # ---- normalization ----
    Case("layer_norm-3d", aten.native_layer_norm.default,
         lambda d: ((R(2, 3, 8, d=d), [8], R(8, d=d), R(8, d=d), 1e-5), {})),
    Case("layer_norm-2dims-noaffine", aten.native_layer_norm.default,
         lambda d: ((NC(2, 4, 5, d=d), [4, 5], None, None, 1e-5), {})),
    Case("layer_norm-weight-only", aten.native_layer_norm.default,
         lambda d: ((R(3, 6, d=d), [6], R(6, d=d), None, 1e-3), {})),
    Case("batch_norm-train", aten._native_batch_norm_legit_functional.default,
         lambda d: ((R(4, 3, 5, 5, d=d), R(3, d=d), R(3, d=d), torch.zeros(3, dtype=d), torch.ones(3, dtype=d),
                     True, 0.1, 1e-5), {})),
    Case("batch_norm-train-2d-noaffine", aten._native_batch_norm_legit_functional.default,
         lambda d: ((R(6, 4, d=d), None, None, torch.zeros(4, dtype=d), torch.ones(4, dtype=d), True, 0.1, 1e-5), {})),
    # eval mode: only the output; eager returns empty saved statistics where meta says (C,)
    Case("batch_norm-eval", aten._native_batch_norm_legit_no_training.default,
         lambda d: ((R(4, 3, 5, 5, d=d), R(3, d=d), R(3, d=d), R(3, d=d), P(3, d=d), 0.1, 1e-5), {}), outputs=(0,)),
    Case("batch_norm-eval-noaffine", aten._native_batch_norm_legit_no_training.default,
         lambda d: ((NC(4, 3, 5, d=d), None, None, R(3, d=d), P(3, d=d), 0.1, 1e-5), {}), outputs=(0,)),
    # ---- pooling ----
    Case("max_pool2d-2x2", aten.max_pool2d_with_indices.default, lambda d: ((R(2, 3, 6, 6, d=d), [2, 2], [2, 2]), {})),
    Case("max_pool2d-3x3-s1-p1", aten.max_pool2d_with_indices.default,
         lambda d: ((R(1, 2, 5, 5, d=d), [3, 3], [1, 1], [1, 1]), {})),
    Case("max_pool2d-ceil-dilation", aten.max_pool2d_with_indices.default,
         lambda d: ((R(1, 2, 7, 7, d=d), [2, 2], [2, 2], [0, 0], [2, 2], True), {})),
    Case("max_pool2d-unbatched", aten.max_pool2d_with_indices.default,
         lambda d: ((NC(3, 6, 5, d=d), [2, 2], [1, 2]), {})),
    Case("max_pool2d-default-stride", aten.max_pool2d_with_indices.default, lambda d: ((R(1, 2, 4, 4, d=d), [2, 2]), {})),
    Case("avg_pool2d-ceil-nopad-divisor", aten.avg_pool2d.default,
         lambda d: ((R(1, 2, 7, 7, d=d), [3, 3], [2, 2], [1, 1], True, False, 5), {})),
    Case("avg_pool2d-default-stride", aten.avg_pool2d.default, lambda d: ((NC(2, 3, 6, 6, d=d), [2, 2]), {})),
    Case("avg_pool2d", aten.avg_pool2d.default,
         lambda d: ((R(2, 3, 6, 6, d=d), [3, 3], [2, 2], [1, 1], True, False), {})),
    Case("adaptive_avg_pool2d", aten._adaptive_avg_pool2d.default, lambda d: ((R(2, 3, 7, 5, d=d), [3, 2]), {})),
    # ---- dropout (seeded: Kiln's forward draws the same mask as torch's) ----
    Case("native_dropout", aten.native_dropout.default, lambda d: ((R(8, 16, d=d), 0.3, True), {}), seed=7),
    Case("native_dropout-train-None", aten.native_dropout.default, lambda d: ((R(8, 16, d=d), 0.5, None), {}), seed=7,
         ref=_dropout_train_ref),
    Case("native_dropout-eval", aten.native_dropout.default, lambda d: ((R(8, 16, d=d), 0.3, False), {}), seed=7),
    Case("native_dropout-p0", aten.native_dropout.default, lambda d: ((NC(8, 16, d=d), 0.0, True), {}), seed=7),
    Case("native_dropout-p1", aten.native_dropout.default, lambda d: ((R(8, 16, d=d), 1.0, True), {}), seed=7),
    # ---- softmax and losses ----
    Case("_softmax", aten._softmax.default, lambda d: ((NC(2, 3, 5, d=d), -1, False), {})),
    Case("_softmax-dim0", aten._softmax.default, lambda d: ((R(4, 5, d=d), 0, False), {})),
    Case("_log_softmax", aten._log_softmax.default, lambda d: ((NC(3, 5, d=d), 1, False), {})),
    Case("_log_softmax-dim0", aten._log_softmax.default, lambda d: ((R(2, 4, 5, d=d), 0, False), {})),
    *[Case(f"nll_loss-red{red}", aten.nll_loss_forward.default,
           lambda d, red=red: ((R(6, 5, d=d).log_softmax(1), torch.tensor([0, 4, 2, 2, 1, 3]), None, red, -100), {}))
      for red in (0, 1, 2)],
    *[Case(f"nll_loss-ignore-weight-red{red}", aten.nll_loss_forward.default,
           lambda d, red=red: ((R(6, 5, d=d), torch.tensor([0, 4, -1, 2, -1, 3]), P(5, d=d), red, -1), {}))
      for red in (0, 1, 2)],
    Case("nll_loss-ignore-index-in-range", aten.nll_loss_forward.default,
         lambda d: ((NC(6, 5, d=d), torch.tensor([0, 4, 1, 2, 1, 3]), None, 1, 1), {})),
    Case("nll_loss-1d", aten.nll_loss_forward.default, lambda d: ((R(5, d=d), torch.tensor(3), None, 1, -100), {})),
    *[Case(f"nll_loss2d-red{red}", aten.nll_loss2d_forward.default,
           lambda d, red=red: ((R(2, 4, 3, 3, d=d), I(2, 3, 3, high=4), P(4, d=d), red, 1), {}))
      for red in (0, 1, 2)],
    # ---- attention ----
    Case("flash_cpu", aten._scaled_dot_product_flash_attention_for_cpu.default,
         lambda d: ((R(2, 3, 5, 8, d=d), R(2, 3, 7, 8, d=d), R(2, 3, 7, 8, d=d)), {})),
    Case("flash_cpu-causal-scale", aten._scaled_dot_product_flash_attention_for_cpu.default,
         lambda d: ((R(1, 2, 6, 4, d=d), R(1, 2, 6, 4, d=d), R(1, 2, 6, 4, d=d), 0.0, True), dict(scale=0.3))),
    Case("flash_cpu-float-mask", aten._scaled_dot_product_flash_attention_for_cpu.default,
         lambda d: ((R(2, 2, 5, 4, d=d), R(2, 2, 6, 4, d=d), R(2, 2, 6, 4, d=d)), dict(attn_mask=R(5, 6, d=d)))),
    # (no bool-mask case: the CPU flash kernel requires a mask of the query's dtype)
    Case("flash_cpu-bcast-mask-nc", aten._scaled_dot_product_flash_attention_for_cpu.default,
         lambda d: ((R(2, 5, 2, 4, d=d).transpose(1, 2), R(2, 2, 6, 4, d=d), NC(2, 2, 6, 4, d=d)),
                    dict(attn_mask=R(2, 1, 1, 6, d=d)))),
    # ---- selections returning (values, indices): the gradient goes back to the picked places ----
    Case("topk", aten.topk.default, lambda d: ((R(3, 5, 6, d=d), 3), {})),
    Case("topk-dim-smallest", aten.topk.default, lambda d: ((NC(3, 6, 5, d=d), 2, 1, False), {})),
    Case("topk-unsorted-kw", aten.topk.default, lambda d: ((R(4, 5, d=d), 2), dict(dim=0, sorted=False))),
    Case("sort-descending", aten.sort.default, lambda d: ((R(3, 5, d=d), 1, True), {})),
    Case("sort.stable", aten.sort.stable, lambda d: ((NC(3, 6, 5, d=d),), dict(stable=True, dim=-1))),
    Case("sort.stable-dim0", aten.sort.stable, lambda d: ((R(4, 3, d=d),), dict(stable=None, dim=0))),
    Case("max.dim", aten.max.dim, lambda d: ((R(3, 5, 6, d=d), 1), {})),
    Case("max.dim-keepdim", aten.max.dim, lambda d: ((NC(3, 6, 5, d=d), -1, True), {})),
    Case("min.dim", aten.min.dim, lambda d: ((R(3, 5, d=d), 0), {})),
    Case("kthvalue-keepdim", aten.kthvalue.default, lambda d: ((R(3, 5, 6, d=d), 2, 1, True), {})),
    Case("median.dim", aten.median.dim, lambda d: ((NC(3, 6, 5, d=d), -1), {})),
    Case("nanmedian.dim", aten.nanmedian.dim, lambda d: ((R(3, 5, d=d), 1, True), {})),
    Case("mode", aten.mode.default, lambda d: ((R(3, 5, d=d), 1), {})),
    Case("cummax", aten.cummax.default, lambda d: ((R(3, 5, d=d), 1), {})),
    Case("cummin", aten.cummin.default, lambda d: ((NC(3, 6, 5, d=d), -1), {})),
    Case("max-ties", aten.max.default, lambda d: ((torch.tensor([[1., 3., 3.], [2., 0., 3.]], dtype=d),), {})),
    Case("min", aten.min.default, lambda d: ((R(3, 5, d=d),), {})),
    # no rule, a floating and an integer output: the autograd fallback differentiates the first only
    Case("frexp-fallback", aten.frexp.Tensor, lambda d: ((R(3, 5, d=d),), {}), fallback=True),
]

IDS = [c.id for c in CASES]
assert len(set(IDS)) == len(IDS), "duplicate case ids"


def covered_ops() -> set[str]:
    """Registry names of the ops these cases check."""
    return {lookup(c.target).name for c in CASES}


@pytest.mark.parametrize("dtype,strided", [(torch.float64, False), (torch.float32, False), (torch.float64, True)],
                         ids=["fp64", "fp32", "fp64-strided-grad"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vjp_case(case: Case, dtype, strided):
    """fp64 and fp32; and fp64 again with non-contiguous output gradients (a rule must not assume
    the gradient it receives is contiguous, e.g. by calling view on it)."""
    torch.manual_seed(0)
    args, kwargs = case.make(dtype)
    tol = dict(TOL[dtype], **(case.tol32 if dtype == torch.float32 else {}))
    check_vjp(case.target, args, kwargs, seed=case.seed, outputs=case.outputs, ref=case.ref,
              fallback=case.fallback, strided_cotangents=strided, what=f"[{case.id} {dtype}{' strided grad' if strided else ''}]", **tol)
