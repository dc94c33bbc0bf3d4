"""The kiln-kernel rules of issue 6: swiglu and linear_gelu rewrite to kiln.kernels (config activations
through the run-time guarded linear_act / act_mul); dropout_add_layernorm, fused_qkv,
linear_cross_entropy and unpaired rope are reported with applied=false and a reason."""
import pytest

from tests.adopt.helpers import assert_same_numerics, rewrite

MLP = """\
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden=8, inner=12):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = {act}

    def forward(self, x):
{body}
"""


@pytest.mark.parametrize("act, body", [
    ("nn.SiLU()", "        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"),
    ("None", "        return self.down_proj(self.up_proj(x) * F.silu(self.gate_proj(x)))"),
])
def test_swiglu_known_silu_rewrites_to_kiln_kernel(act, body):
    src, new, matches = rewrite(MLP.format(act=act, body=body), rules=["swiglu"])
    assert [(m.rule, m.applied) for m in matches] == [("swiglu", True)]
    assert "self.down_proj(kiln_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))" in new
    assert "\ntry:\n    import kiln.kernels as kiln_kernels\nexcept ImportError:" in new
    assert_same_numerics(src, new, "MLP")


def test_swiglu_across_lines_refuses_to_move_the_call():
    body = "        h = self.act_fn(self.gate_proj(x))\n        return self.down_proj(h * self.up_proj(x))"
    src = MLP.format(act="nn.SiLU()", body=body)
    _, new, matches = rewrite(src, rules=["swiglu"])
    assert new == src and [m.applied for m in matches] == [False] and "calls may not be moved" in matches[0].reason


CONFIG_MLP = """\
import types

import torch
from torch import nn
from transformers.activations import ACT2FN


class MLP(nn.Module):
    def __init__(self, act="silu"):
        super().__init__()
        config = types.SimpleNamespace(hidden_act=act)
        self.gate_proj = nn.Linear(8, 12, bias=False)
        self.up_proj = nn.Linear(8, 12, bias=False)
        self.down_proj = nn.Linear(12, 8, bias=False)
        self.fc = nn.Linear(8, 8)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        h = self.fc(x)
        h = self.act_fn(h)
        return self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h))
"""


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_new", "relu"])
def test_config_activation_rewrites_with_a_run_time_guard(act):
    """Without the configuration module the activation is unknown: linear_act / act_mul check it on
    every call, so the rewrite computes exactly the original for any config (here silu, gelu, relu)."""
    pytest.importorskip("transformers")
    src, new, matches = rewrite(CONFIG_MLP)
    assert sorted((m.rule, m.applied) for m in matches) == [("linear_gelu", True), ("swiglu", True)]
    assert "h = kiln_kernels.linear_act(x, self.fc, self.act_fn)" in new
    assert "self.down_proj(kiln_kernels.act_mul(self.act_fn, self.gate_proj(h), self.up_proj(h)))" in new
    assert_same_numerics(src, new, "MLP", args=(act,), atol=1e-5)


@pytest.mark.parametrize("act, body", [
    # a different activation: not SwiGLU
    ("nn.ReLU()", "        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"),
    # gate and up read different inputs
    ("nn.SiLU()", "        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x + 1))"),
])
def test_swiglu_must_not_match(act, body):
    src = MLP.format(act=act, body=body)
    _, new, matches = rewrite(src, rules=["swiglu"])
    assert matches == [] and new == src


LINEAR_GELU = """\
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden=8, inner=12):
        super().__init__()
        self.fc = nn.Linear(hidden, inner{bias})
        self.act = {act}

    def forward(self, x):
{body}
"""


