"""The `onednn` dialect: oneDNN linear, chosen per shape only where measured faster than ATen here."""
from __future__ import annotations

import copy

import pytest
import torch

import kiln
from kiln.dialects import measure, onednn
from tests.models import zoo

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def _train(model, args, dialects, steps=3):
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=dialects)
    for _ in range(steps):
        loss = step(*args)
    return step, loss


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def _mlp():
    torch.manual_seed(0)
    model, args, _, _ = zoo.MODELS["mlp"]()
    return model, args


def test_onednn_linear_trains_like_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_KEEP", "all")               # use it whatever it measures
    model, args = _mlp()
    ref = copy.deepcopy(model)
    step, _ = _train(model, args, ["onednn"])
    linears = [n for n in step.graph.nodes if n.op.name == "aten.linear"]
    assert linears and all(n.impl.label == "onednn:linear" for n in linears)
    _assert_eager_adamw(model, ref, args, steps=3)


def _assert_eager_adamw(trained, ref, args, steps):
    """`trained`'s parameters equal `ref`'s after `steps` steps of torch.optim.AdamW(lr=1e-3) on `_loss`."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        _loss(ref, *args).backward()
        opt.step()
    for p, q in zip(trained.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("new_ms,aten_ms,chosen", [(2.0, 1.0, False), (0.5, 1.0, True), (0.99, 1.0, False),
                                                   (0.01, 0.04, False)])
def test_onednn_is_used_only_where_measured_faster(monkeypatch, tmp_path, kiln_log, new_ms, aten_ms, chosen):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "ahead")           # measured before the first step (online: test_tuning)
    calls = []
    monkeypatch.setattr(measure, "medians", lambda fns, runs=5: calls.append(1) or {"new_ms": new_ms, "aten_ms": aten_ms})
    model, args = _mlp()
    step, _ = _train(model, args, ["onednn"], steps=1)
    labels = {n.impl.label for n in step.graph.nodes if n.op.name == "aten.linear"}
    assert labels == ({"onednn:linear"} if chosen else {"aten"})
    assert calls and any("onednn:linear" in r.getMessage() and ("used" if chosen else "ATen kept") in r.getMessage()
                         for r in kiln_log.records)
    timings = list((tmp_path / "kernels").rglob("*.timing.json"))
    assert len(timings) == len(calls)
    # measured once per machine: a second compilation reads the decision
    calls.clear()
    model2, _ = _mlp()
    step2, _ = _train(model2, args, ["onednn"], steps=1)
    assert not calls and {n.impl.label for n in step2.graph.nodes if n.op.name == "aten.linear"} == labels


def test_low_precision_linear_needs_native_instructions():
    from kiln.passes.amp import cpu_has_native
    if cpu_has_native(torch.bfloat16):
        pytest.skip("this CPU has native bf16: oneDNN may take bf16 here")
    model, args = _mlp()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["onednn"], amp="bf16")
    step(*args)
    assert not any(n.impl.dialect is onednn.ONEDNN for n in step.graph.nodes)


def test_kiln_keep_must_be_known(monkeypatch):
    monkeypatch.setenv("KILN_KEEP", "sometimes")
    with pytest.raises(ValueError, match="KILN_KEEP"):
        measure.keep()
    monkeypatch.delenv("KILN_KEEP")
    assert measure.keep() == "faster"


def test_example_inputs_keep_broadcast_strides():
    from kiln.ir.graph import TensorMeta
    meta = TensorMeta((2, 2, 2, 12, 8), torch.float32, (192, 8, 0, 16, 1), torch.device("cpu"))
    t = measure.example(meta)
    assert t.shape == meta.shape and t.stride() == meta.stride and torch.isfinite(t).all()
    assert measure.example(TensorMeta((0, 3), torch.int64, (3, 1), torch.device("cpu"))).shape == (0, 3)


def test_measuring_draws_nothing_from_the_users_random_stream(monkeypatch, tmp_path):
    """Timing oneDNN against ATen on example tensors at compile time used the global generator, so a
    seeded step's dropout masks differed from eager's (cvt trained wrong, gradient error 0.78)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))     # nothing measured yet: compiling measures
    monkeypatch.setenv("KILN_KEEP", "all")
    monkeypatch.setenv("KILN_TUNING", "ahead")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4)).train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), loss_fn=_loss, dialects=["onednn"])
    torch.manual_seed(123)
    step(x, y)
    after_kiln = torch.get_rng_state()
    assert any(n.impl.label == "onednn:linear" for n in step.graph.nodes if n.op.name == "aten.linear")
    torch.manual_seed(123)
    _loss(ref, x, y).backward()
    assert torch.equal(after_kiln, torch.get_rng_state())   # the same number of draws as eager
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - q.grad, rtol=1e-5, atol=1e-6)


