"""User `torch.autograd.Function`s: Kiln runs the user's own backward, never the forward's derivative.

Each model is trained by Kiln and eagerly from the same weights: one SGD(lr=1) step (the parameter
deltas are the gradients) and three AdamW steps, compared with torch.optim.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp

import kiln
from kiln.ops import functions


# ---- the Functions ---------------------------------------------------------------------------
class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: round in the forward, identity in the backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    """Gradient reversal layer (domain-adversarial training): identity forward, -lambda * g backward."""

    @staticmethod
    def forward(ctx, x, lam: float):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class ScaleWithMask(torch.autograd.Function):
    """save_for_backward, non-tensor arguments, two outputs, one of them marked non-differentiable; the
    backward is deliberately not the forward's derivative (a sign estimator for w)."""

    @staticmethod
    def forward(ctx, x, w, scale: float, mode: str):
        assert mode == "sign"
        out = x * w * scale
        mask = (out > 0).to(out.dtype)
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        ctx.mark_non_differentiable(mask)
        return out, mask

    @staticmethod
    def backward(ctx, g, g_mask):
        x, w = ctx.saved_tensors
        assert g_mask is None or not g_mask.any()
        return g * torch.sign(w) * ctx.scale, (g * x).sum(0) * ctx.scale * 0.5, None, None


class ClampSTE(torch.autograd.Function):
    """Old-style Function (forward(ctx, ...)): clamp forward, gradient passed where |x| <= bound."""

    @staticmethod
    def forward(ctx, x, bound):
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp(-bound, bound).round()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= ctx.bound).to(g.dtype), None


class ScaledSign(torch.autograd.Function):
    """setup_context-style Function: sign forward, scaled tanh' backward."""

    @staticmethod
    def forward(x, k=2.0):
        return torch.sign(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, k = inputs
        ctx.save_for_backward(x)
        ctx.k = k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k * (1 - torch.tanh(ctx.k * x) ** 2), None


class GateNoGradForB(torch.autograd.Function):
    """a * b forward; the backward gives a gradient for a only (None for b, which requires grad)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        (b,) = ctx.saved_tensors
        return g * b * 2, None


class NeedsGradProbe(torch.autograd.Function):
    """Records ctx.needs_input_grad, as eager and Kiln's step see it."""

    seen: list = []

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        NeedsGradProbe.seen.append(tuple(ctx.needs_input_grad))
        return (g * 3 if ctx.needs_input_grad[0] else None), (g if ctx.needs_input_grad[1] else None)


class WithIndices(torch.autograd.Function):
    """An integer tensor output and a Python number among the outputs; a custom backward for the float one."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, x.argmax(-1), x.shape[-1]

    @staticmethod
    def backward(ctx, g, g_idx, g_n):
        assert g_idx is None or not g_idx.is_floating_point()
        return g * 5


class Outer(torch.autograd.Function):
    """A Function whose forward calls another Function: only the outer backward runs (as in eager, where
    the forward runs without grad)."""

    @staticmethod
    def forward(ctx, x):
        return RoundSTE.apply(x * 3)

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ApplyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class DataDependent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2 if x.sum() > 0 else x * 3

    @staticmethod
    def backward(ctx, g):
        return g


# ---- models ----------------------------------------------------------------------------------
class Two(nn.Module):
    """in -> l1 -> fn -> l2 -> loss."""

    def __init__(self, fn):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.fn = fn

    def forward(self, x):
        return self.l2(self.fn(self.l1(x))).pow(2).mean()


class MaskModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        out, mask = ScaleWithMask.apply(self.l1(x), self.w, 1.5, "sign")
        return (self.l2(out * mask).pow(2).mean() + (out * mask).sum() * 0.1)


class GateModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.la, self.lb, self.l2 = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.l2(GateNoGradForB.apply(self.la(x), self.lb(x))).pow(2).mean()


class TwiceModel(nn.Module):
    """The same Function in two places, on different shapes."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = RoundSTE.apply(self.l1(x) * 2)
        h = RoundSTE.apply(self.l2(h))
        return self.l3(h).pow(2).mean()


class ProbeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x):
        return self.l2(NeedsGradProbe.apply(self.l1(x), self.offset)).pow(2).mean()


class IndicesModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        y, idx, n = WithIndices.apply(self.l1(x))
        return self.l2(y / n).pow(2).mean() + y.gather(1, idx[:, None]).mean()


