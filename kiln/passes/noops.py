"""Remove no-op views, transposes and casts, and fold view chains. One rule per line.

The pass first re-infers every node's metas (`refresh_metas`): passes that swap a value for one of
another layout (fusion) leave later metas as they were. Layouts stay predictions (kiln/ir/builder.py), so
the rules never need a prediction to be right: a clone predicted to copy nothing is dropped, and every
`aten.view` of a value whose layout is not exact becomes `aten.reshape` (the same view where the real
layout allows it, else the copy the clone would have made), so no consumer needs the clone's layout.
"""
from __future__ import annotations

import torch

from kiln.ir.builder import VIEWS, layout_known, viewable
from kiln.ir.graph import Graph
from kiln.ops.common import arg, shape
from kiln.passes.rewrite import refresh_metas, rewrite
from kiln.ir.symbolic import same

aten = torch.ops.aten
RESHAPES = VIEWS + (aten.reshape.default,)


def _same_shape(b, n):
    # view / reshape / expand to the shape it has returns the tensor itself, whatever its strides
    x = n.args[0]
    return x if same(shape(x), shape(n.out)) else None


def _view_of_predicted_layout(b, n):
    # view(x) -> reshape(x) where x's layout is a prediction (a captured view, or one a rewrite left behind)
    return None if layout_known(n.args[0]) else b(aten.reshape.default, *n.args)


def _to_copy_noop(b, n):
    x = n.args[0]
    extra = set(n.kwargs) - {"dtype", "device", "layout"}
    same = x.meta.dtype == n.out.meta.dtype and x.meta.device == n.out.meta.device
    return x if same and not extra else None


def _cast_chain(b, n):
    # to(to(x, a), b) -> to(x, b) when the middle dtype is wider than both ends (no rounding lost)
    x = n.args[0]
    p = x.producer
    if p is None or p.target is not aten._to_copy.default or set(n.kwargs) != {"dtype"} or set(p.kwargs) != {"dtype"}:
        return None
    src, mid, dst = p.args[0].meta.dtype, x.meta.dtype, n.out.meta.dtype
    if src.is_floating_point and mid.is_floating_point and mid.itemsize >= max(src.itemsize, dst.itemsize):
        return p.args[0] if src == dst else b(aten._to_copy.default, p.args[0], dtype=dst)
    return None


def _view_of_view(b, n):
    # reshape(reshape(x)) -> reshape(x), a view when x's exact layout is contiguous
    x = n.args[0]
    p = x.producer
    if p is not None and p.target in RESHAPES:
        src = p.args[0]
        return b(aten.view.default if viewable(src) else aten.reshape.default, src, n.args[1])
    return None


def _transpose_twice(b, n):
    # transpose(transpose(x, a, b), a, b) -> x ;  t(t(x)) -> x
    p = n.args[0].producer
    if p is not None and p.target is n.target and sorted(p.args[1:]) == sorted(n.args[1:]):
        return p.args[0]
    return None


def _identity_transpose(b, n):
    # transpose(x, d, d) -> x
    nd = len(shape(n.args[0])) or 1
    return n.args[0] if n.args[1] % nd == n.args[2] % nd else None


def _full_slice(b, n):
    # x[:, 0:len] -> x
    x, step = n.args[0], arg(n, 4, "step", 1)
    return x if same(shape(x), shape(n.out)) and step == 1 else None


def _identity_permute(b, n):
    nd = len(n.args[1])
    return n.args[0] if [d % nd for d in n.args[1]] == list(range(nd)) else None


NOOP_RULES = {
    aten.view.default: _same_shape,            # view(x, x.shape) -> x
    aten._unsafe_view.default: _same_shape,
    aten.reshape.default: _same_shape,
    aten.expand.default: _same_shape,          # expand(x, x.shape) -> x
    aten.alias.default: lambda b, n: n.args[0],  # alias(x) -> x (the graph is functional)
    aten.clone.default: lambda b, n: n.args[0] if n.args[0].meta.as_meta_tensor().is_contiguous() else None,
    aten._to_copy.default: lambda b, n: _to_copy_noop(b, n) or _cast_chain(b, n),  # to(x, x.dtype) -> x
    aten.transpose.int: lambda b, n: _identity_transpose(b, n) or _transpose_twice(b, n),
    aten.t.default: _transpose_twice,
    aten.permute.default: _identity_permute,
    aten.slice.Tensor: _full_slice,
}
NOOP_RULES.update({t: lambda b, n: _same_shape(b, n) or _view_of_view(b, n) or _view_of_predicted_layout(b, n)
                   for t in VIEWS})
NOOP_RULES[aten.reshape.default] = lambda b, n: _same_shape(b, n) or _view_of_view(b, n)


def remove_noops(graph: Graph) -> int:
    refresh_metas(graph)
    return rewrite(graph, NOOP_RULES)
