"""The `upcast` dialect: low-precision matmul/conv/attention on fp32 copies, checked against ATen's
native low-precision kernels (same output dtypes, values within one rounding of the result)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.dialects import measure, upcast
from kiln.ops.registry import Kind

aten = torch.ops.aten


def _r(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def _cases(dtype):
    x, w, b = _r(16, 32, dtype=dtype), _r(24, 32, dtype=dtype), _r(24, dtype=dtype)
    q, k, v = (_r(2, 3, 16, 8, dtype=dtype) for _ in range(3))
    img, ker = _r(2, 3, 10, 10, dtype=dtype), _r(4, 3, 3, 3, dtype=dtype)
    conv = (img, ker, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, True)
    return {
        "mm": (aten.mm.default, (x, w.t())),
        "addmm": (aten.addmm.default, (b, x, w.t())),
        "bmm": (aten.bmm.default, (_r(4, 8, 16, dtype=dtype), _r(4, 16, 8, dtype=dtype))),
        "baddbmm": (aten.baddbmm.default, (_r(4, 8, 8, dtype=dtype), _r(4, 8, 16, dtype=dtype),
                                           _r(4, 16, 8, dtype=dtype))),
        "linear": (aten.linear.default, (x, w, b)),
        "convolution": (aten.convolution.default, conv),
        "convolution_backward": (aten.convolution_backward.default,
                                 (_r(2, 4, 10, 10, dtype=dtype), img, ker, [4], [1, 1], [1, 1], [1, 1], False,
                                  [0, 0], 1, [True, True, True])),
        "flash": (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True)),
        "flash_backward": (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                           (torch.ones_like(out), q, k, v, out, lse, 0.0, True)),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(_cases(torch.float32)))
def test_kernel_matches_native_low_precision_op(case, dtype):
    torch.manual_seed(0)
    op, args = _cases(dtype)[case]
    if case == "flash_backward" and dtype == torch.float16:
        pytest.skip("ATen has no fp16 flash-attention backward on CPU")
    want = op(*args)
    got = upcast.upcast_kernel(op)(*args)
    want, got = (list(o) if isinstance(o, (tuple, list)) else [o] for o in (want, got))
    assert len(got) == len(want)
    eps = torch.finfo(dtype).eps
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = w.float().abs().max().clamp_min(1.0)
        # native kernels also accumulate in fp32; what may differ is summation order and, in the fused
        # attention kernels, where intermediate probabilities are rounded: a few units of the last place
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=float(8 * eps * scale))


def test_flash_log_sum_exp_stays_fp32():
    q = _r(1, 2, 8, 4, dtype=torch.bfloat16)
    out, lse = upcast.upcast_kernel(aten._scaled_dot_product_flash_attention_for_cpu.default)(q, q, q, 0.0, False)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


def _compile(model, lacks_native, monkeypatch, **kw):
    monkeypatch.setattr(upcast, "_lacks_native", lambda dtype: lacks_native)
    return kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), **kw)


def _train_like_autocast(step, model, ref, x, y):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(5):
        got = step(x, y)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = ref(x, y)
        want.backward()
        opt.step()
    assert abs(got.item() - want.item()) <= 0.02 * abs(want.item())
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=0.05, atol=2e-3)


def test_taken_for_every_low_precision_product_on_cpus_without_native_matmul(monkeypatch):
    monkeypatch.setattr(measure, "medians", lambda *a, **k: pytest.fail("nothing is measured: fp32 copies are faster"))
    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    step = _compile(model, True, monkeypatch, amp="bf16")
    _train_like_autocast(step, model, ref, x, y)
    products = [n for n in step.graph.nodes if n.op.kind is Kind.MATMUL]
    assert products and all(n.impl.label == "upcast:fp32" for n in products)


@pytest.mark.parametrize("faster", [True, False], ids=["measured-faster", "measured-slower"])
def test_measured_on_cpus_with_native_matmul(faster, monkeypatch, tmp_path, kiln_log):
    """A native instruction does not make the native kernel the faster one (a Xeon with AVX-512 BF16 and no
    AMX): there each product shape is timed against ATen's, and fp32 copies are used where they win."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "ahead")
    timed = []
    monkeypatch.setattr(measure, "medians", lambda fns, runs=5: timed.append(sorted(fns)) or
                        {"new_ms": 1.0 if faster else 3.0, "aten_ms": 2.0})
    torch.manual_seed(0)
    model, x, y = MLP(), torch.randn(8, 32), torch.randint(0, 10, (8,))
    ref = copy.deepcopy(model)
    with kiln.dialects("upcast", "kiln"):
        step = _compile(model, False, monkeypatch, amp="bf16")
        _train_like_autocast(step, model, ref, x, y)
    products = [n for n in step.graph.nodes if n.op.kind is Kind.MATMUL]
    assert products and timed                      # the bf16 products were timed against ATen's
    assert {n.impl.label for n in products} == ({"upcast:fp32"} if faster else {"aten"})
    assert any("upcast:fp32" in r.getMessage() and ("used" if faster else "ATen kept") in r.getMessage()
               for r in kiln_log.records)
    fp32 = _compile(MLP(), False, monkeypatch)     # fp32 products are not low precision: nothing to time
    timed.clear()
    with kiln.dialects("upcast", "kiln"):
        fp32(x, y)
    assert not timed and "upcast_" not in fp32.source()


