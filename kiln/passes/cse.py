"""Common-subexpression elimination: one node per (op, inputs, constants).

Random ops, ops with side effects and opaque fallbacks are never merged: two dropout calls must draw
two masks.
"""
from __future__ import annotations

import torch

from kiln.ir import symbolic
from kiln.ir.graph import Graph, Value, tree_map_values
from kiln.ops.registry import Kind
from kiln.passes.dce import dead_code_elimination


def _key(x):
    if isinstance(x, Value):
        return ("%", x.uid)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(i) for i in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, float):
        return ("f", x, str(x))          # keeps 0.0 and -0.0 apart
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("size", str(symbolic.expr(x)))   # a symbolic size: by its expression (SymInts do not hash)
    return (type(x).__name__, x)


def common_subexpression_elimination(graph: Graph) -> int:
    seen: dict[tuple, list[Value]] = {}
    subst: dict[Value, Value] = {}
    merged = 0
    fix = lambda v: subst.get(v, v)  # noqa: E731
    for n in graph.nodes:
        if subst:
            n.args, n.kwargs = tree_map_values(fix, n.args), tree_map_values(fix, n.kwargs)
        if n.op.side_effects or n.op.kind in (Kind.RANDOM, Kind.OPAQUE, Kind.OPTIMIZER):
            continue
        try:
            key = (n.target, _key(n.args), _key(n.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            for old, new in zip(n.outputs, seen[key]):
                subst[old] = new
            merged += 1
        else:
            seen[key] = n.outputs
    if merged:
        graph.outputs = [fix(v) for v in graph.outputs]
        graph.mutations = [(t, fix(v)) for t, v in graph.mutations]
        dead_code_elimination(graph)
    return merged
