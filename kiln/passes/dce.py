"""Dead-code elimination: drop nodes whose outputs nothing needs (side effects are always kept)."""
from __future__ import annotations

from kiln.ir.graph import Graph


def dead_code_elimination(graph: Graph) -> int:
    live = graph.live_outputs()
    keep = []
    for n in reversed(graph.nodes):
        if n.op.side_effects or any(o in live for o in n.outputs):
            keep.append(n)
            live.update(n.inputs)
    removed = len(graph.nodes) - len(keep)
    graph.nodes = keep[::-1]
    return removed
