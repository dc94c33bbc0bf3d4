"""Kiln's native single-pass CPU loops (kiln/kernels/native.c) against float64 truth and the ATen compositions.

Each case runs the kernel twice on the same inputs, with the native loops (the default) and with
KILN_NATIVE=0 (the ATen compositions), and computes the true values in float64 from the same (rounded)
inputs. The native result must be used (checked), agree with the composition to a few roundings, and be
no further from the truth than the composition is (plus one rounding of the output dtype).
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import sysconfig

import pytest
import torch
import torch.nn.functional as F

import kiln.kernels  # noqa: F401 - registers torch.ops.kiln
from kiln.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the ATen compositions run")

DTYPES = [torch.float32, torch.bfloat16]
kiln_ops = torch.ops.kiln
aten = torch.ops.aten


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps


def _run(fn, native_on: bool):
    old = os.environ.get("KILN_NATIVE")
    os.environ["KILN_NATIVE"] = "1" if native_on else "0"
    try:
        out = fn()
    finally:
        os.environ.pop("KILN_NATIVE") if old is None else os.environ.__setitem__("KILN_NATIVE", old)
    return out if isinstance(out, (tuple, list)) else (out,)


def _compare(fn, truth, dtypes_out=None):
    """Native vs composition vs float64 truth, output by output (relative to each output's largest value)."""
    got, comp = _run(fn, True), _run(fn, False)
    for g, c, t in zip(got, comp, truth):
        assert g.dtype == c.dtype and g.shape == c.shape and g.stride() == c.stride(), "layout differs from ATen's"
        scale = t.abs().max().item() or 1.0
        err_native = (g.double() - t).abs().max().item() / scale
        err_comp = (c.double() - t).abs().max().item() / scale
        one = _eps(g.dtype) if g.dtype != torch.float32 else 4 * _eps(g.dtype)
        assert err_native <= err_comp + one, (err_native, err_comp)
        assert (g.double() - c.double()).abs().max().item() / scale <= err_comp + 2 * one


def _used(monkeypatch, name: str) -> list:
    """Calls of the library function `name` are counted (proof the native path ran)."""
    lib = native.library()
    real = getattr(lib, name)
    calls = []

    class Counting:
        def __getattr__(self, attr):
            if attr == name:
                return lambda *a: calls.append(1) or real(*a)
            return getattr(lib, attr)
    monkeypatch.setattr(native, "library", lambda: Counting() if native.enabled() else None)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_backward(dtype, monkeypatch):
    torch.manual_seed(0)
    x, g, gs = (torch.randn(300, 96, dtype=dtype) for _ in range(3))
    w = (torch.rand(96) + 0.5)
    rstd = x.float().pow(2).mean(-1, keepdim=True).add_(1e-6).rsqrt_()
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    (xd * rstd.double() * wd).backward(g.double())      # rstd held fixed: the gradient through it below
    xd2 = x.double().requires_grad_()
    wd2 = w.double().requires_grad_()
    (xd2 * torch.rsqrt(xd2.pow(2).mean(-1, keepdim=True) + 1e-6) * wd2).backward(g.double())
    calls = _used(monkeypatch, "kiln_rms_backward")
    _compare(lambda: kiln_ops.rms_norm_backward(g, gs, x, w, rstd), (xd2.grad + gs.double(), wd2.grad))
    _compare(lambda: kiln_ops.rms_norm_backward(g, None, x, w, rstd), (xd2.grad, wd2.grad))
    assert calls


@pytest.mark.parametrize("terms", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_backward_of_terms_is_the_call_on_their_sum(dtype, terms, monkeypatch):
    """grad_out2 (and grad_out3): the kernel sums the terms as torch.add does, (g1 + g2) + g3, each add rounded
    once to their dtype, so every output is the one-term call's on the torch.add sum, bit for bit, natively and
    in the composition (that call's numerics against float64 are test_rms_norm_backward's); with grad_sum and
    with a narrower copy."""
    torch.manual_seed(terms)
    gs_ = [torch.randn(300, 96, dtype=dtype) for _ in range(terms)]
    x, gs = torch.randn(300, 96), torch.randn(300, 96)
    w = torch.rand(96) + 0.5
    rstd = x.pow(2).mean(-1, keepdim=True).add_(1e-6).rsqrt_()
    more = dict(zip(("grad_out2", "grad_out3"), gs_[1:]))
    total = gs_[0]
    for t in gs_[1:]:
        total = torch.add(total, t)
    calls = _used(monkeypatch, "kiln_rms_backward")
    for grad_sum, low in ((None, None), (gs, torch.bfloat16)):
        for native_on in (True, False):
            got = _run(lambda: kiln_ops.rms_norm_backward(gs_[0], grad_sum, x, w, rstd, low, **more), native_on)
            one = _run(lambda: kiln_ops.rms_norm_backward(total, grad_sum, x, w, rstd, low), native_on)
            assert all(torch.equal(a, b) for a, b in zip(got, one)), (grad_sum is None, native_on)
    assert calls


def test_rms_norm_backward_rejects_a_second_term_of_another_dtype_or_shape():
    x, w = torch.randn(4, 8), torch.ones(8)
    rstd, g = torch.ones(4, 1), torch.randn(4, 8)
    for g2, first in ((g.bfloat16(), g), (torch.randn(8), g), (torch.randn(4, 8), None)):
        with pytest.raises(ValueError, match="grad_out2"):
            kiln_ops.rms_norm_backward(first, None, x, w, rstd, grad_out2=g2)
    with pytest.raises(ValueError, match="grad_out3"):
        kiln_ops.rms_norm_backward(g, None, x, w, rstd, grad_out2=g, grad_out3=torch.randn(8))
    with pytest.raises(ValueError, match="grad_out3 needs grad_out2"):
        kiln_ops.rms_norm_backward(g, None, x, w, rstd, grad_out3=g)


def test_rms_norm_forward_half_types_single_pass(monkeypatch):
    torch.manual_seed(0)
    x, r = torch.randn(64, 200, dtype=torch.bfloat16), torch.randn(64, 200, dtype=torch.bfloat16)
    w = torch.rand(200) + 0.5
    calls = _used(monkeypatch, "kiln_rms_forward")
    s = (x + r)                                                  # rounded to bf16, as eager's add
    sd = s.double()
    truth = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    _compare(lambda: kiln_ops.add_rms_norm(x, r, w, 1e-6)[:2], (truth, sd))
    xd = x.double()
    _compare(lambda: kiln_ops.rms_norm(x, w, 1e-6)[:1], (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
                                                        * w.double(),))
    assert len(calls) == 2


@pytest.mark.parametrize("d", [16, 17, 64, 100, 512, 1408, 4100, 8192])
def test_rms_norm_forward_fp32_is_bitwise_eager_in_one_pass(d, monkeypatch):
    """A float32 sum: the single pass sums the squares in ATen's order (`norms._aten_lanes`), so its statistics,
    its output (bf16 or fp32) and the residual sum are eager's bit for bit, with no ATen op for the statistics;
    rows of every magnitude, one with exact zeros."""
    from kiln.kernels import norms
    assert norms._aten_lanes() in (8, 16)          # both CI CPUs (and ATEN_CPU_CAPABILITY=default): 8
    torch.manual_seed(d)
    x = torch.randn(6, d) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[1, : d // 2] = 0.0
    r = torch.randn(6, d, dtype=torch.bfloat16)
    w = torch.rand(d) + 0.5
    calls = _used(monkeypatch, "kiln_rms_forward")
    stats = _counted_aten(monkeypatch, "pow")

    def eager(s):
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    for out_dtype in (None, torch.bfloat16):
        out, rstd = kiln_ops.rms_norm(x, w, 1e-6, out_dtype)
        want = eager(x)
        assert torch.equal(out, want if out_dtype is None else want.bfloat16())
        assert torch.equal(rstd, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        out, total, _ = kiln_ops.add_rms_norm(x, r, w, 1e-6, out_dtype)
        s = x + r                                          # eager's float32 add
        assert torch.equal(total, s) and total.dtype == torch.float32
        assert torch.equal(out, eager(s) if out_dtype is None else eager(s).bfloat16())
    assert len(calls) == 4 and not stats                   # the pass computed the statistics itself


def test_rms_norm_forward_fp32_one_row_keeps_aten_statistics(monkeypatch):
    """One row (ATen splits its sum over threads) or rows shorter than 16 (ATen's scalar loop): ATen computes the
    statistics, the output is still eager's."""
    x1, w1 = torch.randn(1, 700) * 5, torch.rand(700) + 0.5
    x2, w2 = torch.randn(9, 12), torch.rand(12) + 0.5
    stats = _counted_aten(monkeypatch, "pow")
    for x, w in ((x1, w1), (x2, w2)):
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        assert torch.equal(kiln_ops.rms_norm(x, w, 1e-6, torch.bfloat16)[0], want.bfloat16())
    assert len(stats) == 2                                  # the kernel asked ATen, once a call


def _counted_aten(monkeypatch, method: str) -> list:
    """Calls of Tensor.<method> from kiln.kernels.norms, counted (its ATen statistics)."""
    from kiln.kernels import norms
    calls = []
    real = getattr(torch.Tensor, method)

    def counting(self, *a, **k):
        import inspect
        if inspect.currentframe().f_back.f_globals.get("__name__") == norms.__name__:
            calls.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, method, counting)
    return calls


def _rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "3d"])
def test_rope_forward_and_backward(dtype, layout, monkeypatch):
    torch.manual_seed(0)
    if layout == "transposed":       # Hugging Face's q: a (batch, seq, heads, dim) projection, transposed
        q, k = torch.randn(2, 7, 3, 16, dtype=dtype).transpose(1, 2), torch.randn(2, 7, 1, 16, dtype=dtype).transpose(1, 2)
        cos, sin = torch.randn(2, 1, 7, 16), torch.randn(2, 1, 7, 16)
    elif layout == "contiguous":
        q, k = torch.randn(2, 3, 7, 16, dtype=dtype), torch.randn(2, 3, 7, 16, dtype=dtype)
        cos, sin = torch.randn(7, 16), torch.randn(7, 16)          # broadcast over batch and heads
    else:
        q, k = torch.randn(5, 9, 32, dtype=dtype), torch.randn(5, 9, 32, dtype=dtype)
        cos, sin = torch.randn(5, 9, 32), torch.randn(5, 9, 32)
    calls = _used(monkeypatch, "kiln_rope")
    c, s = cos.double(), sin.double()

    def fwd(t):
        return t.double() * c + _rotate_half(t.double()) * s

    def bwd(g):                       # the transpose of t -> t c + rotate_half(t) s
        gd = g.double()
        return gd * c - _rotate_half(gd * s)
    _compare(lambda: kiln_ops.rope(q, k, cos, sin), (fwd(q), fwd(k)))
    _compare(lambda: kiln_ops.rope_backward(q, k, cos, sin), (bwd(q), bwd(k)))
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_forward_backward_on_halves_of_one_product(dtype, monkeypatch):
    """gate and up as the two halves of one [gate | up] product (row stride 2I), as swiglu_linear makes them;
    one row longer than a block (2048) of the C loop."""
    torch.manual_seed(0)
    inter = 2100
    gu = torch.randn(13, 2 * inter, dtype=dtype) * 4
    gate, up = gu[:, :inter], gu[:, inter:]
    grad = torch.randn(13, inter, dtype=dtype)
    calls = _used(monkeypatch, "kiln_swiglu")
    gd, ud, grd = gate.double(), up.double(), grad.double()
    sig = torch.sigmoid(gd)
    _compare(lambda: kiln_ops.swiglu(gate, up), (F.silu(gd) * ud,))
    calls_b = _used(monkeypatch, "kiln_swiglu_backward")
    _compare(lambda: kiln_ops.swiglu_backward(grad, gate, up), (grd * ud * sig * (1 + gd * (1 - sig)), grd * gd * sig))
    assert calls and calls_b


def test_swiglu_extremes_and_nan():
    """silu's tails (exp over- and underflow inside) and NaN propagation match ATen's."""
    gate = torch.tensor([[-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4, float("nan")]])
    up = torch.ones_like(gate)
    got, want = kiln_ops.swiglu(gate, up), F.silu(gate)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)
    gg, gu = kiln_ops.swiglu_backward(torch.ones_like(gate), gate, up)
    assert torch.isnan(gg[0, -1]) and torch.isnan(gu[0, -1])
    assert torch.isfinite(gg[0, :-1]).all() and torch.isfinite(gu[0, :-1]).all()


