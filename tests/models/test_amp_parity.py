"""Mixed precision against eager torch.autocast: loss after 20 steps within 2%, fp16 loss scaling,
and the same convergence on real data."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.capture import extract_loss
from tests.models import zoo
from tests.models.test_convergence import digits


def autocast_loss(model, args, kwargs, loss_fn, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return loss_fn(model, *args, **kwargs) if loss_fn else extract_loss(model(*args, **kwargs))


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert", "gpt2", "llama", "t5", "vit"])
def test_bf16_loss_after_20_steps_matches_autocast(name):
    _bf16_matches_autocast(name)


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_bf16_with_inductor_regions_matches_autocast(name, monkeypatch):
    monkeypatch.setenv("KILN_KEEP", "all")      # every compiled region runs
    step = _bf16_matches_autocast(name)
    assert any(n.op.name == "kiln.region" for n in step.graph.nodes)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_with_aten_only_matches_autocast(name):
    step = _bf16_matches_autocast(name, dialects=["aten"])
    assert all(n.impl.dialect.name == "aten" for n in step.graph.nodes)


def _bf16_matches_autocast(name, dialects=None):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = zoo.MODELS[name]()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=loss_fn, amp="bf16", dialects=dialects)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(20):
        got = step(*args, **kwargs)
        opt.zero_grad()
        want = autocast_loss(ref, args, kwargs, loss_fn, torch.bfloat16)
        want.backward()
        opt.step()
    assert abs(got.item() - want.item()) <= 0.02 * abs(want.item()), (got.item(), want.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())          # master weights stay fp32
    assert all(t.dtype == torch.float32 for s in step.state.values() for k, t in s.items() if k != "step")
    return step


def test_fp16_with_loss_scaling_matches_autocast_and_gradscaler():
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = zoo.llama()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), amp="fp16")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(20):
        got = step(*args, **kwargs)
        opt.zero_grad()
        want = autocast_loss(ref, args, kwargs, loss_fn, torch.float16)
        scaler.scale(want).backward()
        scaler.step(opt)
        scaler.update()
    assert abs(got.item() - want.item()) <= 0.02 * abs(want.item()), (got.item(), want.item())
    assert step.loss_scale == scaler.get_scale()


class Amplified(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, k):
        return (self.lin(x) * k).pow(2).mean()


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    torch.manual_seed(0)
    model, x = Amplified(), torch.randn(4, 8)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), amp="fp16")
    step(x, torch.tensor(1.0))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = step.state_dict()
    scale = step.loss_scale
    step(x, torch.tensor(1e4))                  # gradients overflow fp16
    assert step.loss_scale == scale / 2
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n                              # bit-identical
    for n, slots in step.state_dict()["state"].items():
        if n == "__amp__":
            continue
        for k, t in slots.items():
            assert torch.equal(t, state["state"][n][k]), (n, k)
    step(x, torch.tensor(1.0))                  # a clean step updates again
    assert any(not torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert step.state["__amp__"]["growth_tracker"].item() == 1


def test_bf16_converges_like_fp32_on_digits():
    (xtr, ytr), _ = digits()
    curves = {}
    for amp in (None, "bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))
        step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=3e-3), amp=amp,
                            loss_fn=lambda m, x, y: F.cross_entropy(m(x), y))
        curves[amp] = [step(xtr[i:i + 100], ytr[i:i + 100]).item() for _ in range(3) for i in range(0, 1500, 100)]
    fp32, bf16 = torch.tensor(curves[None]), torch.tensor(curves["bf16"])
    assert bf16[-5:].mean() < 0.25 * bf16[0]
    assert (bf16[-10:].mean() - fp32[-10:].mean()).abs() < 0.05 + 0.1 * fp32[-10:].mean()
