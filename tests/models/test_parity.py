"""Model-level parity: 5 Kiln training steps vs the same model trained eagerly with torch.optim."""
from __future__ import annotations

import copy

import pytest
import torch

import kiln
from kiln.capture import extract_loss
from tests.models import zoo


def eager_loss(model, args, kwargs, loss_fn):
    return loss_fn(model, *args, **kwargs) if loss_fn else extract_loss(model(*args, **kwargs))


def train_both(name, kiln_opt, torch_opt_fn, steps=5, dialects=None):
    torch.manual_seed(0)
    model, args, kwargs, loss_fn = zoo.MODELS[name]()
    model.train()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln_opt, loss_fn=loss_fn, dialects=dialects, verify=True)
    opt = torch_opt_fn(ref.parameters())
    for _ in range(steps):
        got = step(*args, **kwargs)
        opt.zero_grad()
        want = eager_loss(ref, args, kwargs, loss_fn)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: parameter {n}: {m}")
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: buffer {n}: {m}")
    return step


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_adamw_parity(name):
    step = train_both(name, kiln.optim.AdamW(lr=1e-3, weight_decay=0.01),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
    fallbacks = [n.op.name for n in step.graph.nodes if n.op.name == "kiln.fallback_forward"]
    assert not fallbacks, f"{name} needed gradient fallbacks: {fallbacks}"


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_sgd_momentum_parity(name):
    train_both(name, kiln.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
               lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_aten_only_dialect_parity(name):
    step = train_both(name, kiln.optim.AdamW(lr=1e-3), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      steps=2, dialects=["aten"])
    assert all(n.impl.dialect.name == "aten" for n in step.graph.nodes)
