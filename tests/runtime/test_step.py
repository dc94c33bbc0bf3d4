"""The compiled step object: checkpoints, caching by signature, errors, dialect choice, introspection."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.dialects import registry as dialect_registry
from tests.models import zoo


def ce(m, x, y):
    return F.cross_entropy(m(x), y)


def mlp_and_data():
    model, (x, y), _, _ = zoo.mlp()
    return model, x, y


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_checkpoint_resume_is_identical():
    model, x, y = mlp_and_data()
    twin = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), loss_fn=ce)
    for _ in range(3):
        step(x, y)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), step.state_dict()
    tail = [step(x, y).item() for _ in range(3)]

    twin.load_state_dict(saved_model)
    resumed = kiln.compile(twin, optimizer=kiln.optim.AdamW(lr=1e-2), loss_fn=ce)
    resumed.load_state_dict(saved_opt)
    assert [resumed(x, y).item() for _ in range(3)] == tail
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


def test_optimizer_state_matches_torch_optim():
    model, x, y = mlp_and_data()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2, betas=(0.8, 0.99)), loss_fn=ce)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.99))
    for _ in range(4):
        step(x, y)
        opt.zero_grad()
        ce(ref, x, y).backward()
        opt.step()
    for (name, _), p in zip(model.named_parameters(), ref.parameters()):
        mine, theirs = step.state_dict()["state"][name], opt.state[p]
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        assert mine["step"].item() == theirs["step"].item() == 4


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_gradient_clipping_matches_clip_grad_norm(max_norm):
    model, x, y = mlp_and_data()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1, momentum=0.9, max_grad_norm=max_norm), loss_fn=ce)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        step(x, y)
        opt.zero_grad()
        ce(ref, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_learning_rate_is_read_every_step():
    model, x, y = mlp_and_data()
    ref = copy.deepcopy(model)
    kopt = kiln.optim.SGD(lr=0.1)
    step = kiln.compile(model, optimizer=kopt, loss_fn=ce)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for lr in (0.1, 0.01, 0.5):
        kopt.lr = lr
        for g in opt.param_groups:
            g["lr"] = lr
        step(x, y)
        opt.zero_grad()
        ce(ref, x, y).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_static_shapes_up_to_the_bound_when_asked_to_fail():
    """dynamic=False compiles one program per shape; fail_on_max_programs=True refuses past the bound."""
    model, _, _ = mlp_and_data()
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce, max_programs=2, dynamic=False,
                        fail_on_max_programs=True)
    for n in (4, 4, 8):
        step(torch.randn(n, 10), torch.randint(0, 5, (n,)))
    assert len(step.programs) == 2
    with pytest.raises(kiln.InputError, match="max_programs"):
        step(torch.randn(3, 10), torch.randint(0, 5, (3,)))
    step(torch.randn(8, 10), torch.randint(0, 5, (8,)))      # a cached signature still runs


def test_failed_step_changes_nothing(monkeypatch):
    """A kernel that fails in the backward: parameters and optimizer state stay exactly as they were."""
    model, x, y = mlp_and_data()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), loss_fn=ce)
    step(x, y)
    before, state_before = params_of(model), step.state_dict()

    def broken_mm(*a, **k):
        raise RuntimeError("injected kernel failure")
    broken = dialect_registry.dialect("broken_for_test", priority=100, devices=("cpu",))
    impl = dialect_registry.kernel(broken, torch.ops.aten.mm.default, broken_mm, fallback=False)
    try:
        failing = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), loss_fn=ce,
                               dialects=["broken_for_test"])
        failing.load_state_dict(state_before)
        with pytest.raises(kiln.StepError, match="injected"):
            failing(x, y)
    finally:
        dialect_registry._IMPLS[torch.ops.aten.mm.default].remove(impl)
        del dialect_registry.DIALECTS["broken_for_test"]
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    for n, slots in failing.state_dict()["state"].items():
        for k, t in slots.items():
            assert torch.equal(t, state_before["state"][n][k]), (n, k)


def test_a_kernel_failing_at_run_time_hands_over_to_aten(caplog):
    model, x, y = mlp_and_data()
    ref = copy.deepcopy(model)
    calls = []

    def flaky_mm(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel for this layout")
    flaky = dialect_registry.dialect("flaky_for_test", priority=100, devices=("cpu",))
    impl = dialect_registry.kernel(flaky, torch.ops.aten.mm.default, flaky_mm)
    try:
        step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce, dialects=["flaky_for_test"])
        with caplog.at_level(logging.WARNING, logger="kiln"):
            losses = [step(x, y) for _ in range(2)]
        assert "kernel flaky_for_test of aten.mm.default failed at run time" in caplog.text
        assert caplog.text.count("failed at run time") == 1 and len(calls) == 1    # tried once, then ATen
        assert "flaky_for_test" in step.source()
    finally:
        dialect_registry._IMPLS[torch.ops.aten.mm.default].remove(impl)
        del dialect_registry.DIALECTS["flaky_for_test"]
    with kiln.dialects("aten"):
        plain = kiln.compile(ref, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce)
        want = [plain(x, y) for _ in range(2)]
    torch.testing.assert_close(losses, want, rtol=0, atol=0)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_dialect_checker_rejection_falls_back_to_aten():
    calls = []
    picky = dialect_registry.dialect("picky_for_test", priority=100, devices=("cpu",))
    impl = dialect_registry.kernel(picky, torch.ops.aten.mm.default, lambda *a: calls.append(1) or torch.mm(*a),
                                   checker=lambda n: n.args[0].meta.shape[0] > 1000)   # never for this model
    try:
        model, x, y = mlp_and_data()
        step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce)
        with kiln.dialects("picky_for_test"):
            step(x, y)
        assert not calls
        assert all(n.impl.dialect.name == "aten" for n in step.graph.nodes if n.target is torch.ops.aten.mm.default)
    finally:
        dialect_registry._IMPLS[torch.ops.aten.mm.default].remove(impl)
        del dialect_registry.DIALECTS["picky_for_test"]


def test_unknown_dialect_is_a_clear_error():
    model, _, _ = mlp_and_data()
    with pytest.raises(kiln.KilnError, match="unknown dialect"):
        kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce, dialects=["triton-on-cpu"])


def test_source_and_explain_describe_the_whole_step(capsys):
    model, args, kwargs, _ = zoo.gpt2()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3))
    step(*args, **kwargs)
    src = step.source()
    for marker in ("# ---- forward ----", "# ---- backward ----", "# ---- optimizer ----",
                   "flash_backward(", "adamw_update", "del "):
        assert marker in src, marker
    assert "transformer.h.1.attn" in src                       # lines name their module
    text = kiln.explain(step)
    assert "sdpa:flash" in text and "aten:fused" in text
    assert "(autograd:" not in text
    assert capsys.readouterr().out.strip() == text.strip()


def test_explain_tells_parameter_casts_from_activation_casts():
    """In a bf16 program each weight and bias is cast once per step and its gradient cast back; what else
    is cast (here the batch into the first matmul, the logits into the fp32 loss and the loss's gradient
    back) is an activation cast, the kind issue 22 wants inside kernels."""
    from kiln.runtime.explain import cast_kinds
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), amp="bf16",
                        loss_fn=lambda m, x, y: F.cross_entropy(m(x), y))
    step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    kinds = list(cast_kinds(step.graph).values())
    assert kinds.count("parameters") == 4 and kinds.count("gradients") == 4, kinds
    assert kinds.count("activations") >= 2, kinds
    assert "4 of parameters and buffers (once per step), 4 of their gradients" in kiln.explain(step)


def test_explain_profile_times_every_op_and_changes_nothing():
    model, args, kwargs, _ = zoo.gpt2()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3))
    step(*args, **kwargs)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {s: t.clone() for s, t in d.items()} for k, d in step.state.items()}
    rng = torch.get_rng_state()
    seconds = step.profile()
    assert len(seconds) == len(step.graph.nodes) and all(s >= 0 for s in seconds) and sum(seconds) > 0
    text = kiln.explain(step, profile=True, file=open("/dev/null", "w"))
    head = text.splitlines()[0].split()
    assert head[:6] == ["#", "phase", "op", "dialect", "compute", "ms"]
    split = next(line for line in text.splitlines() if line.startswith("time: "))
    for part in ("matmul", "attention", "optimizer"):
        assert part in split
    # the replays ran on copies: model, optimizer state and RNG are untouched
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(state[k][s], t) for k, d in step.state.items() for s, t in d.items())
    assert torch.equal(rng, torch.get_rng_state())
    # and training continues exactly as without the profile (same loss as an unprofiled twin)
    twin_model, _, _, _ = zoo.gpt2()
    twin_model.load_state_dict(params)
    twin = kiln.compile(twin_model, optimizer=kiln.optim.AdamW(lr=1e-3))
    twin.load_state_dict(step.state_dict())
    torch.manual_seed(1)
    a = step(*args, **kwargs)
    torch.manual_seed(1)
    b = twin(*args, **kwargs)
    assert torch.equal(a, b)


def test_profile_needs_a_step_first():
    model, _, _, _ = zoo.gpt2()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3))
    with pytest.raises(kiln.KilnError, match="call the step once"):
        kiln.explain(step, profile=True)


def test_ops_without_rules_use_a_visible_fallback(kiln_log):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return torch.atan(self.lin(x)).pow(2).mean()

    torch.manual_seed(0)
    model, x = Odd(), torch.randn(4, 6)
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.5))
    step(x)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(x).backward()
    opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert any("no gradient rule for aten.atan" in r.getMessage() for r in kiln_log.records)
    assert "(autograd: aten.atan)" in step.explain()


def test_step_returns_detached_loss_and_updates_in_place():
    model, x, y = mlp_and_data()
    ids = [id(p) for p in model.parameters()]
    before = params_of(model)
    loss = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=ce)(x, y)
    assert loss.shape == () and not loss.requires_grad
    assert [id(p) for p in model.parameters()] == ids
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())     # torch.autograd was never involved


def test_frozen_parameters_are_read_not_updated():
    model, x, y = mlp_and_data()
    model[0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    frozen = model[0].weight.detach().clone()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-2), loss_fn=ce)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        step(x, y)
        opt.zero_grad()
        ce(ref, x, y).backward()
        opt.step()
    assert torch.equal(model[0].weight, frozen)
    assert "0.weight" not in step.state_dict()["state"]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_train_and_eval_mode_compile_separate_programs():
    model, x, y = mlp_and_data()
    model.append(nn.Dropout(0.5))
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.0), loss_fn=ce)
    model.eval()
    a, b = step(x, y), step(x, y)
    assert torch.equal(a, b)                      # eval: dropout is off, lr 0: same loss twice
    model.train()
    step(x, y)
    assert len(step.programs) == 2


def test_one_tensor_passed_twice_does_not_specialize_the_program():
    """input_ids=x, labels=x compiles a program that is also right for two different tensors."""
    model, _, kwargs, _ = zoo.gpt2()
    ref = copy.deepcopy(model)
    ids = kwargs["input_ids"]
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.0))
    step(input_ids=ids, labels=ids)
    other = torch.randint(0, zoo.VOCAB, ids.shape)
    got = step(input_ids=ids, labels=other)
    assert len(step.programs) == 1
    torch.testing.assert_close(got, ref(input_ids=ids, labels=other).loss.detach(), rtol=1e-5, atol=1e-6)


def test_numeric_hyperparameters_are_runtime_inputs_and_nesterov_recompiles():
    """weight decay, momentum, lr: runtime scalars of the program (no recompile); nesterov is baked in."""
    model, x, y = mlp_and_data()
    ref = copy.deepcopy(model)
    kopt = kiln.optim.SGD(lr=0.1, momentum=0.9)
    step = kiln.compile(model, optimizer=kopt, loss_fn=ce)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for wd, mom, nesterov in ((0.0, 0.9, False), (0.1, 0.5, False), (0.1, 0.5, True)):
        kopt.weight_decay, kopt.momentum, kopt.nesterov = wd, mom, nesterov
        for g in opt.param_groups:
            g.update(weight_decay=wd, momentum=mom, nesterov=nesterov)
        for _ in range(2):
            step(x, y)
            opt.zero_grad()
            ce(ref, x, y).backward()
            opt.step()
    assert len(step.programs) == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
