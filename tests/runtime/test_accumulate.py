"""Gradient accumulation inside the step (`kiln.compile(..., accumulate=N)`), against eager accumulation:
`(loss / N).backward()` per micro-batch, then (clipping and) `opt.step()`, `opt.zero_grad()`."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln

N = 4
TOL = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(10, 20), nn.LayerNorm(20), nn.Linear(20, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def batch(i):
    g = torch.Generator().manual_seed(500 + i)
    return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


def eager_micro(model, x, y):
    loss = ce(model, x, y)
    (loss / N).backward()
    return loss.detach()


def eager_update(model, opt, max_norm=None):
    norm = None
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def same(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("which", ["kiln_adamw_clipped", "torch_sgd_nesterov_clipped"])
def test_accumulation_matches_eager(which):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    max_norm = 0.05                                  # small: the clipping acts on the summed gradient
    if which == "kiln_adamw_clipped":
        kopt = kiln.optim.AdamW(lr=1e-2, weight_decay=0.05, max_grad_norm=max_norm)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
        step = kiln.compile(model, optimizer=kopt, loss_fn=ce, accumulate=N)
    else:                                            # a torch optimizer: clipping is kiln.compile's option
        kopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
        step = kiln.compile(model, optimizer=kopt, loss_fn=ce, accumulate=N, max_grad_norm=max_norm)
    assert step.grad_norm is None                    # no update yet
    for update in range(3):
        before = same(model)
        for micro in range(N):
            x, y = batch(update * N + micro)
            loss = step(x, y)
            torch.testing.assert_close(loss, eager_micro(ref, x, y), rtol=1e-6, atol=1e-6)   # unscaled
            if micro < N - 1:
                assert step.accumulated == micro + 1
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))   # no update yet
        norm = eager_update(ref, ref_opt, max_norm)
        torch.testing.assert_close(step.grad_norm, norm, rtol=1e-5, atol=0)     # of the summed gradient
        assert step.accumulated == 0
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"update {update}, {n}: {m}")
    assert len(step.programs) == 2                   # the micro-step and the update step


def test_grad_norm_is_reported_without_clipping_and_kept_by_a_failed_step():
    """max_grad_norm=math.inf: the norm clip_grad_norm_(..., inf) returns, and gradients left as they are."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=ce,
                        max_grad_norm=math.inf)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in range(3):
        x, y = batch(i)
        step(x, y)
        ce(ref, x, y).backward()
        torch.testing.assert_close(step.grad_norm, eager_update(ref, ref_opt, math.inf), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    kept = step.grad_norm
    x, y = batch(9)
    with pytest.raises(kiln.KilnError):            # a NaN input: the step raises and writes nothing
        step(torch.full_like(x, math.nan), y)
    assert torch.equal(step.grad_norm, kept)


def test_grad_norm_stays_unset_until_an_update_commits():
    """A failed update leaves no norm behind, even when a micro-step commits after it."""
    torch.manual_seed(0)
    model = Net()
    step = kiln.compile(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce, accumulate=2,
                        max_grad_norm=1.0)
    x, y = batch(0)
    step(x, y)                                     # a micro-step: no update, no norm
    with pytest.raises(kiln.KilnError):            # the update fails on a NaN input: nothing is written
        step(torch.full_like(x, math.nan), y)
    step.reset_accumulation()
    step(x, y)                                     # a micro-step commits
    assert step.grad_norm is None


def test_a_failed_micro_step_leaves_the_sums_unchanged():
    torch.manual_seed(1)
    model = Net()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1, momentum=0.9), loss_fn=ce, accumulate=N)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    step(*batch(0))
    eager_micro(ref, *batch(0))
    sums = {n: t.clone() for n, t in step.grad_sums.items()}
    x, y = batch(1)
    with pytest.raises(kiln.NonFiniteError):
        step(torch.full_like(x, float("inf")), y)
    assert step.accumulated == 1
    assert all(torch.equal(sums[n], t) for n, t in step.grad_sums.items())
    for i in range(1, N):                            # the cycle goes on as if the bad batch never came
        step(*batch(i))
        eager_micro(ref, *batch(i))
    eager_update(ref, ref_opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)
    step(*batch(9))
    step.reset_accumulation()
    assert step.accumulated == 0 and all(not t.any() for t in step.grad_sums.values())


def test_bad_accumulate_values_are_refused():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(kiln.KilnError, match="accumulate"):
            kiln.compile(Net(), optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce, accumulate=bad)
    with pytest.raises(kiln.KilnError, match="max_grad_norm"):       # kiln.optim clips with its own argument
        kiln.compile(Net(), optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce, max_grad_norm=1.0)
