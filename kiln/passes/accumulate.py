"""Sums folded into the kernels that can add a tensor to their own output.

The backward of a residual network adds gradients: the gradient of the residual stream is the sum of the
gradient reaching it directly and the one through its branch's normalization (`add(rms_norm_backward(...),
g)`). A kernel that can add a tensor to one of its outputs in the same pass (`OpDef.accumulates` (i, j):
output i plus t equals the op with t as its argument j, given as None) takes the add instead: the sum is
written once, no second pass reads it, and a narrowing cast of the sum then folds into the kernel too
(`OpDef.also_low`, kiln/passes/casts.py), where before it needed an Inductor region or a stand-alone cast.

Only where the result is the same bits: both addends and the sum in float32 (the kernel adds in float32
before it rounds, so a narrower output would be rounded once where the graph rounded twice), the same
shape (no broadcast), alpha 1, and the other addend computed before the kernel (nothing is moved).
"""
from __future__ import annotations

import torch

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.symbolic import same

aten = torch.ops.aten


def fold_accumulation(graph: Graph) -> int:
    """Fold `add(op(...)[i], t)` into `op(..., t at argument j, ...)` where the op declares it. Returns how many."""
    users, live = graph.users(), graph.live_outputs()
    pos = {n.uid: k for k, n in enumerate(graph.nodes)}
    folded: dict[int, Node] = {}                    # add's uid -> the kernel that took it
    for add in graph.nodes:
        if add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
            continue
        for mine, other in (add.args, add.args[::-1]):
            n = _kernel_taking(mine, other, add, users, live, pos)
            if n is not None:
                i, j = n.op.accumulates
                n.args = tuple(other if k == j else a for k, a in enumerate(n.args))
                folded[add.uid] = n
                graph.replace_uses(add.outputs[0], n.outputs[i], start=pos[add.uid])
                break
    if folded:
        graph.nodes = [n for n in graph.nodes if n.uid not in folded]
    return len(folded)


def _kernel_taking(mine, other, add: Node, users: dict, live: set, pos: dict) -> Node | None:
    """The node whose output `mine` is, when it can take `other` into that output in place of `add`."""
    if not (isinstance(mine, Value) and isinstance(other, Value)) or mine.producer is None:
        return None
    n = mine.producer
    acc = n.op.accumulates
    if acc is None or n.outputs.index(mine) != acc[0] or len(n.args) <= acc[1] or n.args[acc[1]] is not None:
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
