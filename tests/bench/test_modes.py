"""Mode factories: the Kiln modes say "not available" instead of crashing the harness."""
import types

import pytest
import torch

import kiln
from kiln.bench import modes, zoo


@pytest.fixture
def model():
    return zoo.get("resnet", "tiny").build_model()


def test_parse_modes():
    assert modes.parse_modes("eager, kiln") == ["eager", "kiln"]
    for bad, message in (("eager,warp", "unknown mode 'warp'"), ("", "empty"), ("eager,eager", "twice")):
        with pytest.raises(ValueError, match=message):
            modes.parse_modes(bad)


def test_eager_step_trains(model):
    batch = zoo.get("resnet", "tiny").build_batch(0)
    step = modes.make_step("eager", model)
    before = [p.detach().clone() for p in model.parameters()]
    loss = step(**batch)
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_kiln_missing_compile(monkeypatch, model):
    monkeypatch.delattr(kiln, "compile", raising=False)
    with pytest.raises(modes.Unavailable, match="kiln.compile is missing"):
        modes.make_step("kiln", model)


def test_kiln_missing_optimizer(monkeypatch, model):
    monkeypatch.setattr(kiln, "compile", lambda m, **kw: None, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "kiln.optim", types.ModuleType("kiln.optim"))
    with pytest.raises(modes.Unavailable, match="AdamW is missing"):
        modes.make_step("kiln", model)


def _fake_kiln(monkeypatch, compile_fn):
    optim = types.ModuleType("kiln.optim")
    optim.AdamW = lambda **kw: ("adamw", kw)
    monkeypatch.setitem(__import__("sys").modules, "kiln.optim", optim)
    monkeypatch.setattr(kiln, "compile", compile_fn, raising=False)


def test_kiln_amp_not_supported(monkeypatch, model):
    calls = []

    def compile_fn(m, optimizer):  # no amp= keyword yet
        calls.append(optimizer)
        return lambda **batch: 1.0

    _fake_kiln(monkeypatch, compile_fn)
    assert modes.make_step("kiln", model)() == 1.0
    assert calls == [("adamw", {"lr": 1e-4, "weight_decay": 0.01})]
    with pytest.raises(modes.Unavailable, match="amp='bf16'.*TypeError"):
        modes.make_step("kiln-bf16", model)


def test_kiln_type_error_without_amp_is_a_failure(monkeypatch, model):
    def compile_fn(m, optimizer):
        raise TypeError("model is not an nn.Module")

    _fake_kiln(monkeypatch, compile_fn)
    with pytest.raises(TypeError, match="not an nn.Module"):
        modes.make_step("kiln", model)


def test_kiln_not_implemented(monkeypatch, model):
    def compile_fn(m, optimizer, amp=None):
        raise NotImplementedError("amp is coming")

    _fake_kiln(monkeypatch, compile_fn)
    with pytest.raises(modes.Unavailable, match="amp is coming"):
        modes.make_step("kiln-bf16", model)
