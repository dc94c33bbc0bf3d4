"""sdpa on GPT-2-style attention (transformers 4.x gpt2, imagegpt, decision_transformer, bark): a helper
method `_attn` scales the scores under config `if`s, masks them with `torch.finfo(dtype).min` (not -inf)
under `if not self.is_cross_attention:`, adds an optional padding mask, and returns its probabilities on
every call; the caller reads them only under `if output_attentions:` (attention_lift.py,
attention_probs.py).  The snippet is written for these tests in that style.  Each variant is rewritten
and checked against the original eager module in fp32 (outputs, returned probabilities and cache,
gradients of the inputs and of every parameter), with a count of the scaled_dot_product_attention calls
to show which path ran; the refusals give their one reason."""
import pytest
import torch

from tests.adopt.helpers import load, rewrite

SOURCE = '''\
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d=16, heads=2, cross=False, layer_idx=0, by_layer=False, p=0.0, max_len=32):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.is_cross_attention = cross
        self.is_causal = not cross
        self.scale_attn_weights = True
        self.scale_attn_by_inverse_layer_idx = by_layer
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(d, 3 * d)
        self.q_proj = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(p)
        lower = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("bias", lower.view(1, 1, max_len, max_len), persistent=False)

    def _heads(self, x):
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).permute(0, 2, 1, 3)

    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        scores = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            scores = scores / torch.full([], value.size(-1) ** 0.5, dtype=scores.dtype, device=scores.device)
        # per-layer scaling
        if self.scale_attn_by_inverse_layer_idx:
            scores = scores / float(self.layer_idx + 1)
        if not self.is_cross_attention:
            q_len, k_len = query.size(-2), key.size(-2)
            causal = self.bias[:, :, k_len - q_len : k_len, :k_len]
            {mask}
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        probs = probs.type(value.dtype)
        probs = self.attn_dropout(probs)
        if head_mask is not None:
            probs = probs * head_mask
        context = torch.matmul(probs, value)
        return context, probs

    def forward(self, x, past=None, attention_mask=None, head_mask=None, encoder_states=None,
                output_attentions=False):
        if self.is_cross_attention:
            query = self._heads(self.q_proj(x))
            key, value = self.kv(encoder_states).split(x.size(-1), dim=2)
        else:
            query, key, value = self.qkv(x).split(x.size(-1), dim=2)
            query = self._heads(query)
        key = self._heads(key)
        value = self._heads(value)
        if past is not None:
            key = torch.cat((past[0], key), dim=-2)
            value = torch.cat((past[1], value), dim=-2)
        context, probs = self._attn(query, key, value, attention_mask, head_mask)
        context = context.permute(0, 2, 1, 3).reshape(x.size(0), x.size(1), -1)
        {tail}
'''
# GPT-2: torch.where with a 0-d tensor holding finfo.min
WHERE = ('''lowest = torch.finfo(scores.dtype).min
            lowest = torch.full([], lowest, dtype=scores.dtype).to(scores.device)
            scores = torch.where(causal, scores.to(scores.dtype), lowest)''')
# Bark: masked_fill where the causal mask is False, with finfo.min as a Python float
FILL = "scores = scores.masked_fill(causal == 0, torch.finfo(scores.dtype).min)"
TAIL = '''outputs = (self.out(context), (key, value))
        if output_attentions:
            outputs += (probs,)
        return outputs'''


def source(mask=WHERE, tail=TAIL):
    return SOURCE.replace("{mask}", mask).replace("{tail}", tail)


def padding(batch, keys, padded):
    """GPT-2's additive mask: 0 where a key takes part, finfo.min where it is padding."""
    keep = torch.ones(batch, keys)
    for b, positions in padded.items():
        keep[b, positions] = 0.0
    return ((1.0 - keep) * torch.finfo(torch.float32).min)[:, None, None, :]


