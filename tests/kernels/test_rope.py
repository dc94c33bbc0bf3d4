"""rope vs Hugging Face's apply_rotary_pos_emb written in plain PyTorch."""
from __future__ import annotations

import pytest
import torch

import kiln.kernels as K
from kiln.kernels import native
from tests.kernels import refs
from tests.kernels.refs import BF16, FP32, FP64, check


def _tables(batch, seq, dim, dtype=torch.float32):
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], -1).expand(batch, seq, dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _hf(q, k, cos, sin):
    return refs.rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
def test_rope_fp32(heads):
    q, k = torch.randn(2, heads[0], 6, 16), torch.randn(2, heads[1], 6, 16)
    cos, sin = _tables(2, 6, 16)
    check(lambda q, k, c, s: K.rope(q, k, c, s, unsqueeze_dim=1), _hf, [q, k, cos, sin], FP32, nograd=(2, 3))


def test_rope_non_contiguous_projections():
    """q/k as Hugging Face makes them: views of (batch, seq, heads, dim) projections, transposed."""
    q = torch.randn(2, 5, 4, 8).transpose(1, 2)
    k = torch.randn(2, 5, 2 * 8 * 2)[..., ::2].reshape(2, 5, 2, 8).transpose(1, 2)   # sliced, then transposed
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = _tables(2, 5, 8)
    check(lambda q, k, c, s: K.rope(q, k, c, s, unsqueeze_dim=1), _hf, [q, k, cos, sin], FP32, nograd=(2, 3))


def test_rope_broadcast_tables_and_fp64():
    """(seq, dim) tables broadcast over batch and heads; fp64 checks the formula exactly."""
    q, k = torch.randn(3, 2, 7, 12, dtype=torch.float64), torch.randn(3, 2, 7, 12, dtype=torch.float64)
    cos, sin = (t[0] for t in _tables(1, 7, 12, torch.float64))
    check(K.rope, refs.rope, [q, k, cos, sin], FP64, nograd=(2, 3))


def test_rope_table_gradients():
    """A learned rotation table gets its gradient too (cos/sin requiring grad)."""
    q, k = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(2, 1, 5, 8, dtype=torch.float64)
    cos, sin = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    check(K.rope, refs.rope, [q, k, cos, sin], FP64)


def test_rope_bf16():
    q, k = torch.randn(1, 2, 4, 16).bfloat16(), torch.randn(1, 1, 4, 16).bfloat16()
    cos, sin = _tables(1, 4, 16, torch.bfloat16)
    check(lambda q, k, c, s: K.rope(q, k, c, s, unsqueeze_dim=1), _hf, [q, k, cos, sin], BF16, nograd=(2, 3),
          ref_dtype=torch.float32)


def test_rope_saves_only_the_tables():
    """The rotation is linear in q and k: the backward needs cos/sin only (eager saves only views of
    them too; rope's gain is the temporaries it never makes, see docs/kernels.md)."""
    q, k = torch.randn(2, 4, 8, 16, requires_grad=True), torch.randn(2, 4, 8, 16, requires_grad=True)
    cos, sin = _tables(2, 8, 16)
    assert refs.saved_bytes(lambda *a: K.rope(*a, unsqueeze_dim=1), [q, k, cos, sin]) == 0   # cos/sin are inputs


@pytest.mark.parametrize("bad", ["odd", "shape"])
def test_rope_rejects_bad_shapes(bad):
    q = torch.randn(1, 2, 4, 7 if bad == "odd" else 8)
    cos = torch.randn(4, 7 if bad == "odd" else 6)
    with pytest.raises((ValueError, RuntimeError)):
        K.rope(q, q, cos, cos)


def _rotated_fp32(t, cos, sin, backward=False):
    """The rotation computed in fp32 by ATen, as the kernel computes it (products, then one add), unrounded."""
    t, cos, sin = t.float(), cos.float(), sin.float()
    h = t.shape[-1] // 2
    a, b = t[..., :h], t[..., h:]
    if backward:
        return torch.cat([a * cos[..., :h] + b * sin[..., h:], b * cos[..., h:] - a * sin[..., :h]], -1)
    return torch.cat([a * cos[..., :h] - b * sin[..., :h], b * cos[..., h:] + a * sin[..., h:]], -1)


@pytest.mark.skipif(native.library() is None, reason="native.c's loop (the ATen composition rounds in between)")
@pytest.mark.parametrize("tables", ["shared-by-heads", "per-head"])
def test_rope_bf16_rounds_once_in_the_projection_layout(tables):
    """bf16 q and k as a Llama layer makes them ((batch, seq, heads, dim) projections seen transposed), forward and
    backward: the fp32 rotation rounded once, bit for bit, whether the heads share a table row (the kernel converts
    it once for all of them) or each head has its own."""
    b, t, h, d = 2, 6, 3, 64
    q = torch.randn(b, t, h, d).bfloat16().transpose(1, 2)
    k = torch.randn(b, t, h, d).bfloat16().transpose(1, 2)
    if tables == "shared-by-heads":
        cos, sin = (x.unsqueeze(1) for x in _tables(b, t, d, torch.bfloat16))
    else:
        cos, sin = torch.randn(b, h, t, d).bfloat16(), torch.randn(b, h, t, d).bfloat16()
    qr, kr = K.OPS["rope"](q, k, cos, sin)
    gq, gk = K.OPS["rope_backward"](q, k, cos, sin)
    for got, x, backward in ((qr, q, False), (kr, k, False), (gq, q, True), (gk, k, True)):
        assert got.dtype == torch.bfloat16 and got.stride() == x.stride()
        assert torch.equal(got, _rotated_fp32(x, cos, sin, backward).bfloat16())
    # fp32 tables with bf16 q (the staged path), rounded to bf16 once
    qr32, _ = K.OPS["rope"](q, k, cos.float(), sin.float(), torch.bfloat16)
    assert torch.equal(qr32, _rotated_fp32(q, cos, sin).bfloat16())