class NoGradCall(nn.Module):
    """The Function called under no_grad: in eager nothing flows back through it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.l1(x)
        with torch.no_grad():
            q = GradReverse.apply(h, 0.7)
        return self.l2(h + q).pow(2).mean()


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.l0 = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.l0(x)
        h = h + cp.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(torch.relu(h)).pow(2).mean()


class CheckpointedFirst(nn.Module):
    """The checkpointed block reads the raw input: with use_reentrant=True eager gives its parameters no
    gradient (no input requires grad), and Kiln must not either."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        h = cp.checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h).pow(2).mean()


# ---- the check -------------------------------------------------------------------------------
def _x():
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1)) * 2


def assert_trains_like_eager(make, steps=3):
    """SGD(lr=1): one step, the parameter deltas are the gradients; then `steps` AdamW steps."""
    x = _x()
    for kiln_opt, torch_opt, n in ((kiln.optim.SGD(lr=1.0), lambda ps: torch.optim.SGD(ps, lr=1.0), 1),
                                   (kiln.optim.AdamW(lr=1e-2, weight_decay=0.01),
                                    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01), steps)):
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        step = kiln.compile(model, optimizer=kiln_opt, verify=True)
        opt = torch_opt(ref.parameters())
        for _ in range(n):
            got = step(x)
            opt.zero_grad()
            want = ref(x)
            want.backward()
            opt.step()
            torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{type(model).__name__} "
                                       f"{type(kiln_opt).__name__}: parameter {name}: {m}")
    return step


def test_straight_through_estimator():
    step = assert_trains_like_eager(lambda: Two(RoundSTE.apply))       # apply bound before the capture
    ops = [n.op.name for n in step.graph.nodes]
    assert "aten.round" not in ops and ops.count("kiln.fallback_forward") == 1, ops


def test_gradient_reversal():
    assert_trains_like_eager(lambda: Two(lambda h: GradReverse.apply(h, 0.7)))


def test_saved_tensors_non_tensor_args_and_non_differentiable_output():
    assert_trains_like_eager(MaskModel)


def test_old_style_function():
    assert_trains_like_eager(lambda: Two(lambda h: ClampSTE.apply(h, 0.8)))


def test_setup_context_function():
    assert_trains_like_eager(lambda: Two(lambda h: ScaledSign.apply(h, 3.0)))
    assert_trains_like_eager(lambda: Two(ScaledSign.apply))            # the default argument, bound as apply does


def test_integer_and_python_outputs():
    assert_trains_like_eager(IndicesModel)


def test_nested_function_runs_the_outer_backward():
    assert_trains_like_eager(lambda: Two(Outer.apply))


def test_function_called_under_no_grad():
    assert_trains_like_eager(NoGradCall)


def test_backward_returning_none_for_an_input_that_requires_grad():
    assert_trains_like_eager(GateModel)


def test_function_used_twice():
    step = assert_trains_like_eager(TwiceModel)
    assert sum("RoundSTE" in repr(n.args) for n in step.graph.nodes) == 2


def test_needs_input_grad_is_as_in_eager():
    NeedsGradProbe.seen.clear()
    assert_trains_like_eager(ProbeModel, steps=1)
    assert NeedsGradProbe.seen and set(NeedsGradProbe.seen) == {(True, False)}


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint(reentrant):
    assert_trains_like_eager(lambda: Checkpointed(reentrant))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_of_the_raw_input(reentrant):
    assert_trains_like_eager(lambda: CheckpointedFirst(reentrant))


def _refusal(model) -> str:
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(kiln.KilnError) as e:
        step(_x())
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)                           # refused before any update
    return str(e.value)


@pytest.mark.parametrize("fn,problem", [
    (DataDependent.apply, "could not run on fake tensors"),
    (InPlace.apply, "in place"),
    (lambda h: ApplyFn.apply(h, lambda t: t * h), "tensor of the capture"),
], ids=["data-dependent", "mark_dirty", "closure"])
def test_functions_kiln_cannot_honour_are_refused(fn, problem):
    msg = _refusal(Two(fn))
    assert "torch.autograd.Function" in msg and problem in msg and "To fix" in msg, msg
    # the capture put every Function back as it was
    assert torch.autograd.Function.__dict__["apply"] is functions.ORIGINAL_APPLY
    for cls in (DataDependent, InPlace, ApplyFn, RoundSTE):
        assert cls.__dict__["forward"].__func__.__name__ == "forward"
