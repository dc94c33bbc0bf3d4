"""sdpa: hand-written attention -> F.scaled_dot_product_attention; forms, refusals, numerics."""
import re

import pytest
import torch

from tests.adopt.helpers import assert_same_training, load, rewrite

MODULE = """\
import math
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.heads, self.head_dim).transpose(1, 2)
{body}
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)
"""

FORMS = {
    "div_sqrt_and_mask": """\
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = F.softmax(att + mask, dim=-1)
        y = att @ v""",
    "scale_attr": """\
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        y = torch.matmul(scores.softmax(dim=-1), v)""",
    "scale_on_q": """\
        q = q * self.scale
        att = torch.softmax(q @ k.transpose(-2, -1) + mask, dim=-1)
        y = att @ v""",
    "no_scale": """\
        y = torch.softmax(q @ k.transpose(-2, -1), -1) @ v""",
    "dropout_module": """\
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att + mask, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v""",
    "dropout_functional": """\
        w = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        w = nn.functional.softmax(w, dim=-1)
        w = nn.functional.dropout(w, p=0.1, training=self.training)
        y = torch.matmul(w, v)""",
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_rewrite_and_match_numerics(form):
    src, new, matches = rewrite(MODULE.format(body=FORMS[form]))
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)]
    assert "F.scaled_dot_product_attention(q, k, v" in new
    ref_cls, new_cls = load(src, "o")["Attention"], load(new, "n")["Attention"]
    torch.manual_seed(0)
    ref = ref_cls().eval()           # eval: dropout off, so the reference is deterministic
    rew = new_cls().eval()
    rew.load_state_dict(ref.state_dict())
    assert_same_training(ref, rew, torch.randn(2, 5, 16), torch.randn(5, 5), atol=1e-5, rtol=1e-5)


def test_dropout_text_and_training_mode_runs():
    _, new, _ = rewrite(MODULE.format(body=FORMS["dropout_module"]))
    assert ("        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.attn_dropout.p "
            "if self.attn_dropout.training else 0.0, scale=1.0 / math.sqrt(k.size(-1)))\n") in new
    model = load(new, "n")["Attention"]().train()
    out = model(torch.randn(2, 5, 16), torch.zeros(5, 5))
    assert out.shape == (2, 5, 16) and torch.isfinite(out).all()


def test_expected_text():
    _, new, _ = rewrite(MODULE.format(body=FORMS["div_sqrt_and_mask"]))
    assert "        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=k.size(-1) ** -0.5)\n" in new
    assert "att =" not in new


@pytest.mark.parametrize("body", [
    # probabilities also returned / used elsewhere: not folded, so not rewritten
    "        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)\n        y = att @ v\n        self.last = att",
    # softmax over another dim
    "        y = torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v",
    # an elementwise product with the values is not attention
    "        y = torch.softmax(q @ k.transpose(-2, -1), dim=-1) * v",
    # no transpose: not attention
    "        y = torch.softmax(q @ k, dim=-1) @ v",
])
def test_must_not_match(body):
    src = MODULE.format(body=body)
    _, new, matches = rewrite(src, rules=["sdpa"])
    assert [m for m in matches if m.applied] == [] and new == src


# -- transformers' shape: the mask added under `if attention_mask is not None:` ------------------

HF = """\
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, attention_mask=None):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if attention_mask is not None:
            # slice the mask to the keys
            causal_mask = attention_mask[:, :, :, : k.shape[-2]]
            attn_weights = attn_weights + causal_mask
{probs}
        attn_output = torch.matmul(attn_weights, v)
        return attn_output.transpose(1, 2).reshape(B, T, C)
"""

HF_PROBS = {
    "float32_softmax_cast_back": """\
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_weights = self.dropout(attn_weights)""",
    "softmax_module": """\
        attn_weights = self.softmax(attn_weights)
        attn_weights = nn.functional.dropout(attn_weights, p=0.1, training=self.training)""",
}


