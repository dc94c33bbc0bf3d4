"""Bad input gets a clear error that names the problem and where it is."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:                      # data-dependent Python control flow
            return y.mean()
        return y.sum()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Branchy()

    def forward(self, x):
        return self.block(x)


def sgd():
    return kiln.optim.SGD(lr=0.1)


def test_unsupported_python_names_module_and_line():
    with pytest.raises(kiln.CaptureError) as e:
        kiln.compile(Outer(), optimizer=sgd())(torch.randn(2, 4))
    msg = str(e.value)
    assert "module `block` (Branchy)" in msg and "test_errors.py" in msg and "if y.sum() > 0" in msg


def test_non_scalar_loss():
    model = nn.Linear(4, 3)
    with pytest.raises(kiln.UnsupportedError, match=r"scalar, got shape \(2, 3\)"):
        kiln.compile(model, optimizer=sgd())(torch.randn(2, 4))


def test_model_without_loss():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return {"logits": self.lin(x)}
    with pytest.raises(kiln.UnsupportedError, match="not a loss tensor"):
        kiln.compile(NoLoss(), optimizer=sgd())(torch.randn(2, 2))


def test_hugging_face_model_without_labels_gets_a_hint():
    from tests.models import zoo
    model, _, kwargs, _ = zoo.gpt2()
    with pytest.raises(kiln.UnsupportedError, match="loss=None when no labels"):
        kiln.compile(model, optimizer=sgd())(input_ids=kwargs["input_ids"])


def test_no_trainable_parameters():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(kiln.KilnError, match="no trainable parameters"):
        kiln.compile(model, optimizer=sgd())


def test_wrong_input_type():
    step = kiln.compile(nn.Linear(2, 1), optimizer=sgd(), loss_fn=lambda m, x: m(x).mean())
    with pytest.raises(kiln.InputError, match="type object"):
        step(object())


def test_not_a_module_and_not_an_optimizer_kiln_can_run():
    with pytest.raises(kiln.KilnError, match="expects a torch.nn.Module"):
        kiln.compile(lambda x: x, optimizer=sgd())
    lin = nn.Linear(2, 2)   # torch.optim AdamW, Adam and SGD are accepted; others are refused by name
    with pytest.raises(kiln.KilnError, match="torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD"):
        kiln.compile(lin, optimizer=torch.optim.RMSprop(lin.parameters(), lr=0.1))


def test_bad_hyperparameters():
    with pytest.raises(kiln.KilnError, match="lr"):
        kiln.optim.AdamW(lr=-1)
    with pytest.raises(kiln.KilnError, match="betas"):
        kiln.optim.AdamW(betas=(1.0, 0.9))
    with pytest.raises(kiln.KilnError, match="nesterov"):
        kiln.optim.SGD(lr=0.1, nesterov=True)


def test_loss_independent_of_parameters():
    step = kiln.compile(nn.Linear(2, 2), optimizer=sgd(), loss_fn=lambda m, x: (x * 2).sum())
    with pytest.raises(kiln.UnsupportedError, match="does not depend on any trainable parameter"):
        step(torch.randn(3, 2))


def test_state_dict_mismatch_loads_nothing():
    step = kiln.compile(nn.Linear(2, 2), optimizer=kiln.optim.AdamW(lr=0.1), loss_fn=lambda m, x: F.mse_loss(m(x), x))
    sd = step.state_dict()
    sd["state"]["weight"]["exp_avg"] = torch.ones(2, 2)
    sd["state"]["bias"]["exp_avg"] = torch.ones(5)             # wrong shape
    with pytest.raises(kiln.KilnError, match=r"state\['bias'\]\['exp_avg'\] is \(5,\)"):
        step.load_state_dict(sd)
    assert torch.equal(step.state["weight"]["exp_avg"], torch.zeros(2, 2))   # nothing half-loaded


@torch.library.custom_op("kilntest::double_no_autograd", mutates_args=())
def _double_no_autograd(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double_no_autograd.register_fake
def _(x):
    return torch.empty_like(x)


class NoAutograd(nn.Module):
    """A custom op registered without a backward: eager PyTorch cannot differentiate it either."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _double_no_autograd(self.lin(x)).sum()


def test_runtime_failure_names_op_module_and_line_and_evicts_the_program():
    model = nn.Sequential(nn.Linear(4, 4), NoAutograd())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = kiln.compile(model, optimizer=sgd())
    with pytest.raises(kiln.StepError) as e:
        step(torch.randn(2, 4))
    msg = str(e.value)
    assert "kilntest.double_no_autograd" in msg and "module `1`" in msg, msg
    assert "line" in msg and "fallback_backward" in msg and "what to do" in msg, msg
    assert "unchanged" in msg, msg
    assert isinstance(e.value.__cause__, RuntimeError)
    assert not step.programs, "a program that failed on its first run keeps no slot"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


