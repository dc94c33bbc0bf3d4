"""rms_norm: the Llama, T5, Gemma and plain spellings; must-not-match cases; refusals; numerics."""
import pytest
import torch

from tests.adopt.helpers import load, assert_same_numerics, rewrite

HEADER = """\
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, hidden_size=8, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
"""

LLAMA = HEADER + """\
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        # accumulate in float32
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
"""

T5 = HEADER + """\
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

        # convert into half-precision if necessary
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)

        return self.weight * hidden_states
"""

GEMMA = HEADER + """\
        x = hidden_states.float()
        output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        output = output * (1.0 + self.weight.float())
        return output.type_as(hidden_states)
"""

SPELLINGS = [
    "hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight",
    "self.weight * (hidden_states / torch.sqrt(torch.mean(hidden_states ** 2, dim=-1, keepdim=True) + 1e-6))",
    "self.weight * hidden_states * (1.0 / torch.sqrt((hidden_states * hidden_states).mean(-1, True) + 1e-5))",
    "hidden_states * (hidden_states.square().mean(dim=-1, keepdim=True) + self.variance_epsilon) ** -0.5 * self.weight",
]


def test_llama_style():
    src, new, matches = rewrite(LLAMA)
    assert [(m.rule, m.cls, m.method, m.first_line, m.last_line, m.applied) for m in matches] == [
        ("rms_norm", "Norm", "forward", 15, 17, True)]
    assert new == src.replace("""\
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
""", """\
        return self.weight * nn.functional.rms_norm(hidden_states, hidden_states.shape[-1:], eps=self.variance_epsilon).to(input_dtype)
""")
    assert "# accumulate in float32" in new        # the comment of a removed line survives
    assert_same_numerics(src, new, "Norm")


def test_llama_style_bf16_input_keeps_dtype():
    src, new, _ = rewrite(LLAMA)
    assert_same_numerics(src, new, "Norm", dtype=torch.bfloat16, atol=1e-2, rtol=1e-2)


def test_t5_style_weight_after_control_flow():
    src, new, matches = rewrite(T5)
    assert [(m.rule, m.first_line, m.last_line, m.applied) for m in matches] == [("rms_norm", 12, 13, True)]
    assert ("hidden_states = nn.functional.rms_norm(hidden_states.to(torch.float32), hidden_states.shape[-1:], "
            "eps=self.variance_epsilon)") in new
    assert "variance = " not in new
    assert_same_numerics(src, new, "Norm")


def test_gemma_style_one_plus_weight():
    src, new, matches = rewrite(GEMMA)
    assert [m.rule for m in matches] == ["rms_norm"]
    assert ("output = nn.functional.rms_norm(x, x.shape[-1:], 1 + self.weight.float(), "
            "eps=self.variance_epsilon)") in new
    assert_same_numerics(src, new, "Norm")


@pytest.mark.parametrize("expr", SPELLINGS)
def test_spellings(expr):
    src, new, matches = rewrite(HEADER + f"        return {expr}\n")
    assert [m.rule for m in matches] == ["rms_norm"], new
    assert "nn.functional.rms_norm(hidden_states, hidden_states.shape[-1:], " in new
    assert_same_numerics(src, new, "Norm")


@pytest.mark.parametrize("expr", [
    # layer norm: subtracts the mean
    "self.weight * (hidden_states - hidden_states.mean(-1, keepdim=True)) * torch.rsqrt("
    "hidden_states.var(-1, keepdim=True) + 1e-6)",
    # not over the last dimension
    "self.weight * hidden_states * torch.rsqrt(hidden_states.pow(2).mean(0, keepdim=True) + 1e-6)",
    # no keepdim
    "self.weight * hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1) + 1e-6)",
    # sqrt instead of rsqrt: a different function
    "self.weight * hidden_states * torch.sqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)",
    # a constant where the weight goes is not a weight
    "2.0 * hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6) + self.weight",
])
def test_must_not_match(expr):
    src = HEADER + f"        return {expr}\n"
    _, new, matches = rewrite(src)
    assert matches == [] and new == src


def test_different_tensors_do_not_match():
    src = HEADER.replace("forward(self, hidden_states)", "forward(self, hidden_states, other)") + """\
        variance = other.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)
"""
    _, new, matches = rewrite(src)
    assert matches == [] and new == src


def test_refuses_when_a_name_is_reassigned_before_the_replacement():
    src = """\
    import torch

    def f(h, w):
        variance = h.pow(2).mean(-1, keepdim=True)
        y = h * torch.rsqrt(variance + 1e-6)
        h = None
        return w * y
    """
    src, new, matches = rewrite(src)
    assert len(matches) == 1 and not matches[0].applied
    assert "`h`" in matches[0].reason
    assert new == src


def test_refuses_when_modified_in_place():
    src = """\
    import torch

    def f(h, w):
        var = h.pow(2).mean(-1, keepdim=True)
        h.mul_(2)
        return w * (h * torch.rsqrt(var + 1e-6))
    """
    src, new, matches = rewrite(src)
    assert [m.applied for m in matches] == [False] and "in place" in matches[0].reason
    assert new == src


def test_a_change_in_place_before_every_read_is_no_obstacle():
    # the replacement reads `h` where the original first read it: after the change, like the original
    src, new, matches = rewrite("""\
    import torch

    def f(h, w):
        h.mul_(2)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    """)
    assert [m.applied for m in matches] == [True]
    h, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(load(new, "n")["f"](h.clone(), w), load(src, "o")["f"](h.clone(), w))
