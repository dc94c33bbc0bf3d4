"""Locations found by data flow across statements and branches, config defaults, inherited
__init__, and the paired RoPE rewrite. References: hand-labelled expectations and eager PyTorch."""
import textwrap

import pytest
import torch

from kiln.adopt import rewrite_source
from tests.adopt.helpers import load, rewrite

# BERT (transformers 4.x) style: relative-position branch, mask under `if`, head mask, probs returned
BERT_ATTENTION = """\
import math
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.size = heads, d // heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.dropout = nn.Dropout(0.0)
        self.distance_embedding = nn.Embedding(64, self.size)
        self.relative = False

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, self.size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        query_layer = self.split(self.query(hidden_states))
        key_layer = self.split(self.key(hidden_states))
        value_layer = self.split(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        if self.relative:
            seq = hidden_states.shape[1]
            pos = torch.arange(seq).view(-1, 1) - torch.arange(seq).view(1, -1)
            emb = self.distance_embedding(pos + 31)
            attention_scores = attention_scores + torch.einsum("bhld,lrd->bhlr", query_layer, emb)
        attention_scores = attention_scores / math.sqrt(self.size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        if head_mask is not None:
            attention_probs = attention_probs * head_mask
        context_layer = torch.matmul(attention_probs, value_layer)
        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)
        return outputs
"""


def test_attention_across_branches_is_a_location():
    # relative-position branch, head mask, probabilities returned under `output_attentions`: the
    # explicit path is kept under those tests (attention_split.py; numerics in test_sdpa_split.py)
    src, new, matches = rewrite(BERT_ATTENTION, rules=["sdpa"])
    assert [(m.rule, m.cls, m.method, m.applied) for m in matches] == [("sdpa", "SelfAttention", "forward", True)]
    assert matches[0].first_line == 24 and matches[0].last_line == 37
    assert "        if self.relative or head_mask is not None or output_attentions:  # kiln adopt" in new


@pytest.mark.parametrize("change", [
    # talking heads: the probabilities are mixed across heads before the product with v
    ("attention_probs = self.dropout(attention_probs)",
     "attention_probs = self.dropout(attention_probs).permute(0, 2, 3, 1).permute(0, 3, 1, 2)"),
    # the probabilities feed something else besides the product with v
    ("outputs = (context_layer, attention_probs)", "outputs = (context_layer, attention_probs.sum(-1))"),
    # softmax over another dim
    ("softmax(attention_scores, dim=-1)", "softmax(attention_scores, dim=1)"),
    # no q k^T product behind the scores (on any path)
    ("attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))",
     "attention_scores = query_layer.sum(-1, keepdim=True).expand(-1, -1, -1, query_layer.shape[2])",
     'torch.einsum("bhld,lrd->bhlr", query_layer, emb)', "emb.sum()"),
])
def test_not_attention(change):
    src = BERT_ATTENTION
    for old, new in zip(change[::2], change[1::2]):
        src = src.replace(old, new)
    assert src != BERT_ATTENTION
    _, new, matches = rewrite(src, rules=["sdpa"])
    assert matches == [] and new == src


POST_LN = """\
import torch
from torch import nn
import torch.nn.functional as F


class Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.p = 0.1

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.fc(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.p, training=self.training)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        return hidden_states + residual
"""


def test_dropout_add_layernorm_with_the_sum_kept_as_residual():
    src, new, matches = rewrite(POST_LN, rules=["dropout_add_layernorm"])
    assert new == src
    assert [(m.method, m.first_line, m.last_line, m.applied) for m in matches] == [("forward", 16, 19, False)]


def test_dropout_add_layernorm_needs_the_dropout():
    src = POST_LN.replace("hidden_states = F.dropout(hidden_states, p=self.p, training=self.training)",
                          "hidden_states = hidden_states * 2")
    _, _, matches = rewrite(src, rules=["dropout_add_layernorm"])
    assert matches == []


