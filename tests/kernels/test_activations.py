"""swiglu, swiglu_linear and linear_gelu vs unfused PyTorch."""
from __future__ import annotations

import math

import pytest
import torch

import kiln.kernels as K
from kiln.kernels import activations
from tests.kernels import refs
from tests.kernels.refs import BF16, FP32, FP64, LAYOUTS, check

aten = torch.ops.aten

SHAPES = [(9, 24), (2, 7, 40), (2, 3, 5, 16)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_fp32(shape, layout):
    gate, up = LAYOUTS[layout](torch.randn(shape) * 3), torch.randn(shape)
    check(K.swiglu, refs.swiglu, [gate, up], FP32)


def test_swiglu_fp64_and_bf16():
    g, u = torch.randn(6, 20, dtype=torch.float64) * 3, torch.randn(6, 20, dtype=torch.float64)
    check(K.swiglu, refs.swiglu, [g, u], FP64)
    check(K.swiglu, refs.swiglu, [g.bfloat16(), u.bfloat16()], BF16, ref_dtype=torch.float32)


def test_swiglu_keeps_only_its_inputs():
    """silu(gate) is recomputed in the backward: nothing beyond gate and up is saved (eager adds silu(gate))."""
    g, u = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    assert refs.saved_bytes(K.swiglu, [g, u]) == 0
    assert refs.saved_bytes(refs.swiglu, [g, u]) >= 64 * 128 * 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lead", [(11,), (2, 6), (1, 3, 4)], ids=str)
def test_swiglu_linear_fp32(lead, layout):
    x = LAYOUTS[layout](torch.randn(*lead, 32))
    wg, wu = torch.randn(48, 32) * 0.3, torch.randn(48, 32) * 0.3
    check(K.swiglu_linear, refs.swiglu_linear, [x, wg, wu], FP32)


def test_swiglu_linear_transposed_weights_fp64_bf16():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    wg, wu = refs.transposed(torch.randn(24, 16, dtype=torch.float64)), torch.randn(24, 16, dtype=torch.float64)
    check(K.swiglu_linear, refs.swiglu_linear, [x, wg, wu], FP64)
    check(K.swiglu_linear, refs.swiglu_linear, [x.bfloat16(), (wg * 0.3).bfloat16(), (wu * 0.3).bfloat16()], BF16,
          ref_dtype=torch.float32)


def test_swiglu_linear_saves_less_than_eager():
    """gate|up (2 x tokens x intermediate) vs eager's gate, up and silu(gate) (3x)."""
    x, wg, wu = torch.randn(64, 32, requires_grad=True), *(torch.randn(96, 32, requires_grad=True) for _ in range(2))
    fused, eager = refs.saved_bytes(K.swiglu_linear, [x, wg, wu]), refs.saved_bytes(refs.swiglu_linear, [x, wg, wu])
    assert fused == 2 * 64 * 96 * 4 and eager == 3 * 64 * 96 * 4


def test_swiglu_linear_rejects_mismatched_weights():
    with pytest.raises(ValueError, match="do not fit"):
        K.swiglu_linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5, 8))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_gelu_fp32(layout, bias, approximate):
    x = LAYOUTS[layout](torch.randn(4, 6, 32))
    w, b = torch.randn(40, 32) * 0.3, torch.randn(40)
    args = [x, w, b] if bias else [x, w]
    check(lambda *a: K.linear_gelu(*a, **({} if bias else {"bias": None}), approximate=approximate),
          lambda *a: refs.linear_gelu(*a, approximate=approximate) if bias else
          refs.linear_gelu(a[0], a[1], None, approximate), args, FP32)


def test_linear_gelu_fp64_bf16():
    x, w, b = torch.randn(7, 16, dtype=torch.float64), torch.randn(12, 16, dtype=torch.float64), \
        torch.randn(12, dtype=torch.float64)
    check(K.linear_gelu, refs.linear_gelu, [x, w, b], FP64)
    check(K.linear_gelu, refs.linear_gelu, [x.bfloat16(), (w * 0.3).bfloat16(), b.bfloat16()], BF16,
          ref_dtype=torch.float32)


def test_linear_gelu_keeps_no_pre_activation():
    x, w, b = torch.randn(64, 32, requires_grad=True), torch.randn(80, 32, requires_grad=True), \
        torch.randn(80, requires_grad=True)
    assert refs.saved_bytes(K.linear_gelu, [x, w, b]) == 0          # the backward recomputes x @ w.T + b
    assert refs.saved_bytes(refs.linear_gelu, [x, w, b]) >= 64 * 80 * 4


def test_linear_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        K.linear_gelu(torch.randn(2, 4), torch.randn(3, 4), None, "erf")


class _TanhFormulaGELU(torch.nn.Module):
    """transformers' NewGELUActivation as written there (the tanh approximation in several ops);
    recognized by class name and module, so this stand-in takes both."""
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


_TanhFormulaGELU.__name__ = "NewGELUActivation"
_TanhFormulaGELU.__module__ = "transformers.activations"

ACTS = {"nn.GELU": (torch.nn.GELU(), "none"), "nn.GELU-tanh": (torch.nn.GELU(approximate="tanh"), "tanh"),
        "NewGELUActivation": (_TanhFormulaGELU(), "tanh")}


def _linear_act_case(act_name):
    torch.manual_seed(0)
    fc = torch.nn.Linear(32, 80)
    x = torch.randn(4, 16, 32, requires_grad=True)
    return fc, x, ACTS[act_name][0]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("act_name", list(ACTS))
