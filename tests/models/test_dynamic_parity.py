"""Every model of the test zoo trained on batches of varying batch and sequence sizes (what a data loader
with per-batch padding gives): one Kiln program compiled for dynamic sizes serves them all, checked against
eager torch.optim.AdamW after every step. (How the default policy gets there, a static program first,
then one dynamic program: tests/runtime/test_dynamic.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

import kiln
from tests.models import zoo
from tests.models.test_parity import eager_loss


def _ids(b, t):
    return torch.randint(0, zoo.VOCAB, (b, t))


def _bert(b, t):
    ids = _ids(b, t)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    labels = ids.clone()
    labels[:, ::2] = -100
    return (), dict(input_ids=ids, attention_mask=mask, labels=labels)


def _lm(b, t):
    ids = _ids(b, t)
    return (), dict(input_ids=ids, labels=ids)


# (batch, sequence) per step: a new length, then a new length and batch size
SIZES = [(2, 12), (2, 9), (3, 15)]
BATCHES = {
    "mlp": lambda b, t: ((torch.randn(4 * b, 10), torch.randint(0, 5, (4 * b,))), {}),
    "cnn": lambda b, t: ((torch.randn(2 * b, 1, 8, 8), torch.randint(0, 10, (2 * b,))), {}),
    "bert": _bert,
    "gpt2": _lm,
    "llama": _lm,
    "t5": lambda b, t: ((), dict(input_ids=_ids(b, t), labels=_ids(b, t // 2 + 1))),
    "vit": lambda b, t: ((), dict(pixel_values=torch.randn(b, 3, 16, 16), labels=torch.randint(0, 10, (b,)))),
}


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_varying_sizes_match_eager(name):
    assert set(BATCHES) == set(zoo.MODELS), "every zoo model needs a batch maker here"
    torch.manual_seed(0)
    model, _, _, loss_fn = zoo.MODELS[name]()
    model.train()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3, weight_decay=0.01), loss_fn=loss_fn,
                        dynamic=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    noise: set[str] = set()
    for i, (b, t) in enumerate(SIZES):
        args, kwargs = BATCHES[name](b, t)
        got = step(*args, **kwargs)
        opt.zero_grad()
        want = eager_loss(ref, args, kwargs, loss_fn)
        want.backward()
        # a parameter whose true gradient is zero (a key projection's bias) steps on rounding noise, which
        # Adam scales to lr-sized steps: compared within lr * steps (tests/models/test_parity.py)
        noise |= {n for n, q in ref.named_parameters() if q.grad is not None and q.grad.abs().max() < 1e-7}
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} step {i}: {m}")
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            atol = 1e-3 * (i + 1) if n in noise else 1e-5
            torch.testing.assert_close(p, q, rtol=1e-4, atol=atol, msg=lambda m: f"{name} step {i}: {n}: {m}")
    info = step.cache_info()
    assert info.compiles == 1 and info.programs[0].dynamic, f"{name}: one dynamic program for every batch:\n{info}"
