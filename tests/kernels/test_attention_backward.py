"""Attention's backward from the log-sum-exp (kiln/kernels/attention.py) against float64 autograd of the same
(rounded) inputs, beside ATen's CPU flash backward, which it stands in for where measured faster: no further
from the truth than ATen's kernel (plus a rounding of the dtype), with the native loops and without."""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch

from kiln.dialects.sdpa import flash_backward
from kiln.dialects.upcast import upcast_kernel
from kiln.kernels import attention, native
from tests.kernels.test_attention_forward import EDGES, _mode, masks

aten = torch.ops.aten


def _case(dtype, mask_kind, b=2, h=3, t=40, s=40, d=16, transposed=False):
    torch.manual_seed(0)
    if transposed:          # q/k/v as projections make them: (b, t, h, d) seen as (b, h, t, d)
        q, k, v = [torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2) for n in (t, s, s)]
    else:
        q, k, v = [torch.randn(b, h, n, d, dtype=dtype) for n in (t, s, s)]
    mask, causal = masks(mask_kind, b, h, t, s, dtype)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)[:2]
    g = torch.randn_like(out)
    return (g, q, k, v, out, lse), dict(causal=causal, mask=mask)


def _truth(g, q, k, v, causal, mask):
    qd, kd, vd = [x.double().requires_grad_() for x in (q, k, v)]
    sc = (qd @ kd.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        sc = sc + mask.double()
    if causal:
        sc = sc.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), float("-inf"))
    (torch.softmax(sc, -1) @ vd).backward(g.double())
    return qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("mask_kind", ["additive", "per-head", "causal", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_at_least_as_well_as_flash(dtype, mask_kind, native_on, monkeypatch):
    if native_on and native.library() is None:
        pytest.skip("no C compiler: the ATen elementwise ops run")
    monkeypatch.setenv("KILN_NATIVE", "1" if native_on else "0")
    args, kw = _case(dtype, mask_kind, transposed=mask_kind == "additive")
    g, q, k, v, out, lse = args
    flash = aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, 0.0, kw["causal"],
                                                                       attn_mask=kw["mask"])
    truth = _truth(g, q, k, v, kw["causal"], kw["mask"])
    eps = torch.finfo(dtype).eps
    kernels = {"math_backward": attention.flash_backward_math}
    if dtype == torch.bfloat16:                     # the dialect's other alternative, for half types
        kernels["flash_fp32"] = upcast_kernel(flash_backward)
    for label, kernel in kernels.items():
        got = kernel(*args, 0.0, kw["causal"], attn_mask=kw["mask"])
        for name, mine, theirs, exact in zip("qkv", got, flash, truth):
            assert mine.dtype == dtype and mine.shape == theirs.shape
            err_mine = (mine.double() - exact).abs().max().item()
            err_flash = (theirs.double() - exact).abs().max().item()
            scale = exact.abs().max().item()
            assert err_mine <= err_flash + 2 * eps * scale, \
                f"{label} d{name}: {err_mine:.3g} against flash's {err_flash:.3g}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", EDGES + [dict(t=300, s=300, d=64, dv=64)],
                         ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()))
