"""sdpa on attention written the ways single-file models write it (snippets written for these tests,
after the idioms of nanoGPT, minGPT, Meta's llama, mistral's reference, llama2.c, gemma, whisper,
timm and open_clip). Each is rewritten and checked against the original eager module (outputs and
gradients, fp32), or refused with the one reason that blocks it."""
import pytest
import torch

from tests.adopt.helpers import load, rewrite

HEAD = """\
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


def maybe_add_mask(scores, mask=None):
    return scores if mask is None else scores + mask


def softcap(x, cap):
    return torch.tanh(x / cap) * cap


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2, block=8):
        super().__init__()
        self.n_head, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_dropout = nn.Dropout(0.0)
        self.flash = False
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))
        self.register_buffer("causal", torch.tril(torch.ones(block, block, dtype=torch.bool)))
        self.cache_k = torch.zeros((2, block, heads, dim // heads))
        self.cache_v = torch.zeros((2, block, heads, dim // heads))

    def forward(self, x, mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
{body}
"""

SPLIT_HEADS = """\
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
"""
MERGE = "        return y.transpose(1, 2).contiguous().view(B, T, C)"

CASES = {
    # nanoGPT: the manual path under `else` of `if self.flash:`, causal buffer through masked_fill
    "nanogpt_flash_else": (SPLIT_HEADS + """\
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
""" + MERGE, "attn_mask=self.bias[:, :, :T, :T] != 0"),
    # minGPT-style single head on 3-D tensors, tril buffer, transpose(-2, -1) as .mT
    "mingpt_head": ("""\
        wei = q @ k.mT * C ** -0.5
        wei = wei.masked_fill(self.bias[0, 0, :T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        return self.attn_dropout(wei) @ v""", "attn_mask=self.bias[0, 0, :T, :T] != 0"),
    # Meta llama: KV cache written in place, transpose(2, 3) of a 4-D k (through repeat_kv),
    # float softmax cast back with type_as
    "llama_kv_cache": ("""\
        xq = q.view(B, T, self.n_head, self.head_dim)
        xk = k.view(B, T, self.n_head, self.head_dim)
        xv = v.view(B, T, self.n_head, self.head_dim)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:B, :T] = xk
        self.cache_v[:B, :T] = xv
        keys = self.cache_k[:B, :T]
        values = self.cache_v[:B, :T]
        keys = repeat_kv(keys, 1)
        values = repeat_kv(values, 1)
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        y = torch.matmul(scores, values)
""" + MERGE, "keys, values, attn_mask=mask"),
    # mistral's reference: `+=` of the mask under `if`, `.float()` on its own line
    "mistral_ref": (SPLIT_HEADS + """\
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if mask is not None:
            scores += mask[None, None, ...]
        scores = scores.float()
        scores = nn.functional.softmax(scores, dim=-1).type_as(q)
        y = torch.matmul(scores, v)
""" + MERGE, "attn_mask=mask[None, None, ...] if mask is not None else None"),
    # llama2.c: mask buffer added, float softmax, dropout module
    "llama2c": (SPLIT_HEADS + """\
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + torch.where(self.causal[:T, :T], 0.0, float("-inf"))
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        scores = self.attn_dropout(scores)
        y = torch.matmul(scores, v)
""" + MERGE, "attn_mask=torch.where(self.causal[:T, :T], 0.0, float(\"-inf\"))"),
    # timm: the mask through a helper, scale on q, bool `where` mask
    "timm_helper": (SPLIT_HEADS + """\
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = maybe_add_mask(attn, mask)
        attn = attn.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        y = attn @ v
""" + MERGE, "attn_mask=mask"),
    # open_clip: bmm on 3-D (batch * heads) tensors, in-place mask add, torch.where keep-mask
    # gemma: soft-capping only under `if`: the explicit path is kept under that test
    "gemma_softcap_if": (SPLIT_HEADS + """\
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if self.flash:
            scores = torch.tanh(scores / 30.0) * 30.0
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        y = torch.matmul(scores, v)
""" + MERGE, "        if self.flash:  # kiln adopt: the attention as written"),
    "openclip_bmm": ("""\
        q = q.reshape(B, T, self.n_head, -1).transpose(1, 2).reshape(B * self.n_head, T, -1)
        k = k.reshape(B, T, self.n_head, -1).transpose(1, 2).reshape(B * self.n_head, T, -1)
        v = v.reshape(B, T, self.n_head, -1).transpose(1, 2).reshape(B * self.n_head, T, -1)
        attn = torch.bmm(q * self.scale, k.transpose(1, 2))
        if mask is not None:
            attn += mask
        attn = torch.where(self.causal[:T, :T], attn, float("-inf"))
        attn = attn.softmax(dim=-1)
        y = torch.bmm(attn, v)
        return y.view(B, self.n_head, T, -1).transpose(1, 2).reshape(B, T, C)""", "torch.where(self.causal[:T, :T], "),
}