def _same_attention(src, new, masks, dtype=torch.float32, tol=1e-5):
    ref_cls, new_cls = load(src, "o")["Attention"], load(new, "n")["Attention"]
    torch.manual_seed(0)
    ref, rew = ref_cls().eval().to(dtype), new_cls().eval().to(dtype)
    rew.load_state_dict(ref.state_dict())
    for mask in masks:
        x = torch.randn(2, 5, 16, dtype=dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa, mask), rew(xb, mask)
        torch.testing.assert_close(yb, ya, atol=tol, rtol=tol)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(xb.grad, xa.grad, atol=tol, rtol=tol)
        for pa, pb in zip(ref.parameters(), rew.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, atol=tol, rtol=tol)
            pa.grad = pb.grad = None


@pytest.mark.parametrize("probs", sorted(HF_PROBS))
def test_mask_under_if_is_right_on_both_paths(probs):
    src, new, matches = rewrite(HF.format(probs=HF_PROBS[probs]), rules=["sdpa"])
    assert [(m.rule, m.applied, m.first_line, m.last_line) for m in matches] == [("sdpa", True, 21, 28)]
    assert ("        attn_output = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask"
            "[:, :, :, : k.shape[-2]] if attention_mask is not None else None, dropout_p=") in new
    assert "if attention_mask" not in new.split("attn_mask=")[0]          # the `if` went with the match
    assert "        # slice the mask to the keys\n" in new                 # its comment stayed
    mask = torch.randn(2, 1, 5, 7)          # wider than the keys: the slice matters
    _same_attention(src, new, [None, mask])


def test_float32_softmax_cast_back_in_bfloat16():
    src, new, _ = rewrite(HF.format(probs=HF_PROBS["float32_softmax_cast_back"]))
    _same_attention(src, new, [None, torch.randn(2, 1, 5, 5, dtype=torch.bfloat16)], dtype=torch.bfloat16,
                    tol=3e-2)


def test_dropout_probability_honours_training():
    _, new, _ = rewrite(HF.format(probs=HF_PROBS["softmax_module"]))
    assert "dropout_p=0.1 if self.training else 0.0, scale=self.scaling)" in new
    _, new, _ = rewrite(HF.format(probs=HF_PROBS["float32_softmax_cast_back"]))
    assert "dropout_p=self.dropout.p if self.dropout.training else 0.0" in new
    model = load(new, "n")["Attention"]()
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    model.train()
    a, b = model(x), model(x)
    assert not torch.equal(a, b)             # dropout on in training
    model.eval()
    assert torch.equal(model(x), model(x))


EAGER = """\
import torch
from torch import nn


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    attn_weights = torch.matmul(query, key.transpose({dims})) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    {ret}
"""


def test_returned_probabilities_are_reported_not_rewritten():
    src = EAGER.format(dims="-2, -1", ret="return attn_output, attn_weights")
    _, new, matches = rewrite(src)
    assert new == src
    assert [(m.rule, m.applied, m.first_line, m.last_line) for m in matches] == [("sdpa", False, 6, 11)]
    assert matches[0].reason == "the attention probabilities `attn_weights` are also returned (line 12)"


def test_not_returned_rewrites_with_mask_passed_through():
    src, new, matches = rewrite(EAGER.format(dims="-2, -1", ret="return attn_output"))
    assert [m.applied for m in matches] == [True]
    assert ("    attn_output = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, "
            "dropout_p=dropout if module.training else 0.0, scale=scaling)\n") in new
    ref, rew = load(src, "o")["eager_attention_forward"], load(new, "n")["eager_attention_forward"]
    module = torch.nn.Module().eval()
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    for mask in (None, torch.randn(2, 1, 5, 5)):
        ya, yb = ref(module, q, k, v, mask, 0.3), rew(module, q, k, v, mask, 0.3)
        torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
        ga = torch.autograd.grad(ya.sum(), (q, k, v))
        gb = torch.autograd.grad(yb.sum(), (q, k, v))
        for a, b in zip(ga, gb):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_transpose_2_3_is_refused_with_a_reason():
    src = EAGER.format(dims="2, 3", ret="return attn_output")
    _, new, matches = rewrite(src)
    assert new == src
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", False)]
    assert "4-D" in matches[0].reason


def test_head_mask_keeps_the_explicit_path():
    src = """\
    import math
    import torch


    def attend(query, key, value, attention_mask, head_mask):
        scores = query @ key.transpose(-1, -2) / math.sqrt(query.size(-1))
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, -1)
        if head_mask is not None:
            probs = probs * head_mask
        return torch.matmul(probs, value)
    """
    src, new, matches = rewrite(src)
    assert new == src
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", False)] and "head mask" in matches[0].reason