def _native_bf16() -> bool:
    return onednn.native_half(torch.bfloat16)


class _Conv1D(torch.nn.Module):
    """GPT-2's Conv1D: x @ w + b through torch.addmm, w stored (in, out)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not _native_bf16(),
                    reason="oneDNN takes bf16 addmm only on a CPU with native bf16")
@pytest.mark.parametrize("shape", [(64, 48, 40), (256, 512, 1536)])
def test_onednn_addmm_is_atens_addmm_bit_for_bit(shape):
    m, k, n = shape
    torch.manual_seed(0)
    x, w, b = (torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16(), torch.randn(n).bfloat16())
    assert torch.equal(onednn.onednn_addmm(b, x, w).view(torch.int16), torch.addmm(b, x, w).view(torch.int16))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not _native_bf16(),
                    reason="oneDNN takes bf16 addmm only on a CPU with native bf16")
def test_onednn_addmm_trains_a_conv1d_model_like_autocast(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_KEEP", "all")               # use it whatever it measures
    monkeypatch.setenv("KILN_TUNING", "ahead")
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Conv1D(32, 64), torch.nn.GELU(), _Conv1D(64, 10))
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 16, 32), torch.randint(0, 10, (4, 16))
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())  # noqa: E731
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=loss_fn, dialects=["onednn"], amp="bf16")
    for _ in range(3):
        step(x, y)
    addmms = [n for n in step.graph.nodes if n.op.name == "aten.addmm"]
    assert addmms and all(n.impl.label == "onednn:addmm" for n in addmms)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(ref, x, y)
        loss.backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def _value(shape, dtype=torch.bfloat16, device="cpu"):
    from kiln.ir.graph import TensorMeta, Value
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return Value("v", TensorMeta(tuple(shape), dtype, tuple(stride), torch.device(device)))


def _node(*args, **kwargs):
    from kiln.ir.graph import Node
    node = Node.__new__(Node)
    node.args, node.kwargs = args, kwargs
    return node


@pytest.mark.parametrize("case", ["bias 2-D", "beta", "mixed dtypes", "3-D input"])
def test_onednn_addmm_declines_what_it_does_not_compute(case):
    bias = _value((1, 8) if case == "bias 2-D" else (8,), torch.float32 if case == "mixed dtypes" else torch.bfloat16)
    x = _value((2, 4, 16) if case == "3-D input" else (4, 16))
    assert not onednn._addmm_ok(_node(bias, x, _value((16, 8)), **({"beta": 2} if case == "beta" else {})))
    assert onednn._addmm_ok(_node(_value((8,)), _value((4, 16)), _value((16, 8)))) == _native_bf16()
    f32 = torch.float32     # fp32 is MKL's product in ATen, oneDNN's here: measured like linear
    assert onednn._addmm_ok(_node(_value((8,), f32), _value((4, 16), f32), _value((16, 8), f32)))


@pytest.mark.parametrize("case", ["3-D", "mixed dtypes", "fp64", "not cpu", "one operand"])
def test_onednn_mm_declines_what_it_does_not_compute(case):
    f32 = torch.float32
    a = _value((2, 4, 16) if case == "3-D" else (4, 16), torch.float64 if case == "fp64" else f32,
               "meta" if case == "not cpu" else "cpu")
    b = _value((16, 8), torch.bfloat16 if case == "mixed dtypes" else a.meta.dtype)
    assert not onednn._mm_ok(_node(a) if case == "one operand" else _node(a, b))
    assert onednn._mm_ok(_node(_value((4, 16), f32), _value((16, 8), f32)))
    assert not onednn._mm_ok(_node(_value((4, 16)), _value((16, 8))))     # bf16: ATen's is oneDNN's already


def _matrix(rows, cols, transposed):
    """An fp32 (rows, cols) matrix, row-major or a transposed view of a column-major one."""
    return torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("shape", [(64, 48, 40), (300, 512, 96), (1, 7, 5), (5, 7, 1), (0, 4, 3), (3, 0, 4), (3, 4, 0)])
def test_onednn_mm_is_the_matrix_product(layout, shape):
    m, k, n = shape
    torch.manual_seed(0)
    a, b = _matrix(m, k, layout[0] == "T"), _matrix(k, n, layout[1] == "T")
    got, ref = onednn.onednn_mm(a, b), torch.mm(a.double(), b.double())
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    # sums in another order than MKL's: rounding noise only (float64 products of N(0, 1) entries: |ref| ~ sqrt(k))
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * max(1.0, k))


def test_onednn_mm_and_addmm_train_fp32_like_eager(monkeypatch, tmp_path):
    """An fp32 step with oneDNN's products everywhere (the backward's mm, a Conv1D's addmm) trains as
    torch.optim.AdamW on eager's gradients."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_KEEP", "all")
    monkeypatch.setenv("KILN_TUNING", "ahead")
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Conv1D(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 16, 32), torch.randint(0, 10, (4, 16))
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())  # noqa: E731
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=loss_fn, dialects=["onednn"])
    for _ in range(3):
        step(x, y)
    labels = {(n.op.name, n.impl.label) for n in step.graph.nodes if n.op.name in ("aten.addmm", "aten.mm")}
    assert labels == {("aten.addmm", "onednn:addmm"), ("aten.mm", "onednn:mm")}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(ref, x, y).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_loss_with_onednn_products_against_float64(bias, monkeypatch):
    """kiln.linear_cross_entropy_grads with oneDNN's logits and grad_hidden products (the kernel's onednn=True,
    several chunks, ignored labels, a decoder's bias): loss and gradients as float64's, and as the kernel's own
    with ATen's products."""
    import importlib
    module = importlib.import_module("kiln.kernels.cross_entropy")    # (kiln.kernels.cross_entropy is a function)
    calls = []
    monkeypatch.setattr(module, "inner_product", lambda a, w, f=module.inner_product: calls.append(a.shape) or f(a, w))
    linear_cross_entropy_grads = module.linear_cross_entropy_grads
    torch.manual_seed(3)
    h, w = torch.randn(50, 24), torch.randn(70, 24) * 0.5
    b = torch.randn(70) if bias else None
    y = torch.randint(0, 70, (50,))
    y[::4] = -100
    got = linear_cross_entropy_grads(h, w, y, -100, "mean", 7, b, onednn=True)
    assert len(calls) == 2 * 6                              # 37 counted rows in chunks of 7: both products each
    assert torch.equal(got[1][::4], torch.zeros(13, 24))
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    bd = None if b is None else b.double().requires_grad_()
    want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hd, wd, bd), y, ignore_index=-100)
    want.backward()
    s = got[3].item()
    torch.testing.assert_close(got[0].double(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1].double() * s, hd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2].double() * s, wd.grad, rtol=1e-5, atol=1e-6)
    if bias:
        torch.testing.assert_close(got[4].double() * s, bd.grad, rtol=1e-5, atol=1e-6)
    for a, c in zip(got, torch.ops.kiln.linear_cross_entropy_grads(h, w, y, -100, "mean", 7, b)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_the_fused_loss_takes_onednn_products_in_an_fp32_step(monkeypatch, tmp_path):
    """A Llama step's fused loss on oneDNN's products (measured: here KILN_KEEP=all takes it) trains as eager."""
    from kiln.dialects import kiln_kernels
    from tests.passes.test_fuse import _llama, _train_both
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_KEEP", "all")
    monkeypatch.setattr(kiln_kernels, "LOGITS_BYTES_TO_FUSE", 0)
    model, ids = _llama()
    step = _train_both(model, ids, dialects=["onednn", "kiln"])
    losses = [n.impl.label for n in step.graph.nodes if n.op.name == "kiln.linear_cross_entropy_grads"]
    assert losses == ["onednn:linear_cross_entropy_grads"]


def test_the_fused_loss_keeps_atens_products_in_half_types_and_for_empty_sums():
    f32, bf16, labels = torch.float32, torch.bfloat16, _value((6,), torch.int64)
    for (h, w), ok in [(((6, 4), (5, 4)), True), (((6, 0), (5, 0)), False), (((6, 4), (0, 4)), False)]:
        assert onednn._loss_ok(_node(_value(h, f32), _value(w, f32), labels, -100, "mean", 0)) == ok
    assert not onednn._loss_ok(_node(_value((6, 4), bf16), _value((5, 4), bf16), labels, -100, "mean", 0))


def test_an_empty_sum_takes_atens_op():
    """oneDNN creates no primitive for x's last dimension 0: linear and addmm give ATen's result (the bias)."""
    x, w, wt, b = torch.randn(3, 0), torch.randn(4, 0), torch.randn(0, 4), torch.randn(4)
    assert torch.equal(onednn.onednn_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(onednn.onednn_addmm(b, x, wt), torch.addmm(b, x, wt))
    assert torch.equal(onednn.onednn_mm(x, wt), torch.zeros(3, 4))