@pytest.mark.parametrize("mode", ["bf16-products", "amx"])
def test_bf16_backward_at_the_edges_of_its_tiles(shape, causal, mode, monkeypatch):
    """The one-pass bf16 backward (a head per thread; tiles of 8 queries, blocks of 32 for dK and dV, partial
    ones; odd head dims; a value head dim of its own; causal with fewer queries than keys) and, where Kiln's
    products run on AMX tiles, the head-group loop on them (`one_pass=False`: tiles of 32 rows, k in
    steps of 32) against float64, as close as ATen's flash backward where that runs (the same head dim), else
    within a few bf16 roundings."""
    _mode(mode, monkeypatch)
    backward = functools.partial(attention.flash_backward_math, one_pass=mode != "amx")
    torch.manual_seed(2)
    b, h, t, s, d, dv = 2, 3, shape["t"], shape["s"], shape["d"], shape["dv"]
    q, k, v = [(torch.randn(b, n, h, e) * c).bfloat16().transpose(1, 2) for n, e, c in ((t, d, 2), (s, d, 2), (s, dv, 1))]
    kind = shape.get("mask") if not causal else None
    mask = {None: None, "bcast": torch.randn(t, s).bfloat16().expand(b, h, t, s),
            "per-head": torch.randn(b, h, t, s).bfloat16(),
            "bool": torch.zeros(b, h, t, s).masked_fill_(torch.rand(b, h, t, s) < 0.3, float("-inf")).bfloat16()}[kind]
    out, lse = attention.flash_forward_math(q, k, v, 0.0, causal, attn_mask=mask)
    g = torch.randn(out.shape).bfloat16()
    got = backward(g, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
    truth = _truth(g, q, k, v, causal, mask)
    flash = (aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal,
                                                                        attn_mask=mask) if d == dv else None)
    eps = torch.finfo(torch.bfloat16).eps
    scale = max(x.abs().max().item() for x in truth)    # (one query seeing one key: dq is 0 but for rounding)
    for i, (name, mine, exact, x) in enumerate(zip("qkv", got, truth, (q, k, v))):
        # in the layout of the input (ATen's flash backward's, as the graph's fake tensors have it)
        assert mine.shape == exact.shape and mine.dtype == torch.bfloat16 and mine.stride() == x.stride()
        err = (mine.double() - exact).abs().max().item()
        bound = (flash[i].double() - exact).abs().max().item() + 2 * eps * scale if flash else 8 * eps * scale
        assert err <= bound, f"d{name}: {err:.3g} against {bound:.3g}"


def test_head_groups_cover_every_head(monkeypatch):
    """Groups smaller than the heads (the cache-sized blocks): the result is the same as in one group."""
    args, kw = _case(torch.float32, "additive", h=5)
    whole = attention.flash_backward_math(*args, 0.0, False, attn_mask=kw["mask"])
    monkeypatch.setattr(attention, "GROUP_BYTES", 2 * 40 * 40 * 4)        # 2 heads a group
    grouped = attention.flash_backward_math(*args, 0.0, False, attn_mask=kw["mask"])
    for a, b in zip(whole, grouped):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_fully_masked_row_gets_no_gradient_through_it():
    args, kw = _case(torch.float32, None)
    g, q, k, v, out, lse = args
    lse = lse.clone()
    lse[0, 0, 3] = float("-inf")          # as the forward reports a row with nothing to attend to
    dq, dk, dv = attention.flash_backward_math(g, q, k, v, out, lse, 0.0, False)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert dq[0, 0, 3].abs().max() == 0
    if native.bf16_products() is not None:          # the one-pass bf16 backward: the same
        bf = [x.bfloat16() for x in (g, q, k, v, out)]
        dq, dk, dv = attention.flash_backward_math(*bf, lse, 0.0, False)
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
        assert dq[0, 0, 3].abs().max() == 0


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_the_step_trains_like_eager_with_the_measured_backward(amp, monkeypatch):
    """A compiled step whose attention forward and backward are the `attention` dialect's (every measured kernel
    kept, faster here or not: `math_forward`, and the first of the backward's, `math_backward`) trains as eager
    does (in bf16 on a CPU without native bf16
    the `upcast` dialect runs the backward instead)."""
    from kiln.passes.amp import cpu_has_native
    from tests.models.reference import sgd_like_eager
    monkeypatch.setenv("KILN_KEEP", "all")
    step = sgd_like_eager("llama", amp, tuning="ahead")
    labels = {n.impl.label for n in step.graph.nodes
              if n.target in (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                              aten._scaled_dot_product_flash_attention_for_cpu.default,
                              attention.forward_keeping_probs, attention.backward_from_probs)}
    if amp is None:
        assert labels == {"attention:math_backward", "attention:math_forward"}, labels
    elif attention.keeps_probs_here():       # the pair that keeps P (kiln/passes/keep_probs.py): the same kernels
        assert labels == {"attention:keep_probs", "attention:from_probs"}, labels
    elif cpu_has_native(torch.bfloat16):
        assert labels == {"attention:math_backward", "attention:math_forward"}, labels
    assert os.environ["KILN_KEEP"] == "all"