def test_an_if_that_does_more_keeps_the_explicit_path():
    # the `if` also does something else with the scores: explicit when it is entered, SDPA otherwise
    body = """\
        attn_weights = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            self.seen = attn_weights
        y = torch.softmax(attn_weights, dim=-1) @ v"""
    src = MODULE.format(body=body).replace("def forward(self, x, mask)", "def forward(self, x, attention_mask)")
    src, new, matches = rewrite(src, rules=["sdpa"])
    assert [m.applied for m in matches] == [True] and "        if attention_mask is not None:  # kiln adopt" in new
    assert "            y = F.scaled_dot_product_attention(q, k, v, scale=self.scale)\n" in new
    for mask in (None, torch.randn(5, 5)):
        torch.manual_seed(0)
        ref, rew = load(src, "o")["Attention"]().eval(), load(new, "n")["Attention"]().eval()
        rew.load_state_dict(ref.state_dict())
        assert_same_training(ref, rew, torch.randn(2, 5, 16), mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("body", [
    # the guarded mask and another bias together: `None + bias` would fail
    """\
        attn_weights = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        y = torch.softmax(attn_weights + self.bias, dim=-1) @ v""",
    # a float32 softmax that is never cast back: the result's dtype would change
    "        y = torch.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float32) @ v",
    # probabilities mixed across heads (talking heads): not attention to rewrite
    """\
        p = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        y = p @ v
        z = p.sum(1)""",
])
def test_must_not_rewrite_hf_shapes(body):
    src = MODULE.format(body=body).replace("def forward(self, x, mask)", "def forward(self, x, attention_mask)")
    _, new, matches = rewrite(src, rules=["sdpa"])
    assert [m for m in matches if m.applied] == [] and new == src


def test_if_with_other_work_is_not_folded():
    # the `if` is not folded into the mask; the explicit path is kept for when it is entered
    src = HF.format(probs="        attn_weights = self.softmax(attn_weights)").replace(
        "            attn_weights = attn_weights + causal_mask\n",
        "            attn_weights = attn_weights + causal_mask\n            unused = print(causal_mask)\n")
    _, new, matches = rewrite(src)
    assert [m.applied for m in matches if m.rule == "sdpa"] == [True]
    assert "        if attention_mask is not None:  # kiln adopt" in new


def test_probabilities_returned_through_a_variable_are_reported():
    src = EAGER.format(dims="-2, -1", ret="outputs = (attn_output, attn_weights) if module.output_attentions "
                                          "else (attn_output,)\n    return outputs")
    _, new, matches = rewrite(src)
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)]
    assert "    if module.output_attentions:  # kiln adopt" in new and "        attn_weights = None\n" in new


GUARDED = """\
import torch
from torch import nn


def attend(module, query, key, value, attention_mask, scaling, position_bias=None, extra=None):
    attn_weights = torch.matmul(query, key.transpose(-2, -1)) * scaling
    if position_bias is not None:
        attn_weights = attn_weights + position_bias
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
{third}    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    return torch.matmul(attn_weights, value)
"""


@pytest.mark.parametrize("bias, mask", [(False, False), (True, False), (False, True), (True, True)])
def test_two_guarded_additions_are_one_mask(bias, mask):
    src, new, matches = rewrite(GUARDED.replace("{third}", ""))
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)]
    # one of them when the other is None, else their sum (either order: a + b is b + a in floating point)
    assert re.search(r"attn_mask=(\w+) if (\w+) is None else \2 if \1 is None else (\1 \+ \2|\2 \+ \1),", new)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, requires_grad=True) for _ in range(3))
    args = (torch.randn(2, 1, 5, 5) if mask else None, 0.5, torch.randn(1, 3, 5, 5) if bias else None)
    ref, out = load(src, "o")["attend"](None, q, k, v, *args), load(new, "n")["attend"](None, q, k, v, *args)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(ref.sum(), (q, k, v)), torch.autograd.grad(out.sum(), (q, k, v))):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_three_guarded_additions_are_reported_not_rewritten():
    third = "    if extra is not None:\n        attn_weights = attn_weights + extra\n"
    src, new, matches = rewrite(GUARDED.replace("{third}", third))
    assert new == src
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", False)]
    assert "together with other masks" in matches[0].reason
