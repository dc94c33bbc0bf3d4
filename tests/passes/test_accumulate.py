"""Residual gradients' sums folded into rms_norm_backward (kiln/passes/accumulate.py): the same bits as the
add it replaces, checked on hand-built graphs against PyTorch and on whole Llama steps."""
from __future__ import annotations

import copy

import torch

import kiln
import kiln.kernels  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.passes.accumulate import fold_accumulation
from tests.passes.graphs import aten, count, graph_with_inputs, run

kiln_ops = torch.ops.kiln


def _graph(dtype=torch.float32, broadcast=False, other_after=False, read_alone=False):
    torch.manual_seed(0)
    g_out, x = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    w, other = torch.rand(32) + 0.5, torch.randn(6, 32) if broadcast else torch.randn(4, 6, 32)
    rstd = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    tensors = (g_out, x, w, rstd, other.to(dtype))
    g, b, (gv, xv, wv, rv, ov) = graph_with_inputs(*tensors)
    gi, _gw, _low = b(kiln_ops.rms_norm_backward.default, gv, None, xv, wv, rv)
    if other_after:
        ov = b(aten.mul.Tensor, ov, 1.0)                    # computed after the kernel
    s = b(aten.add.Tensor, gi, ov)
    g.outputs = [s, gi] if read_alone else [s]
    return g, tensors


def test_the_sum_becomes_the_kernels_grad_sum_with_the_same_bits():
    g, tensors = _graph()
    g_out, x, w, rstd, other = tensors
    gi_ref = torch.ops.kiln.rms_norm_backward(g_out, None, x, w, rstd)[0]
    assert fold_accumulation(g) == 1 and count(g, aten.add.Tensor) == 0
    (n,) = [n for n in g.nodes if n.target is kiln_ops.rms_norm_backward.default]
    assert n.args[1] is g.inputs[4]
    got = run(g, *tensors)
    assert torch.equal(got, gi_ref + other)


def test_the_sum_stays_where_folding_would_change_bits_or_order():
    for kwargs in (dict(dtype=torch.bfloat16), dict(broadcast=True), dict(other_after=True), dict(read_alone=True)):
        g, _ = _graph(**kwargs)
        assert fold_accumulation(g) == 0, kwargs
        assert count(g, aten.add.Tensor) == 1


def test_llama_steps_fold_every_residual_sum_and_train_bit_for_bit_as_with_the_adds(monkeypatch):
    """fp32 and bf16 Llama: the residual gradients' adds after a norm's backward go into the kernel (and in
    bf16 their casts into its bf16 copy); losses and parameters after 3 steps are the same bits as the
    program with the adds (the program's parity with eager is tests/models)."""
    import kiln.passes.pipeline as pipeline
    from tests.models import zoo
    model, _args, batch, _loss = zoo.llama()
    real = pipeline.fold_accumulation

    def train(fold: bool, amp):
        monkeypatch.setattr(pipeline, "fold_accumulation", real if fold else (lambda graph: 0))
        m = copy.deepcopy(model)
        step = kiln.compile(m, optimizer=kiln.optim.AdamW(lr=1e-3), amp=amp, dialects=["kiln", "sdpa", "aten"])
        losses = [step(**batch).item() for _ in range(3)]
        return step.last.graph, losses, [p.detach().clone() for p in m.parameters()]

    for amp in (None, "bf16"):
        g1, l1, p1 = train(True, amp)
        g0, l0, p0 = train(False, amp)
        assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(p1, p0)), amp
        taking = [n for n in g1.nodes if n.target is kiln_ops.rms_norm_backward.default and n.args[1] is not None]
        norms = [n for n in g1.nodes if n.target is kiln_ops.rms_norm_backward.default]
        assert len(taking) >= len(norms) - 1 >= 1, (len(taking), len(norms))
        casts = lambda g: sum(n.target is aten._to_copy.default and n.phase.name == "BACKWARD" for n in g.nodes)  # noqa
        assert casts(g1) <= casts(g0), amp
