"""Train a model with Kiln and with eager PyTorch side by side and assert they agree: one SGD(lr=1) step,
whose parameter deltas are the gradients (compared with eager's .grad), then 3 kiln.optim.AdamW steps
against torch.optim.AdamW; losses, buffers and untouched frozen parameters are compared too.

Entries whose true gradient is zero (a key projection's bias, a bias just before BatchNorm: both are
shifts the next op removes) get rounding noise as gradient, which Adam scales up to lr-sized steps; any
other summation order gives other noise. Those entries are compared to within lr * steps after AdamW;
their SGD gradients, and every other entry, as tightly as ever.
"""
from __future__ import annotations

import copy

import torch

import kiln
from kiln.capture import extract_loss

RTOL, ATOL = 1e-4, 1e-5


def _eager_loss(model, args, kwargs, loss_fn):
    return loss_fn(model, *args, **kwargs) if loss_fn else extract_loss(model(*args, **kwargs))


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _same_state(model, ref, what: str, noise: dict, slack: float) -> None:
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        p, q = p.detach(), q.detach()
        if n in noise:                                      # true gradient 0: Adam steps on rounding noise
            assert (p - q)[noise[n]].abs().max() <= slack, f"{what}: parameter {n}: beyond lr * steps"
            p, q = p.masked_fill(noise[n], 0.0), q.masked_fill(noise[n], 0.0)
        _close(p, q, f"{what}: parameter {n}")
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        _close(b, c, f"{what}: buffer {n}")


def check_training(make, *args, loss_fn=None, fallbacks: bool = False, steps: int = 3, **kwargs):
    """Train `make()` with Kiln and eagerly on the same batch; assert they agree (see the module doc).
    `fallbacks`: whether the step may use the autograd fallback for some op. `steps=0`: the SGD gradient
    check only (one capture instead of two, for models that take seconds to export). Returns the last
    compiled step, for tests that look at its graph."""
    torch.manual_seed(0)
    model = make()
    model.train()

    # one SGD(lr=1) step: p_before - p_after is the gradient (0 for a parameter the loss ignores)
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    step = kiln.compile(mine, optimizer=kiln.optim.SGD(lr=1.0), loss_fn=loss_fn)
    before = {n: p.detach().clone() for n, p in mine.named_parameters()}
    got = step(*args, **kwargs)
    want = _eager_loss(ref, args, kwargs, loss_fn)
    want.backward()
    _close(got, want.detach(), "loss")
    noise = {}
    for (n, p), (_, q) in zip(mine.named_parameters(), ref.named_parameters()):
        grad = q.grad if q.grad is not None else torch.zeros_like(q)
        _close(before[n] - p.detach(), grad.detach(), f"gradient of {n} (SGD lr=1 step)")
        if q.grad is not None and bool((q.grad.abs() < 1e-7).any()):
            noise[n] = q.grad.abs() < 1e-7
    for (n, b), (_, c) in zip(mine.named_buffers(), ref.named_buffers()):
        _close(b, c, f"buffer {n} after the SGD step")
    if not fallbacks:
        used = [n.op.name for n in step.graph.nodes if n.op.name == "kiln.fallback_forward"]
        assert not used, f"the step needed the autograd fallback: {used}"

    if not steps:
        return step
    # 3 AdamW steps
    mine, ref = copy.deepcopy(model), copy.deepcopy(model)
    lr = 1e-2
    step = kiln.compile(mine, optimizer=kiln.optim.AdamW(lr=lr, weight_decay=0.01), loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    for i in range(steps):
        got = step(*args, **kwargs)
        opt.zero_grad()
        want = _eager_loss(ref, args, kwargs, loss_fn)
        want.backward()
        opt.step()
        _close(got, want.detach(), f"AdamW step {i}: loss")
    _same_state(mine, ref, f"after {steps} AdamW steps", noise, slack=2 * lr * steps)
    return step


def sgd_like_eager(name: str, amp: str | None = None, steps: int = 3, **compile_kw):
    """The zoo model `name` trained `steps` SGD(lr=0.1) steps by Kiln (`kiln.compile(..., amp=amp,
    **compile_kw)`) and by eager (under bf16 autocast when `amp`): losses each step and parameters after them
    agree (fp32 tightly; bf16 within its rounding). Returns Kiln's step, whose graph the caller inspects."""
    from tests.models import zoo
    torch.manual_seed(0)
    model, args, kwargs, _ = zoo.MODELS[name]()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), amp=amp, **compile_kw)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tol = dict(rtol=RTOL, atol=ATOL) if amp is None else dict(rtol=2e-2, atol=2e-2)
    for _ in range(steps):
        got = step(*args, **kwargs)
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=amp is not None):
            want = ref(*args, **kwargs).loss
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach().float(), **tol)
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **tol, msg=lambda m: f"{name}: parameter {n}: {m}")
    return step
