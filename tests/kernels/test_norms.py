"""rms_norm (with and without the fused residual add) and dropout_add_layer_norm vs unfused PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln.kernels as K
from kiln.kernels.norms import dropout_scale
from tests.kernels import refs
from tests.kernels.refs import BF16, FP32, FP64, LAYOUTS, check

SHAPES = [(7, 32), (2, 5, 48), (3, 1, 4, 16)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_fp32(shape, layout):
    x = LAYOUTS[layout](torch.randn(shape))
    w = torch.rand(shape[-1]) + 0.5
    check(lambda x, w: K.rms_norm(x, w, 1e-5), lambda x, w: refs.rms_norm(x, w, 1e-5), [x, w], FP32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_rms_norm_fp32(shape, layout):
    x, r = LAYOUTS[layout](torch.randn(shape)), torch.randn(shape)
    w = torch.rand(shape[-1]) + 0.5
    out = check(lambda x, r, w: K.rms_norm(x, w, 1e-6, residual=r),
                lambda x, r, w: refs.rms_norm(x, w, 1e-6, residual=r), [x, r, w], FP32)
    assert len(out) == 2                      # (normalized output, x + residual)


def test_rms_norm_fp64_formula():
    x, r, w = torch.randn(4, 6, 40, dtype=torch.float64), torch.randn(4, 6, 40, dtype=torch.float64), \
        torch.randn(40, dtype=torch.float64)
    check(lambda x, w: K.rms_norm(x, w, 1e-6), refs.rms_norm, [x, w], FP64)
    check(lambda x, r, w: K.rms_norm(x, w, 1e-6, residual=r),
          lambda x, r, w: refs.rms_norm(x, w, 1e-6, residual=r), [x, r, w], FP64)


def test_rms_norm_forward_is_bitwise_eager_llama_rmsnorm():
    """The same float32 formula as Hugging Face's `hidden * rsqrt(hidden.pow(2).mean(-1) + eps) * weight`: the
    norm squared back (vector_norm) rounded otherwise, which ill-conditioned weight gradients amplified."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 96) * 3, torch.rand(96) + 0.5
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.equal(K.rms_norm(x, w, 1e-6), want)


def test_rms_norm_only_residual_used():
    """The gradient reaching x + residual only through the returned sum (the norm output unused)."""
    x, r, w = (torch.randn(3, 8, requires_grad=True) for _ in range(3))
    _, s = K.rms_norm(x, w, 1e-6, residual=r)
    s.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 8)) and torch.equal(r.grad, torch.ones(3, 8))


def test_rms_norm_bf16():
    x, r = torch.randn(2, 3, 32).bfloat16(), torch.randn(2, 3, 32).bfloat16()
    w = (torch.rand(32) + 0.5).bfloat16()
    check(lambda x, w: K.rms_norm(x, w, 1e-6), refs.rms_norm, [x, w], BF16, ref_dtype=torch.float32)
    check(lambda x, r, w: K.rms_norm(x, w, 1e-6, residual=r),
          lambda x, r, w: refs.rms_norm(x, w, 1e-6, residual=r), [x, r, w], BF16, ref_dtype=torch.float32)


def test_rms_norm_rejects_broadcast_residual():
    with pytest.raises(ValueError, match="same shape"):
        K.rms_norm(torch.randn(2, 4, 8), torch.ones(8), 1e-6, residual=torch.randn(4, 8))


def test_rms_norm_saves_no_normalized_activations():
    """Only the fp32 rstd per row is kept (x is an input); eager keeps x**2-sized buffers too."""
    x, w = torch.randn(64, 256, requires_grad=True), torch.ones(256, requires_grad=True)
    fused, eager = refs.saved_bytes(lambda x, w: K.rms_norm(x, w), [x, w]), refs.saved_bytes(refs.rms_norm, [x, w])
    assert fused == 64 * 4 and eager >= 64 * 256 * 4


# ---- dropout + residual + LayerNorm -----------------------------------------------------------
def _ln_ref(p_scale_mask=None, affine=True):
    def ref(x, r, *wb):
        d = x if p_scale_mask is None else x * p_scale_mask[1] * p_scale_mask[0]
        s = d + r
        w, b = wb if affine else (None, None)
        return F.layer_norm(s, (x.shape[-1],), w, b, 1e-5), s
    return ref


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dropout_add_layer_norm_no_dropout(shape, layout):
    x, r = LAYOUTS[layout](torch.randn(shape)), torch.randn(shape)
    w, b = torch.rand(shape[-1]) + 0.5, torch.randn(shape[-1])
    check(lambda x, r, w, b: K.dropout_add_layer_norm(x, r, w, b, 0.0, 1e-5), _ln_ref(), [x, r, w, b], FP32)
    # eval mode: p > 0 but training=False is the identity, like F.dropout
    check(lambda x, r, w, b: K.dropout_add_layer_norm(x, r, w, b, 0.5, 1e-5, training=False), _ln_ref(),
          [x, r, w, b], FP32)