def _avx512_runs() -> bool:
    return all(native.cpu_flag(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


@pytest.mark.skipif(not _avx512_runs(), reason="the AVX-512 build needs a CPU with AVX-512")
def test_avx512_intrinsic_loops_give_the_plain_loops_bits(monkeypatch):
    """native_vec512.c (the AVX-512 build's SwiGLU forward and backward in bf16, and the loss's exp pass) against
    the AVX2 build's plain C: SwiGLU bit for bit over wide values, exp's clamp edges, infinities, NaN and lengths
    that leave partial vectors; the loss's per-token losses and gradients (fp32 and bf16 logits) to the last bits
    (their row sums add the same exps in another order)."""
    torch.manual_seed(0)
    edges = [0.0, -0.0, 87.3, -87.3, 88.3, -88.3, 87.4, -87.4, 90.0, -90.0, 1e4, -1e4, 1e-40, -1e-40,
             float("inf"), float("-inf"), float("nan")]
    # a million values: an ulp of fp32 anywhere in the exp shows as a few bf16 roundings that go the other way
    gate = torch.cat([torch.randn(511, 2048) * 12, torch.tensor(edges * 121)[:2048].reshape(1, 2048)]).bfloat16()
    up, grad = torch.randn(512, 2048).bfloat16(), torch.randn(512, 2048).bfloat16()
    up[-1, :17] = torch.tensor(edges).bfloat16()
    h, w = torch.randn(37, 16), torch.randn(1000, 16) * 2
    y = torch.randint(0, 1000, (37,))
    results = {}
    for isa in ("AVX512", "AVX2"):
        lib = native._library(isa)
        assert lib is not None
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        outs = []
        for cols in (2048, 299, 17, 16, 15, 1):         # whole vectors and partial ones
            rows = slice(None) if cols == 2048 else slice(-8, None)
            g, u, gr = (x[rows, :cols].contiguous() for x in (gate, up, grad))
            outs += [kiln_ops.swiglu(g, u), *kiln_ops.swiglu_backward(gr, g, u)]
        losses = [torch.ops.kiln.linear_cross_entropy_grads(h.to(dt), w.to(dt), y, -100, "sum", 0)[:2]
                  for dt in (torch.float32, torch.bfloat16)]
        results[isa] = outs, losses
    for a, b in zip(results["AVX512"][0], results["AVX2"][0]):
        assert a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
    for (la, ga), (lb, gb) in zip(results["AVX512"][1], results["AVX2"][1]):
        torch.testing.assert_close(la, lb, rtol=1e-6, atol=0)
        # grad_hidden is a product over the vocabulary of softmax - onehot, whose terms cancel: an ulp of a
        # softmax value shows relative to the largest gradient, not to each
        tol = (1e-6 if ga.dtype == torch.float32 else 8e-3) * gb.abs().max().item()
        torch.testing.assert_close(ga.float(), gb.float(), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_forward_backward(dtype, monkeypatch):
    """GELU's tanh approximation (x * sigmoid(2u) in the loop) against float64 truth and ATen's gelu; a length
    that is no multiple of the loop's 2048-value blocks, and in place (linear_gelu writes over its product)."""
    from kiln.kernels import activations
    torch.manual_seed(0)
    x = (torch.randn(3, 2500) * 4).to(dtype)
    grad = torch.randn(3, 2500).to(dtype)
    xd, gd = x.double().requires_grad_(), grad.double()
    want = F.gelu(xd, approximate="tanh")
    want.backward(gd)
    fp32 = dtype == torch.float32        # bf16 runs by table (the test below)
    calls = _used(monkeypatch, "kiln_gelu_tanh" if fp32 else "kiln_lut_bf16")
    _compare(lambda: activations.gelu(x, "tanh"), (want.detach(),))
    calls_b = _used(monkeypatch, "kiln_gelu_tanh_backward" if fp32 else "kiln_lut_scale_bf16")
    _compare(lambda: activations.gelu_backward(grad, x, "tanh"), (xd.grad,))
    assert calls and calls_b
    inplace = x.clone()
    assert activations.gelu(inplace, "tanh", out=inplace) is inplace
    assert torch.equal(inplace, activations.gelu(x, "tanh"))
    inplace = grad.clone()
    activations.gelu_backward(inplace, x, "tanh", out=inplace)
    assert torch.equal(inplace, activations.gelu_backward(grad, x, "tanh"))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bf16_gelu_by_table(approximate, monkeypatch):
    """bf16 GELU by table: the forward is ATen's own result for every one of the 65536 bf16 values (NaN as NaN),
    whatever the offset into the loop; the backward (alone, and with its column sums) is within one bf16
    rounding of the float64 truth, as close as ATen's, in place too; fp32 exact GELU is not taken."""
    from kiln.kernels import activations
    calls = _used(monkeypatch, "kiln_lut_bf16")
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for offset in (0, 1, 7):
        x = every[offset:].contiguous()
        torch.testing.assert_close(activations.gelu(x, approximate), F.gelu(x, approximate=approximate), rtol=0,
                                   atol=0, equal_nan=True)
    assert len(calls) == 3
    torch.manual_seed(0)
    x = (torch.randn(257, 96) * 3).bfloat16()
    grad = torch.randn(257, 96).bfloat16()
    truth = torch.ops.aten.gelu_backward(grad.double(), x.double(), approximate=approximate)
    aten_err = (torch.ops.aten.gelu_backward(grad, x, approximate=approximate).double() - truth).abs()
    half_ulp = truth.abs() * 2 ** -8 + 1e-38
    outs = (activations.gelu_backward(grad, x, approximate), activations.gelu_backward_sums(grad, x, approximate)[0])
    for got in outs:
        err = (got.double() - truth).abs()
        assert (err <= half_ulp * 1.01).all() and err.sum() <= aten_err.sum()
    assert torch.equal(outs[0], outs[1])
    inplace = grad.clone()
    assert activations.gelu_backward(inplace, x, approximate, out=inplace) is inplace and torch.equal(inplace, outs[0])
    sums = activations.gelu_backward_sums(grad, x, approximate)[1]
    torch.testing.assert_close(sums.double(), outs[0].double().sum(0), rtol=2 ** -7, atol=1e-3)
    before = len(calls)
    activations.gelu(x.float(), "none")
    assert len(calls) == before


def test_gelu_tanh_extremes_and_nan():
    """The tails (exp over- and underflow inside the sigmoid) agree with ATen's gelu to within 1e-20 (far out on
    the negative side ATen's 1 + tanh(u) is exactly 0 where x * sigmoid(2u) is a tiny number); NaN stays NaN."""
    from kiln.kernels import activations
    x = torch.tensor([[-1e4, -100.0, -20.0, -9.0, -1e-30, 0.0, 1e-30, 9.0, 20.0, 100.0, 1e4, float("nan")]])
    got, want = activations.gelu(x, "tanh"), F.gelu(x, approximate="tanh")
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-20, equal_nan=True)
    g = activations.gelu_backward(torch.ones_like(x), x, "tanh")
    assert torch.allclose(g, torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="tanh"), rtol=1e-5,
                          atol=1e-20, equal_nan=True)
    assert torch.isnan(got[0, -1]) and torch.isnan(g[0, -1]) and torch.isfinite(g[0, :-1]).all()


def test_rms_norm_nan_propagates():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    out, rstd = kiln_ops.rms_norm(x, torch.ones(32), 1e-6)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()


def test_results_do_not_depend_on_the_thread_count():
    """Forward results are bitwise the same on 1 and 2 threads; the weight gradient's per-thread partial sums
    (double) round to the same float32 here."""
    torch.manual_seed(0)
    x, g = torch.randn(513, 128, dtype=torch.bfloat16), torch.randn(513, 128, dtype=torch.bfloat16)
    w = torch.rand(128) + 0.5
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, rstd = kiln_ops.rms_norm(x, w, 1e-6)
            outs.append((out, rstd, *kiln_ops.rms_norm_backward(g, None, x, w, rstd)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=0)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][2], outs[1][2])


