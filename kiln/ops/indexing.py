"""Indexing, gathering, scattering and tensor creation. One block per op."""
from __future__ import annotations

import torch

from kiln.ir.graph import TensorMeta
from kiln.kernels.embedding import embedding_backward_acc
from kiln.ops.common import arg, shape
from kiln.ops.registry import Cast, Kind, OpDef, defop, nondiff, register
from kiln.ir.symbolic import same

aten = torch.ops.aten
I = Kind.INDEX


def _zeros_like(b, v):
    return b(aten.zeros.default, shape(v), dtype=v.meta.dtype, device=v.meta.device)


defop(aten.embedding.default, lambda b, n, g: (
    b(aten.embedding_dense_backward.default, g, n.args[1], shape(n.args[0])[0],
      arg(n, 2, "padding_idx", -1), arg(n, 3, "scale_grad_by_freq", False)), None), I)
# a tied embedding's gradient plus the output projection's, one pass (kiln/passes/accumulate.py folds the add)
EMBEDDING_BACKWARD_ACC = register(OpDef(
    "kiln.embedding_backward_acc", (embedding_backward_acc,), None, Kind.OPAQUE, Cast.FOLLOW, differentiable=False,
    promotes=True,           # a widening cast of either addend folds into it (kiln/passes/casts.py)
    infer=lambda args, kwargs: [TensorMeta(tuple(args[-1].meta.shape),
                                           torch.promote_types(args[0].meta.dtype, args[-1].meta.dtype), (),
                                           args[-1].meta.device).contiguous()],
    doc="embedding_dense_backward plus another gradient of the same weight (a tied embedding), the same bits"))
nondiff(aten.embedding_dense_backward.default, Kind.OPAQUE, accumulating=EMBEDDING_BACKWARD_ACC)
defop(aten.index.Tensor, lambda b, n, g: (
    b(aten.index_put.default, _zeros_like(b, n.args[0]), n.args[1], g, True), None), I)
defop(aten.index_select.default, lambda b, n, g: (
    b(aten.index_add.default, _zeros_like(b, n.args[0]), n.args[1], n.args[2], g), None, None), I)
defop(aten.gather.default, lambda b, n, g: (
    b(aten.scatter_add.default, _zeros_like(b, n.args[0]), n.args[1], n.args[2], g), None, None), I)


def _gather_src_grad(b, g, dim, index, src):
    """src's gradient for scatter/scatter_add: g gathered at index. Only src's leading index-shaped
    block is read, so where src is larger the rest gets zeros (padded at the end of each dim)."""
    gsrc = b(aten.gather.default, g, dim, index)
    if not same(shape(src), shape(index)):
        pads = []
        for s, i in reversed(list(zip(shape(src), shape(index)))):
            pads += [0, s - i]
        gsrc = b(aten.constant_pad_nd.default, gsrc, pads, 0.0)
    return gsrc


def vjp_scatter_src(b, n, g):
    """scatter(x, dim, index, src): x's gradient is g with the written places zeroed; src's is gathered."""
    x, dim, index = n.args[0], n.args[1], n.args[2]
    gx = b(aten.scatter.value, g, dim, index, 0.0)
    src = n.args[3] if len(n.args) > 3 else None
    gsrc = _gather_src_grad(b, g, dim, index, src) if hasattr(src, "meta") else None
    return gx, None, None, gsrc


defop((aten.scatter.src, aten.scatter.value), vjp_scatter_src, I)
defop(aten.scatter_add.default, lambda b, n, g: (
    g, None, None, _gather_src_grad(b, g, n.args[1], n.args[2], n.args[3])), I)


def _masked_values_grad(b, g, mask, values):
    """values' gradient for index_put(x, [mask], values) with a bool mask over x's leading dims.
    g[mask] has a data-dependent length, which shape inference cannot give: take it from values
    when values spans it, else sum g over the masked positions (values broadcast along it)."""
    k, rest = len(shape(mask)), shape(g)[len(shape(mask)):]
    vs = shape(values)
    if len(vs) == len(rest) + 1 and vs[0] != 1:           # values: (nnz, *rest'), nnz known statically
        meta = type(g.meta)(tuple([vs[0]] + rest), g.meta.dtype, tuple(_contig_strides([vs[0]] + rest)),
                            g.meta.device)
        return b.emit(aten.index.Tensor, (g, [mask]), {}, metas=[meta])
    m = mask
    for _ in rest:
        m = b(aten.unsqueeze.default, m, -1)
    gv = b(aten.sum.dim_IntList, b(aten.where.ScalarOther, m, g, 0.0), list(range(k)), len(vs) > len(rest))
    # keep the mask's dims as one size-1 dim where values has it (autodiff sums the rest back)
    return b(aten.view.default, gv, [1] + rest) if len(vs) > len(rest) and k != 1 else gv


def _contig_strides(s):
    strides, acc = [], 1
    for d in reversed(s):
        strides.insert(0, acc)
        acc *= max(d, 1)
    return strides


def vjp_index_put(b, n, g):
    x, indices, values = n.args[0], n.args[1], n.args[2]
    accumulate = arg(n, 3, "accumulate", False)
    gx = g if accumulate else b(aten.index_put.default, g, indices, b(aten.zeros.default, [], dtype=g.meta.dtype,
                                                                       device=g.meta.device), False)
    masks = [i for i in indices if i is not None and i.meta.dtype in (torch.bool, torch.uint8)]
    if not masks:
        gv = b(aten.index.Tensor, g, indices)
    elif len(indices) == 1:            # x[mask] = values: the common masked assignment
        gv = _masked_values_grad(b, g, indices[0], values)
    else:
        raise NotImplementedError("index_put with a boolean mask among several indices")
    return gx, None, gv


defop(aten.index_put.default, vjp_index_put, I)
def vjp_slice_scatter(b, n, g):
    x, src = n.args[0], n.args[1]
    dim, start, end, step = (arg(n, 2, "dim", 0), arg(n, 3, "start"), arg(n, 4, "end"), arg(n, 5, "step", 1))
    gx = b(aten.slice_scatter.default, g, _zeros_like(b, src), dim, start, end, step)
    return gx, b(aten.slice.Tensor, g, dim, start, end, step)


defop(aten.slice_scatter.default, vjp_slice_scatter, I)
defop(aten.select_scatter.default, lambda b, n, g: (
    b(aten.select_scatter.default, g, _zeros_like(b, n.args[1]), n.args[2], n.args[3]),
    b(aten.select.int, g, n.args[2], n.args[3])), I)

# ---- creation and random draws: nothing to differentiate ----------------------------------------
nondiff([aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format,
         aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default,
         aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
         aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
         aten.lift_fresh.default], kind=Kind.CREATION)
nondiff([aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default,
         aten.randint.low, aten.bernoulli.p, aten.bernoulli.default], kind=Kind.RANDOM)
