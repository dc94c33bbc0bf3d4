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


def fuse_regions(g: Graph, names: tuple[str, ...], tuner=None) -> list:
    """What a compilation does with regions: the pure passes find them and dispatch, the tuner (a fresh one,
    tuning as $KILN_TUNING says, unless given) compiles and measures, then the regions with a kernel are
    placed. Returns every region considered."""
    from kiln.dialects.tuning import Tuner
    from kiln.passes.pipeline import AFTER_TUNING, Context, run_pipeline
    from kiln.passes.regions import find_regions
    ctx = Context(g, None, names)
    ctx.regions.extend(find_regions(g, names))
    dispatch(g, names, ctx.choices)
    (tuner if tuner is not None else Tuner()).realize(ctx)
    run_pipeline(ctx, AFTER_TUNING)
    return ctx.regions
