"""Sums folded into the kernels that can add a tensor to their own output, or sum it.

The backward of a residual network adds gradients: the gradient of the residual stream is the sum of the
gradient reaching it directly and the one through its branch's normalization (`add(rms_norm_backward(...),
g)`). A kernel that can add a tensor to one of its outputs in the same pass (`OpDef.accumulates` (i, j):
output i plus t equals the op with t as its argument j, given as None) takes the add instead: the sum is
written once, no second pass reads it, and a narrowing cast of the sum then folds into the kernel too
(`OpDef.also_low`, kiln/passes/casts.py), where before it needed an Inductor region or a stand-alone cast.

Only where the result is the same bits: both addends and the sum in float32 (the kernel adds in float32
before it rounds, so a narrower output would be rounded once where the graph rounded twice), the same
shape (no broadcast), alpha 1, and the other addend computed before the kernel (nothing is moved).

An op with no argument to take the addend declares a twin instead (`OpDef.accumulating`: its arguments, then
t): a tied embedding's two gradients, `add(embedding_dense_backward(...), the output projection's gradient)`,
become `kiln.embedding_backward_acc` (kiln/kernels/embedding.py), which writes the sum in one pass where ATen
zeroes a vocabulary-sized matrix, adds the tokens' rows into it and the add reads both again.

A bias's gradient is the sum of the gradient reaching its output over every dimension but the last; where
that gradient is an op's result (BERT's and GPT-2's GELU backward), a second pass reads it all again. An op
declaring `OpDef.column_sums` (a twin computing its outputs from the same arguments and, after them, that
sum) becomes its twin where the graph sums its output `OpDef.sums_output` (0 unless said), or a view of it
keeping the last dimension, over all the other dimensions (`fold_column_sums`); the sum becomes a view of the
twin's. LayerNorm's backward sums its bf16 copy (`also_low`), the output gradient of the linear layer before
the norm in the backward (GPT-2's and BERT's projections back into the residual stream): that copy exists only
once the narrowing casts are folded (kiln/passes/casts.py), so the fold runs again after them. The twin's kernel sums
the values as the output's dtype holds them, in fp32, in its own order. Only for half-type outputs, whose
rounding is the error that counts: in fp32 the twin's last bits (its erf, its order of summation) would differ
from ATen's, and fp32 steps keep eager's arithmetic where they can (a parameter whose true gradient is 0, a key
projection's bias, gets that rounding noise as its gradient, which Adam scales up to lr-sized steps).
"""
from __future__ import annotations

import torch

from kiln.ir.builder import infer_metas
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.symbolic import same

aten = torch.ops.aten


def fold_accumulation(graph: Graph, dialects: tuple[str, ...] | None = None) -> int:
    """Fold `add(op(...)[i], t)` into `op(..., t at argument j, ...)` where the op declares it (`accumulates`),
    or into the op's `accumulating` twin, given t after its arguments, where an enabled dialect runs the twin
    (every dialect when `dialects` is None). Returns how many."""
    users, live = graph.users(), graph.live_outputs()
    pos = {n.uid: k for k, n in enumerate(graph.nodes)}
    folded: dict[int, Node] = {}                    # add's uid -> the kernel that took it
    for add in graph.nodes:
        if add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
            continue
        for mine, other in (add.args, add.args[::-1]):
            n = _kernel_taking(mine, other, add, users, live, pos, dialects)
            if n is None:
                continue
            if n.op.accumulates is not None:
                i, j = n.op.accumulates
                n.args = tuple(other if k == j else a for k, a in enumerate(n.args))
            else:                                   # the twin: output 0 plus its last argument
                i, twin = 0, n.op.accumulating
                n.op, n.target, n.args = twin, twin.targets[0], (*n.args, other)
            folded[add.uid] = n
            graph.replace_uses(add.outputs[0], n.outputs[i], start=pos[add.uid])
            break
    if folded:
        graph.nodes = [n for n in graph.nodes if n.uid not in folded]
    return len(folded)


