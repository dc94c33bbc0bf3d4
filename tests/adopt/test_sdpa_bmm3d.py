"""sdpa on the BART family's attention (transformers 4.x: bart, mbart, marian, pegasus, blenderbot, plbart,
m2m_100, whisper, speech_to_text, informer ...): 3-D `bmm` products over (batch * heads), the query
scaled before the product, masks added through a 4-D view of the scores and viewed back, shape checks
that read the scores, a head mask and `output_attentions`, cross attention and a key/value cache
chosen by `if`/`elif`.  The snippet is written for these tests in that style.  Each variant is
rewritten and checked against the original eager module in fp32 on every path (outputs, returned
probabilities and cache, gradients of the inputs and of every parameter), or refused with the one
reason that blocks it."""
import functools
import itertools

import pytest
import torch

from tests.adopt.helpers import load, rewrite

SOURCE = '''\
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, embed_dim=16, num_heads=2, dropout=0.0, is_decoder=False):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None,
                layer_head_mask=None, output_attentions=False):
        is_cross_attention = key_value_states is not None
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if is_cross_attention and past_key_value is not None and past_key_value[0].shape[2] == key_value_states.shape[1]:
            key_states = past_key_value[0]
            value_states = past_key_value[1]
        elif is_cross_attention:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        elif past_key_value is not None:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        if self.is_decoder:
            past_key_value = (key_states, value_states)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.reshape(*proj_shape)
        value_states = value_states.reshape(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
{check}
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, tgt_len, src_len)}")
            attn_weights = attn_weights.view({there}) + attention_mask
{between}            attn_weights = attn_weights.view({back})

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)

        if layer_head_mask is not None:
            if layer_head_mask.size() != (self.num_heads,):
                raise ValueError(f"Head mask for a single layer should be of size {(self.num_heads,)}")
            attn_weights = layer_head_mask.view(1, -1, 1, 1) * attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if output_attentions:
            attn_weights_reshaped = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights_reshaped.view(bsz * self.num_heads, tgt_len, src_len)
        else:
            attn_weights_reshaped = None

        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)

        if attn_output.size() != (bsz * self.num_heads, tgt_len, self.head_dim):
            raise ValueError(f"`attn_output` should be of size {(bsz * self.num_heads, tgt_len, self.head_dim)}")
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), attn_weights_reshaped, past_key_value
'''
CHECK = '''\
        if attn_weights.size() != (bsz * self.num_heads, tgt_len, src_len):
            raise ValueError(f"Attention weights should be of size {(bsz * self.num_heads, tgt_len, src_len)}")
'''
THERE, BACK = "bsz, self.num_heads, tgt_len, src_len", "bsz * self.num_heads, tgt_len, src_len"
# OPT and XGLM: the masked scores clamped at the dtype's minimum before they are viewed back
CLAMP = '''\
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
'''


def source(check=CHECK, there=THERE, back=BACK, between=""):
    return SOURCE.replace("{check}", check).replace("{there}", there).replace("{back}", back) \
        .replace("{between}", between)


@functools.lru_cache(maxsize=None)
def rewritten(between=""):
    """(original, rewritten) of the family's attention; the rewrite must have happened."""
    src, new, matches = rewrite(source(between=between), rules=["sdpa"])
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", True)], matches
    assert "scaled_dot_product_attention(" in new
    return src, new