def test_the_step_trains_like_eager_with_the_tiles_backward(monkeypatch):
    """Where Kiln's products run on AMX tiles: a bf16 BERT step (no causal mask) whose attention backward is
    `math_backward` (kept whatever its time) runs the head-group loop on the tiles, not the one-pass kernel,
    and trains as eager under autocast does."""
    from tests.models.reference import sgd_like_eager
    if not native.amx_tiles():
        pytest.skip("Kiln's products do not run on AMX tiles here")
    monkeypatch.setenv("KILN_KEEP", "all")
    ran = {"loop": 0, "one-pass": 0}
    loop, one_pass = attention._products, attention._backward_bf16
    monkeypatch.setattr(attention, "_products", lambda *a, **k: ran.__setitem__("loop", ran["loop"] + 1) or loop(*a, **k))
    monkeypatch.setattr(attention, "_backward_bf16",
                        lambda *a, **k: ran.__setitem__("one-pass", ran["one-pass"] + 1) or one_pass(*a, **k))
    step = sgd_like_eager("bert", "bf16", tuning="ahead")
    labels = {n.impl.label for n in step.graph.nodes
              if n.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
    assert labels == {"attention:math_backward"}, labels
    assert ran["loop"] > 0 and ran["one-pass"] == 0, ran


def test_bf16_backward_with_a_materialized_causal_mask_and_padding():
    """A causal mask as an exported model hands it over, with padded keys at the end of one sequence: the
    one-pass backward skips each query's later keys and still applies the padding; as close to float64 as
    ATen's flash backward."""
    if native.bf16_products() is None:
        pytest.skip("no AVX-512 BF16 here (or ATen runs its AVX2 kernels)")
    from tests.kernels.test_attention_forward import _materialized_causal
    args, _ = _case(torch.bfloat16, None, transposed=True)
    g, q, k, v, _, _ = args
    mask = _materialized_causal(2, 40, 40)
    mask[1, :, :, 33:] = float("-inf")
    mask = mask.bfloat16()
    assert attention._causal(native.bf16_products(), mask.float().expand(2, 3, 40, 40), False)
    out, lse = attention.flash_forward_math(q, k, v, 0.0, False, attn_mask=mask)
    got = attention.flash_backward_math(g, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    flash = aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    truth = _truth(g, q, k, v, False, mask)
    scale = max(x.abs().max().item() for x in truth)
    for name, mine, theirs, exact in zip("qkv", got, flash, truth):
        err, flash_err = ((x.double() - exact).abs().max().item() for x in (mine, theirs))
        assert err <= flash_err + 2 * torch.finfo(torch.bfloat16).eps * scale, f"d{name}: {err:.3g} against {flash_err:.3g}"


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fewer_key_value_heads_than_query_heads(kv_heads, dtype, causal):
    """ATen's flash kernels take k and v with fewer heads than q (grouped- or multi-query attention, as Falcon's
    graph passes them; query head i reads key/value head i // (heads / kv_heads)), and the gradients of k and v
    have k's and v's heads. The math kernels give the same contract: against float64 of the expanded heads, as
    close as ATen's flash kernels. (They once indexed k and v by the query's head: reads past k and writes past
    dK, which corrupted the heap.)"""
    torch.manual_seed(5)
    q = torch.randn(2, 20, 4, 16).to(dtype).transpose(1, 2)
    k, v, = (torch.randn(2, 20, kv_heads, 16).to(dtype).transpose(1, 2) for _ in range(2))
    rep = 4 // kv_heads
    out, lse = attention.flash_forward_math(q, k, v, 0.0, causal)
    f_out, f_lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    g = torch.randn(out.shape).to(dtype)
    got = attention.flash_backward_math(g, q, k, v, out, lse, 0.0, causal)
    flash = aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, f_out, f_lse, 0.0, causal)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    z = qd @ kd.repeat_interleave(rep, 1).transpose(-1, -2) / 4.0
    if causal:
        z = z.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(z, -1) @ vd.repeat_interleave(rep, 1)
    want.backward(g.double())
    eps = torch.finfo(dtype).eps
    for name, mine, theirs, exact in (("out", out, f_out, want.detach()), *zip("qkv", got, flash, (qd.grad, kd.grad, vd.grad))):
        assert mine.shape == exact.shape and mine.dtype == dtype, name
        err, flash_err = ((x.double() - exact).abs().max().item() for x in (mine, theirs))
        assert err <= flash_err + 4 * eps * exact.abs().max().item(), f"{name}: {err:.3g} against flash's {flash_err:.3g}"