class AssertsOnValues(nn.Module):
    """A check on a tensor's value (XLM and Flaubert: `assert lengths.max().item() <= slen`): export keeps
    it as Python scalar nodes feeding a runtime assertion; they compute nothing the step uses."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids):
        lengths = (ids != 0).sum(dim=1).long()
        torch._check(lengths.max().item() <= ids.shape[1])
        return self.emb(ids).sum()


def test_python_scalar_checks_do_not_stop_capture():
    torch.manual_seed(0)
    model = AssertsOnValues()
    ref = nn.Embedding(10, 4)
    ref.load_state_dict(model.emb.state_dict())
    ids = torch.tensor([[1, 2, 0], [3, 3, 3]])
    kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0))(ids)
    ref(ids).sum().backward()
    with torch.no_grad():
        for p, q in zip(model.emb.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q - q.grad)


@torch.library.custom_op("kilntest::scale_rows", mutates_args=())
def _scale_rows(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_scale_rows.register_fake
def _(x):
    return torch.empty_like(x)


def _scale_rows_backward(ctx, g):
    # a correct gradient in a transposed layout, as some autograd formulas return them
    return (g * 3).transpose(-1, -2).contiguous().transpose(-1, -2)


_scale_rows.register_autograd(_scale_rows_backward)


def test_fallback_gradients_in_any_layout_reach_later_views():
    """The autograd fallback's gradients may come in any layout; the rules after it (here a linear over a
    3-D input, whose gradient is viewed as a matrix) must see the layout they were promised."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    ref = copy.deepcopy(lin)
    x = torch.randn(2, 5, 4)
    kiln.compile(lin, optimizer=kiln.optim.SGD(lr=1.0), loss_fn=lambda m, x: _scale_rows(m(x)).square().sum())(x)
    _scale_rows(ref(x)).square().sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q.detach() - q.grad)


class PartlyNoGrad(nn.Module):
    """What a forward computes under torch.no_grad() (or detaches) carries no gradient; a parameter
    reached only that way gets none and is not updated (eager's AdamW skips it, weight decay included)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.only_detached = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            t = h * self.scale
        return (h * t).sum() + (x * self.only_detached.detach()).sum()


def test_no_grad_blocks_and_detach_stop_gradients():
    torch.manual_seed(0)
    model = PartlyNoGrad()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=0.1, weight_decay=0.1))
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        step(x)
        opt.zero_grad()
        ref(x).backward()
        opt.step()
    assert ref.scale.grad is None and ref.only_detached.grad is None
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{n}: {m}")


class MaskedSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, ids):
        return self.lin(x)[ids == 2].sum()        # a shape that depends on the values of ids


def test_value_dependent_shapes_are_refused_naming_op_and_line():
    with pytest.raises(kiln.UnsupportedError) as e:
        kiln.compile(MaskedSelect(), optimizer=sgd())(torch.randn(2, 3, 4), torch.tensor([[1, 2, 2], [2, 0, 1]]))
    msg = str(e.value)
    assert "aten.index" in msg and "depends on tensor values" in msg and "ids == 2" in msg, msg
    assert "torch.where" in msg, msg


def test_capture_failure_names_the_model_line_from_the_error_text():
    """An error raised while export re-traces an op (granite_speech's loss over a masked selection) has
    no model frame in its traceback, only in its text: the message still names the model's line."""
    from kiln.capture.export import _user_frame
    e = RuntimeError('Could not guard\nOriginal traceback:\n  File "/models/granite.py", line 571, in forward\n'
                     '    loss = loss_fct(\n  File "' + torch.__file__ + '", line 9, in f\n    x = 1\n')
    assert _user_frame(e) == "/models/granite.py:571: `loss = loss_fct(`"


def test_a_python_number_read_from_tensor_values_is_refused_with_its_line():
    """`x * n.max().item()` used to fail with a raw AttributeError deep in the passes."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, n):
            return (self.lin(x) * n.max().item()).sum()

    step = kiln.compile(Scaled(), optimizer=sgd(), loss_fn=lambda m, *a: m(*a))
    with pytest.raises(kiln.UnsupportedError, match=r"aten.mul.Tensor .* Python number .*test_errors.py.*item\(\)"):
        step(torch.randn(2, 4), torch.tensor([3, 4]))
