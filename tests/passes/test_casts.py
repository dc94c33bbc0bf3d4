"""Widening casts folded into the ops that promote by themselves (kiln/passes/casts.py): dropped only where
the op computes the same from the narrow value, checked against PyTorch on the same tensors."""
from __future__ import annotations

import torch

import kiln
from kiln.passes.casts import fold_widening_casts
from tests.passes.graphs import aten, count, graph_with_inputs, run


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8).bfloat16(), torch.randn(4, 8), torch.randn(4, 8).bfloat16()


def test_a_widening_cast_read_by_an_op_that_promotes_is_dropped_and_the_result_is_exact():
    x, y, _ = _inputs()
    g, b, (xv, yv, _zv) = graph_with_inputs(*_inputs())
    wide = b(aten._to_copy.default, xv, dtype=torch.float32)
    g.outputs = [b(aten.mul.Tensor, b(aten.add.Tensor, wide, yv), wide)]
    assert fold_widening_casts(g) == 1 and count(g, aten._to_copy.default) == 0
    assert all(n.args[0] is xv for n in g.nodes if n.target is aten.add.Tensor)
    got = run(g, *_inputs())
    want = (x.float() + y) * x.float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_cast_reaching_the_op_through_views_is_dropped_and_the_views_taken_of_the_narrow_value():
    x, y, _ = _inputs()
    g, b, (xv, yv, _zv) = graph_with_inputs(*_inputs())
    wide = b(aten._to_copy.default, b(aten.t.default, xv), dtype=torch.float32)      # (8, 4), not contiguous
    flat = b(aten.unsqueeze.default, b(aten.view.default, wide, [32]), 0)
    g.outputs = [b(aten.add.Tensor, flat, b(aten.view.default, yv, [1, 32]))]
    assert fold_widening_casts(g) == 1 and count(g, aten._to_copy.default) == 0
    got = run(g, *_inputs())
    torch.testing.assert_close(got, x.t().float().reshape(1, 32) + y.reshape(1, 32), rtol=0, atol=0)


def test_of_two_widening_casts_into_one_op_only_one_is_dropped():
    """add(cast(x), cast(z)) computes in fp32 from one narrow input, not from two (segformer's gradient sum of
    two bf16 branches went into LayerNorm's fp32 backward as bf16 when both were dropped)."""
    x, _, z = _inputs()
    g, b, (xv, _yv, zv) = graph_with_inputs(*_inputs())
    total = b(aten.add.Tensor, b(aten._to_copy.default, xv, dtype=torch.float32),
              b(aten.view.default, b(aten._to_copy.default, zv, dtype=torch.float32), [4, 8]))
    g.outputs = [b(aten.mul.Tensor, total, 2.0)]
    assert fold_widening_casts(g) == 1 and count(g, aten._to_copy.default) == 1
    got = run(g, *_inputs())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (x.float() + z.float()) * 2, rtol=0, atol=0)


def test_casts_are_kept_where_dropping_them_would_change_the_result():
    g, b, (xv, yv, zv) = graph_with_inputs(*_inputs())
    both_low = b(aten.mul.Tensor, b(aten._to_copy.default, xv, dtype=torch.float32), zv)   # would compute in bf16
    softmaxed = b(aten._softmax.default, b(aten._to_copy.default, zv, dtype=torch.float32), -1, False)  # no promotion
    shared = b(aten._to_copy.default, b(aten.neg.default, xv), dtype=torch.float32)
    mixed = b(aten.add.Tensor, b(aten.exp.default, shared), b(aten.add.Tensor, shared, yv))   # one reader does not promote
    narrowed = b(aten.add.Tensor, b(aten._to_copy.default, yv, dtype=torch.bfloat16), zv)     # rounds: never dropped
    out = b(aten._to_copy.default, zv, dtype=torch.float32)                                   # a step output
    viewed = b(aten.exp.default, b(aten.view.default, b(aten._to_copy.default, xv, dtype=torch.float32), [32]))
    g.outputs = [b(aten.add.Tensor, b(aten.add.Tensor, both_low, softmaxed), mixed), narrowed, out, viewed]
    before = count(g, aten._to_copy.default)
    assert fold_widening_casts(g) == 0 and count(g, aten._to_copy.default) == before


def test_a_bf16_llama_step_keeps_no_widening_cast_before_the_residual_adds_and_rotary_kernels():
    from tests.models import zoo                       # the zoo's Llama (rope kernel, residual adds)
    model, _args, batch, _loss = zoo.llama()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.01), amp="bf16", dialects=["kiln", "aten"])
    step(**batch)
    g = step.last.graph
    users = g.users()
    widening = [n for n in g.nodes if n.target is aten._to_copy.default and n.args[0].meta.dtype == torch.bfloat16
                and n.outputs[0].meta.dtype == torch.float32]
    readers = {u.op.name for n in widening for u in users.get(n.outputs[0], ())}
    assert not readers & {"kiln.rope", "kiln.rope_backward", "aten.add.Tensor"}, readers
    assert any(n.op.name == "kiln.rope_backward" and n.inputs[0].meta.dtype == torch.bfloat16 for n in g.nodes)
