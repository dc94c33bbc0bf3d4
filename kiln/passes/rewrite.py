"""The local-rewrite driver every table-driven pass uses.

A rule table maps an op target to `callback(b, node) -> list[Value] | Value | None`. Returning values
replaces the node's outputs (new nodes emitted through `b` are inserted in its place); None keeps the
node. Tables compose with `|` and run to a fixed point.
"""
from __future__ import annotations

from typing import Callable

from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Value, tree_map_values

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
    for n in graph.nodes:
        n.args, n.kwargs = tree_map_values(fix, n.args), tree_map_values(fix, n.kwargs)
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
            if new is not None and new is not old:
                subst[old] = new
        new_nodes.extend(b.dest)
        changed += 1
    graph.nodes = new_nodes
    graph.outputs = [fix(v) for v in graph.outputs]
    graph.mutations = [(t, fix(v)) for t, v in graph.mutations]
    return changed
