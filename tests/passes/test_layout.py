"""Layouts in the generated step: strides in metas are predictions, and no `aten.view` may rest on one.

Model-level cases train against eager PyTorch (one SGD(lr=1) step: the parameter delta is the gradient;
then 3 kiln.optim.AdamW steps against torch.optim.AdamW); graph-level cases check which op the builder
and `remove_noops` leave, and run the graph against the same computation in eager."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.ir.builder import layout_known
from kiln.ir.graph import Role, TensorMeta
from kiln.passes.noops import remove_noops
from kiln.passes.rewrite import refresh_metas
from tests.passes.graphs import aten, count, graph_with_inputs, run
from tests.models.reference import check_training


def train_like_eager(model, *args):
    """One SGD(lr=1) step (gradients) and 3 AdamW steps (losses and parameters), Kiln vs eager."""
    return check_training(lambda: model, *args)


class ChannelNorm(nn.Module):
    """BatchNorm1d over the channels of a (B, T, C) sequence, then a Linear: CPU batch norm returns a
    contiguous output where its meta predicts the input's (transposed) layout."""

    def __init__(self, contiguous: bool = False, flatten: bool = False):
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(8), nn.Linear(8, 4)
        self.contiguous, self.flatten = contiguous, flatten

    def forward(self, x):
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)
        if self.contiguous:
            h = h.contiguous()                 # export drops it: its fake tensor was already contiguous
        if self.flatten:
            h = h.view(-1, 8)
        return self.lin(h).pow(2).mean()


@pytest.mark.parametrize("contiguous,flatten", [(False, False), (True, True)],
                         ids=["batchnorm-transpose-linear", "contiguous-then-view"])
def test_batch_norm_over_a_transpose_then_linear_trains_like_eager(contiguous, flatten):
    train_like_eager(ChannelNorm(contiguous, flatten), torch.randn(2, 5, 8))


class EmbeddingChannelNorm(nn.Module):
    """The view is in the backward only: the gradient of `e.view(B, T, C)` comes out of batch norm's
    backward through a transpose, in a layout other than its meta predicts, and the view's rule views it."""

    def __init__(self):
        super().__init__()
        self.emb, self.bn = nn.Embedding(16, 8), nn.BatchNorm1d(8)

    def forward(self, ids):
        b, t = ids.shape
        e = self.emb(ids.reshape(-1)).view(b, t, 8)
        return self.bn(e.transpose(1, 2)).pow(2).mean()


def test_a_transposed_gradient_reaching_a_view_trains_like_eager():
    train_like_eager(EmbeddingChannelNorm(), torch.randint(0, 16, (2, 5)))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim)), eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class QKNormAttention(nn.Module):
    """Attention with per-head q/k RMSNorm and rope whose output is `.contiguous()` then viewed (Exaone 4,
    Gemma 3): the RMSNorm fusion swaps the transposed queries for a contiguous kernel output, after which
    the metas of the attention output still describe the transposed layout."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(self.hd), RMSNorm(self.hd)
        ang = torch.arange(6.0)[:, None] * torch.arange(1, self.hd // 2 + 1.0)[None]
        self.register_buffer("cos", torch.cat([ang.cos(), ang.cos()], -1), persistent=False)
        self.register_buffer("sin", torch.cat([ang.sin(), ang.sin()], -1), persistent=False)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.cos[:t], self.sin[:t]
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(b, t, d)
        return self.o(out).pow(2).mean()


def test_attention_output_viewed_after_the_norm_fusion_trains_like_eager():
    step = train_like_eager(QKNormAttention(), torch.randn(2, 6, 16))
    assert any(n.fused is not None and "rms_norm" in n.fused.fusion for n in step.graph.nodes)


class LowRankAttention(nn.Module):
    """MLA-style attention (MiniCPM3, GLM-4 MoE Lite): queries and keys of a no-rope and a rope part
    (head size 6), values of head size 4 from a low-rank projection. The CPU flash kernel needs one head size
    for all three, and its meta gives the output the queries' head size."""

    def __init__(self, dim=16, heads=2, nope=4, rope=2, v_dim=4, rank=6):
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim = heads, nope, rope, v_dim
        self.q = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.kv_down = nn.Linear(dim, rank + rope, bias=False)
        self.kv_up = nn.Linear(rank, heads * (nope + v_dim), bias=False)
        self.o = nn.Linear(heads * v_dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)                      # (B, H, T, nope+rope)
        latent, k_rope = self.kv_down(x).split([self.kv_down.out_features - self.rope, self.rope], -1)
        kv = self.kv_up(latent).view(b, t, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)                              # v: (B, H, T, v_dim)
        k = torch.cat([k_nope, k_rope[:, None].expand(b, self.heads, t, self.rope)], -1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)                 # (B, H, T, v_dim)
        return self.o(out.transpose(1, 2).reshape(b, t, -1)).pow(2).mean()


