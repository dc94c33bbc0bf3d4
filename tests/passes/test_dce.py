import torch

from kiln.passes.dce import dead_code_elimination
from tests.passes.graphs import aten, count, graph_with_inputs, run


def test_removes_unused_nodes_keeps_live_ones():
    x = torch.randn(4, 4)
    g, b, (xv,) = graph_with_inputs(x)
    dead = b(aten.exp.default, xv)
    b(aten.mul.Tensor, dead, 2.0)            # unused chain
    live = b(aten.sin.default, xv)
    g.outputs = [live]
    assert dead_code_elimination(g) == 2
    assert count(g, aten.exp.default) == 0 and count(g, aten.sin.default) == 1
    torch.testing.assert_close(run(g, x), torch.sin(x))


def test_keeps_mutation_values_and_side_effects():
    x = torch.randn(3)
    g, b, (xv,) = graph_with_inputs(x)
    new = b(aten.add.Tensor, xv, 1.0)
    out = b(aten.sum.default, xv)
    g.outputs = [out]
    g.mutations = [(xv, new)]                # the buffer update keeps `new` alive
    assert dead_code_elimination(g) == 0
    assert count(g, aten.add.Tensor) == 1