def test_the_family_is_rewritten_with_the_explicit_path_kept():
    src, new, matches = rewrite(source(), rules=["sdpa"])
    assert [(m.rule, m.applied, m.reason) for m in matches] == [("sdpa", True, None)]
    explicit, fast = new.split("        else:\n            if attention_mask is not None:")
    assert "        if layer_head_mask is not None or output_attentions:  # kiln adopt" in explicit
    # the explicit branch is the original statements from the scores to the product with v
    assert explicit.count("torch.bmm(") == 2 and "Attention weights should be of size" in explicit
    # the fast path: q, k, v split as the scores were viewed, the mask as it is, q already scaled,
    # dropout only in training; the mask's check kept, the check of the scores goes with the scores
    assert ("attn_output = nn.functional.scaled_dot_product_attention(query_states.unflatten(0, (bsz, self.num_heads)), "
            "key_states.unflatten(0, (bsz, self.num_heads)), value_states.unflatten(0, (bsz, self.num_heads)), "
            "attn_mask=attention_mask, dropout_p=self.dropout if self.training else 0.0, scale=1.0).flatten(0, 1)\n"
            ) in fast
    assert "Attention mask should be of size" in fast and "Attention weights should be of size" not in fast
    assert "            attn_weights_reshaped = None\n" in fast and "softmax" not in fast
    # the cache, the cross-attention branches and the output's own check are untouched
    head, tail = src.split("        src_len = key_states.size(1)\n")
    assert new.startswith(head) and new.endswith(tail.split("        attn_output = torch.bmm(attn_probs, value_states)\n")[1])


