"""Small hand-built graphs for pass tests, and a runner that executes a graph on concrete tensors."""
from __future__ import annotations

import torch

from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Phase, Role, TensorMeta
from kiln.passes.dispatch import dispatch
from kiln.runtime.codegen import generate

aten = torch.ops.aten


def graph_with_inputs(*tensors):
    g = Graph()
    vals = [g.add_input(f"x{i}", TensorMeta.of(t), Role.INPUT, str(i)) for i, t in enumerate(tensors)]
    return g, Builder(g, Phase.FORWARD), vals


def run(g: Graph, *tensors):
    dispatch(g, ("aten",))
    _, fn = generate(g)
    return fn(*tensors)


def count(g: Graph, target) -> int:
    return sum(n.target is target for n in g.nodes)
