"""Casts folded into the ops around them: widening casts into the ops that read them, narrowing casts into
the kernels that make their input.

A cast from a narrower float dtype to a wider one (bf16 -> fp32) is exact, so an op that promotes mixed
inputs itself (`OpDef.promotes`: ATen's Tensor-Tensor arithmetic, the rope kernels) computes the same
from the narrow value as from its widened copy, provided another input still makes the wider dtype the
result type (ATen's rule: tensors with dimensions decide). A cast every use of which reaches such ops,
directly or through views (a reshape, a squeeze), is dropped: the views are taken of the narrow value and
the ops read it. One pass over memory less, and no wider copy kept.

amp inserts no widening casts before such ops in the forward (kiln/passes/amp.py); this pass finds the
ones autodiff makes in the backward (the gradient of a cast to bf16 is a cast back to fp32, read by the
rope kernel's backward) and any the model wrote itself.

A narrowing cast rounds, so it cannot be dropped; but a kernel that computes in the wide dtype can round its
result once itself (`OpDef.out_dtype`: RMSNorm's output, RoPE's and its backward's): amp's cast of an
fp32 RMSNorm output to bf16 before a projection, and of RoPE's fp32 result back to bf16 before attention,
become the kernel's `out_dtype`, with the same values (the kernel computes what the wide op computed and
rounds it to nearest-even, as the cast did) and one full-size pass and buffer fewer. Where the wide value is
read as well (the residual stream's fp32 gradient, which the o_proj/down_proj backward also needs in bf16),
a kernel that can (`OpDef.also_low`: RMSNorm's backward) writes the narrow copy in the same pass.
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


def fold_narrowing_casts(graph: Graph) -> int:
    """Fold narrowing casts into the kernels that make their input. `OpDef.out_dtype`: a kernel is rewritten
    when every output its `out_dtype` sets is read only by one cast (directly or through views read only by
    the next), all to the same dtype, and none is a step output. `OpDef.also_low`: a cast of an output that
    is also read as it is becomes an extra output the kernel writes in the same pass. Returns the number of
    kernels rewritten."""
    users, live = graph.users(), graph.live_outputs()
    plans: dict[Node, tuple[torch.dtype, list[Node]]] = {}
    copies: dict[Node, Node] = {}                # kernel -> the cast of output i that output j replaces
    for n in graph.nodes:
        if n.op.also_low is not None and "low_dtype" not in n.kwargs:
            v = n.outputs[n.op.also_low[0]]
            cast = next((r for r in users.get(v, []) if _narrowing(r) and r.args[0] is v), None)
            if cast is not None:
                copies[n] = cast
        if not n.op.out_dtype or "out_dtype" in n.kwargs:
            continue
        chains = [_cast_chain(n.outputs[i], users, live) for i in n.op.out_dtype]
        dtypes = {chain[-1].outputs[0].meta.dtype for chain in chains if chain}
        if all(chains) and len(dtypes) == 1:
            plans[n] = (dtypes.pop(), chains)
    if not plans and not copies:
        return 0
    replace: dict[Value, Value] = {}
    nodes: list[Node] = []
    for n in graph.nodes:
        n.args, n.kwargs = tree_map_values(lambda v: replace.get(v, v), (n.args, n.kwargs))
        if n in copies:
            cast = copies[n]
            outs = Builder(graph, n.phase, n.scope, dest=nodes)(n.target, *n.args, **n.kwargs,
                                                              low_dtype=cast.outputs[0].meta.dtype)
            nodes[-1].fused = n.fused               # explain still names the fusion that made it
            replace.update(zip(n.outputs, outs))
            replace[cast.outputs[0]] = outs[n.op.also_low[1]]
            continue
        if n not in plans:
            nodes.append(n)
            continue
        dtype, chains = plans[n]
        b = Builder(graph, n.phase, n.scope, dest=nodes)
        out = b(n.target, *n.args, **n.kwargs, out_dtype=dtype)
        nodes[-1].fused = n.fused
        outs = out if isinstance(out, tuple) else (out,)
        replace.update(zip(n.outputs, outs))
        for i, chain in zip(n.op.out_dtype, chains):
            v = outs[i]
            for step in chain[:-1]:                 # the same views and copies, of the narrow result
                target = aten.reshape.default if step.target in VIEWS else step.target
                v = b(target, v, *step.args[1:], **step.kwargs)
            replace[chain[-1].outputs[0]] = v
    graph.nodes = nodes
    dead_code_elimination(graph)
    return len(plans) + len(copies)


def _cast_chain(v: Value, users, live) -> list[Node]:
    """[views or copies..., cast] when v's only reader is a narrowing cast, or a chain of views and plain
    copies (GQA's repeat_kv: unsqueeze, expand, clone, view), each read only by the next, ending in one (none
    of them a step output); [] otherwise. Moving data commutes with rounding it."""
    chain: list[Node] = []
    while True:
        readers = users.get(v, [])
        if v in live or len(readers) != 1:
            return []
        r = readers[0]
        if _narrowing(r) and r.args[0] is v:
            return chain + [r]
        if not (_view_of(r, v) or _copy_of(r, v)):
            return []
        chain.append(r)
        v = r.outputs[0]


def _narrowing(n: Node) -> bool:
    return _float_cast(n) < 0


def _widening(n: Node) -> bool:
    return _float_cast(n) > 0


def _float_cast(n: Node) -> int:
    """For a plain cast between float dtypes (`_to_copy(x, dtype=...)`): its output's item size less its
    input's (> 0 widening, < 0 narrowing); 0 for anything else."""
    if n.target is not aten._to_copy.default or set(n.kwargs) != {"dtype"} or len(n.args) != 1:
        return 0
    src, out = n.args[0], n.outputs[0]
    return out.meta.dtype.itemsize - src.meta.dtype.itemsize if src.is_float and out.is_float else 0


def _copy_of(n: Node, v: Value) -> bool:
    """Whether n is a plain copy of v (`clone`, any memory format), reading v nowhere else."""
    return n.target is aten.clone.default and len(n.outputs) == 1 and n.args[0] is v and \
        sum(x is v for x in n.inputs) == 1


def _view_of(n: Node, v: Value) -> bool:
    """Whether n is a single-output view of v (and reads v nowhere else)."""
    return n.op.kind is Kind.VIEW and len(n.outputs) == 1 and bool(n.args) and n.args[0] is v and \
        sum(x is v for x in n.inputs) == 1


def _still_promotes(reader: Node, wide: Value, dtype: torch.dtype, dropped) -> bool:
    """Whether `reader` computes in `dtype` with `wide` in the narrow dtype: it promotes by itself, and
    another input with dimensions has that dtype and keeps it (`dropped(v)`: v is a cast already dropped); or
    it reads any input narrow as it is (`OpDef.reads_narrow`)."""
    if reader.op.reads_narrow:
        return True
    if not reader.op.promotes:
        return False
    others = [v for v in reader.inputs if v is not wide and v.is_float and len(v.meta.shape) > 0]
    return any(v.meta.dtype == dtype and not dropped(v) for v in others)
