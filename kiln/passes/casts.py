"""Widening casts folded into the ops that read them.

A cast from a narrower float dtype to a wider one (bf16 -> fp32) is exact, so an op that promotes mixed
inputs itself (`OpDef.promotes`: ATen's Tensor-Tensor arithmetic, the rope kernels) computes the same
from the narrow value as from its widened copy, provided another input still makes the wider dtype the
result type (ATen's rule: tensors with dimensions decide). A cast every use of which reaches such ops,
directly or through views (a reshape, a squeeze), is dropped: the views are taken of the narrow value and
the ops read it. One pass over memory less, and no wider copy kept.

amp inserts no widening casts before such ops in the forward (kiln/passes/amp.py); this pass finds the
ones autodiff makes in the backward (the gradient of a cast to bf16 is a cast back to fp32, read by the
rope kernel's backward) and any the model wrote itself. Narrowing casts round, so they stay.
"""
from __future__ import annotations

import torch

from kiln.ir.builder import VIEWS, Builder
from kiln.ir.graph import Graph, Node, Value, tree_map_values
from kiln.ops.registry import Kind
from kiln.passes.dce import dead_code_elimination

aten = torch.ops.aten


def fold_widening_casts(graph: Graph) -> int:
    """Drop the widening casts every use of which promotes by itself. Returns how many."""
    users, live = graph.users(), graph.live_outputs()

    narrow: dict[Value, Value] = {}          # a wide value -> the same values in the narrow dtype

    def becomes_narrow(v: Value) -> bool:
        """Whether v is a cast this pass drops, or a view of one (the views are taken of the narrow value)."""
        p = v.producer
        return v in narrow or (p is not None and bool(p.args) and isinstance(p.args[0], Value)
                               and _view_of(p, p.args[0]) and becomes_narrow(p.args[0]))

    def foldable(v: Value, dtype: torch.dtype) -> bool:
        readers = users.get(v, [])
        return v not in live and bool(readers) and all(
            foldable(r.outputs[0], dtype) if _view_of(r, v) else _still_promotes(r, v, dtype, becomes_narrow)
            for r in readers)

    # in program order, each decision counting the ones before it: of add(cast(a), cast(b)) one cast goes
    for n in graph.nodes:
        if _widening(n) and foldable(n.outputs[0], n.outputs[0].meta.dtype):
            narrow[n.outputs[0]] = n.args[0]
    if not narrow:
        return 0
    folded = len(narrow)
    nodes: list[Node] = []
    for n in graph.nodes:
        if n.op.kind is Kind.VIEW and n.args and n.args[0] in narrow and _view_of(n, n.args[0]):
            b = Builder(graph, n.phase, n.scope, dest=nodes)     # the same view of the narrow value
            target = aten.reshape.default if n.target in VIEWS else n.target   # its layout may not allow a view
            narrow[n.outputs[0]] = b(target, narrow[n.args[0]], *n.args[1:], **n.kwargs)
        else:
            n.args, n.kwargs = tree_map_values(lambda v: narrow.get(v, v), (n.args, n.kwargs))
        nodes.append(n)
    graph.nodes = nodes
    dead_code_elimination(graph)
    return folded


def _widening(n: Node) -> bool:
    if n.target is not aten._to_copy.default or set(n.kwargs) != {"dtype"} or len(n.args) != 1:
        return False
    src, out = n.args[0], n.outputs[0]
    return src.is_float and out.is_float and src.meta.dtype.itemsize < out.meta.dtype.itemsize


def _view_of(n: Node, v: Value) -> bool:
    """Whether n is a single-output view of v (and reads v nowhere else)."""
    return n.op.kind is Kind.VIEW and len(n.outputs) == 1 and bool(n.args) and n.args[0] is v and \
        sum(x is v for x in n.inputs) == 1


def _still_promotes(reader: Node, wide: Value, dtype: torch.dtype, dropped) -> bool:
    """Whether `reader` computes in `dtype` with `wide` in the narrow dtype: it promotes by itself, and
    another input with dimensions has that dtype and keeps it (`dropped(v)`: v is a cast already dropped)."""
    if not reader.op.promotes:
        return False
    others = [v for v in reader.inputs if v is not wide and v.is_float and len(v.meta.shape) > 0]
    return any(v.meta.dtype == dtype and not dropped(v) for v in others)
