"""The local-rewrite driver every table-driven pass uses.

A rule table maps an op target to `callback(b, node) -> list[Value] | Value | None`. Returning values
replaces the node's outputs (new nodes emitted through `b` are inserted in its place); None keeps the
node. A replacement must have the shape and dtype of the output it replaces (its strides may differ: the
metas after it are re-inferred). Tables compose with `|` and run to a fixed point.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._ops import OpOverload

from kiln.errors import KilnError
from kiln.ir.builder import VIEWS, Builder, infer_metas
from kiln.ir.graph import Graph, Value, tree_map_values
from kiln.ir.symbolic import same

aten = torch.ops.aten
Rule = Callable[[Builder, object], "list[Value] | Value | None"]


def rewrite(graph: Graph, rules: dict, max_rounds: int = 8) -> int:
    """Apply `rules` until nothing changes. Returns how many nodes were rewritten."""
    total = 0
    for _ in range(max_rounds):
        changed = _one_round(graph, rules)
        total += changed
        if not changed:
            break
    return total


def _one_round(graph: Graph, rules: dict) -> int:
    subst: dict[Value, Value] = {}
    fix = lambda v: subst.get(v, v)  # noqa: E731
    new_nodes = []
    changed = 0
    dirty: set[Value] = set()        # values whose strides may differ from what capture recorded
    for n in graph.nodes:
        n.args, n.kwargs = tree_map_values(fix, n.args), tree_map_values(fix, n.kwargs)
        if dirty and any(v in dirty for v in n.inputs) and _refresh_metas(n):
            dirty.update(n.outputs)
        rule = rules.get(n.target)
        result = None
        if rule is not None:
            b = Builder(graph, n.phase, n.scope, dest=[])
            result = rule(b, n)
        if result is None:
            new_nodes.append(n)
            continue
        results = [result] if isinstance(result, Value) else list(result)
        assert len(results) == len(n.outputs), f"{n.op.name} rewrite gave {len(results)} of {len(n.outputs)} outputs"
        for old, new in zip(n.outputs, results):
            if new is not None and old.meta is not None and new.meta is not None and \
                    (not same(new.meta.shape, old.meta.shape) or new.meta.dtype != old.meta.dtype):
                raise KilnError(f"Kiln bug: a rewrite of {n.op.name} (in {n.scope or '<top>'}) gives {new.meta} for "
                                f"{old.meta}; please report it (KILN_DUMP=1 prints the graph after each pass)")
            if new is not None and new is not old:
                subst[old] = new
                if new.meta != old.meta:
                    dirty.add(new)
        new_nodes.extend(b.dest)
        changed += 1
    graph.nodes = new_nodes
    graph.outputs = [fix(v) for v in graph.outputs]
    graph.mutations = [(t, fix(v)) for t, v in graph.mutations]
    return changed


def refresh_metas(graph: Graph) -> int:
    """Re-infer every ATen node's output metas from its inputs', in program order: a pass that swapped a
    value for one of another layout (a fused op's contiguous output for a transposed one) leaves the
    metas after it describing the old layout. Nodes whose metas cannot be inferred on meta tensors (data-
    dependent shapes, built with explicit metas) keep theirs. Returns how many nodes changed."""
    changed = 0
    for n in graph.nodes:
        try:
            changed += _refresh_metas(n)
        except Exception:  # noqa: BLE001 - not inferable on meta tensors: the metas it was built with stand
            continue
    return changed


def _refresh_metas(n) -> bool:
    """Re-infer n's output metas after its inputs were replaced. Returns whether any changed."""
    if not isinstance(n.target, OpOverload):
        return False
    try:
        metas = infer_metas(n.target, n.args, n.kwargs)
    except (RuntimeError, ValueError):      # fake tensors (symbolic sizes) raise ValueError
        if n.target not in VIEWS:
            raise
        # the captured view relied on the strides of the op we replaced; reshape copies when it must
        n.target = aten.reshape.default
        metas = infer_metas(n.target, n.args, n.kwargs)
    changed = False
    for v, m in zip(n.outputs, metas):
        if m is not None and v.meta != m:
            v.meta, changed = m, True
    return changed
