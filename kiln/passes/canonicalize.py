"""Canonicalize the captured forward before autodiff: composite ops become the ATen ops whose
backward kernels exist (layer_norm -> native_layer_norm, cross_entropy -> log_softmax + nll_loss, ...),
and ops that dialects implement by lowering (attention) are lowered by the chosen dialect."""
from __future__ import annotations

import logging

import torch

from kiln.dialects import registry as dialects
from kiln.ir.graph import Graph, Value
from kiln.ops.common import arg, reshape, shape
from kiln.passes.rewrite import rewrite
from kiln.ir.symbolic import same

aten = torch.ops.aten
log = logging.getLogger("kiln")


def _layer_norm(b, n):
    # layer_norm(x) -> native_layer_norm(x)[0]   (keeps mean/rstd for the fused backward)
    x, ns, w, bias, eps = n.args[0], arg(n, 1, "normalized_shape"), arg(n, 2, "weight"), arg(n, 3, "bias"), \
        arg(n, 4, "eps", 1e-5)
    return [b(aten.native_layer_norm.default, x, ns, w, bias, eps)[0]]


def _conv(b, n):
    # conv{1,2,3}d(x, w, b, stride, padding, dilation, groups) -> convolution(...)
    x, w, bias = n.args[0], n.args[1], arg(n, 2, "bias")
    nd = len(shape(w)) - 2
    expand = (lambda v, d: list(v) * nd if isinstance(v, (list, tuple)) and len(v) == 1 else
              (list(v) if isinstance(v, (list, tuple)) else [v] * nd))
    stride, padding, dilation = expand(arg(n, 3, "stride", 1), 1), arg(n, 4, "padding", 0), \
        expand(arg(n, 5, "dilation", 1), 1)
    if isinstance(padding, str):
        return None                                 # 'same'/'valid': keep the ATen op (fallback gradient)
    return [b(aten.convolution.default, x, w, bias, stride, expand(padding, 0), dilation, False, [0] * nd,
              arg(n, 6, "groups", 1))]


def _max_pool2d(b, n):
    # max_pool2d(x) -> max_pool2d_with_indices(x)[0]   (indices drive the backward)
    return [b(aten.max_pool2d_with_indices.default, *n.args, **n.kwargs)[0]]


def _softmax(log):
    def rule(b, n):
        # softmax(x, dim, dtype) -> _softmax(to(x, dtype), dim, False)
        x, dim, dtype = n.args[0], n.args[1], arg(n, 2, "dtype")
        if dtype is not None and dtype != x.meta.dtype:
            x = b(aten._to_copy.default, x, dtype=dtype)
        return [b(aten._log_softmax.default if log else aten._softmax.default, x, dim, False)]
    return rule


def _dropout(b, n):
    # dropout(x, p, train) -> native_dropout(x, p, train)[0]   (the mask drives the backward)
    x, p, train = n.args[0], arg(n, 1, "p"), arg(n, 2, "train")
    if not train or p == 0:
        return [x]
    return [b(aten.native_dropout.default, x, p, True)[0]]


def _cross_entropy(b, n):
    # cross_entropy(x, t) -> nll_loss(log_softmax(x), t); probability targets and smoothing in ATen ops
    x, target, weight = n.args[0], n.args[1], arg(n, 2, "weight")
    reduction, ignore, smoothing = arg(n, 3, "reduction", 1), arg(n, 4, "ignore_index", -100), \
        arg(n, 5, "label_smoothing", 0.0)
    if target.meta.dtype.is_floating_point or (smoothing and weight is not None):
        return None                                 # rare forms: the fallback handles them visibly
    cdim = 1 if len(shape(x)) > 1 else 0
    if len(shape(x)) > 2:                           # (N, C, d1...) -> (N*d1..., C)
        perm = [0] + list(range(2, len(shape(x)))) + [1]
        x = reshape(b, b(aten.permute.default, x, perm), [-1, shape(x)[1]])
        target = reshape(b, target, [-1])
        cdim = 1
    lsm = b(aten._log_softmax.default, x, cdim, False)
    if reduction == 0 and len(shape(n.out)) > 1:
        return None
    nll = b(aten.nll_loss_forward.default, lsm, target, weight, reduction, ignore)[0]
    if not smoothing:
        return [nll if same(shape(nll), shape(n.out)) else reshape(b, nll, shape(n.out))]
    # label smoothing: (1-e) * nll + e * mean over classes of -log p, with ignored targets masked out
    classes = shape(x)[cdim]
    smooth = b(aten.neg.default, b(aten.sum.dim_IntList, lsm, [cdim], False))
    valid = b(aten.ne.Scalar, target, ignore)
    smooth = b(aten.where.ScalarOther, valid, smooth, 0.0)
    if reduction == 1:
        count = b(aten.sum.default, valid)
        smooth = b(aten.div.Tensor, b(aten.sum.default, smooth), count)
    elif reduction == 2:
        smooth = b(aten.sum.default, smooth)
    mixed = b(aten.add.Tensor, b(aten.mul.Tensor, nll, 1.0 - smoothing), b(aten.mul.Tensor, smooth, smoothing / classes))
    return [mixed]