def test_dropout_add_layer_norm_without_affine():
    x, r = torch.randn(5, 24), torch.randn(5, 24)
    check(lambda x, r: K.dropout_add_layer_norm(x, r, None, None, 0.0, 1e-5), _ln_ref(affine=False), [x, r], FP32)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_uses_the_forward_mask(p, layout):
    """The reference applies the mask the op returned; the backward must use that same mask and
    must not draw from the RNG again."""
    x, r = LAYOUTS[layout](torch.randn(6, 8, 64)), torch.randn(6, 8, 64)
    w, b = torch.rand(64) + 0.5, torch.randn(64)
    torch.manual_seed(123)
    *_, mask = torch.ops.kiln.dropout_add_layer_norm(x, r, w, b, p, 1e-5, True)   # what this seed draws
    assert mask.dtype == torch.bool and mask.shape == x.shape and 0 < mask.sum() < mask.numel()
    torch.manual_seed(123)

    def fused(x, r, w, b):
        out = K.dropout_add_layer_norm(x, r, w, b, p, 1e-5, True)
        fused.state = torch.get_rng_state()
        return out
    check(fused, _ln_ref((dropout_scale(p), mask)), [x, r, w, b], FP32)
    assert torch.equal(torch.get_rng_state(), fused.state), "the backward drew random numbers"


def test_dropout_mask_statistics_and_scale():
    """P(keep) = 1 - p and the scale keeps the expectation: E[dropout(x)] = x."""
    x, r = torch.ones(256, 1024), torch.zeros(256, 1024)
    for p in (0.1, 0.3, 0.9):
        *_, s, _, _, mask = torch.ops.kiln.dropout_add_layer_norm(x, r, None, None, p, 1e-5, True)
        keep = mask.float().mean().item()
        assert abs(keep - (1 - p)) < 5e-3, (p, keep)
        assert abs(s.mean().item() - 1.0) < 1.5e-2
        assert abs(dropout_scale(p) * (1 - p) - 1) < 1e-4          # p is rounded to a multiple of 1/65536
    *_, mask = torch.ops.kiln.dropout_add_layer_norm(x, r, None, None, 1.0, 1e-5, True)
    assert not mask.any()


def test_dropout_is_reproducible_with_the_seed():
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    torch.manual_seed(7)
    a = K.dropout_add_layer_norm(x, r, None, None, 0.5)
    torch.manual_seed(7)
    b = K.dropout_add_layer_norm(x, r, None, None, 0.5)
    c = K.dropout_add_layer_norm(x, r, None, None, 0.5)
    assert torch.equal(a[0], b[0]) and not torch.equal(b[1], c[1])


def test_dropout_add_layer_norm_bf16():
    x, r = torch.randn(3, 4, 32).bfloat16(), torch.randn(3, 4, 32).bfloat16()
    w, b = (torch.rand(32) + 0.5).bfloat16(), torch.randn(32).bfloat16()
    check(lambda x, r, w, b: K.dropout_add_layer_norm(x, r, w, b, 0.0, 1e-5), _ln_ref(), [x, r, w, b], BF16,
          ref_dtype=torch.float32)


def test_dropout_add_layer_norm_saves_bool_mask():
    """Eager CPU dropout keeps a float noise tensor (4 bytes/element); the kernel keeps a bool mask."""
    x, r = torch.randn(32, 128, requires_grad=True), torch.randn(32, 128, requires_grad=True)
    w, b = torch.ones(128, requires_grad=True), torch.zeros(128, requires_grad=True)
    fused = refs.saved_bytes(lambda *a: K.dropout_add_layer_norm(*a, 0.1, 1e-5, True), [x, r, w, b])
    eager = refs.saved_bytes(lambda x, r, w, b: F.layer_norm(F.dropout(x, 0.1) + r, (128,), w, b), [x, r, w, b])
    n = 32 * 128
    assert fused <= n * 4 + n + 2 * 32 * 4 < eager      # the sum, the mask, mean and rstd


