"""Attention's forward as products and row passes (kiln/kernels/attention.py `flash_forward_math`) against float64
of the same (rounded) inputs, beside ATen's CPU flash forward, which it stands in for where measured faster; and
the bf16 products with fp32 results it and the backward use (native_attention.c `kiln_bf16_abt`)."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.kernels import attention, native

aten = torch.ops.aten
MODES = ["bf16-products", "native", "aten"]      # dpbf16 products + native passes; native passes only; ATen ops


def _mode(mode, monkeypatch):
    if mode != "aten" and native.library() is None:
        pytest.skip("no C compiler: the ATen elementwise ops run")
    if mode in ("bf16-products", "amx") and native.bf16_products() is None:
        pytest.skip("no AVX-512 BF16 here (or ATen runs its AVX2 kernels)")
    monkeypatch.setenv("KILN_NATIVE", "0" if mode == "aten" else "1")
    # "bf16-products": the pair dot products (AMX's tiles off); "amx": AMX tiles' products, where the CPU has them
    monkeypatch.setenv("KILN_AMX", "1" if mode == "amx" else "0")
    if mode == "amx" and not native.amx_tiles():
        pytest.skip("no AMX tiles here")
    if mode == "native":
        monkeypatch.setattr(attention, "_bf16_products", lambda: None)


def _inputs(dtype, mask_kind, b=2, h=3, t=40, s=40, d=16):
    torch.manual_seed(0)
    # q/k/v as projections make them: (b, t, h, d) seen as (b, h, t, d); q and k scaled up so that the
    # probabilities are far from uniform
    q, k, v = [(torch.randn(b, n, h, d) * c).to(dtype).transpose(1, 2) for n, c in ((t, 2), (s, 2), (s, 1))]
    mask, causal = masks(mask_kind, b, h, t, s, dtype)
    return (q, k, v), dict(causal=causal, mask=mask)


def masks(kind, b, h, t, s, dtype):
    """(attn_mask, is_causal) of a kind: None, additive (keys masked in one batch), per-head, bool, causal."""
    mask, causal = None, False
    if kind == "additive":
        mask = torch.zeros(b, 1, t, s, dtype=dtype)
        mask[1, :, :, -5:] = float("-inf")
    elif kind == "per-head":
        mask = torch.randn(b, h, t, s, dtype=dtype)
    elif kind == "bool":
        mask = torch.rand(b, h, t, s) > 0.3
    elif kind == "causal":
        causal = True
    return mask, causal


def _flash(q, k, v, causal, mask):
    if mask is not None and mask.dtype == torch.bool:      # as the sdpa lowering hands it to the kernel
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)[:2]


def _truth(q, k, v, causal, mask):
    z = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask.double()
    if causal:
        z = z.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(z, -1) @ v.double(), torch.logsumexp(z, -1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["additive", "per-head", "bool", "causal", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_as_well_as_flash(dtype, mask_kind, mode, monkeypatch):
    if mode == "bf16-products" and dtype != torch.bfloat16:
        pytest.skip("the bf16 products are for bf16 inputs")
    _mode(mode, monkeypatch)
    (q, k, v), kw = _inputs(dtype, mask_kind)
    out, lse = attention.flash_forward_math(q, k, v, 0.0, kw["causal"], attn_mask=kw["mask"])
    f_out, f_lse = _flash(q, k, v, kw["causal"], kw["mask"])
    t_out, t_lse = _truth(q, k, v, kw["causal"], kw["mask"])
    assert out.dtype == dtype and out.shape == f_out.shape and lse.dtype == torch.float32 and lse.shape == f_lse.shape
    _as_accurate_as_flash(out, lse, f_out, f_lse, t_out, t_lse, dtype)


def _as_accurate_as_flash(out, lse, f_out, f_lse, t_out, t_lse, dtype):
    eps = torch.finfo(dtype).eps
    for what, mine, theirs, exact in (("out", out, f_out, t_out), ("lse", lse, f_lse, t_lse)):
        err, flash_err = ((x.double() - exact).abs() for x in (mine, theirs))
        scale = exact.abs().max().item()
        assert err.max() <= flash_err.max() + 4 * eps * scale, \
            f"{what}: {err.max():.3g} against flash's {flash_err.max():.3g}"
        assert err.mean() <= 1.25 * flash_err.mean() + eps * scale / 100, \
            f"{what}: mean {err.mean():.3g} against flash's {flash_err.mean():.3g}"


# the one-pass bf16 forward's edges: tiles of 8 queries and 32 keys or values (partial ones), odd head dims (pairs
# padded), a value head dim of its own, causal with fewer queries than keys, one query, masks broadcast over heads
EDGES = [dict(t=1, s=7, d=64, dv=64), dict(t=13, s=45, d=5, dv=40, mask="bcast"), dict(t=33, s=70, d=16, dv=16),
         dict(t=70, s=33, d=31, dv=9, mask="per-head"), dict(t=200, s=200, d=64, dv=64, mask="bool")]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", EDGES, ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()))
def test_bf16_forward_at_the_edges_of_its_tiles(shape, causal, monkeypatch):
    _mode("bf16-products", monkeypatch)
    torch.manual_seed(1)
    b, h, t, s, d, dv = 2, 3, shape["t"], shape["s"], shape["d"], shape["dv"]
    q, k, v = [(torch.randn(b, n, h, e) * c).bfloat16().transpose(1, 2) for n, e, c in ((t, d, 2), (s, d, 2), (s, dv, 1))]
    kind = shape.get("mask") if not causal else None
    mask = {"bcast": lambda: torch.randn(t, s).bfloat16().expand(b, h, t, s), None: lambda: None,
            "per-head": lambda: torch.randn(b, h, t, s).bfloat16(), "bool": lambda: torch.rand(b, h, t, s) > 0.3}[kind]()
    out, lse = attention.flash_forward_math(q, k, v, 0.0, causal, attn_mask=mask)
    t_out, t_lse = _truth(q, k, v, causal, mask)
    # ATen's flash layout: (b, t, h, dv) seen as (b, h, t, dv), as the graph's fake tensors have it
    assert out.shape == (b, h, t, dv) and out.transpose(1, 2).is_contiguous() and lse.shape == (b, h, t)
    if d == dv:
        _as_accurate_as_flash(out, lse, *_flash(q, k, v, causal, mask), t_out, t_lse, torch.bfloat16)
    # either way within a few bf16 roundings of float64 (the output is rounded once, from fp32 sums of bf16
    # probabilities, each rounded once)
    torch.testing.assert_close(out.double(), t_out, rtol=0, atol=8 * 2 ** -8 * t_out.abs().max().item())
    torch.testing.assert_close(lse.double(), t_lse, rtol=1e-5, atol=1e-5)


def test_bf16_forward_keeps_a_nan_to_its_own_query():
    """A NaN query gives NaN for that query's output and log-sum-exp only; an infinite value a non-finite output
    column for the queries that see its key (and, as in eager's math attention, where a probability of 0 meets
    it: 0 * inf), no other column."""
    if native.bf16_products() is None:
        pytest.skip("no AVX-512 BF16 here (or ATen runs its AVX2 kernels)")
    (q, k, v), _ = _inputs(torch.bfloat16, None)
    q[0, 1, 9, 3] = float("nan")
    v[1, 2, 20, 0] = float("inf")
    for causal in (False, True):
        out, lse = attention.flash_forward_math(q, k, v, 0.0, causal)
        bad = torch.zeros(out.shape[:3], dtype=torch.bool)
        bad[0, 1, 9] = True
        assert torch.equal(lse.isnan(), bad) and out[bad].isnan().all()
        seen = torch.zeros_like(bad)
        seen[1, 2, 20 if causal else 0:] = True        # the queries that see key 20
        other_heads = torch.ones_like(bad)
        other_heads[1, 2] = False
        assert (~torch.isfinite(out[..., 0]))[seen].all() and torch.isfinite(out[..., 0][other_heads & ~bad]).all()
        assert torch.equal(~torch.isfinite(out[..., 1:]).all(-1), bad)


@pytest.mark.parametrize("mode", MODES)
def test_a_fully_masked_row_gives_what_flash_gives(mode, monkeypatch):
    """Zeros, and a log-sum-exp of 0 (ATen's CPU flash forward), which its backward and math_backward both read
    as no gradient through the row."""
    _mode(mode, monkeypatch)
    (q, k, v), _ = _inputs(torch.bfloat16, None)
    mask = torch.zeros(2, 3, 40, 40, dtype=torch.bfloat16)
    mask[0, 1, 7] = float("-inf")
    out, lse = attention.flash_forward_math(q, k, v, 0.0, False, attn_mask=mask)
    f_out, f_lse = _flash(q, k, v, False, mask)
    assert out[0, 1, 7].abs().max() == 0 and lse[0, 1, 7] == f_lse[0, 1, 7] == 0
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_head_groups_cover_every_head(monkeypatch):
    (q, k, v), kw = _inputs(torch.float32, "per-head", h=5)
    whole = attention.flash_forward_math(q, k, v, 0.0, False, attn_mask=kw["mask"])
    monkeypatch.setattr(attention, "GROUP_BYTES", 2 * 40 * 40 * 4)        # 2 heads a group
    grouped = attention.flash_forward_math(q, k, v, 0.0, False, attn_mask=kw["mask"])
    for a, b in zip(whole, grouped):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_either_forward_feeds_either_backward(dtype):
    """The tuner picks the forward and the backward separately: the math forward's output and log-sum-exp,
    given to ATen's flash backward, give flash's gradients (and the other way round)."""
    (q, k, v), kw = _inputs(dtype, "causal")
    g = torch.randn(q.shape, dtype=dtype)
    f_out, f_lse = _flash(q, k, v, True, None)
    m_out, m_lse = attention.flash_forward_math(q, k, v, 0.0, True)
    back = aten._scaled_dot_product_flash_attention_for_cpu_backward
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for a, b in zip(back(g, q, k, v, m_out, m_lse, 0.0, True), back(g, q, k, v, f_out, f_lse, 0.0, True)):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(attention.flash_backward_math(g, q, k, v, f_out, f_lse, 0.0, True),
                    attention.flash_backward_math(g, q, k, v, m_out, m_lse, 0.0, True)):
        torch.testing.assert_close(a, b, **tol)


def _operands(layout: str, m: int, n: int, k: int, causal: bool = False):
    """bf16 (a, b) for `_products` in `layout` ("abt": a @ b^T, "kn": a @ b, "at": a^T @ b) and the product's
    float64 operands (m x k, k x n per matrix). Causal: scores' queries i, keys j; for kn a holds probabilities
    (queries m x keys k, 0 past the diagonal), for at their transpose's source (queries k x keys m, 0 past it)."""
    if layout == "abt":
        a = torch.randn(3, m, k + 5).to(torch.bfloat16)[:, :, 2:k + 2]       # rows 5 elements apart
        b = torch.randn(3, n, k).to(torch.bfloat16)
        return a, b, a.double(), b.double().transpose(1, 2)
    if layout == "kn":
        a = torch.randn(3, m, k + 5)[:, :, 2:k + 2]
        a = (a.tril() if causal else a).to(torch.bfloat16)
        b = torch.randn(3, k, n).to(torch.bfloat16)
        return a, b, a.double(), b.double()
    a = torch.randn(3, k, m + 5)[:, :, 2:m + 2]                                 # (queries k, keys m)
    a = (a.tril() if causal else a).to(torch.bfloat16)
    b = torch.randn(3, k, n).to(torch.bfloat16)
    return a, b, a.double().transpose(1, 2), b.double()


def _bound(ad, bd, k):
    return k * torch.finfo(torch.float32).eps * torch.bmm(ad.abs(), bd.abs())


def _tiles(mode, monkeypatch):
    """kiln_bf16_abt on the pair dot products ("bf16-products") or on AMX tiles ("amx", where there are)."""
    _mode(mode, monkeypatch)
    assert native.amx_tiles() == (mode == "amx")


@pytest.mark.parametrize("mode", ["bf16-products", "amx"])
@pytest.mark.parametrize("m,n,k", [(40, 40, 16), (37, 53, 64), (8, 32, 2), (9, 33, 7), (256, 64, 197), (1, 1, 1),
                                   (70, 100, 96)])
@pytest.mark.parametrize("layout", ["abt", "kn", "at"])
def test_bf16_products_are_fp32_accurate(m, n, k, layout, mode, monkeypatch):
    """kiln_bf16_abt against float64, within the error bound of an fp32 dot product of length k (|error| at
    most k eps |a| |b|; row and column tails, odd k, strided rows, either operand given either way round, k over
    several of AMX's steps of 32); a bf16 `out` gets those fp32 sums rounded once."""
    _tiles(mode, monkeypatch)
    torch.manual_seed(0)
    a, b, ad, bd = _operands(layout, m, n, k)
    flags = dict(kn=layout == "kn", at=layout == "at")
    got = attention._products(a, b, **flags)
    exact = torch.bmm(ad, bd)
    assert got.dtype == torch.float32 and got.shape == (3, m, n)
    assert ((got.double() - exact).abs() <= _bound(ad, bd, k)).all(), (got.double() - exact).abs().max()
    rounded = torch.full((3, m, n), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(attention._products(a, b, out=rounded, **flags), got.to(torch.bfloat16))
    a[0, 0, 0] = float("nan")                      # in the product's row 0 for every layout
    assert attention._products(a, b, **flags)[0, 0].isnan().all()     # NaN stays NaN (no flush to a number)


@pytest.mark.parametrize("mode", ["bf16-products", "amx"])
@pytest.mark.parametrize("m,n,k", [(40, 40, 16), (37, 53, 64), (9, 33, 7), (256, 256, 64), (70, 30, 5), (30, 20, 70),
                                   (100, 64, 100)])
@pytest.mark.parametrize("layout", ["abt", "kn", "at"])
def test_causal_bf16_products_skip_only_what_the_mask_makes_irrelevant(m, n, k, layout, mode, monkeypatch):
    """With `causal` (query i sees keys j <= i): scores a @ b^T are fp32-accurate for j <= i and a finite
    number (0 where a tile was skipped) above the diagonal, whatever `out` held, since dS = P * (dP - delta)
    multiplies them by a probability of 0; probabilities (zero past the diagonal) times b (kn: dO's, rows over
    keys) and their transpose times b (at: dV = P^T dO, dK = dS^T q, each key's sum over the queries that see
    it) equal the whole product, in fp32 and rounded to bf16."""
    _tiles(mode, monkeypatch)
    torch.manual_seed(0)
    a, b, ad, bd = _operands(layout, m, n, k, causal=True)
    flags = dict(kn=layout == "kn", at=layout == "at")
    out = torch.full((3, m, n), float("nan"))
    got = attention._products(a, b, out=out, causal=True, **flags)
    exact = torch.bmm(ad, bd)
    counted = torch.ones(m, n, dtype=torch.bool) if layout != "abt" else torch.ones(m, n, dtype=torch.bool).tril()
    err = (got.double() - exact).abs()
    assert (err <= _bound(ad, bd, k))[:, counted].all(), err[:, counted].max()
    assert torch.isfinite(got).all()
    if layout != "abt":
        whole = attention._products(a, b, out=torch.empty(3, m, n, dtype=torch.bfloat16), **flags)
        assert torch.equal(attention._products(a, b, out=torch.empty_like(whole), causal=True, **flags), whole)
    elif m >= 64 and n >= 64:
        assert (got[:, :8, 32:] == 0).all()              # the first row tile's keys past 31 were not computed

def _materialized_causal(b, t, s, hide=float("-inf")):
    """A causal mask as Hugging Face builds one (b, 1, t, s): 0 where a query sees a key, `hide` after it."""
    return torch.zeros(b, 1, t, s).masked_fill_(torch.ones(t, s, dtype=torch.bool).triu(1), hide)


@pytest.mark.parametrize("hide", [float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min])
def test_a_materialized_causal_mask_runs_as_is_causal(hide):
    """Exported models hand attention a causal mask instead of is_causal: the one-pass kernels recognize it
    (each query's later keys hidden, some key left) and skip what it hides: the results are is_causal's, bit
    for bit, forward and backward."""
    if native.bf16_products() is None:
        pytest.skip("no AVX-512 BF16 here (or ATen runs its AVX2 kernels)")
    (q, k, v), _ = _inputs(torch.bfloat16, None, t=70, s=70)
    mask = _materialized_causal(2, 70, 70, hide).bfloat16()
    assert attention._causal(native.bf16_products(), mask.float().expand(2, 3, 70, 70), False)
    want = attention.flash_forward_math(q, k, v, 0.0, True)
    got = attention.flash_forward_math(q, k, v, 0.0, False, attn_mask=mask)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # and both as close to float64 as ATen's flash kernel with the mask
    _as_accurate_as_flash(*got, *_flash(q, k, v, False, mask), *_truth(q, k, v, True, None), torch.bfloat16)
    g = torch.randn(q.shape).bfloat16()
    for a, b in zip(attention.flash_backward_math(g, q, k, v, *want, 0.0, False, attn_mask=mask),
                    attention.flash_backward_math(g, q, k, v, *want, 0.0, True)):
        assert torch.equal(a, b)


def test_a_causal_mask_with_padding_is_recognized_only_where_it_is_safe():
    """Padded keys at the end (each query still sees a key): causal, the padding still applied. Padded keys at
    the start (the first queries see none: eager spreads them over every key) or one later key left visible:
    not causal. Either way as close to float64 as ATen's flash kernel."""
    if native.bf16_products() is None:
        pytest.skip("no AVX-512 BF16 here (or ATen runs its AVX2 kernels)")
    lib = native.bf16_products()
    (q, k, v), _ = _inputs(torch.bfloat16, None)
    right = _materialized_causal(2, 40, 40)
    right[1, :, :, 35:] = float("-inf")
    left = _materialized_causal(2, 40, 40, torch.finfo(torch.float32).min)
    left[1, :, :, :3] = torch.finfo(torch.float32).min
    leak = _materialized_causal(2, 40, 40)
    leak[0, 0, 10, 30] = 0.0
    for mask, causal in ((right, True), (left, False), (leak, False)):
        assert attention._causal(lib, mask.expand(2, 3, 40, 40), False) is causal
        out, lse = attention.flash_forward_math(q, k, v, 0.0, False, attn_mask=mask)
        _as_accurate_as_flash(out, lse, *_flash(q, k, v, False, mask), *_truth(q, k, v, False, mask), torch.bfloat16)
