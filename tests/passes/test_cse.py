import torch

from kiln.passes.cse import common_subexpression_elimination
from tests.passes.graphs import aten, count, graph_with_inputs, run


def test_merges_identical_pure_ops():
    x = torch.randn(5)
    g, b, (xv,) = graph_with_inputs(x)
    a1 = b(aten.mul.Tensor, xv, 2.0)
    a2 = b(aten.mul.Tensor, xv, 2.0)
    g.outputs = [b(aten.add.Tensor, a1, a2)]
    assert common_subexpression_elimination(g) == 1
    assert count(g, aten.mul.Tensor) == 1
    torch.testing.assert_close(run(g, x), 4 * x)


def test_distinguishes_constants_and_signed_zero():
    x = torch.randn(5)
    g, b, (xv,) = graph_with_inputs(x)
    a1 = b(aten.mul.Tensor, xv, 0.0)
    a2 = b(aten.mul.Tensor, xv, -0.0)
    a3 = b(aten.mul.Tensor, xv, 3)
    g.outputs = [b(aten.add.Tensor, b(aten.add.Tensor, a1, a2), a3)]
    assert common_subexpression_elimination(g) == 0


def test_never_merges_random_ops():
    x = torch.randn(1000)
    g, b, (xv,) = graph_with_inputs(x)
    d1 = b(aten.native_dropout.default, xv, 0.5, True)[0]
    d2 = b(aten.native_dropout.default, xv, 0.5, True)[0]
    g.outputs = [b(aten.sub.Tensor, d1, d2)]
    assert common_subexpression_elimination(g) == 0
    assert count(g, aten.native_dropout.default) == 2
    assert run(g, x).abs().sum() > 0        # two different masks
