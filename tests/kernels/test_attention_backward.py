"""Attention's backward from the log-sum-exp (kiln/kernels/attention.py) against float64 autograd of the same
(rounded) inputs, beside ATen's CPU flash backward, which it stands in for where measured faster: no further
from the truth than ATen's kernel (plus a rounding of the dtype), with the native loops and without."""
from __future__ import annotations

import math
import os

import pytest
import torch

from kiln.dialects.sdpa import flash_backward
from kiln.dialects.upcast import upcast_kernel
from kiln.kernels import attention, native
from tests.kernels.test_attention_forward import masks

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


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_the_step_trains_like_eager_with_the_measured_backward(amp, monkeypatch):
    """A compiled step whose attention forward and backward are the `attention` dialect's (every measured kernel
    kept, faster here or not: `math_forward`, and the first of the backward's, `math_backward`) trains as eager
    does (in bf16 on a CPU without native bf16
    the `upcast` dialect runs the backward instead)."""
    import copy

    import kiln
    from kiln.passes.amp import cpu_has_native
    from tests.models import zoo
    monkeypatch.setenv("KILN_KEEP", "all")
    torch.manual_seed(0)
    model, args, kwargs, _ = zoo.MODELS["llama"]()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), tuning="ahead", amp=amp)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = dict(rtol=1e-4, atol=1e-5) if amp is None else dict(rtol=2e-2, atol=2e-2)
    for _ in range(3):
        got = step(*args, **kwargs)
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=amp is not None):
            want = ref(*args, **kwargs).loss
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach().float(), **tol)
    labels = {n.impl.label for n in step.graph.nodes
              if n.target in (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                              aten._scaled_dot_product_flash_attention_for_cpu.default)}
    if amp is None:
        assert labels == {"attention:math_backward", "attention:math_forward"}, labels
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    elif cpu_has_native(torch.bfloat16):
        assert labels == {"attention:math_backward", "attention:math_forward"}, labels
    assert os.environ["KILN_KEEP"] == "all"