# ---- LayerNorm's backward with the residual stream's gradient sums ------------------------------
def _ln_backward_ref(g, g2, x, w, b, gsum):
    """ATen's native_layer_norm_backward in float64 on the summed gradient, plus gsum: the reference."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    rstd = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    gd = g.double() + (g2.double() if g2 is not None else 0)
    gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
        gd, xd, [x.shape[-1]], mean, rstd, None if w is None else w.double(), None if b is None else b.double(),
        [True, w is not None, b is not None])
    return gi + (gsum.double() if gsum is not None else 0), gw, gb


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("case", ["plain", "bf16-grad", "sum-of-two", "accumulate-low", "no-affine", "bf16-input"])
def test_layer_norm_backward_matches_aten_in_float64(case, native, monkeypatch):
    monkeypatch.setenv("KILN_NATIVE", native)
    torch.manual_seed(0)
    shape = (3, 37, 96)
    x = torch.randn(shape) * 2 + 0.5
    w, b = torch.rand(96) + 0.5, torch.randn(96)
    g, g2, gsum, low = torch.randn(shape), None, None, None
    if case == "bf16-grad":
        g = g.bfloat16()
    elif case == "sum-of-two":
        g2 = torch.randn(shape).bfloat16()            # the branch's gradient, as autocast leaves it
    elif case == "accumulate-low":
        g2, gsum, low = torch.randn(shape), torch.randn(shape), torch.bfloat16
    elif case == "no-affine":
        w = b = None
    elif case == "bf16-input":
        x = x.bfloat16()
    _, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), [96], w, b, 1e-5)
    gi, gw, gb, gl = torch.ops.kiln.layer_norm_backward(g, g2, x, mean, rstd, w, b, gsum, low)
    rgi, rgw, rgb = _ln_backward_ref(g, g2, x.float(), w, b, gsum)
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
    assert gi.dtype == x.dtype and gi.shape == x.shape
    torch.testing.assert_close(gi.double(), rgi, rtol=tol, atol=tol * rgi.abs().max().item())
    if w is None:
        assert gw.numel() == gb.numel() == 0
    else:
        torch.testing.assert_close(gw.double(), rgw, rtol=1e-5, atol=1e-5 * rgw.abs().max().item())
        torch.testing.assert_close(gb.double(), rgb, rtol=1e-5, atol=1e-5 * rgb.abs().max().item())
    if low is None:
        assert gl.numel() == 0
    else:                                             # the cast folded in: gi's own value, rounded once
        assert gl.dtype == low and torch.equal(gl, gi.to(low))


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_backward_sums_adds_the_low_copys_column_sums(native, affine, monkeypatch):
    """The twin's outputs are layer_norm_backward's, and its fifth is the sum of the bf16 copy over the rows as
    aten.sum of that copy computes it (fp32 sums of the rounded values, rounded to bf16): the same value or one
    bf16 step from it, where the two orders of summation round to either side."""
    monkeypatch.setenv("KILN_NATIVE", native)
    torch.manual_seed(0)
    shape = (3, 150, 96)                              # rows beyond one block of 64 in each thread
    x = torch.randn(shape) * 2 + 0.5
    w, b = (torch.rand(96) + 0.5, torch.randn(96)) if affine else (None, None)
    g, g2, gsum = torch.randn(shape).bfloat16(), torch.randn(shape), torch.randn(shape)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [96], w, b, 1e-5)
    plain = torch.ops.kiln.layer_norm_backward(g, g2, x, mean, rstd, w, b, gsum, torch.bfloat16)
    *outs, sums = torch.ops.kiln.layer_norm_backward_sums(g, g2, x, mean, rstd, w, b, gsum, torch.bfloat16)
    for a, o in zip(plain, outs):
        assert torch.equal(a, o)
    rgi, _, _ = _ln_backward_ref(g, g2, x, w, b, gsum)  # and against float64 ATen, not only the plain op
    torch.testing.assert_close(outs[0].double(), rgi, rtol=1e-5, atol=1e-5 * rgi.abs().max().item())
    assert torch.equal(outs[3], outs[0].to(torch.bfloat16))
    ref = torch.ops.aten.sum(plain[3], [0, 1])        # ATen's sum of the bf16 copy: fp32 sums, rounded
    assert sums.dtype == torch.bfloat16 and sums.shape == (96,)
    exact = plain[3].double().sum((0, 1))
    assert ((sums.double() - exact).abs() <= (ref.double() - exact).abs() + exact.abs() * 2 ** -8 + 1e-6).all()
    with pytest.raises(ValueError, match="low_dtype"):
        torch.ops.kiln.layer_norm_backward_sums(g, g2, x, mean, rstd, w, b, gsum, None)


def test_layer_norm_backward_rejects_mismatched_shapes():
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    with pytest.raises(ValueError, match="grad_out2"):
        torch.ops.kiln.layer_norm_backward(g, torch.randn(4, 1), x, mean, rstd, None, None)
    with pytest.raises(ValueError, match="weight"):
        torch.ops.kiln.layer_norm_backward(g, None, x, mean, rstd, torch.ones(4), None)
