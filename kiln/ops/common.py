"""Small helpers that make common gradient shapes one line in the op blocks."""
from __future__ import annotations

import torch

from kiln.ir.graph import Value
from kiln.ir.symbolic import same

aten = torch.ops.aten


class _Zero:
    """A VJP rule's way to say "this input's gradient is exactly zero" (not "missing")."""

    def __repr__(self) -> str:
        return "ZERO"


ZERO = _Zero()


def shape(v: Value) -> list[int]:
    return list(v.meta.shape)


def arg(n, i: int, name: str, default=None):
    """Positional-or-keyword argument `name` (position i) of node n, with the schema default."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def sum_to(b, g: Value, target_shape) -> Value:
    """Reduce a broadcast gradient back to `target_shape` (the inverse of broadcasting)."""
    target_shape = list(target_shape)
    gshape = shape(g)
    if same(gshape, target_shape):
        return g
    lead = len(gshape) - len(target_shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(target_shape) if s == 1 and gshape[lead + i] != 1]
    if dims:
        g = b(aten.sum.dim_IntList, g, dims, True)
    if not same(shape(g), target_shape):
        g = reshape(b, g, target_shape)
    return g


def _is_contig(v: Value) -> bool:
    return v.meta.as_meta_tensor().is_contiguous()


def reshape(b, g: Value, target_shape) -> Value:
    return b(aten.view.default, g, list(target_shape)) if _is_contig(g) else b(aten.reshape.default, g, list(target_shape))


def cast(b, g: Value, dtype: torch.dtype) -> Value:
    return g if g.meta.dtype == dtype else b(aten._to_copy.default, g, dtype=dtype)


def norm_dims(dims, ndim: int) -> list[int]:
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % ndim if ndim else 0 for d in dims)