def test_every_isa_build_agrees(monkeypatch):
    """The AVX2 and plain builds (what an AVX2-only CPU or ATEN_CPU_CAPABILITY=avx2 gets) compute the same."""
    torch.manual_seed(0)
    gu = torch.randn(64, 600)
    want = kiln_ops.swiglu(gu[:, :300], gu[:, 300:])
    for isa in ("AVX2", "DEFAULT"):
        lib = native._library(isa)
        assert lib is not None
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        assert torch.allclose(kiln_ops.swiglu(gu[:, :300], gu[:, 300:]), want, rtol=1e-6, atol=1e-7)


def _no_installed(monkeypatch) -> None:
    """As where `pip install` built no library (or one for other sources): the build on first use is tested."""
    monkeypatch.setattr(native, "_installed", lambda isa: None)


def test_the_library_installed_for_these_sources_is_loaded_and_no_other(monkeypatch, tmp_path):
    """setup.py's library (named by the sources' and flags' digest) is loaded instead of a build; a library
    built for other sources (an edited checkout) is not: the cache's build runs instead."""
    from kiln.kernels import native_build
    isa = "DEFAULT"                 # the quickest to build
    here = tmp_path / "pkg"
    here.mkdir()
    for src in native_build.SOURCES:
        (here / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(native_build, "HERE", here)
    monkeypatch.setattr(native_build, "SOURCES", tuple(here / p.name for p in native_build.SOURCES))
    monkeypatch.setattr(native_build, "SOURCE", here / "native.c")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    stem = native_build.installed_stem(isa, native_build.flags(isa))
    assert native._installed(isa) is None
    lib = here / (stem + sysconfig.get_config_var("EXT_SUFFIX"))
    native_build.compile_library(shutil.which("cc"), native_build.flags(isa), str(lib))
    native._library.cache_clear()
    try:
        assert native._installed(isa) == lib and native._library(isa) is not None
        assert native._loaded[isa] == str(lib) and not (tmp_path / "cache").exists()
        with open(here / "native_lut.c", "a") as f:         # the sources change: that library is not theirs
            f.write("\n/* edited */\n")
        assert native._installed(isa) is None
        native._library.cache_clear()
        assert native._library(isa) is not None and native._loaded[isa].startswith(str(tmp_path / "cache"))
    finally:
        native._library.cache_clear()


def test_disabled_or_unbuildable_runs_the_compositions(monkeypatch, tmp_path, caplog):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    want = _run(lambda: kiln_ops.rms_norm(x, torch.ones(8), 1e-6), False)[0]
    monkeypatch.setenv("KILN_NATIVE", "0")
    assert native.library() is None
    monkeypatch.delenv("KILN_NATIVE")
    _no_installed(monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            assert native.library() is None
            assert torch.equal(kiln_ops.rms_norm(x, torch.ones(8), 1e-6)[0], want)
        assert "no C compiler" in caplog.text
    finally:
        native._library.cache_clear()


def test_a_folder_others_can_write_is_not_loaded_from(monkeypatch, tmp_path, caplog):
    """A shared library is code: the build folder must be this user's alone."""
    cache = tmp_path / "cache"
    (cache / "native").mkdir(parents=True)
    os.chmod(cache / "native", 0o777)
    _no_installed(monkeypatch)
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))
    native._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kiln"):
            assert native.library() is None
        assert "writable by others" in caplog.text
        assert not list((cache / "native").iterdir())
    finally:
        native._library.cache_clear()