def test_attention_with_values_of_another_head_size_trains_like_eager():
    step = train_like_eager(LowRankAttention(), torch.randn(2, 5, 16))
    assert not [n for n in step.graph.nodes if "flash_attention" in n.op.name]     # the math lowering
    assert not [n for n in step.graph.nodes if n.op.name == "kiln.fallback_forward"]


def test_a_rewrite_that_changes_a_shape_is_refused():
    from kiln.errors import KilnError
    from kiln.passes.rewrite import rewrite
    x = torch.randn(4, 6)
    g, b, (xv,) = graph_with_inputs(x)
    g.outputs = [b(aten.neg.default, xv)]
    with pytest.raises(KilnError, match="Kiln bug: a rewrite of aten.neg .* float32\\[24\\] for float32\\[4, 6\\]"):
        rewrite(g, {aten.neg.default: lambda b, n: b(aten.reshape.default, n.args[0], [24])})


# ---- the rule, on graphs -------------------------------------------------------------------------
def test_views_of_predicted_layouts_are_reshapes_and_views_of_exact_ones_stay_views():
    x, w = torch.randn(4, 6), torch.randn(6, 4)
    g, b, (xv,) = graph_with_inputs(x)
    wv = g.add_input("w", TensorMeta.of(w), Role.PARAM, "w")
    wt = b(aten.t.default, wv)                               # an exact layout: a view of a parameter
    assert layout_known(wt) and not layout_known(xv)          # the user's inputs are not keyed on strides
    kept = b(aten.view.default, b(aten.t.default, wt), [24])  # (6, 4) again, contiguous: a real view
    mm = b(aten.mm.default, xv, wv)                          # computed: its layout is predicted
    flat = b(aten.view.default, mm, [16])
    assert kept.producer.target is aten.view.default and flat.producer.target is aten.reshape.default
    g.outputs = [b(aten.add.Tensor, b(aten.sum.default, flat), b(aten.sum.default, kept))]
    torch.testing.assert_close(run(g, x, w), (x @ w).sum() + w.sum())


def test_a_captured_view_of_a_computed_value_becomes_reshape():
    # a view made outside the builder (capture makes nodes directly) of a transposed gradient-like value
    x = torch.randn(3, 5)
    g, b, (xv,) = graph_with_inputs(x)
    t = b(aten.t.default, b(aten.neg.default, xv))           # (5, 3), transposed strides
    view = b(aten.reshape.default, t, [15])
    view.producer.target = aten.view.default                  # as capture would leave it, on a wrong meta
    g.outputs = [b(aten.mul.Tensor, view, 2.0)]
    remove_noops(g)
    assert count(g, aten.view.default) == 0 and count(g, aten.reshape.default) == 1
    torch.testing.assert_close(run(g, x), (-x).t().reshape(15) * 2.0)


def test_stale_metas_are_refreshed_and_views_they_no_longer_allow_become_reshapes():
    # a pass swapped a contiguous value for a transposed one of the same values (as a fusion swaps a kernel's
    # output in) and left the metas after it as they were
    x = torch.randn(4, 6)
    g, b, (xv,) = graph_with_inputs(x)
    a = b(aten.neg.default, xv)                                                     # (4, 6), strides (6, 1)
    swapped = b(aten.t.default, b(aten.clone.default, b(aten.t.default, a), memory_format=torch.contiguous_format))
    flat = b(aten.reshape.default, a, [24])
    flat.producer.target = aten.view.default              # as captured, on the contiguous value
    g.outputs = [b(aten.mul.Tensor, flat, 3.0)]
    g.replace_uses(a, swapped, start=g.nodes.index(flat.producer))                 # strides (1, 4) now
    refresh_metas(g)
    assert flat.producer.target is aten.reshape.default
    torch.testing.assert_close(run(g, x), (-x).reshape(24) * 3.0)