def _pad(b, n):
    # pad(x, p, 'constant', v) -> constant_pad_nd(x, p, v)
    mode = arg(n, 2, "mode", "constant")
    if mode != "constant":
        return None
    value = arg(n, 3, "value")
    return [b(aten.constant_pad_nd.default, n.args[0], n.args[1], 0.0 if value is None else value)]


def _matmul(b, n):
    # matmul(a, b) -> mm / bmm on flattened batch dims (their backward rules are exact)
    x, y = n.args
    xs, ys = shape(x), shape(y)
    if len(xs) >= 2 and len(ys) == 2:
        out = b(aten.mm.default, reshape(b, x, [-1, xs[-1]]), y)
        return [reshape(b, out, xs[:-1] + [ys[-1]])]
    if len(xs) >= 3 and xs[:-2] == ys[:-2]:
        out = b(aten.bmm.default, reshape(b, x, [-1] + xs[-2:]), reshape(b, y, [-1] + ys[-2:]))
        return [reshape(b, out, xs[:-1] + [ys[-1]])]
    return None


CANONICAL_RULES = {
    aten.layer_norm.default: _layer_norm,
    aten.conv1d.default: _conv, aten.conv2d.default: _conv, aten.conv3d.default: _conv,
    aten.max_pool2d.default: _max_pool2d,
    aten.softmax.int: _softmax(log=False),
    aten.log_softmax.int: _softmax(log=True),
    aten.dropout.default: _dropout,
    aten.cross_entropy_loss.default: _cross_entropy,
    aten.pad.default: _pad,
    aten.matmul.default: _matmul,
    aten.contiguous.default: lambda b, n: [b(aten.clone.default, n.args[0], memory_format=torch.contiguous_format)],
}


def canonicalize(graph: Graph) -> int:
    return rewrite(graph, CANONICAL_RULES)


def lower_dialects(graph: Graph, names: tuple[str, ...]) -> int:
    """Ops that a dialect implements by a graph lowering are lowered by the preferred dialect. A lowering
    whose outputs would not have the node's shapes and dtypes (a kernel whose meta disagrees with the op it
    stands for, e.g. a fused attention kernel given values of another head size than the queries) is
    dropped with a warning and the next dialect's is used."""
    def lower(b, n):
        allowed = names
        while (impl := dialects.select(n, allowed, "lower")) is not None:
            start = len(b.dest)
            result = impl.lower(b, n)
            wrong = _changed_metas(n, result)
            if not wrong:
                return result
            log.warning("kiln: the %s lowering of %s (in %s) gives %s; using the next dialect's",
                        impl.label, n.op.name, n.scope or "<top>", wrong)
            del b.dest[start:]
            allowed = tuple(d for d in allowed if d != impl.dialect.name)
        return None
    return rewrite(graph, {t: lower for t in dialects.lowered_targets()}, max_rounds=1)


def _changed_metas(n, result) -> str:
    """'' when `result` (a rule's replacement of n's outputs) keeps their shapes and dtypes, else what differs."""
    if result is None:
        return ""
    news = [result] if isinstance(result, Value) else list(result)
    for old, new in zip(n.outputs, news):
        if isinstance(new, Value) and old.meta is not None and new.meta is not None and \
                (not same(old.meta.shape, new.meta.shape) or old.meta.dtype != new.meta.dtype):
            return f"{new.meta} for {old.meta}"
    return ""