def test_never_chosen_for_fp32_or_when_disabled(monkeypatch):
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    fp32 = _compile(MLP(), True, monkeypatch)
    fp32(x, y)
    assert "upcast_" not in fp32.source()
    with kiln.dialects("sdpa", "kiln"):
        off = _compile(MLP(), True, monkeypatch, amp="bf16")
        off(x, y)
    assert "upcast_" not in off.source()


@pytest.mark.parametrize("m, k, n", [(96, 40, 24), (40, 96, 24), (33, 7, 5), (7, 33, 5)],
                         ids=["rows", "reduction", "rows-uneven", "reduction-uneven"])
@pytest.mark.parametrize("limit", ["bytes", "rows"])
def test_large_products_are_sliced_with_the_same_result(m, k, n, limit, monkeypatch):
    """Slices of rows are independent products; slices of the reduction accumulate in fp32."""
    if limit == "bytes":
        monkeypatch.setattr(upcast, "SLICE_BYTES", 4 * 3 * min(m, k))       # force a few slices
    else:
        monkeypatch.setattr(upcast, "SLICE_ROWS", 3)
    torch.manual_seed(0)
    a, b = _r(m, k, dtype=torch.bfloat16), _r(k, n, dtype=torch.bfloat16)
    got, want = upcast.upcast_mm(a, b), aten.mm.default(a, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=float(2 * eps * want.float().abs().max()))
    assert upcast.upcast_mm(a.t().contiguous().t(), b).equal(got)    # strided operand, same slices


@pytest.mark.parametrize("case", ["linear", "linear-3d", "addmm", "addmm-row-bias"])
def test_sliced_linear_and_addmm_match_native(case, monkeypatch):
    monkeypatch.setattr(upcast, "SLICE_BYTES", 4 * 3 * 40)
    torch.manual_seed(0)
    bf = torch.bfloat16
    if case.startswith("linear"):
        x = _r(2, 37, 24, dtype=bf) if case == "linear-3d" else _r(37, 24, dtype=bf)
        args, op, fn = (x, _r(16, 24, dtype=bf), _r(16, dtype=bf)), aten.linear.default, upcast.upcast_linear
    else:
        bias = _r(37, 16, dtype=bf) if case == "addmm-row-bias" else _r(16, dtype=bf)
        args, op, fn = (bias, _r(37, 24, dtype=bf), _r(24, 16, dtype=bf)), aten.addmm.default, upcast.upcast_addmm
    got, want = fn(*args), op(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(bf).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=float(2 * eps * want.float().abs().max()))
