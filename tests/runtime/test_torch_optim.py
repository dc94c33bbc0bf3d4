"""torch.optim optimizers inside the compiled step (kiln/torch_optim.py), each checked against eager
PyTorch training an identical copy with the same optimizer and schedule.

Tolerances: rtol=1e-5, atol=1e-6 on parameters. Kiln runs ATen's fused multi-tensor Adam kernel where eager
(CPU) runs torch's single-tensor loop, so results differ by float rounding order; Adam's update
normalizes the gradient, so for near-zero gradient entries such noise is amplified to O(lr) relative
changes of a tiny update, which stays well inside atol=1e-6 at these learning rates.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln

TOL = dict(rtol=1e-5, atol=1e-6)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(12, 24), nn.LayerNorm(24), nn.Linear(24, 5)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def batch(i, n=16):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def two_groups(model, lr_no_decay=3e-3, **extra):
    """The usual split: weight decay on matrices, none on biases and norms (with their own lr)."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr_no_decay,
                                                      **extra}]


def eager_step(model, opt, x, y, loss_fn=ce):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, x, y)
    loss.backward()
    opt.step()
    return loss.detach()


def assert_params_close(model, ref):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{n}: {m}")


def warmup(opt, steps=5):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / steps))


def test_adamw_two_groups_with_warmup_matches_eager_and_never_recompiles():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(two_groups(model), lr=1e-2), torch.optim.AdamW(two_groups(ref), lr=1e-2)
    sched, ref_sched = warmup(opt), warmup(ref_opt)
    step = kiln.compile(model, optimizer=opt, loss_fn=ce)
    lrs = []
    for i in range(20):
        x, y = batch(i)
        loss = step(x, y)
        with warnings.catch_warnings():                # "lr_scheduler.step() before optimizer.step()": not here
            warnings.simplefilter("error", UserWarning)
            sched.step()
        ref_loss = eager_step(ref, ref_opt, x, y)
        ref_sched.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        lrs.append([g["lr"] for g in opt.param_groups])
    assert lrs[0] != lrs[-1]                       # the schedule did change the learning rates
    assert len(step.programs) == 1 and step.cache_info().compiles == 1
    assert_params_close(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):   # torch's own state format, written by Kiln
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert set(mine) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"}
        assert mine["step"].dtype == theirs["step"].dtype and mine["step"].item() == theirs["step"].item() == 20
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_tiny_gpt2_with_tied_weights_and_transformers_schedule():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(model)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() > 1]
        return [{"params": decay, "weight_decay": 0.01}, {"params": [p for p in m.parameters() if p.dim() <= 1],
                                                          "weight_decay": 0.0}]
    opt, ref_opt = torch.optim.AdamW(groups(model), lr=3e-3), torch.optim.AdamW(groups(ref), lr=3e-3)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=12)
    ref_sched = transformers.get_linear_schedule_with_warmup(ref_opt, num_warmup_steps=3, num_training_steps=12)
    step = kiln.compile(model, optimizer=opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        step(input_ids=ids, labels=ids)
        sched.step()
        ref_opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_sched.step()
    assert len(step.programs) == 1
    # The attention's key bias gets an exactly-zero gradient in exact arithmetic (softmax is invariant to
    # adding one constant to every score of a query): what both sides compute for it is float noise, which
    # Adam normalizes into O(lr) steps. Those entries are held to lr * steps; everything else to TOL.
    key = slice(config.n_embd, 2 * config.n_embd)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if n.endswith("attn.c_attn.bias"):
            torch.testing.assert_close(p[key], q[key], rtol=0, atol=3e-3 * 8)
            p, q = torch.cat([p[:key.start], p[key.stop:]]), torch.cat([q[:key.start], q[key.stop:]])
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["sgd_nesterov", "sgd_dampening", "adam", "adam_decoupled"])
def test_sgd_and_adam_match_eager(kind):
    torch.manual_seed(1)
    model = MLP()
    ref = copy.deepcopy(model)

    def make(m):
        if kind == "sgd_nesterov":      # group 1: no momentum at all (torch keeps no state for it)
            return torch.optim.SGD(two_groups(m, lr_no_decay=0.05, momentum=0.0, nesterov=False), lr=0.1,
                                   momentum=0.9, nesterov=True)
        if kind == "sgd_dampening":     # first step: the buffer is the gradient, not (1 - dampening) * gradient
            return torch.optim.SGD(two_groups(m, momentum=0.5), lr=0.1, momentum=0.9, dampening=0.3)
        if kind == "adam":              # weight decay added to the gradient
            return torch.optim.Adam(two_groups(m, betas=(0.8, 0.95), eps=1e-6), lr=1e-2)
        return torch.optim.Adam(two_groups(m), lr=1e-2, decoupled_weight_decay=True)
    opt, ref_opt = make(model), make(ref)
    step = kiln.compile(model, optimizer=opt, loss_fn=ce)
    for i in range(10):
        x, y = batch(i)
        step(x, y)
        eager_step(ref, ref_opt, x, y)
    assert_params_close(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert set(opt.state[p]) == set(ref_opt.state[q])
        for k, t in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][k], t, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trips_to_and_from_eager():
    torch.manual_seed(2)
    model = MLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(two_groups(model), lr=1e-2), torch.optim.AdamW(two_groups(ref), lr=1e-2)
    step = kiln.compile(model, optimizer=opt, loss_fn=ce)
    for i in range(4):
        step(*batch(i))
        eager_step(ref, ref_opt, *batch(i))
    # Kiln -> eager: an eager copy resumes from Kiln's torch-format state and follows the eager reference
    resumed = copy.deepcopy(model)
    resumed_opt = torch.optim.AdamW(two_groups(resumed), lr=1e-2)
    resumed_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    # eager -> Kiln: a fresh compiled step loads the eager reference's state (through the step, and directly)
    other = copy.deepcopy(ref)
    other_opt = torch.optim.AdamW(two_groups(other), lr=1e-2)
    other_step = kiln.compile(other, optimizer=other_opt, loss_fn=ce)
    other_step.load_state_dict({"torch_optimizer": copy.deepcopy(ref_opt.state_dict())})
    direct = copy.deepcopy(ref)
    direct_opt = torch.optim.AdamW(two_groups(direct), lr=1e-2)
    direct_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    direct_step = kiln.compile(direct, optimizer=direct_opt, loss_fn=ce)
    for i in range(4, 8):
        eager_step(ref, ref_opt, *batch(i))
        eager_step(resumed, resumed_opt, *batch(i))
        other_step(*batch(i))
        direct_step(*batch(i))
    for m in (resumed, other, direct, model):
        if m is not model:
            assert_params_close(m, ref)
    assert other_opt.state_dict()["state"][0]["step"].item() == 8
    saved = step.state_dict()                        # the step's own checkpoint: torch's, with copies
    assert saved["torch_optimizer"]["state"][0]["step"].item() == 4
    assert saved["torch_optimizer"]["state"][0]["exp_avg"] is not opt.state[model.fc1.weight]["exp_avg"]
    # a load into the optimizer of a step that has run: the next call reads the loaded tensors
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(q)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for i in range(8, 10):
        step(*batch(i))
        eager_step(ref, ref_opt, *batch(i))
    assert_params_close(model, ref)
    assert opt.state[model.fc1.weight]["step"].item() == 10