def _kernel_taking(mine, other, add: Node, users: dict, live: set, pos: dict, dialects) -> Node | None:
    """The node whose output `mine` is, when it (or its `accumulating` twin) can take `other` into that output
    in place of `add`."""
    if not (isinstance(mine, Value) and isinstance(other, Value)) or mine.producer is None:
        return None
    n = mine.producer
    acc, twin = n.op.accumulates, n.op.accumulating
    if acc is not None:
        if n.outputs.index(mine) != acc[0] or len(n.args) <= acc[1] or n.args[acc[1]] is not None:
            return None
    elif twin is None or n.outputs.index(mine) != 0 or n.kwargs or not _runs(twin, dialects):
        return None
    if users.get(mine) != [add] or mine in live:
        return None                                 # the output alone is read elsewhere too
    f32 = torch.float32
    if not (mine.meta.dtype == other.meta.dtype == add.outputs[0].meta.dtype == f32
            and same(mine.meta.shape, other.meta.shape)):
        return None
    if other.producer is not None and pos[other.producer.uid] > pos[n.uid]:
        return None                                 # computed after the kernel: it would have to move
    return n


def _runs(op, dialects) -> bool:
    """Whether an enabled dialect (any, for None) has a kernel for `op`."""
    from kiln.dialects import registry as kernels
    return any(dialects is None or i.dialect.name in dialects for i in kernels.impls_for(op.targets[0]))


def fold_column_sums(graph: Graph, dialects: tuple[str, ...]) -> int:
    """Fold `sum(op(...)[i] or a view of it, every dim but the last)` into the op's `column_sums` twin where an
    enabled dialect runs the twin (i: the op's `sums_output`). Returns how many sums were folded."""
    from kiln.ops import registry
    twins: dict[int, Value] = {}                    # node uid -> its sums output
    folded = 0
    for s in graph.nodes:
        n = _summed_node(s)
        if n is None:
            continue
        twin = n.op.column_sums
        if n.uid not in twins:
            if not _runs(twin, dialects):
                continue
            meta = infer_metas(twin.targets[0], n.args, n.kwargs)[-1]
            sums = Value(graph.fresh_name("column_sums"), meta)
            sums.producer = n
            n.op, n.target, n.outputs = twin, twin.targets[0], [*n.outputs, sums]
            twins[n.uid] = sums
        keep = len(s.outputs[0].meta.shape) - 1          # keepdim: the summed dims stay as 1s
        s.op, s.target = registry.lookup(aten.view.default), aten.view.default
        s.args, s.kwargs = (twins[n.uid], [1] * keep + [-1]), {}
        folded += 1
    return folded


def _summed_node(s: Node) -> Node | None:
    """The node with a `column_sums` twin whose `sums_output` `s` sums over every dimension but the last
    (reading it or a view of it that keeps that dimension), or None."""
    if s.target is not aten.sum.dim_IntList or s.kwargs.get("dtype") is not None or len(s.args) < 2:
        return None
    src, dims = s.args[0], s.args[1]
    if not isinstance(src, Value) or src.meta is None or not isinstance(dims, (list, tuple)):
        return None
    rank = len(src.meta.shape)
    if rank < 2 or sorted(d % rank for d in dims) != list(range(rank - 1)):
        return None
    base = src
    if base.producer is not None and base.producer.target in _VIEWS and len(base.producer.inputs) == 1:
        inner = base.producer.inputs[0]
        if inner.meta is not None and same(inner.meta.shape[-1:], src.meta.shape[-1:]):
            base = inner
    n = base.producer
    if n is None or n.op.column_sums is None or base is not n.outputs[n.op.sums_output]:
        return None
    if not same(s.outputs[0].meta.shape[-1:], base.meta.shape[-1:]) or s.outputs[0].meta.dtype != base.meta.dtype:
        return None
    if base.meta.dtype not in (torch.bfloat16, torch.float16):
        return None
    return n


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
