import torch

from kiln.passes.noops import remove_noops
from tests.passes.graphs import aten, count, graph_with_inputs, run


def test_removes_identity_views_transposes_and_casts():
    x = torch.randn(2, 3, 4)
    g, b, (xv,) = graph_with_inputs(x)
    v = b(aten.view.default, xv, [2, 3, 4])                  # same shape
    t = b(aten.transpose.int, v, 1, 1)                       # same dim
    c = b(aten._to_copy.default, t, dtype=torch.float32)     # same dtype
    e = b(aten.expand.default, c, [2, 3, 4])
    p = b(aten.permute.default, e, [0, 1, 2])
    g.outputs = [b(aten.exp.default, p)]
    remove_noops(g)
    assert [n.target for n in g.nodes] == [aten.exp.default]
    torch.testing.assert_close(run(g, x), x.exp())


def test_folds_double_transpose_and_keeps_real_ones():
    x = torch.randn(3, 5)
    g, b, (xv,) = graph_with_inputs(x)
    tt = b(aten.t.default, b(aten.t.default, xv))
    real = b(aten.transpose.int, xv, 0, 1)
    g.outputs = [b(aten.add.Tensor, b(aten.sum.dim_IntList, tt, [0]), b(aten.sum.dim_IntList, real, [1]))]
    remove_noops(g)
    from kiln.passes.dce import dead_code_elimination
    dead_code_elimination(g)
    assert count(g, aten.t.default) == 0 and count(g, aten.transpose.int) == 1
    torch.testing.assert_close(run(g, x), x.sum(0) * 2)


def test_keeps_narrowing_cast_chain():
    # fp32 -> bf16 -> fp32 rounds: it is not a no-op and must stay
    x = torch.randn(8)
    g, b, (xv,) = graph_with_inputs(x)
    down = b(aten._to_copy.default, xv, dtype=torch.bfloat16)
    g.outputs = [b(aten._to_copy.default, down, dtype=torch.float32)]
    remove_noops(g)
    assert count(g, aten._to_copy.default) == 2
    torch.testing.assert_close(run(g, x), x.bfloat16().float())


def test_folds_widening_cast_chain():
    # bf16 -> fp32 -> bf16 is exact: one round trip less
    x = torch.randn(8).bfloat16()
    g, b, (xv,) = graph_with_inputs(x)
    up = b(aten._to_copy.default, xv, dtype=torch.float32)
    g.outputs = [b(aten.mul.Tensor, b(aten._to_copy.default, up, dtype=torch.bfloat16), 2)]
    remove_noops(g)
    from kiln.passes.dce import dead_code_elimination
    dead_code_elimination(g)
    assert count(g, aten._to_copy.default) == 0
    torch.testing.assert_close(run(g, x), x * 2)