def test_rewritten_with_a_parameter_saying_when_the_probabilities_are_needed():
    src, new, matches = rewrite(source(), rules=["sdpa"])
    assert [(m.rule, m.method, m.applied) for m in matches] == [("sdpa", "_attn", True)]
    assert "    def _attn(self, query, key, value, attention_mask=None, head_mask=None, need_weights=True):\n" in new
    assert ("        if head_mask is not None or need_weights:  # kiln adopt: the attention as written, "
            "where it is still needed\n") in new
    assert "self._attn(query, key, value, attention_mask, head_mask, need_weights=output_attentions)" in new
    assert "                attn_mask = torch.where(causal, 0.0, lowest)\n" in new
    assert "                lowest = torch.finfo(query.dtype).min\n" in new          # the scores' dtype is q's
    assert "            attn_scale = attn_scale / (value.size(-1) ** 0.5)\n" in new
    assert "            probs = None\n" in new
    assert "        # per-layer scaling\n" in new


# Rows of the output whose every visible key is padding: the forward pass agrees on them too (uniform
# over the same entries), but the fused kernels' backward recomputes the probabilities from a log-sum-exp
# that rounds away next to finfo.min (as for any additive finfo.min mask), so the loss leaves them out,
# as a loss on padded positions does.
DEAD = {"padding": [(1, 0), (1, 1)] + [(2, i) for i in range(5)]}
CASES = {
    # name: (constructor kwargs, forward inputs, scaled_dot_product_attention calls expected)
    "causal": ({}, {}, 1),
    "padding": ({}, {"attention_mask": padding(3, 5, {0: [3, 4], 1: [0, 1], 2: [0, 1, 2, 3, 4]})}, 1),
    "cross": ({"cross": True}, {"encoder_states": 7, "attention_mask": padding(3, 7, {1: [5, 6]})}, 1),
    "output_attentions": ({}, {"attention_mask": padding(3, 5, {1: [0, 1]}), "output_attentions": True}, 0),
    "head_mask": ({}, {"head_mask": torch.rand(1, 2, 1, 1)}, 0),
    "cache": ({}, {"past": 3, "attention_mask": padding(3, 8, {0: [0, 1, 2]})}, 1),
    "by_layer": ({"by_layer": True, "layer_idx": 2}, {"attention_mask": padding(3, 5, {2: [1]})}, 1),
    "dropout_eval": ({"p": 0.3}, {"attention_mask": padding(3, 5, {0: [4]})}, 1),
}


def _run(src, new, init, inputs, calls, monkeypatch, dead=()):
    torch.manual_seed(0)
    ref = load(src, "o")["Attention"](**init)
    rew = load(new, "n")["Attention"](**init)
    rew.load_state_dict(ref.state_dict())
    ref.eval()
    rew.eval()
    count = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: count.append(1) or sdpa(*a, **k))
    x = torch.randn(3, 5, 16)
    kwargs = dict(inputs)
    leaves = {"x": x}
    if isinstance(kwargs.get("encoder_states"), int):
        leaves["encoder_states"] = torch.randn(3, kwargs.pop("encoder_states"), 16)
    if isinstance(kwargs.get("past"), int):
        n = kwargs.pop("past")
        leaves["past_k"], leaves["past_v"] = torch.randn(3, 2, n, 8), torch.randn(3, 2, n, 8)
    outs, grads = [], []
    for model in (ref, rew):
        model.zero_grad()
        args = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        extra = {"past": (args["past_k"], args["past_v"])} if "past_k" in args else {}
        if "encoder_states" in args:
            extra["encoder_states"] = args["encoder_states"]
        y = model(args["x"], **kwargs, **extra)
        flat = [y[0], *y[1], *y[2:]]
        weight = torch.ones(3, 5, 1)
        for b, i in dead:
            weight[b, i] = 0.0
        (sum(t.sum() * (i + 1) for i, t in enumerate(flat[1:])) + (flat[0] * weight).sum()).backward()
        outs.append(flat)
        grads.append([args[k].grad for k in sorted(args)] + [p.grad for p in model.parameters()])
    assert len(count) == calls
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", [WHERE, FILL], ids=["where", "masked_fill"])
@pytest.mark.parametrize("case", list(CASES))
def test_both_paths_compute_the_original(case, mask, monkeypatch):
    src, new, matches = rewrite(source(mask), rules=["sdpa"])
    assert [m.applied for m in matches] == [True]
    init, inputs, calls = CASES[case]
    _run(src, new, init, inputs, calls, monkeypatch, DEAD.get(case, ()))


