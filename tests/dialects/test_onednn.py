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


@pytest.mark.parametrize("case", ["bias 2-D", "beta", "fp32", "3-D input"])
def test_onednn_addmm_declines_what_it_does_not_compute(case):
    from kiln.ir.graph import Node, TensorMeta, Value
    cpu = torch.device("cpu")

    def value(shape, dtype=torch.bfloat16):
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        return Value("v", TensorMeta(tuple(shape), dtype, tuple(stride), cpu))
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    bias = value((1, 8) if case == "bias 2-D" else (8,), dtype)
    x = value((2, 4, 16) if case == "3-D input" else (4, 16), dtype)
    node = Node.__new__(Node)
    node.args, node.kwargs = (bias, x, value((16, 8), dtype)), ({"beta": 2} if case == "beta" else {})
    assert not onednn._addmm_ok(node)
    node.args, node.kwargs = (value((8,)), value((4, 16)), value((16, 8))), {}
    assert onednn._addmm_ok(node) == _native_bf16()
