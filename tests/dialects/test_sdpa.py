"""The `sdpa` dialect's flash kernels (kiln/dialects/sdpa.py) on layouts ATen's CPU kernel misreads.

ATen's `_scaled_dot_product_flash_attention_for_cpu` (and its backward) read q/k/v as if their last
dimension were dense; eager `F.scaled_dot_product_attention` checks and takes the math path otherwise,
Kiln's lowering called the kernel directly: attention over channels (Florence-2's DaViT, q/k/v permuted
so that tokens are the last dimension) gave garbage and trained to NaN. References: PyTorch's math path
and eager training."""
from __future__ import annotations

import copy

import torch

import kiln
from kiln.dialects.sdpa import flash_backward, flash_forward

aten = torch.ops.aten


def _strided_qkv(seed=0):
    torch.manual_seed(seed)
    base = torch.randn(3, 2, 16, 9, 4).permute(0, 1, 2, 4, 3)       # (3, 2, 16, 4, 9): last-dim stride 4
    return base.unbind(0)


def test_flash_kernels_on_a_strided_head_dimension_match_the_math_path():
    q, k, v = _strided_qkv()
    assert q.stride(-1) != 1
    ref_q, ref_k, ref_v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = aten._scaled_dot_product_attention_math(ref_q, ref_k, ref_v, scale=1 / 3)[0]
    out, lse = flash_forward(q, k, v, 0.0, False, scale=1 / 3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out).transpose(-1, -2).contiguous().transpose(-1, -2)     # strided gradient too
    ref.backward(g)
    gq, gk, gv = flash_backward(g, q, k, v, out, lse, 0.0, False, scale=1 / 3)
    for got, want in ((gq, ref_q.grad), (gk, ref_k.grad), (gv, ref_v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class ChannelAttention(torch.nn.Module):
    """DaViT's channel attention: tokens are the attention's last (head) dimension."""

    def __init__(self, dim=32, groups=4):
        super().__init__()
        self.qkv, self.proj, self.groups = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), groups

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.groups, c // self.groups).permute(2, 0, 3, 4, 1)
        q, k, v = qkv.unbind(0)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=n ** -0.5)
        return self.proj(h.permute(0, 3, 2, 1).reshape(b, n, c)).square().mean()


def test_channel_attention_trains_like_eager():
    torch.manual_seed(0)
    model, x = ChannelAttention(), torch.randn(2, 9, 32)
    ref = copy.deepcopy(model)
    ref(x).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0))
    loss = step(x)
    assert any(n.target is aten._scaled_dot_product_flash_attention_for_cpu.default for n in step.graph.nodes)
    torch.testing.assert_close(loss, ref(x).detach(), rtol=1e-5, atol=0)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(before[n] - dict(model.named_parameters())[n].detach(), p.grad, rtol=1e-4, atol=1e-6)
