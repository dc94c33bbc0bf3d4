"""gelu_tanh, gelu_erf, silu: before/after text, algebraic spellings, must-not-match, numerics."""
import pytest

from tests.adopt.helpers import assert_same_numerics, rewrite

MODULE = """\
import math
import torch
from torch import nn


class Act(nn.Module):
    def forward(self, x):
        return {expr}
"""

GELU_TANH = [
    "0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))",
    "x * 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))",
    "0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))",
    "0.5 * x * (1.0 + (0.7978845608028654 * (x + 0.044715 * x.pow(3))).tanh())",
    "0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))",   # FastGELU
    "x * (0.5 + 0.5 * torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))",
]
GELU_ERF = [
    "x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))",
    "0.5 * x * (1 + torch.erf(x * 0.7071067811865476))",
    "x * (1.0 + torch.erf(x / 1.4142135623730951)) / 2",
    "x * 0.5 * (1.0 + torch.special.erf(x / math.sqrt(2.0)))",
]
SILU = ["x * torch.sigmoid(x)", "torch.sigmoid(x) * x", "x * x.sigmoid()", "torch.mul(x, torch.sigmoid(x))",
        "x * nn.functional.sigmoid(x)"]


@pytest.mark.parametrize("expr", GELU_TANH)
def test_gelu_tanh_spellings(expr):
    src, new, matches = rewrite(MODULE.format(expr=expr))
    assert [m.rule for m in matches] == ["gelu_tanh"] and matches[0].applied
    assert 'return nn.functional.gelu(x, approximate="tanh")' in new
    assert_same_numerics(src, new, "Act")


@pytest.mark.parametrize("expr", GELU_ERF)
def test_gelu_erf_spellings(expr):
    src, new, matches = rewrite(MODULE.format(expr=expr))
    assert [m.rule for m in matches] == ["gelu_erf"]
    assert "return nn.functional.gelu(x)" in new
    assert_same_numerics(src, new, "Act")


@pytest.mark.parametrize("expr", SILU)
def test_silu_spellings(expr):
    src, new, matches = rewrite(MODULE.format(expr=expr))
    assert [m.rule for m in matches] == ["silu"]
    assert "return nn.functional.silu(x)" in new
    assert_same_numerics(src, new, "Act")


@pytest.mark.parametrize("expr", [
    "x * torch.sigmoid(1.702 * x)",                      # quick_gelu: not SiLU
    "x * torch.sigmoid(x * 1.702)",
    "y * torch.sigmoid(x)",                              # different tensors
    "0.5 * x * (1.0 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))",    # a different constant
    "0.5 * x * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 2)))",
    "0.5 * x * (1.0 + torch.erf(x / 2.0))",
    "0.5 * y * (1.0 + torch.erf(x / math.sqrt(2.0)))",
])
def test_must_not_match(expr):
    src = MODULE.format(expr=expr).replace("forward(self, x)", "forward(self, x, y=None)")
    _, new, matches = rewrite(src)
    assert matches == [] and new == src


def test_same_name_different_values_do_not_match():
    # `x` is reassigned between the sigmoid and the product: two different tensors.
    src = """\
    import torch

    def f(x):
        s = torch.sigmoid(x)
        x = x + 1
        return x * s
    """
    _, new, matches = rewrite(src)
    assert matches == []


def test_silu_across_statements_and_rule_selection():
    src = """\
    import torch

    def f(h):
        gate = torch.sigmoid(h)
        out = h * gate
        return out
    """
    src_, new, matches = rewrite(src, rules=["silu"])
    assert [(m.rule, m.cls, m.method, m.first_line, m.last_line) for m in matches] == [("silu", None, "f", 4, 5)]
    assert "gate" not in new and "out = torch.nn.functional.silu(h)" in new
    _, untouched, none = rewrite(src, rules=["gelu_erf"])
    assert none == [] and untouched == src_


def test_import_added_when_missing():
    src = '''\
    """Doc."""
    from torch import sigmoid

    def f(x):
        return x * sigmoid(x)
    '''
    _, new, _ = rewrite(src)
    assert new.startswith('"""Doc."""\nfrom torch import sigmoid\nimport torch\n')
    assert "return torch.nn.functional.silu(x)" in new


def test_existing_alias_is_used():
    src = """\
    import torch
    import torch.nn.functional as F

    def f(x):
        return x * torch.sigmoid(x)
    """
    _, new, _ = rewrite(src)
    assert "return F.silu(x)" in new


def test_nested_inside_larger_expression_keeps_precedence():
    src = """\
    import torch

    def f(x, y):
        return y ** (x * torch.sigmoid(x)) + 1
    """
    src, new, matches = rewrite(src)
    assert "return y ** torch.nn.functional.silu(x) + 1" in new
    import torch
    from tests.adopt.helpers import load
    x, y = torch.rand(4), torch.rand(4) + 0.5
    torch.testing.assert_close(load(new, "n")["f"](x, y), load(src, "o")["f"](x, y))
