"""The backward reordered for memory (kiln/passes/schedule.py): on hand-built graphs whose best order is
known, the same values (run against PyTorch), and on a whole Llama step (the same bits as autodiff's order)."""
from __future__ import annotations

import copy

import pytest
import torch

import kiln
from kiln.ir.builder import Builder
from kiln.ir.graph import Phase
from kiln.passes import memory
from kiln.passes.schedule import schedule_backward
from tests.passes.graphs import aten, graph_with_inputs, run

N = 10000        # 40 KB of fp32


def _graph(random_ops: bool = False):
    """a = 2x in the forward, read by the backward's sum; the backward first makes c = 3y (a step output, alive
    to the end), then sums a: in that order a and c are live together; summing a first frees it before c."""
    x, y = torch.randn(N), torch.randn(N)
    g, fwd, (xv, yv) = graph_with_inputs(x, y)
    a = fwd(aten.mul.Tensor, xv, 2.0)
    bwd = Builder(g, Phase.BACKWARD)
    if random_ops:          # two draws: their order is the random stream's, whatever the memory says
        c = bwd(aten.bernoulli.p, yv, 0.5)
        d = bwd(aten.bernoulli.p, a, 0.5)
    else:
        c = bwd(aten.mul.Tensor, yv, 3.0)
        d = bwd(aten.sum.default, a)
    g.outputs = [c, d]
    return g, (x, y)


def test_the_backward_frees_an_activation_before_it_allocates_and_computes_the_same():
    g, (x, y) = _graph()
    before = memory.profile(g).peak
    got = schedule_backward(g)
    assert got.moved == 2 and got.before == before and got.after == memory.profile(g).peak
    assert got.after <= before - 4 * N + 64                          # a and c are never live together
    assert [n.target for n in g.nodes if n.phase is Phase.BACKWARD] == [aten.sum.default, aten.mul.Tensor]
    g.outputs = [g.outputs[0], g.outputs[1]]
    assert torch.equal(run(g, x, y), y * 3.0)                       # the step function returns outputs[0]
    g.outputs = g.outputs[::-1]
    assert torch.equal(run(g, x, y), (x * 2.0).sum())


def test_random_ops_keep_their_order_and_nothing_moves_when_the_peak_would_not_drop():
    g, _ = _graph(random_ops=True)
    order = [n.uid for n in g.nodes]
    assert schedule_backward(g).moved == 0 and [n.uid for n in g.nodes] == order
    g, _ = _graph()
    schedule_backward(g)
    order = [n.uid for n in g.nodes]
    assert schedule_backward(g).moved == 0 and [n.uid for n in g.nodes] == order   # already the better order


@pytest.mark.parametrize("name,amp", [("llama", None), ("t5", "bf16")])
def test_a_step_reordered_trains_bit_for_bit_as_in_autodiffs_order(monkeypatch, name, amp):
    """The zoo's Llama (nothing to gain) and T5 in bf16 (whose peak is in the backward: reordered): losses and
    parameters after 3 steps are the bits of autodiff's order; where nodes moved, the predicted peak is lower
    and `step.memory()` says so."""
    import kiln.passes.pipeline as pipeline
    from tests.models import zoo
    model, args, batch, _loss = getattr(zoo, name)()
    real = pipeline.schedule_backward

    def train(reorder: bool):
        monkeypatch.setattr(pipeline, "schedule_backward", real if reorder else
                            (lambda graph: pipeline.Schedule(0, 0)))
        m = copy.deepcopy(model)
        step = kiln.compile(m, optimizer=kiln.optim.SGD(lr=0.01), amp=amp)
        losses = [(step(*args, **batch) if args else step(**batch)).item() for _ in range(3)]
        return step, losses, [p.detach().clone() for p in m.parameters()]

    s1, l1, p1 = train(True)
    s0, l0, p0 = train(False)
    assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(p1, p0))
    r1, r0 = s1.memory(), s0.memory()
    assert r1.predicted_peak <= r0.predicted_peak
    if name == "t5":
        assert s1.last.schedule.moved > 0
    if s1.last.schedule.moved:
        assert r1.predicted_peak < r0.predicted_peak and "backward reordered for memory" in str(r1)