def _inputs(kind: str, mask: str, bsz=2, tgt=3, past=4, src=5, dim=16, heads=2):
    """(module kwargs, forward kwargs) for one way the family calls its attention."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(bsz, tgt, dim, generator=g)
    kwargs, keys, causal = {}, tgt, False
    if kind == "decoder_cached":              # self-attention with a cache of `past` earlier steps
        kwargs["past_key_value"] = tuple(torch.randn(bsz, heads, past, dim // heads, generator=g) for _ in range(2))
        keys, causal = past + tgt, True
    elif kind == "decoder":
        causal = True
    elif kind in ("cross", "cross_cached"):   # keys and values from the encoder's states
        kwargs["key_value_states"] = torch.randn(bsz, src, dim, generator=g)
        keys = src
        if kind == "cross_cached":            # ... computed by an earlier step
            kwargs["past_key_value"] = tuple(torch.randn(bsz, heads, src, dim // heads, generator=g) for _ in range(2))
    if mask != "none":
        low = float("-inf") if mask == "-inf" else torch.finfo(torch.float32).min
        m = torch.zeros(bsz, 1, tgt, keys)
        if causal:                            # query i sees the keys up to its own position
            m = m.masked_fill(torch.ones(tgt, keys, dtype=torch.bool).triu(keys - tgt + 1), low)
        else:                                 # padding: the last key of the second sequence
            m[1, :, :, -1] = low
        kwargs["attention_mask"] = m
    return {"is_decoder": kind != "encoder"}, x, kwargs


def _run(module, x, kwargs):
    """Outputs and the gradients of every input and parameter for a fixed output gradient."""
    x = x.clone().requires_grad_()
    leaves = [x]
    kw = dict(kwargs)
    if kw.get("key_value_states") is not None:
        kw["key_value_states"] = kw["key_value_states"].clone().requires_grad_()
        leaves.append(kw["key_value_states"])
    if kw.get("past_key_value") is not None:
        kw["past_key_value"] = tuple(t.clone().requires_grad_() for t in kw["past_key_value"])
        leaves += list(kw["past_key_value"])
    out, probs, cache = module(x, **kw)
    g = torch.Generator().manual_seed(2)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    if probs is not None:
        loss = loss + (probs * torch.randn(probs.shape, generator=g)).sum()
    loss.backward()
    grads = [t.grad for t in leaves] + [p.grad for p in module.parameters()]
    return out, probs, cache, grads


KINDS = ["encoder", "decoder", "decoder_cached", "cross", "cross_cached"]


@pytest.mark.parametrize("kind, mask, head_mask, output_attentions",
                         [(k, m, h, o) for k in KINDS for m in ("none", "min", "-inf")
                          for h, o in itertools.product([False, True], [False, True])
                          if m != "none" or k != "decoder"])
def test_every_path_computes_the_original(kind, mask, head_mask, output_attentions):
    src, new = rewritten()
    ctor, x, kwargs = _inputs(kind, mask)
    kwargs.update(layer_head_mask=torch.rand(2) if head_mask else None, output_attentions=output_attentions)
    torch.manual_seed(0)
    ref = load(src, "o")["Attention"](**ctor).train()       # train mode, dropout 0: the kernels' own draws agree
    rew = load(new, "n")["Attention"](**ctor).train()
    rew.load_state_dict(ref.state_dict())
    (oa, pa, ca, ga), (ob, pb, cb, gb) = _run(ref, x, kwargs), _run(rew, x, kwargs)
    torch.testing.assert_close(ob, oa, atol=1e-6, rtol=1e-5)
    assert (pa is None) == (pb is None) == (not output_attentions)
    if pa is not None:
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5)
    assert (ca is None) == (cb is None) == (kind == "encoder")
    for a, b in zip(ca or (), cb or ()):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert len(ga) == len(gb)
    for i, (a, b) in enumerate(zip(ga, gb)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=f"gradient {i}")


def test_dropout_is_off_in_eval_mode():
    src, new = rewritten()
    ctor, x, kwargs = _inputs("decoder", "min")
    torch.manual_seed(0)
    ref = load(src, "o")["Attention"](dropout=0.5, **ctor).eval()
    rew = load(new, "n")["Attention"](dropout=0.5, **ctor).eval()
    rew.load_state_dict(ref.state_dict())
    torch.testing.assert_close(rew(x, **kwargs)[0], ref(x, **kwargs)[0], atol=1e-6, rtol=1e-5)


def test_a_wrong_mask_still_raises_the_original_error():
    _, new = rewritten()
    rew = load(new, "n")["Attention"]()
    with pytest.raises(ValueError, match="Attention mask should be of size"):
        rew(torch.randn(2, 3, 16), attention_mask=torch.zeros(2, 1, 1, 3))


@pytest.mark.parametrize("variant, reason", [
    # nothing shows that the scores have the sizes the view back names
    (dict(check=""), "the scores are viewed as `attn_weights.view(bsz, self.num_heads, tgt_len, src_len)` to add a "
                     "mask, and no check before it shows that they have the sizes of "
                     "`attn_weights.view(bsz * self.num_heads, tgt_len, src_len)`"),
    # heads and time swapped: the view does not only split the first dimension
    (dict(there="bsz, tgt_len, self.num_heads, src_len"),
     "the scores are reshaped (`attn_weights.view(bsz, tgt_len, self.num_heads, src_len)`, then "
     "`attn_weights.view(bsz * self.num_heads, tgt_len, src_len)`) in a way other than splitting their first "
     "dimension and merging it back"),
    # viewed back to other sizes than the scores had
    (dict(back="bsz * self.num_heads, src_len, tgt_len"),
     "the scores are reshaped (`attn_weights.view(bsz, self.num_heads, tgt_len, src_len)`, then "
     "`attn_weights.view(bsz * self.num_heads, src_len, tgt_len)`) in a way other than splitting their first "
     "dimension and merging it back"),
])
def test_round_trips_that_are_not_exact_are_refused(variant, reason):
    src, new, matches = rewrite(source(**variant), rules=["sdpa"])
    assert new == src
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", False)]
    back = next(i for i, line in enumerate(src.splitlines(), 1) if "attn_weights = attn_weights.view(" in line and "+" not in line)
    assert matches[0].reason == f"{reason} (line {back})"   # the one reason, at the view back


@pytest.mark.parametrize("mask", ["none", "min", "-inf"])
def test_a_clamp_under_the_masks_test_keeps_the_explicit_path_there(mask):
    # OPT, XGLM: a clamp at the dtype's minimum is not an additive mask (a row of -inf becomes uniform);
    # it is under `if attention_mask is not None:`, so SDPA runs only without a mask
    src, new = rewritten(CLAMP)
    assert "if attention_mask is not None or layer_head_mask is not None or output_attentions:  # kiln" in new
    assert "attn_mask" not in new
    ctor, x, kwargs = _inputs("decoder_cached", mask)
    torch.manual_seed(0)
    ref, rew = load(src, "o")["Attention"](**ctor), load(new, "n")["Attention"](**ctor)
    rew.load_state_dict(ref.state_dict())
    (oa, _, _, ga), (ob, _, _, gb) = _run(ref, x, kwargs), _run(rew, x, kwargs)
    torch.testing.assert_close(ob, oa, atol=1e-6, rtol=1e-5)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
