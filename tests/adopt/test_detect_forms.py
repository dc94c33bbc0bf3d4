"""Forms of the rules' patterns that the labelled development set lacked before part 6
(tests/data/adopt-labels/part6.json: ESM, DeBERTa-v2, Graphormer, FSMT, ProphetNet, MPNet, Funnel,
CTRL of transformers 4.35.2): activations looked up where they are called or imported by name,
modules built through helpers, projections of a value chosen on some path, a half rotation by
`chunk`, and fairseq-style attention.  Each snippet is written for the test in the style of those
files; the reference is the labelled expectation and, for rewrites, eager PyTorch."""
import pytest

from tests.adopt.helpers import assert_same_numerics, rewrite

POOLER = """\
from torch import nn
from transformers.activations import ACT2FN, gelu


class Config:
    hidden_size = 8
    pooler_hidden_act = "gelu"


class Pooler(nn.Module):
    def __init__(self, config=Config()):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.config = config

    def forward(self, hidden_states):
        pooled = self.dense(hidden_states)
        pooled = ACT2FN[self.config.pooler_hidden_act](pooled)
        return pooled


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 8)

    def forward(self, features):
        x = self.dense(features)
        x = gelu(x)
        return x
"""


@pytest.mark.parametrize("cls, call", [
    ("Pooler", "kiln_kernels.linear_act(hidden_states, self.dense, ACT2FN[self.config.pooler_hidden_act])"),
    ("Head", "kiln_kernels.linear_act(features, self.dense, gelu)"),
])
def test_linear_gelu_with_the_activation_looked_up_in_place_or_imported(cls, call):
    """`ACT2FN[self.config.pooler_hidden_act](h)` (DeBERTa's ContextPooler, Funnel) and transformers'
    `gelu` imported by name (MPNet's LM head): GELUs, checked again on every call by linear_act."""
    pytest.importorskip("transformers")
    src, new, matches = rewrite(POOLER, rules=["linear_gelu"])
    assert [(m.cls, m.applied) for m in matches] == [("Pooler", True), ("Head", True)]
    assert call in new
    assert_same_numerics(src, new, cls)


BUILT = """\
import torch
from torch import nn


def quant_noise(module, p, block_size):
    if p <= 0:
        return module
    module.register_forward_pre_hook(lambda mod, inputs: None)
    return module


class Layer(nn.Module):
    def __init__(self, d=8, kdim=None, q_noise=0.0):
        super().__init__()
        kdim = kdim if kdim is not None else d
        self.q_proj = quant_noise(nn.Linear(d, d), q_noise, 8)
        self.k_proj = quant_noise(nn.Linear(kdim, d), q_noise, 8)
        self.v_proj = quant_noise(nn.Linear(kdim, d), q_noise, 8)
        self.fc1 = self.build_fc(d, 12, q_noise)
        self.fc2 = nn.Linear(12, d)
        self.act = nn.GELU()

    def build_fc(self, input_dim, output_dim, q_noise):
        return quant_noise(nn.Linear(input_dim, output_dim), q_noise, 8)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = q + k + v
        return self.fc2(self.act(self.fc1(h)))
"""


def test_modules_built_through_a_helper_are_their_constructor():
    """Graphormer: `quant_noise(nn.Linear(...), ...)` returns the Linear it is given, `self.build_fc(...)`
    returns one: both are nn.Linear attributes (fused_qkv, linear_gelu). The in_features are spelled
    differently (`d`, `kdim`) but all three read `x`, which makes them equal."""
    src, new, matches = rewrite(BUILT, rules=["fused_qkv", "linear_gelu"])
    assert sorted((m.rule, m.applied) for m in matches) == [("fused_qkv", False), ("linear_gelu", True)]
    assert "self.fc2(kiln_kernels.linear_act(h, self.fc1, self.act))" in new
    assert_same_numerics(src, new, "Layer")


def test_a_helper_that_returns_something_else_is_not_looked_through():
    src = BUILT.replace("    return module\n\n\nclass", "    return nn.Sequential(module)\n\n\nclass")
    _, _, matches = rewrite(src, rules=["fused_qkv", "linear_gelu"])
    assert matches == []


QKV = """\
from torch import nn


class Attention(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.query_proj = nn.Linear(d, d)
        self.key_proj = nn.Linear(d, d)
        self.value_proj = nn.Linear(d, d)

    def forward(self, hidden_states, query_states=None, key_value_states=None):
{body}
        return self.query_proj(query_states), self.key_proj(kv), self.value_proj(kv)
"""