REFUSED = {
    # whisper: the raw scores are returned with the output
    "whisper_scores_returned": (SPLIT_HEADS + """\
        qk = (q * self.scale) @ k.transpose(-1, -2)
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        y = w @ v
        return y, qk.detach()""", "the attention scores `qk` are also returned (line 45)"),
    # k's rank unknown (a parameter): transpose(2, 3) might not be its last two dims
    "rank_unknown": ("""\
        return self.attend(q, k, v)

    def attend(self, q, k, v):
        w = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale, dim=-1)
        return w @ v""", "k.transpose(2, 3) is k^T only when k is 4-D"),
    # the scores are also read by something else
    "scores_read_twice": (SPLIT_HEADS + """\
        att = q @ k.transpose(-2, -1)
        self.last_max = att.amax()
        att = att.softmax(dim=-1)
        y = att @ v
""" + MERGE, "the attention scores `att` are also read at line"),
    # masked_fill with a finite value: rows with every key masked would differ from a boolean mask
    "finite_fill": (SPLIT_HEADS + """\
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, -1e4)
        y = att.softmax(dim=-1) @ v
""" + MERGE, "masked with `-10000.0` rather than -inf"),
}


def _compare(src: str, new: str, mask):
    torch.manual_seed(0)
    ref, rew = load(src, "o")["Attention"]().train(), load(new, "n")["Attention"]().train()
    rew.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa, mask), rew(xb, mask)
    torch.testing.assert_close(yb, ya, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-5)
    for (name, pa), pb in zip(ref.named_parameters(), rew.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_idiom_is_rewritten_and_computes_the_same(case):
    body, expect = CASES[case]
    src, new, matches = rewrite(HEAD.format(body=body), rules=["sdpa"])
    assert [(m.rule, m.applied, m.reason) for m in matches] == [("sdpa", True, None)]
    assert "scaled_dot_product_attention(" in new and expect in new, new
    if "kiln adopt:" not in new:           # no explicit path kept: the softmax is gone
        assert "softmax" not in new.split("def forward")[1]
    mask = torch.randn(6, 6) if case != "openclip_bmm" else torch.randn(1, 6, 6)
    for m in (None, mask):
        if case in ("mistral_ref", "llama_kv_cache") and m is not None:
            m = torch.triu(torch.full((6, 6), float("-inf")), diagonal=1)
        _compare(src, new, m)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_idiom_is_refused_with_its_reason(case):
    body, reason = REFUSED[case]
    src, new, matches = rewrite(HEAD.format(body=body), rules=["sdpa"])
    assert new == src
    assert [(m.rule, m.applied) for m in matches] == [("sdpa", False)]
    assert reason in matches[0].reason, matches[0].reason
    assert "not rewritten" not in matches[0].reason and matches[0].reason.count("(line") <= 1


def test_softcapping_helper_is_not_attention():
    # scores that always go through tanh soft-capping: SDPA cannot express it, not a location
    body = SPLIT_HEADS + """\
        att = softcap(q @ k.transpose(-2, -1), 30.0)
        y = att.softmax(dim=-1) @ v
""" + MERGE
    _, new, matches = rewrite(HEAD.format(body=body), rules=["sdpa"])
    assert matches == []


def test_softcapping_on_every_path_is_not_attention():
    # gemma: soft-capping on every call (inside the mask's `where`); its KV cache written with index_copy_
    body = SPLIT_HEADS + """\
        self.cache_k.index_copy_(1, torch.arange(T), k.transpose(1, 2))
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.where(self.causal[:T, :T], torch.tanh(scores / 30.0) * 30.0, float("-inf"))
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        y = torch.matmul(scores, v)
""" + MERGE
    _, new, matches = rewrite(HEAD.format(body=body), rules=["sdpa"])
    assert matches == []


def test_fully_masked_rows_are_documented_difference():
    # masked_fill(-inf) as a boolean mask: where every key of a row is masked the original gives NaN,
    # scaled_dot_product_attention zeros; everywhere else the two agree
    body = SPLIT_HEADS + """\
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(mask == 0, float('-inf'))
        y = att.softmax(dim=-1) @ v
""" + MERGE
    src, new, matches = rewrite(HEAD.format(body=body), rules=["sdpa"])
    assert [m.applied for m in matches] == [True] and "attn_mask=mask != 0" in new
    torch.manual_seed(0)
    ref, rew = load(src, "o")["Attention"](), load(new, "n")["Attention"]()
    rew.load_state_dict(ref.state_dict())
    keep = torch.ones(6, 6).tril()
    keep[3] = 0
    x = torch.randn(2, 6, 16)
    ya, yb = ref(x, keep), rew(x, keep)
    assert torch.isnan(ya[:, 3]).all() and (yb[:, 3] == 0).all()
    rows = [0, 1, 2, 4, 5]
    torch.testing.assert_close(yb[:, rows], ya[:, rows], atol=1e-5, rtol=1e-5)