def test_the_build_is_cached_privately(monkeypatch, tmp_path):
    _no_installed(monkeypatch)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        assert native.library() is not None
        folder = tmp_path / "cache" / "native"
        built = [p for p in folder.iterdir()]
        assert len(built) == 1 and built[0].suffix == ".so" and not built[0].name.startswith(".")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        native._library.cache_clear()


def _wrapped_cc(monkeypatch, tmp_path, before: str) -> None:
    """$CC: a shell script running `before`, then the real cc; a fresh cache folder; the build forgotten."""
    import shutil
    cc = tmp_path / "cc-wrapped"
    cc.write_text(f"#!/bin/sh\n{before}\nexec {shutil.which('cc')} \"$@\"\n")
    cc.chmod(0o755)
    _no_installed(monkeypatch)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    native._library.cache_clear()


def test_a_compiler_without_openmp_builds_a_one_thread_library(monkeypatch, tmp_path, caplog):
    """Apple's clang has no -fopenmp: the loops are built without it (one thread) and still compute right."""
    _wrapped_cc(monkeypatch, tmp_path, "for a in \"$@\"; do [ \"$a\" = -fopenmp ] && { echo 'unsupported option "
                "-fopenmp' >&2; exit 1; }; done")
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            assert native.library() is not None
        assert "without OpenMP" in caplog.text
        torch.manual_seed(0)
        gu = torch.randn(64, 600)
        got = kiln_ops.swiglu(gu[:, :300], gu[:, 300:])
        assert torch.allclose(got, F.silu(gu[:, :300]) * gu[:, 300:], rtol=1e-6, atol=1e-7)
    finally:
        native._library.cache_clear()