def test_linear_act_matches_the_module_and_its_gradients(act_name, recompute):
    fc, x, act = _linear_act_case(act_name)
    ref_out = act(fc(x))
    ref_grads = torch.autograd.grad(ref_out.square().sum(), [x, fc.weight, fc.bias])
    out = K.linear_act(x, fc, act, recompute=recompute)
    grads = torch.autograd.grad(out.square().sum(), [x, fc.weight, fc.bias])
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("act_name", list(ACTS))
def test_linear_act_trades_memory_only_when_asked(act_name):
    """By default the pre-activation is kept (no second matmul in the backward), as F.gelu keeps it,
    and never more than the activation as written keeps; recompute=True keeps nothing but the input."""
    fc, x, act = _linear_act_case(act_name)
    pre_activation = 4 * 16 * 80 * 4
    inputs = [x, fc.weight, fc.bias]
    as_written = refs.saved_bytes(lambda x, *_: act(fc(x)), inputs)
    default = refs.saved_bytes(lambda x, *_: K.linear_act(x, fc, act), inputs)
    assert default == pre_activation <= as_written
    assert refs.saved_bytes(lambda x, *_: K.linear_act(x, fc, act, recompute=True), inputs) == 0
    if act_name == "NewGELUActivation":                 # the formula keeps several full-size temporaries
        assert as_written >= 3 * pre_activation


@pytest.mark.parametrize("recompute", [False, True])
def test_linear_gelu_of_goes_through_an_observed_module(recompute):
    fc, x, _ = _linear_act_case("nn.GELU")
    calls = []
    fc.register_forward_hook(lambda m, i, o: calls.append(1))
    out = K.linear_gelu_of(x, fc, approximate="tanh", recompute=recompute)
    assert calls == [1]
    torch.testing.assert_close(out, torch.nn.functional.gelu(fc(x), approximate="tanh"))


# ---- GELU's backward with its bias's gradient (one pass) ------------------------------------------------
def _gelu_grad_truth(g, x, approximate):
    gd, xd = g.double(), x.double()
    if approximate == "tanh":
        k = (2 / math.pi) ** 0.5
        th = torch.tanh(k * (xd + 0.044715 * xd ** 3))
        return gd * (0.5 * (1 + th) + 0.5 * xd * (1 - th ** 2) * k * (1 + 3 * 0.044715 * xd ** 2))
    return gd * (0.5 * (1 + torch.erf(xd / 2 ** 0.5)) + xd * torch.exp(-0.5 * xd ** 2) / (2 * math.pi) ** 0.5)


@pytest.mark.parametrize("shape", [(8, 64, 2048), (3, 70, 37), (129, 1), (1, 5)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_backward_sums_against_float64(dtype, approximate, shape):
    """The gradient as close to float64 as ATen's gelu_backward (bf16: correctly rounded at least as often, never
    further than one rounding; fp32: within a few ulps of the value), and the column sums those of the values
    it returns, summed in float64, within fp32 summation error (then rounded once to the dtype)."""
    torch.manual_seed(0)
    g, x = torch.randn(shape).to(dtype), (torch.randn(shape) * 3).to(dtype)
    out, sums = activations.gelu_backward_sums(g, x, approximate)
    ref = aten.gelu_backward(g, x, approximate=approximate)
    truth = _gelu_grad_truth(g, x, approximate)
    assert out.dtype == dtype and out.shape == x.shape and sums.dtype == dtype and sums.shape == x.shape[-1:]
    if dtype == torch.bfloat16 and x.numel() >= 10000:     # a rate: over many values
        rounded = truth.to(dtype)
        assert (out == rounded).float().mean() >= (ref == rounded).float().mean() - 1e-3
    # within a rounding of the dtype, plus the erf approximation's 1.5e-7 (ATen's is of the same kind) times |g|
    err = (out.double() - truth).abs()
    assert (err <= torch.finfo(dtype).eps * truth.abs() + 4e-7 * g.double().abs()).all(), err.max().item()
    want = out.double().reshape(-1, shape[-1]).sum(0)
    bound = out.double().abs().reshape(-1, shape[-1]).sum(0) * 1e-6 + want.abs() * torch.finfo(dtype).eps
    assert ((sums.double() - want).abs() <= bound).all()


def test_gelu_backward_sums_keep_nan_and_inf_to_their_columns():
    g, x = torch.randn(70, 40).bfloat16(), torch.randn(70, 40).bfloat16()
    x[3, 5], g[9, 7] = float("nan"), float("inf")
    out, sums = activations.gelu_backward_sums(g, x, "none")
    assert out[3, 5].isnan() and not out[9, 7].isfinite()
    assert sums[5].isnan() and not sums[7].isfinite()
    others = [c for c in range(40) if c not in (5, 7)]
    assert torch.isfinite(sums[others]).all() and torch.isfinite(out[:, others]).all()


def test_gelu_backward_sums_elsewhere_are_atens_two_ops(monkeypatch):
    """A transposed input, mixed dtypes or KILN_NATIVE=0: ATen's gelu_backward and sum, bit for bit."""
    torch.manual_seed(1)
    g, x = torch.randn(40, 24).bfloat16(), torch.randn(24, 40).bfloat16().t()
    out, sums = activations.gelu_backward_sums(g, x, "none")
    ref = aten.gelu_backward(g, x)
    assert torch.equal(out, ref) and torch.equal(sums, ref.sum(0))
    monkeypatch.setenv("KILN_NATIVE", "0")
    x = x.contiguous()
    out, sums = activations.gelu_backward_sums(g, x, "tanh")
    ref = aten.gelu_backward(g, x, approximate="tanh")
    assert torch.equal(out, ref) and torch.equal(sums, ref.sum(0))
