"""Checked state and safe calls: malformed checkpoints are refused whole, replaced parameters are
followed or refused, non-finite steps write nothing, and calls from several threads are serialized."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _trained(opt, steps=2, **kw):
    torch.manual_seed(0)
    model = Net()
    step = kiln.compile(model, optimizer=opt, **kw)
    for i in range(steps):
        step(*_data(i))
    return model, step


def _snapshot(step):
    return {n: {k: t.clone() for k, t in s.items()} for n, s in step.state.items()}, dict(step.optimizer.hyperparameters())


def _bad_checkpoints(good: dict, opt_name: str):
    """(description, checkpoint) pairs, each wrong in one way."""
    name = next(iter(good["state"]))
    slot = next(iter(good["state"][name]))
    t = good["state"][name][slot]

    def edit(fn):
        sd = copy.deepcopy(good)
        fn(sd)
        return sd
    bad = [
        ("not a dict", [1, 2]),
        ("unknown top-level key", edit(lambda sd: sd.update(extra=1))),
        ("other optimizer", edit(lambda sd: sd.update(optimizer="SGD" if opt_name == "AdamW" else "AdamW"))),
        ("state missing", edit(lambda sd: sd.pop("state"))),
        ("negative lr", edit(lambda sd: sd["hyperparameters"].update(lr=-5))),
        ("nan lr", edit(lambda sd: sd["hyperparameters"].update(lr=float("nan")))),
        ("string lr", edit(lambda sd: sd["hyperparameters"].update(lr="abc"))),
        ("method name as key", edit(lambda sd: sd["hyperparameters"].update(emit_update=None))),
        ("unknown hyper-parameter", edit(lambda sd: sd["hyperparameters"].update(foo=1.0))),
        ("hyper-parameters not a dict", edit(lambda sd: sd.update(hyperparameters=[0.1]))),
        ("missing parameter", edit(lambda sd: sd["state"].pop(name))),
        ("unexpected parameter", edit(lambda sd: sd["state"].update(ghost=copy.deepcopy(sd["state"][name])))),
        ("missing slot", edit(lambda sd: sd["state"][name].pop(slot))),
        ("unexpected slot", edit(lambda sd: sd["state"][name].update(extra=t.clone()))),
        ("relabelled slot", edit(lambda sd: sd["state"][name].update({"renamed": sd["state"][name].pop(slot)}))),
        ("wrong shape", edit(lambda sd: sd["state"][name].update({slot: torch.zeros(7, 7)}))),
        ("wrong dtype", edit(lambda sd: sd["state"][name].update({slot: t.to(torch.float16)}))),
        ("not a tensor", edit(lambda sd: sd["state"][name].update({slot: t.tolist()}))),
        ("slots not a dict", edit(lambda sd: sd["state"].update({name: [t]}))),
        ("nan in state", edit(lambda sd: sd["state"][name][slot].fill_(float("nan")))),
    ]
    if opt_name == "AdamW":
        bad += [("betas out of range", edit(lambda sd: sd["hyperparameters"].update(betas=[3, -1]))),
                ("eps string", edit(lambda sd: sd["hyperparameters"].update(eps="abc"))),
                ("betas wrong length", edit(lambda sd: sd["hyperparameters"].update(betas=[0.9])))]
    else:
        bad += [("nesterov without momentum", edit(lambda sd: sd["hyperparameters"].update(nesterov=True,
                                                                                          momentum=0.0))),
                ("dampening > 1", edit(lambda sd: sd["hyperparameters"].update(dampening=2.0)))]
    return bad


@pytest.mark.parametrize("opt", [lambda: kiln.optim.AdamW(lr=1e-2), lambda: kiln.optim.SGD(lr=0.1, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_every_malformed_checkpoint_is_refused_with_nothing_applied(opt):
    model, step = _trained(opt())
    good = step.state_dict()
    for what, sd in _bad_checkpoints(good, type(step.optimizer).__name__):
        before_state, before_hyper = _snapshot(step)
        with pytest.raises(kiln.KilnError, match="nothing was loaded"):
            step.load_state_dict(sd)
        after_state, after_hyper = _snapshot(step)
        assert after_hyper == before_hyper, what
        for n, slots in before_state.items():
            for k, t in slots.items():
                assert torch.equal(after_state[n][k], t), f"{what}: {n}.{k} changed"
    # and a good one still loads, exactly
    other_model, other = _trained(opt(), steps=3)
    step.load_state_dict(other.state_dict())
    for n, slots in other.state.items():
        for k, t in slots.items():
            assert torch.equal(step.state[n][k], t)


def test_hyperparameters_set_between_steps_are_checked():
    _, step = _trained(kiln.optim.AdamW(lr=1e-2))
    step.optimizer.lr = "fast"
    with pytest.raises(kiln.KilnError, match="lr"):
        step(*_data())


def test_parameters_replaced_after_compile_are_followed():
    """model.load_state_dict(sd, assign=True) replaces the Parameter objects: the step must train the
    new ones (the model is what the user evaluates and saves), exactly like eager on them."""
    torch.manual_seed(0)
    model, ref = Net(), Net()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.5))
    step(*_data(0))
    fresh = {k: v.clone() for k, v in Net().state_dict().items()}
    model.load_state_dict(fresh, assign=True)
    ref.load_state_dict(fresh)
    x, y = _data(1)
    step(x, y)
    F.cross_entropy(ref.b(torch.tanh(ref.a(x))), y).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q - 0.5 * q.grad, msg=lambda m: f"{n}: {m}")


def test_parameters_replaced_by_misfits_are_refused():
    _, step = _trained(kiln.optim.SGD(lr=0.5), steps=1)
    step.model.a.weight = nn.Parameter(torch.randn(8, 7))
    with pytest.raises(kiln.InputError, match="a.weight"):
        step(*_data())


@pytest.mark.parametrize("poison", ["lr", "labels"])
def test_nonfinite_loss_or_gradient_raises_and_writes_nothing(poison):
    model, step = _trained(kiln.optim.AdamW(lr=1e-2))
    before = [p.detach().clone() for p in model.parameters()]
    state, _ = _snapshot(step)
    x, y = _data(5)
    if poison == "lr":                    # a diverged step: inf in the input gives inf/NaN gradients
        x[0, 0] = float("inf")
    else:                                 # every label ignored: the mean over no tokens is NaN
        y = torch.full_like(y, -100)
    with pytest.raises(kiln.NonFiniteError, match="unchanged") as e:
        step(x, y)
    assert ("loss" in str(e.value)) or ("gradient of parameter" in str(e.value))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    for n, slots in state.items():
        assert all(torch.equal(step.state[n][k], t) for k, t in slots.items())
    step(*_data(6))                       # training goes on
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_nonfinite_skip_counts_and_ignore_applies():
    model, step = _trained(kiln.optim.AdamW(lr=1e-2), nonfinite="skip")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data(5)
    x[0, 0] = float("nan")
    loss = step(x, y)
    assert torch.isnan(loss) and step.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model, step = _trained(kiln.optim.AdamW(lr=1e-2), nonfinite="ignore")
    step(x, y)
    assert any(torch.isnan(p).any() for p in model.parameters())
    with pytest.raises(kiln.KilnError, match="nonfinite"):
        kiln.compile(Net(), optimizer=kiln.optim.SGD(lr=0.1), nonfinite="warn")


def test_two_threads_on_one_step_equal_a_serial_order_bit_for_bit():
    """Two threads x 40 steps on one step (their first calls race to compile), each on its own batch.
    The calls' order is recovered from the losses they returned; replaying that order serially must give
    the same losses and parameters, bit for bit."""
    torch.manual_seed(0)
    model = Net()
    start = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2))
    batches = {0: _data(10), 1: _data(11)}
    losses, errors = {0: [], 1: []}, []
    barrier = threading.Barrier(2)

    def run(tid):
        try:
            barrier.wait()
            for _ in range(40):
                losses[tid].append(step(*batches[tid]))
        except BaseException as e:      # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    serial_model = copy.deepcopy(start)
    serial = kiln.compile(serial_model, optimizer=kiln.optim.AdamW(lr=1e-2))
    done = {0: 0, 1: 0}
    while done[0] < 40 or done[1] < 40:
        # which thread ran next: the one whose recorded loss is this state's loss on its batch
        with torch.no_grad():
            here = {t: F.cross_entropy(serial_model.b(torch.tanh(serial_model.a(batches[t][0]))), batches[t][1])
                    for t in (0, 1) if done[t] < 40}
        tid = min(here, key=lambda t: abs(here[t] - losses[t][done[t]]).item())
        assert torch.equal(serial(*batches[tid]), losses[tid][done[tid]])
        done[tid] += 1
    for p, q in zip(model.parameters(), serial_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kernel", ["check_finite", "check_finite_scan"])
def test_the_guard_tells_huge_finite_gradients_from_non_finite_ones(kernel):
    """Both kernels of the guard (ATen's norms, the kiln dialect's scan): a gradient whose norm overflows is
    finite; the first non-finite gradient is named; a non-finite loss is named as the loss."""
    from kiln import guards
    check_finite = getattr(guards, kernel)
    loss = torch.tensor(1.0)
    for dtype in (torch.float32, torch.bfloat16):
        huge = torch.full((4,), 1e20 if dtype == torch.float32 else 1e38, dtype=dtype)
        check_finite(loss, [huge, torch.ones(3, dtype=dtype)], ("a", "b"), "raise")   # norm overflows: finite
        with pytest.raises(kiln.NonFiniteError, match="parameter 'b'"):
            check_finite(loss, [huge, torch.tensor([1.0, float("-inf")], dtype=dtype), torch.tensor([float("nan")])],
                         ("a", "b", "c"), "raise")
    with pytest.raises(kiln.NonFiniteError, match="the loss is nan"):
        check_finite(torch.tensor(float("nan")), [torch.tensor([float("nan")])], ("a",), "raise")


def test_a_failing_fused_update_after_a_reference_update_changes_nothing(monkeypatch):
    """A graph with both update kernels (a strided weight takes the reference one, staged first in
    program order): the fused kernel, which may raise, must run before any copy is written."""
    torch.manual_seed(0)
    model = Net()
    model.a.weight = nn.Parameter((torch.randn(8, 12) * 0.1)[:, ::2])
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2))
    step(*_data(0))
    names = [l for l in step.source().splitlines() if "adamw_update" in l]
    assert any("adamw_update(" in l for l in names) and any("adamw_update_multi(" in l for l in names), names
    before = [p.detach().clone() for p in model.parameters()]
    state, _ = _snapshot(step)

    def broken(*args, **kwargs):
        raise RuntimeError("fused kernel refused its arguments")
    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    with pytest.raises(kiln.StepError, match="refused its arguments"):
        step(*_data(1))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    for n, slots in state.items():
        assert all(torch.equal(step.state[n][k], t) for k, t in slots.items()), n