def test_sgd_momentum_switched_on_later_starts_its_buffer_like_torch():
    """momentum 0 keeps no state in torch; switched on, the first buffer is the gradient (dampening ignored)."""
    torch.manual_seed(5)
    model = MLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, dampening=0.5) for m in (model, ref))
    step = kiln.compile(model, optimizer=opt, loss_fn=ce)
    for i in range(6):
        if i == 3:
            opt.param_groups[0]["momentum"] = ref_opt.param_groups[0]["momentum"] = 0.9
        step(*batch(i))
        eager_step(ref, ref_opt, *batch(i))
        assert {id(p): set(s) for p, s in zip(ref.parameters(), (opt.state.get(p, {}) for p in model.parameters()))} \
            == {id(q): set(ref_opt.state.get(q, {})) for q in ref.parameters()}
    assert len(step.programs) == 2
    assert_params_close(model, ref)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {id(p): {k: t.clone() for k, t in s.items()} for p, s in opt.state.items()})


def _assert_same(snap, model, opt):
    params, state = snap
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert {id(p): set(s) for p, s in opt.state.items()} == {i: set(s) for i, s in state.items()}
    for p, s in opt.state.items():
        assert all(torch.equal(t, state[id(p)][k]) for k, t in s.items())


def test_a_failed_step_leaves_parameters_and_torch_state_unchanged(monkeypatch):
    torch.manual_seed(3)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = kiln.compile(model, optimizer=opt, loss_fn=ce)
    x, y = batch(0)
    with pytest.raises(kiln.NonFiniteError):      # the first step fails: torch's lazy state is not made
        step(torch.full_like(x, float("nan")), y)
    assert len(opt.state) == 0
    step(x, y)
    assert all(opt.state[p]["momentum_buffer"] is not None for p in model.parameters())
    snap = _snapshot(model, opt)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(torch, "_foreach_copy_", broken)
    with pytest.raises(kiln.StepError):
        step(*batch(1))
    monkeypatch.undo()
    _assert_same(snap, model, opt)