@pytest.mark.parametrize("body, found", [
    # DeBERTa-v2: the query input defaults to hidden_states
    ("        if query_states is None:\n            query_states = hidden_states\n        kv = hidden_states", True),
    # BioGPT (5.x): key/value input chosen by a conditional expression
    ("        query_states = hidden_states\n        kv = key_value_states if key_value_states is not None "
     "else hidden_states", True),
    # always three different inputs: not a location
    ("        kv = key_value_states", False),
])
def test_fused_qkv_on_some_path(body, found):
    _, _, matches = rewrite(QKV.format(body=body), rules=["fused_qkv"])
    assert [(m.rule, m.applied) for m in matches] == ([("fused_qkv", False)] if found else [])


def test_fused_qkv_paths_must_hold_together():
    """DETR: `hidden_states_original` is bound only when position embeddings are added, and then q
    and k read the sum: no run applies all three to one value (the path where q reads the original
    leaves v's input unbound)."""
    src = QKV.format(body="        if key_value_states is not None:\n"
                          "            original = hidden_states\n"
                          "            hidden_states = hidden_states + key_value_states\n"
                          "        query_states = kv = hidden_states").replace("self.value_proj(kv)", "self.value_proj(original)")
    _, _, matches = rewrite(src, rules=["fused_qkv"])
    assert matches == []


ESM_ROPE = """\
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos, sin):
    cos = cos[:, :, : x.shape[-2], :]
    sin = sin[:, :, : x.shape[-2], :]
    return (x * cos) + (rotate_half(x) * sin)
"""


@pytest.mark.parametrize("change, found", [
    (None, True),
    (("x1, x2 = x.chunk(2, dim=-1)", "x2, x1 = x.chunk(2, dim=-1)"), False),   # (x1, -x2): the other way round
    (("x.chunk(2, dim=-1)", "x.chunk(2, dim=1)"), False),                       # not the last dim
])
def test_rope_with_the_halves_from_chunk(change, found):
    """ESM's rotate_half splits with `chunk(2, dim=-1)`; one tensor per call, so it is reported."""
    src = ESM_ROPE.replace(*change) if change else ESM_ROPE
    _, new, matches = rewrite(src, rules=["rope"])
    assert new == src
    assert [(m.method, m.applied) for m in matches] == ([("apply_rotary_pos_emb", False)] if found else [])


FAIRSEQ_ATTENTION = """\
import torch
from torch import nn


class MultiheadAttention(nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.dropout = nn.Dropout(0.0)

    def forward(self, query, need_weights=False, need_head_weights=False):
        tgt_len, bsz, d = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(query)
        v = self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = self.apply_sparse_mask(attn_weights, tgt_len, bsz)
        attn_weights_float = torch.nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = self.dropout(attn_weights_float.type_as(attn_weights))
        attn = torch.bmm(attn_probs, v)
        attn_weights = None
        if need_weights:
            attn_weights = attn_weights_float.view(bsz, self.heads, tgt_len, tgt_len).transpose(1, 0)
            if not need_head_weights:
                attn_weights = attn_weights.mean(dim=0)
        return attn, attn_weights

    def apply_sparse_mask(self, attn_weights, tgt_len, bsz):
        return attn_weights
"""


@pytest.mark.parametrize("change, found", [
    (None, True),
    # the hook changes the scores: what it does is not known to be a mask
    (("        return attn_weights\n", "        return attn_weights.tanh()\n"), False),
    # the head-averaged weights feed another product: not only returned
    (("        return attn, attn_weights\n", "        return attn @ attn_weights\n"), False),
])
def test_fairseq_attention_hook_and_head_averaged_weights(change, found):
    """Graphormer (fairseq): the scores pass through `self.apply_sparse_mask`, a method returning them
    unchanged (a subclass may override it: reported), and the probabilities are returned viewed,
    transposed and averaged over the heads under `need_weights`."""
    src = FAIRSEQ_ATTENTION.replace(*change) if change else FAIRSEQ_ATTENTION
    _, new, matches = rewrite(src, rules=["sdpa"])
    assert new == src
    assert [(m.method, m.applied) for m in matches] == ([("forward", False)] if found else [])
    if found:
        assert "apply_sparse_mask" in matches[0].reason