def test_inherited_init_types_the_subclass_attributes():
    src = textwrap.dedent("""\
        from torch import nn


        class Attention(nn.Module):
            def __init__(self, d=8):
                super().__init__()
                self.q_proj = nn.Linear(d, d)
                self.k_proj = nn.Linear(d, d)
                self.v_proj = nn.Linear(d, d)


        class FlashAttention(Attention):
            def forward(self, h):
                return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        """)
    _, matches = rewrite_source(src, rules=["fused_qkv"])
    assert [(m.cls, m.method) for m in matches] == [("FlashAttention", "forward")]


ROPE = """\
import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)  # rotate q
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""


def test_rope_pair_rewrites_to_one_kernel_call():
    src, new, matches = rewrite(ROPE, rules=["rope"])
    assert [(m.rule, m.first_line, m.last_line, m.applied) for m in matches] == [("rope", 12, 13, True)]
    assert "    q_embed, k_embed = kiln_kernels.rope(q, k, cos, sin)  # rotate q\n" in new
    assert "k_embed = (k * cos)" not in new
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, requires_grad=True), torch.randn(2, 2, 6, 8, requires_grad=True)
    angles = torch.randn(2, 6, 8)
    cos, sin = angles.cos(), angles.sin()
    outs = {}
    for name, text in (("ref", src), ("new", new)):
        qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        a, b = load(text, name)["apply_rotary_pos_emb"](qq, kk, cos, sin)
        ((a * 1.5).sum() + (b * b).sum()).backward()
        outs[name] = (a, b, qq.grad, kk.grad)
    for got, ref in zip(outs["new"], outs["ref"]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("change", [
    ("k_embed = (k * cos) + (rotate_half(k) * sin)", "k_embed = (k * sin) + (rotate_half(k) * cos)"),   # swapped
    ("    k_embed = (k", "    print()\n    k_embed = (k"),                                             # not adjacent
])
def test_rope_without_a_matching_partner_is_reported(change):
    src = ROPE.replace(*change)
    _, new, matches = rewrite(src, rules=["rope"])
    assert new == src and matches and not any(m.applied for m in matches)


def test_config_default_decides_the_activation(tmp_path):
    """`ACT2FN[config.hidden_act]` with the configuration module beside the file: its default says
    whether a linear + activation is a GELU location at all."""
    pytest.importorskip("transformers")
    model = textwrap.dedent("""\
        from torch import nn
        from transformers.activations import ACT2FN
        from .configuration_toy import ToyConfig


        class MLP(nn.Module):
            def __init__(self, config: ToyConfig):
                super().__init__()
                self.fc = nn.Linear(8, 8)
                self.act = ACT2FN[config.hidden_act]

            def forward(self, x):
                return self.act(self.fc(x))
        """)
    (tmp_path / "modeling_toy.py").write_text(model)
    for default, expected in (("gelu_new", [("linear_gelu", True)]), ("silu", []), ("relu", [])):
        (tmp_path / "configuration_toy.py").write_text(
            f"class ToyConfig:\n    def __init__(self, hidden_act={default!r}, vocab_size=10):\n        pass\n")
        from kiln.adopt.configs import _config_fields
        _config_fields.cache_clear()
        _, matches = rewrite_source(model, filename=str(tmp_path / "modeling_toy.py"))
        assert [(m.rule, m.applied) for m in matches] == expected, default


INPLACE_AFTER = """\
import torch
from torch import nn


class Attention(nn.Module):
    def forward(self, q, k, v, extra, full):
        if full:
            scores = torch.matmul(q, k.transpose(-2, -1))
            probs = nn.functional.softmax(scores, dim=-1)
            out = torch.matmul(probs, v)
        else:
            out = v * 2
        out += extra
        return out
"""


def test_sdpa_is_not_written_where_the_output_is_changed_in_place():
    """`out += extra` after an if/else changes the tensor the attention branch made; SDPA's backward
    needs its own output unchanged, so the rewrite is refused (the matmul form tolerates it)."""
    src, new, matches = rewrite(INPLACE_AFTER, rules=["sdpa"])
    assert new == src
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", False)] and "in place" in matches[0].reason
    mod = load(src, "inplace")["Attention"]()
    q, k, v = (torch.randn(2, 3, 5, 4, requires_grad=True) for _ in range(3))
    mod(q, k, v, torch.randn(2, 3, 5, 4), True).sum().backward()      # the original trains fine