def test_dropout_in_training_takes_scaled_dot_product_attentions_dropout():
    src, new, _ = rewrite(source(), rules=["sdpa"])
    assert "dropout_p=self.attn_dropout.p if self.attn_dropout.training else 0.0" in new
    model = load(new, "n")["Attention"](p=0.5)
    model.train()
    torch.manual_seed(1)
    y = model(torch.randn(2, 5, 16))[0]
    model.eval()
    assert not torch.allclose(y, model(torch.randn(2, 5, 16))[0])


@pytest.mark.parametrize("mask, tail, reason", [
    # the caller hands the probabilities on without a test: nothing can tell when they are not needed
    (WHERE, "return self.out(context), probs",
     "the attention probabilities are returned on every call (line 46), and no call of `self._attn(...)` in "
     "Attention reads them only under a test"),
    # a finite fill that is not the lowest value of the scores' dtype: rows with every key masked differ
    ("scores = torch.where(causal, scores, -10000.0)", TAIL,
     "the scores are masked with `-10000.0` rather than -inf: a boolean attention mask would differ in rows "
     "where every key is masked (line 35)"),
    ("scores = scores.masked_fill(causal == 0, torch.finfo(torch.float16).min)", TAIL,
     "the scores are masked with `torch.finfo(torch.float16).min` rather than -inf: a boolean attention mask "
     "would differ in rows where every key is masked (line 35)"),
])
def test_refused_with_the_reason(mask, tail, reason):
    src, new, matches = rewrite(source(mask, tail), rules=["sdpa"])
    assert new == src
    assert [(m.method, m.applied, m.reason) for m in matches] == [("_attn", False, reason)]


def test_refused_when_a_subclass_in_the_file_overrides_the_helper():
    sub = source() + '''

class Logged(Attention):
    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        return super()._attn(query, key, value, attention_mask, head_mask)
'''
    src, new, matches = rewrite(sub, rules=["sdpa"])
    assert new == src
    assert [m.reason for m in matches if m.method == "_attn" and m.cls == "Attention"] == [
        "the attention probabilities are returned on every call (line 46), and Logged in this file overrides "
        "`_attn`: a parameter saying when they are needed would reach that override"]


def test_scale_after_a_mask_is_refused():
    src = source().replace('''        if attention_mask is not None:
            scores = scores + attention_mask
''', '''        if attention_mask is not None:
            scores = scores + attention_mask
        scores = scores * 0.5
''')
    src, new, matches = rewrite(src, rules=["sdpa"])
    assert new == src
    assert [m.reason for m in matches] == [
        "the scores are scaled at line 40, after a mask is applied: the mask would have to be scaled too"]


def test_q_and_k_upcast_alone_is_refused():
    """GPT-Neo / GPT-J: q and k cast to float32 for the scores, v not: SDPA takes one dtype."""
    src = source().replace('''        scores = torch.matmul(query, key.transpose(-1, -2))
''', '''        query = query.to(torch.float32)
        key = key.to(torch.float32)
        scores = torch.matmul(query, key.transpose(-1, -2))
''')
    src, new, matches = rewrite(src, rules=["sdpa"])
    assert new == src
    assert [m.reason for m in matches] == [
        "q, k and v are not cast alike before the attention (q and k to float32, say): scaled_dot_product_attention "
        "takes them in one dtype"]
