"""The collectives pass (data parallel) on a captured training graph, without processes: where each
collective goes, in which order, and what the optimizer updates (tests/parallel runs them on real ranks)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import kiln
from kiln.capture import capture
from kiln.ir.graph import Phase
from kiln.ops import collectives as C
from kiln.passes.pipeline import Context, run_pipeline
from tests.parallel.worker import TinyLM, batches


@dataclass
class FakeComm:
    world: int = 2
    rank: int = 0


@dataclass
class FakeParallel:                  # what the pass reads of kiln.runtime.parallel.Parallel
    zero: int
    comm: FakeComm
    bucket_mb: float = 0.004
    overlap: bool = True
    layout: tuple | None = None


@functools.cache                     # the tests only read the result
def compiled(zero: int, overlap: bool = True) -> Context:
    torch.manual_seed(0)
    graph, _ = capture(TinyLM(), None, batches(1, 1)[0], {})
    ctx = Context(graph, kiln.optim.AdamW(lr=1e-2, max_grad_norm=1.0), ("aten",), verify=True,
                  parallel=FakeParallel(zero, FakeComm(), overlap=overlap))
    return run_pipeline(ctx)


def at(ctx, op) -> list[int]:
    return [i for i, n in enumerate(ctx.graph.nodes) if n.op is op]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_each_bucket_starts_after_its_last_gradient_and_waits_before_the_update(zero):
    ctx = compiled(zero)
    g, nodes, plan = ctx.graph, ctx.graph.nodes, ctx.collectives
    assert nodes[0].op is C.STEP_BEGIN
    (loss_start,) = at(ctx, C.LOSS_START)
    assert nodes[loss_start - 1].outputs[0] is g.outputs[0]          # right after the loss
    starts, waits = at(ctx, C.REDUCE_START), at(ctx, C.REDUCE_WAIT)
    assert len(starts) == len(waits) == len(plan.layout) > 2
    first_update = min(i for i, n in enumerate(nodes) if n.op.kind.value == "optimizer")
    pos = {n.uid: i for i, n in enumerate(nodes)}
    previous = nodes[loss_start].outputs[0]
    for i, bucket in zip(starts, plan.layout):
        n = nodes[i]
        assert n.phase is Phase.BACKWARD and n.args[1] is bucket and n.args[2] == zero
        assert n.args[3] is previous                                   # issued in order on every rank
        previous = n.outputs[0]
        last = max(pos[v.producer.uid] for v in n.args[4])
        assert all(m.op.kind.value == "collective" for m in nodes[last + 1:i])   # as soon as it can
    assert all(w < first_update and nodes[w].phase is Phase.OPTIMIZER for w in waits)
    # every trainable parameter is in exactly one bucket, in the order the backward produces them
    names = [name for b in plan.layout for name in b.names]
    assert sorted(names) == sorted(v.source for v in g.inputs_with(kiln.ir.graph.Role.PARAM))


def test_zero0_updates_every_parameter_from_the_averaged_gradients():
    ctx = compiled(0)
    (update,) = [n for n in ctx.graph.nodes if n.op.kind.value == "optimizer" and n.op.name.startswith("kiln.adamw")]
    assert update.op.name == "kiln.adamw_update_multi"                # still one fused multi-tensor update
    clipped = [g.producer for g in update.args[1]]                     # grad * clip coefficient
    assert all(m.target is torch.ops.aten.mul.Tensor and m.args[0].producer.op is C.REDUCE_WAIT for m in clipped)
    assert not at(ctx, C.GATHER_START) and not at(ctx, C.CHECK_FINITE_RANKS)
    (norm,) = at(ctx, C.GRAD_NORM)                                     # clipping: one op, the same on every rank
    assert ctx.graph.nodes[norm].args[0] is None


def test_zero_updates_this_ranks_shards_out_of_place_and_gathers_them():
    ctx = compiled(1)
    nodes, layout = ctx.graph.nodes, ctx.collectives.layout
    updates = [i for i, n in enumerate(nodes) if n.op.name == "kiln.adamw_update_out"]
    gathers, waits = at(ctx, C.GATHER_START), at(ctx, C.GATHER_WAIT)
    assert len(updates) == len(gathers) == len(waits) == len(layout)
    for u, s in zip(updates, gathers):
        assert s == u + 1 and nodes[s].args[3] is nodes[u].outputs[0]    # each shard gathered right after its update
        assert nodes[u].args[0].producer.op is C.SHARD_PARAMS
        assert nodes[u].args[0].meta.shape == (layout[updates.index(u)].shard_size,)
    assert min(waits) > max(gathers)
    # the guard and the clipping norm see every rank's shards (collectives in the chain)
    assert at(ctx, C.CHECK_FINITE_RANKS) and at(ctx, C.GRAD_NORM)
    assert nodes[at(ctx, C.GRAD_NORM)[0]].args[0] is not None
    state = [v.source for v in ctx.graph.inputs if v.role.value == "state"]
    # optimizer state: this rank's bucket shards only; besides it, the clipping norm the step reports
    assert "__metrics__:grad_norm" in state
    state.remove("__metrics__:grad_norm")
    assert state and all(s.startswith("__zero__.bucket") for s in state)


def test_without_overlap_every_collective_starts_at_the_end_of_the_backward():
    ctx = compiled(0, overlap=False)
    nodes = ctx.graph.nodes
    starts = at(ctx, C.REDUCE_START)
    assert starts == list(range(starts[0], starts[0] + len(starts)))
    assert all(n.phase is not Phase.BACKWARD or n.op.kind.value == "collective" for n in nodes[starts[0]:])