def test_a_compiler_without_avx512_bf16_builds_the_fallbacks(monkeypatch, tmp_path):
    """Where the compiler cannot build the bf16 products (another architecture, an old gcc), native_attention.c
    compiles its stand-ins instead (KILN_NO_BF16_PRODUCTS builds them here): the library loads, says the
    products are not built, refuses their calls, and attention runs its other paths, as close to float64."""
    _wrapped_cc(monkeypatch, tmp_path, 'set -- -DKILN_NO_BF16_PRODUCTS "$@"')
    try:
        lib = native.library()
        assert lib is not None and lib.kiln_bf16_abt_built() == 0 and native.bf16_products() is None
        assert lib.kiln_attn_forward_bf16(*[None] * 8, 0, *[None] * 4, 1, 1, 1, 1, 1, 1, 1.0, 1) == 4
        assert lib.kiln_attn_backward_bf16(*[None] * 14, 0, *[None] * 4, 1, 1, 1, 1, 1, 1, 1.0, 1) == 4
        from kiln.kernels import attention
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 9, 8).bfloat16() for _ in range(3))
        out, _ = attention.flash_forward_math(q, k, v, 0.0, True)
        z = (q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5).masked_fill(
            torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(out.double(), torch.softmax(z, -1) @ v.double(), rtol=0, atol=3e-2)
    finally:
        native._library.cache_clear()


def test_zero_adamw_out_of_place_writes_nothing_before_the_commit_and_matches_atens_fused_kernel():
    """ZeRO's out-of-place AdamW (kiln.optim.adamw_update_out) by the native loops: the new parameter is
    bit for bit ATen's `_fused_adamw_` on copies (what it replaces), the moments and step stay untouched until
    the commit and then equal torch.optim.AdamW's bit for bit; a step that fails before its commit leaves them
    as they were."""
    from kiln import optim
    from kiln.transaction import step_transaction
    torch.manual_seed(0)
    n = 10007
    p, g = torch.randn(n), torch.randn(n)
    m, v, step = torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.tensor(3.0)
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01)
    want_p, want_m, want_v = p.clone(), m.clone(), v.clone()
    torch._fused_adamw_([want_p], [g], [want_m], [want_v], [], [step + 1], lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    ref = torch.nn.Parameter(p.clone())
    ref.grad = g.clone()
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch_opt.state[ref] = {"step": step.clone(), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    torch_opt.step()
    mm, vv, ss = m.clone(), v.clone(), step.clone()
    with pytest.raises(RuntimeError):
        with step_transaction():
            optim.adamw_update_out(p, g, mm, vv, ss, *hyper)
            raise RuntimeError("a collective failed")
    assert torch.equal(mm, m) and torch.equal(vv, v) and ss.item() == 3.0
    with step_transaction() as txn:
        (new_p,) = optim.adamw_update_out(p, g, mm, vv, ss, *hyper)
        assert torch.equal(mm, m) and torch.equal(vv, v)
    txn.commit()
    assert torch.equal(new_p, want_p)
    assert torch.equal(mm, torch_opt.state[ref]["exp_avg"]) and torch.equal(vv, torch_opt.state[ref]["exp_avg_sq"])
    assert ss.item() == 4.0 and torch.allclose(new_p, ref.detach(), rtol=1e-6, atol=0)


def test_explain_says_whether_the_native_loops_run(monkeypatch):
    import kiln
    from tests.models import zoo
    model, _args, batch, _loss = zoo.llama()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.01), dialects=["kiln", "sdpa", "aten"])
    step(**batch)
    text = kiln.explain(step, file=None)
    line = next(l for l in text.splitlines() if l.startswith("native loops: "))
    assert torch.backends.cpu.get_cpu_capability().lower() in line and ".so" in line
    monkeypatch.setenv("KILN_NATIVE", "0")
    assert "native loops: off (KILN_NATIVE=0)" in kiln.explain(step, file=None)


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_adamw_multi_reads_bf16_gradients_as_the_references_read_their_widened_copies(monkeypatch, native_on):
    """amp's bf16 gradients go to the multi-tensor AdamW as they are (no fp32 copy). With the native loops
    (which read bf16): parameters bit for bit `_fused_adamw_`'s on the widened gradients, moments bit for bit
    torch.optim.AdamW's (single-tensor), as ZeRO's out-of-place loop; without them, widened inside the kernel:
    all of it `_fused_adamw_`'s. Nothing is written before the commit."""
    from kiln import optim
    from kiln.transaction import step_transaction
    monkeypatch.setenv("KILN_NATIVE", native_on)
    torch.manual_seed(0)
    shapes = [(37, 11), (10007,), (64, 64)]
    ps = [torch.randn(s) for s in shapes]
    gs = [torch.randn(s).bfloat16() for s in shapes[:2]] + [torch.randn(shapes[2])]     # mixed: one fp32
    ms = [torch.randn(s) * 0.1 for s in shapes]
    vs = [torch.rand(s) * 0.01 for s in shapes]
    steps = [torch.tensor(float(t)) for t in (0, 3, 7)]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    wp, wm, wv = [[t.clone() for t in ts] for ts in (ps, ms, vs)]
    torch._fused_adamw_(wp, [g.float() for g in gs], wm, wv, [], [s + 1 for s in steps], lr=1e-3, beta1=0.9,
                        beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    refs = [torch.nn.Parameter(p.clone()) for p in ps]
    torch_opt = torch.optim.AdamW(refs, foreach=False, **hyper)
    for r, g, m, v, s in zip(refs, gs, ms, vs, steps):
        r.grad = g.float()
        torch_opt.state[r] = {"step": s.clone(), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    torch_opt.step()
    gp, gm, gv = [[t.clone() for t in ts] for ts in (ps, ms, vs)]
    ss = [s.clone() for s in steps]
    with step_transaction() as txn:
        optim.adamw_update_multi(gp, gs, gm, gv, ss, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        assert all(torch.equal(a, b) for a, b in zip(gp + gm + gv, ps + ms + vs))
        assert [s.item() for s in ss] == [0.0, 3.0, 7.0]          # the step counts too, until the commit
    versions = [s._version for s in ss]
    txn.commit()
    assert all(s._version > v for s, v in zip(ss, versions))    # written as an in-place write would be
    assert all(torch.equal(a, b) for a, b in zip(gp, wp))
    if native_on == "1":
        wm = [torch_opt.state[r]["exp_avg"] for r in refs]
        wv = [torch_opt.state[r]["exp_avg_sq"] for r in refs]
    assert all(torch.equal(a, b) for a, b in zip(gm + gv, wm + wv))
    assert [s.item() for s in ss] == [1.0, 4.0, 8.0]


def test_prepare_builds_once_beside_the_caller(monkeypatch, tmp_path):
    """kiln.compile starts the build in a thread (`native.prepare`); a kernel needing the library meanwhile
    waits for that build instead of starting its own."""
    import threading
    log = tmp_path / "builds"
    _wrapped_cc(monkeypatch, tmp_path, f"case \"$*\" in *-shared*) echo build >> {log};; esac")
    monkeypatch.setattr(native, "_loaded", {})
    try:
        native.prepare()
        native.prepare()                                  # a second compile while the first builds: no second
        lib = native.library()
        for t in threading.enumerate():
            if t.name == "kiln-native-build":
                t.join()
        assert lib is not None and native.library() is lib
        assert log.read_text().split() == ["build"]
        native.prepare()                                  # built: nothing to do
        assert not any(t.name == "kiln-native-build" for t in threading.enumerate())
    finally:
        native._library.cache_clear()


def _finite_truth(tensors):
    return next((i for i, t in enumerate(tensors) if not bool(torch.isfinite(t).all())), None)


@pytest.mark.parametrize("isa", ["native", "AVX2", "DEFAULT"])
def test_the_nonfinite_scan_agrees_with_isfinite(isa, monkeypatch):
    """kiln_first_nonfinite against torch.isfinite: NaN, +-inf (and bf16's) at the first and last element and
    on both sides of its chunk boundaries, in any tensor of a mixed list; the largest finite values, denormals
    and -0 are finite; non-dense and float64 tensors take torch.isfinite beside the scan."""
    if isa != "native":
        lib = native._library(isa)
        monkeypatch.setattr(native, "library", lambda: lib)
    calls = _used(monkeypatch, "kiln_first_nonfinite")
    torch.manual_seed(0)
    edge = [torch.finfo(d).max for d in DTYPES] + [torch.finfo(torch.float32).tiny / 4, -0.0]
    base = [torch.randn(3), torch.randn(140000, dtype=torch.bfloat16), torch.randn(300, 700).t(),
            torch.randn(1, dtype=torch.bfloat16).squeeze(), torch.randn(8, 6)[:, ::2], torch.randn(5).double(),
            torch.randn(65537), torch.tensor(edge), torch.tensor(edge[1:], dtype=torch.bfloat16), torch.empty(0)]
    assert native.first_nonfinite(base) is None and calls
    for i, t in enumerate(base):
        n = t.numel()
        for pos in {0, n - 1, n // 2, min(65535, n - 1), min(65536, n - 1), min(131072, n - 1)} if n else ():
            for value in (float("nan"), float("inf"), float("-inf")):
                poisoned = [u.clone() if j == i else u for j, u in enumerate(base)]
                if not poisoned[i].is_contiguous() and poisoned[i].dim() == 2 and i == 2:
                    poisoned[i] = base[i].t().clone().t()        # keep the transposed (dense) layout
                flat = poisoned[i].reshape(-1) if poisoned[i].is_contiguous() else None
                if flat is not None:
                    flat[pos] = value
                else:
                    poisoned[i][tuple(int(k) for k in torch.unravel_index(torch.tensor(pos), poisoned[i].shape))] = value
                poisoned[-2] = torch.tensor([1.0, float("nan")])     # a later poisoned tensor never wins
                assert native.first_nonfinite(poisoned) == _finite_truth(poisoned) == i, (i, pos, value)


def test_the_guard_in_a_compiled_step_is_the_scan():
    """The kiln dialect runs the guard as the scan on CPU; with the dialect off, ATen's norms run: both
    refuse a step with a NaN in the batch and write nothing."""
    import kiln

    for dialects in (None, ["aten"]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        step = kiln.compile(model, loss_fn=lambda m, x, y: F.cross_entropy(m(x), y),
                            optimizer=kiln.optim.AdamW(lr=1e-2), dialects=dialects)
        x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
        step(x, y)
        guard = [n.impl.label for n in step.graph.nodes if n.op.name == "kiln.check_finite"]
        assert guard == (["kiln:finite_scan"] if dialects is None else ["aten:guard"]), guard
        before = [p.detach().clone() for p in model.parameters()]
        x[1, 2] = float("nan")
        with pytest.raises(kiln.NonFiniteError, match="unchanged"):
            step(x, y)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_tied_embedding_sum_is_atens_two_ops_bit_for_bit(monkeypatch):
    """kiln_embedding_backward_acc against aten.embedding_dense_backward + acc: repeated ids (summed in token
    order), a padding row, int32 ids, NaN and inf in the gradients, -0 in acc, a bf16 addend (widened first, as
    its fp32 cast would be); scale_grad_by_freq and all-bf16 take the ATen ops; an id outside the vocabulary
    raises before anything is written."""
    from kiln.kernels.embedding import embedding_backward_acc
    calls = _used(monkeypatch, "kiln_embedding_backward_acc")
    torch.manual_seed(0)
    grad = torch.randn(6, 50, 24) * torch.logspace(-3, 3, 50).reshape(1, 50, 1)
    ids = torch.randint(0, 30, (6, 50))
    grad[0, 0, 0], grad[1, 1, 1], ids[0, 0], ids[1, 1] = float("nan"), float("inf"), 7, 8
    acc = torch.randn(30, 24)
    acc[29] = -0.0
    ids[ids == 29] = 28
    f32, bf16 = torch.float32, torch.bfloat16
    for index, pad, freq, g_dt, a_dt in ((ids, -1, False, f32, f32), (ids, 5, False, f32, f32),
                                         (ids.int(), 3, False, f32, f32), (ids, -1, True, f32, f32),
                                         (ids, 2, False, f32, bf16), (ids, -1, False, bf16, f32),
                                         (ids, -1, False, bf16, bf16)):
        before = len(calls)
        g, a = grad.to(g_dt), acc.to(a_dt)
        dt = torch.promote_types(g_dt, a_dt)
        want = aten.embedding_dense_backward(g.to(dt), index, 30, pad, freq) + a.to(dt)
        (got,) = embedding_backward_acc(g, index, 30, pad, freq, a)
        bits = torch.int32 if dt == f32 else torch.int16
        assert got.dtype == dt and torch.equal(got.view(bits), want.view(bits)), (pad, freq, g_dt, a_dt)
        assert (len(calls) > before) == (not freq and dt == f32)
    with pytest.raises(IndexError, match="index 30 is out of range for 30 rows"):
        embedding_backward_acc(grad, torch.full((6, 50), 30), 30, -1, False, acc)


def test_the_loss_kernels_scaled_gradients_are_atens_mul_and_cast(monkeypatch):
    """kiln_scale (the fused loss's backward scaling its two gradients) against `(x * factor).to(dtype)`: the same
    values bit for bit (NaN as NaN) over 60 decades, including denormal products; a bf16 product widened to fp32
    and a promoting factor take ATen's ops."""
    import importlib
    ce = importlib.import_module("kiln.kernels.cross_entropy")
    calls = _used(monkeypatch, "kiln_scale")
    torch.manual_seed(0)
    f32, bf16 = torch.float32, torch.bfloat16
    for x_dt, f_dt, out_dt, native_runs in ((f32, f32, bf16, True), (f32, f32, f32, True), (bf16, bf16, bf16, True),
                                            (bf16, bf16, f32, False), (bf16, f32, bf16, False)):
        before = len(calls)
        x = (torch.randn(300, 64) * torch.logspace(-30, 30, 64)).to(x_dt)
        x[0, 0], x[0, 1], x[1, 0] = float("nan"), float("inf"), -0.0
        factor = torch.tensor(1 / 2047).to(f_dt)
        got, want = ce._scaled(x, factor, out_dt), (x * factor).to(out_dt)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert (len(calls) > before) == native_runs, (x_dt, f_dt, out_dt)


def test_the_loss_kernels_weight_gradient_widens_in_place(monkeypatch):
    """kiln_widen_acc (the fused loss's bf16 weight gradient summed over blocks of rows in fp32) gives the bits of
    ATen's `x.to(float32)` and `acc.add_(x)`, specials included; the bf16 loss kernel sums its blocks with it and
    its weight gradient is bit for bit the one ATen's widening and adds give."""
    import importlib
    ce = importlib.import_module("kiln.kernels.cross_entropy")
    calls = _used(monkeypatch, "kiln_widen_acc")
    torch.manual_seed(0)
    x = (torch.randn(257, 33) * 1e3).bfloat16()
    x.view(-1)[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, -0.0, 3e38]).bfloat16()
    acc = torch.randn(257, 33) * 1e3
    assert torch.equal(ce._widened(x, None).view(torch.int32), x.float().view(torch.int32))
    want = acc.clone().add_(x)
    got = acc.clone()
    assert ce._widened(x, got) is got
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert len(calls) == 2
    for args in ((x.t(), None), (x.float(), None)):                 # not dense bf16: ATen's
        torch.testing.assert_close(ce._widened(*args), args[0].float(), rtol=0, atol=0, equal_nan=True)

    h, w = torch.randn(96, 64).bfloat16(), (torch.randn(300, 64) * 0.1).bfloat16()
    y = torch.randint(0, 300, (96,))
    native_out = ce.linear_cross_entropy_grads_op(h, w, y, -100, "mean", 32)
    assert len(calls) == 2 + 3                                     # three blocks of 32 rows
    monkeypatch.setattr(ce, "_widened", lambda x, acc: x.float() if acc is None else acc.add_(x))
    aten_out = ce.linear_cross_entropy_grads_op(h, w, y, -100, "mean", 32)
    for got, want in zip(native_out, aten_out):
        assert torch.equal(got, want)
