"""A step is all or nothing: an interrupt at any line of a step, or at a random time, leaves every
parameter, optimizer slot, step counter, loss scale and buffer either exactly as before the step or
exactly as after an uninterrupted step (bit for bit)."""
from __future__ import annotations

import _thread
import random
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln


class Net(nn.Module):
    """Two linear layers and a BatchNorm (a buffer updated in forward); the second weight is used
    transposed, so its gradient has the other layout."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.w = nn.Parameter(torch.randn(4, 16) * 0.1)

    def forward(self, x, y):
        h = torch.tanh(self.norm(self.a(x)))
        return F.cross_entropy(h @ self.w.T, y)


OPTIMIZERS = {   # name: (kiln.compile arguments, inject at every k-th line event)
    "adamw": (lambda: dict(optimizer=kiln.optim.AdamW(lr=1e-2)), 1),
    # a weight that is a strided view (not dense): the fused kernel declines it, the reference runs
    "adamw-reference-kernel": (lambda: dict(optimizer=kiln.optim.AdamW(lr=1e-2), strided=True), 3),
    "sgd-momentum": (lambda: dict(optimizer=kiln.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)), 1),
    "sgd-nesterov-clip": (lambda: dict(optimizer=kiln.optim.SGD(lr=0.1, momentum=0.9, nesterov=True,
                                                                max_grad_norm=0.5)), 3),
    "fp16": (lambda: dict(optimizer=kiln.optim.AdamW(lr=1e-2), amp="fp16"), 1),
    # bf16 gradients read as they are by the native AdamW loop, one staged C call per parameter
    "bf16-native-adamw": (lambda: dict(optimizer=kiln.optim.AdamW(lr=1e-2), amp="bf16"), 1),
}


def _state(model, step) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.parameters()] + [b.clone() for b in model.buffers()]
    for slots in step.state.values():
        out += [t.clone() for t in slots.values()]
    return out


def _restore(model, step, snapshot) -> None:
    live = list(model.parameters()) + list(model.buffers()) + [t for s in step.state.values() for t in s.values()]
    with torch.no_grad():
        for t, s in zip(live, snapshot):
            t.copy_(s)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


class _Inject:
    """A trace function that raises KeyboardInterrupt at the k-th line event of the traced call."""

    def __init__(self, k: int):
        self.k, self.seen = k, 0

    def __call__(self, frame, event, arg):
        if event == "line":
            self.seen += 1
            if self.seen == self.k:
                raise KeyboardInterrupt(f"injected at line event {self.k}")
        return self


def _prepared(name):
    torch.manual_seed(0)
    model = Net().train()
    kwargs = OPTIMIZERS[name][0]()
    if kwargs.pop("strided", False):
        model.w = nn.Parameter((torch.randn(4, 32) * 0.1)[:, ::2])
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    step = kiln.compile(model, **kwargs)
    for _ in range(2):                    # compiled, and momentum buffers / counters past their first step
        step(x, y)
    return model, step, x, y


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_interrupt_at_every_line_leaves_all_old_or_all_new(name):
    model, step, x, y = _prepared(name)
    old = _state(model, step)
    counter = _Inject(0)
    sys.settrace(counter)
    try:
        step(x, y)
    finally:
        sys.settrace(None)
    new = _state(model, step)
    assert not _same(old, new)
    lines = counter.seen
    assert lines > 20, lines
    outcomes = {"old": 0, "new": 0}
    for k in range(1, lines + 1, OPTIMIZERS[name][1]):
        _restore(model, step, old)
        sys.settrace(_Inject(k))
        try:
            step(x, y)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
            torch.set_grad_enabled(True)   # an injection inside a grad-mode context manager's exit
        got = _state(model, step)
        if _same(got, old):
            outcomes["old"] += 1
        elif _same(got, new):
            outcomes["new"] += 1
        else:
            moved = [i for i, (a, b) in enumerate(zip(got, old)) if not torch.equal(a, b)]
            pytest.fail(f"{name}: an interrupt at line event {k} of {lines} left a half-updated state: "
                        f"tensors {moved} of {len(old)} changed")
    print(f"{name}: {sum(outcomes.values())} interrupts over {lines} line events: {outcomes}")   # with -s
    assert outcomes["old"] and outcomes["new"], outcomes


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum", "fp16"])
def test_interrupts_at_random_times_leave_all_old_or_all_new(name):
    """SIGINT from a timer (KeyboardInterrupt in the main thread) at random moments of a step."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    model, step, x, y = _prepared(name)
    old = _state(model, step)
    t0 = time.perf_counter()
    step(x, y)
    took = time.perf_counter() - t0
    new = _state(model, step)
    rng = random.Random(0)
    for _ in range(40):
        _restore(model, step, old)
        timer = threading.Timer(rng.uniform(0, took * 1.2), _thread.interrupt_main)
        timer.start()
        try:
            step(x, y)
            time.sleep(took)               # a late interrupt lands here, after the step
        except KeyboardInterrupt:
            pass
        finally:
            timer.cancel()
            torch.set_grad_enabled(True)
        got = _state(model, step)
        assert _same(got, old) or _same(got, new), f"{name}: a timed interrupt left a half-updated state"