@pytest.mark.parametrize("act, body, call, bias", [
    ("nn.GELU()", "        h = self.fc(x)\n        return self.act(h)", "linear_act(x, self.fc, self.act)", ""),
    ("nn.GELU(approximate='tanh')", "        return self.act(self.fc(x))", "linear_act(x, self.fc, self.act)", ""),
    ("None", '        return F.gelu(self.fc(x), approximate="tanh")',
     'linear_gelu_of(x, self.fc, approximate="tanh")', ", bias=False"),
    ("None", "        return F.gelu(self.fc(x))", "linear_gelu_of(x, self.fc)", ""),
])
def test_linear_gelu_rewrites_to_kiln_kernel(act, body, call, bias):
    src, new, matches = rewrite(LINEAR_GELU.format(act=act, body=body, bias=bias), rules=["linear_gelu"])
    assert [(m.rule, m.applied) for m in matches] == [("linear_gelu", True)]
    assert f"kiln_kernels.{call}" in new
    assert_same_numerics(src, new, "Block", atol=1e-5)


@pytest.mark.parametrize("act, body", [
    ("nn.ReLU()", "        return self.act(self.fc(x))"),            # not a GELU
    ("nn.GELU()", "        return self.act(self.fc(x) + 1)"),        # not straight from the linear
    ("nn.GELU()", "        return self.act(x)"),
])
def test_linear_gelu_must_not_match(act, body):
    src = LINEAR_GELU.format(act=act, body=body, bias="")
    _, new, matches = rewrite(src, rules=["linear_gelu"])
    assert matches == [] and new == src


REPORTED = """\
import torch
from torch import nn
from torch.nn import CrossEntropyLoss


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def not_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = k * cos + not_rotate_half(k) * sin
    return q_embed, k_embed


class Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(2 * d, d)
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 100, bias=False)

    def forward(self, h, residual, labels, other):
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(other)
        q2, k2, v2 = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        out = self.norm(self.dropout(h) + residual)
        logits = self.lm_head(out)
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)), labels[..., 1:].reshape(-1))
        plain = self.norm(h + residual)
        return loss, logits, plain
"""


def test_report_only_detections():
    src, new, matches = rewrite(REPORTED, rules=["rope", "fused_qkv", "dropout_add_layernorm", "linear_cross_entropy"])
    assert new == src
    got = [(m.rule, m.cls, m.method, m.first_line, m.applied) for m in matches]
    assert got == [
        ("rope", None, "apply_rotary_pos_emb", 19, False),          # k_embed: not the half rotation
        ("fused_qkv", "Layer", "forward", 36, False),               # q, k, v2 of `h` (v reads `other`)
        ("dropout_add_layernorm", "Layer", "forward", 38, False),   # `plain` has no dropout
        ("linear_cross_entropy", "Layer", "forward", 43, False),
    ]
    assert all(m.reason for m in matches)


def test_fused_qkv_needs_one_input():
    # three Linear modules applied to one value have equal in_features (the value's last dim); q, k
    # and v of different values are not a location
    src = REPORTED.replace("self.v_proj(h)", "self.v_proj(other)")
    _, _, matches = rewrite(src, rules=["fused_qkv"])
    assert matches == []


def test_swiglu_unequal_widths_is_refused():
    src = MLP.format(act="nn.SiLU()", body="        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))")
    src = src.replace("self.up_proj = nn.Linear(hidden, inner, bias=False)", "self.up_proj = nn.Linear(hidden, 1)")
    _, new, matches = rewrite(src, rules=["swiglu"])
    assert new == src and [m.applied for m in matches] == [False] and "out_features" in matches[0].reason


def test_cross_entropy_of_a_classifier_is_not_linear_cross_entropy():
    src = REPORTED.replace("self.lm_head", "self.classifier")
    _, _, matches = rewrite(src, rules=["linear_cross_entropy"])
    assert matches == []


CONV1D = """\
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(12, 8)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.act(self.c_fc(x)) + F.gelu(self.c_fc(x))
"""


def test_linear_gelu_on_gpt2_conv1d_transposes_the_weight():
    """transformers' Conv1D stores its weight (in, out): the kernel call passes weight.t()."""
    pytest.importorskip("transformers")
    src, new, matches = rewrite(CONV1D, rules=["linear_gelu"])
    assert [(m.rule, m.applied) for m in matches] == [("linear_gelu", True)] * 2
    assert "kiln_kernels.linear_act(x, self.c_fc, self.act) + kiln_kernels.linear_gelu_of(x, self.c_fc)" in new
    assert_same_numerics(src, new, "MLP", atol=1e-5)