def test_unsupported_optimizers_and_options_are_refused():
    model = MLP()
    for opt, match in [(torch.optim.RMSprop(model.parameters()), "RMSprop"),
                       (torch.optim.AdamW(model.parameters(), amsgrad=True), "amsgrad"),
                       (torch.optim.SGD(model.parameters(), lr=0.1, maximize=True), "maximize"),
                       (type("MyAdam", (torch.optim.Adam,), {})(model.parameters()), "MyAdam")]:
        with pytest.raises(kiln.KilnError, match=match):
            kiln.compile(model, optimizer=opt, loss_fn=ce)
    opt = torch.optim.AdamW(model.parameters())
    step = kiln.compile(model, optimizer=opt, loss_fn=ce)
    opt.param_groups[0]["maximize"] = True               # set later: refused at the next call
    with pytest.raises(kiln.KilnError, match="maximize"):
        step(*batch(0))
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *a: None)
    with pytest.raises(kiln.KilnError, match="step hooks"):
        kiln.compile(model, optimizer=hooked, loss_fn=ce)
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(kiln.KilnError, match="not a parameter"):
        kiln.compile(model, optimizer=stranger, loss_fn=ce)(*batch(0))
    with pytest.raises(kiln.KilnError, match="torch_optimizer"):
        step.load_state_dict({"state": {}})


def test_kiln_optim_groups_by_name_pattern_match_torch_param_groups():
    """kiln.optim's `groups=` (fnmatch patterns on parameter names) against the same split in torch's
    param_groups; a group's lr changed between steps is a runtime input (no recompile)."""
    torch.manual_seed(4)
    model = MLP()
    ref = copy.deepcopy(model)
    kopt = kiln.optim.AdamW(lr=1e-2, weight_decay=0.1, groups=[
        {"params": ["*.bias", "norm.*"], "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.95)}])
    ref_opt = torch.optim.AdamW(two_groups(ref, betas=(0.8, 0.95)), lr=1e-2)
    step = kiln.compile(model, optimizer=kopt, loss_fn=ce)
    for i in range(10):
        if i == 5:
            kopt.groups[0]["lr"] = ref_opt.param_groups[1]["lr"] = 1e-3
        step(*batch(i))
        eager_step(ref, ref_opt, *batch(i))
    assert len(step.programs) == 1
    assert_params_close(model, ref)
    saved = step.state_dict()                       # the groups travel with the checkpoint
    assert saved["hyperparameters"]["groups"][0]["lr"] == 1e-3
    with pytest.raises(kiln.KilnError, match="matches no trainable parameter"):
        kiln.compile(MLP(), optimizer=kiln.optim.SGD(lr=0.1, groups=[{"params": "encoder.*"}]), loss_fn=ce)(*batch(0))
    with pytest.raises(kiln.KilnError, match="groups\\[0\\] sets \\['nesterov'\\]"):
        kiln.optim.SGD(lr=0.1, momentum=0.9, groups=[{"params": "*", "nesterov": True}])
    with pytest.raises(kiln.KilnError, match="groups\\[0\\]: lr"):
        kiln.optim.SGD(lr=0.1, groups=[{"params": "*", "lr": -1.0}])
