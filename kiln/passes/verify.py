"""Graph verifier: every value defined once and before use, tensors typed, outputs reachable."""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.ir.graph import Graph
from kiln.ir.symbolic import same


def verify(graph: Graph, stage: str = "") -> None:
    defined = set(graph.inputs)
    where = f" after {stage}" if stage else ""
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v not in defined:
                raise KilnError(f"verifier{where}: node {i} ({n.op.name}) uses {v!r} before it is defined")
        for o in n.outputs:
            if o in defined:
                raise KilnError(f"verifier{where}: {o!r} defined twice (node {i}, {n.op.name})")
            if o.producer is not n:
                raise KilnError(f"verifier{where}: {o!r} does not point back at its producer {n.op.name}")
            defined.add(o)
    for v in graph.outputs + [new for _, new in graph.mutations]:
        if v not in defined:
            raise KilnError(f"verifier{where}: output {v!r} is never computed")
    for target, new in graph.mutations:
        if target.meta is None or new.meta is None or not same(target.meta.shape, new.meta.shape):
            raise KilnError(f"verifier{where}: mutation of {target!r} with a value of another shape")
