"""Guards: the non-finite check, and the check of value-dependent branches.

A step whose loss or gradients are not finite writes nothing.

`kiln.compile(..., nonfinite="raise")` (the default) adds one node before the optimizer update: it reads
every gradient once and the loss (on CPU, the kiln dialect's scan of exponent bits in native.c; else the
gradients' 2-norms, one multi-tensor pass, where NaN and inf propagate),
and on a non-finite value raises `NonFiniteError` naming the loss or the first parameter whose gradient is
not finite. Since updates are only staged until the step commits (kiln/transaction.py), parameters and
optimizer state are left exactly as they were. "skip" counts and warns instead (the step returns the
loss); "ignore" adds no check. fp16 training has its own: the loss scaler skips overflowing steps.

A Python branch on tensor values (kiln/capture/branches.py) is decided by the batch that compiled the
program; a `branch_guard` node re-checks each such decision on every batch and raises `BranchChanged`
(before any write) when a batch decides otherwise.
"""
from __future__ import annotations

import torch

from kiln.errors import KilnError
from kiln.ops.registry import Cast, Kind, OpDef, register
from kiln.ir.symbolic import hint

NONFINITE = ("raise", "skip", "ignore")


class NonFiniteError(KilnError):
    """The loss or a gradient was NaN or infinite; the step wrote nothing."""


class BranchChanged(KilnError):
    """Raised inside a step when the batch would take another value-dependent Python branch than the batch
    the program was compiled for (kiln/capture/branches.py); nothing was written, the step compiles a
    variant."""


class SkippedStep(KilnError):
    """Raised inside a step with nonfinite="skip"; the step catches it and returns `loss`."""

    def __init__(self, message: str, loss: torch.Tensor):
        super().__init__(message)
        self.loss = loss


def check_finite(loss: torch.Tensor, grads: list, names: tuple, mode: str) -> None:
    # The 2-norms (one vectorized multi-tensor pass; measured 20x faster than the inf-norm on CPU) are
    # NaN or inf when a gradient holds a NaN or an inf. A huge but finite gradient (|g| > 1e19 in fp32)
    # also overflows its norm: the exact per-element check below runs only then, to tell them apart.
    norms = torch._foreach_norm(grads) if grads else []
    total = loss.detach().float() + (torch.stack(norms).float().sum() if norms else 0.0)
    if bool(torch.isfinite(total)):
        return
    if not bool(torch.isfinite(loss)):
        _refuse(loss, None, mode)
    first = next((n for n, g in zip(names, grads) if not bool(torch.isfinite(g).all())), None)
    if first is not None:                 # else finite after all: only the sum of squares overflowed
        _refuse(loss, first, mode)


def check_finite_scan(loss: torch.Tensor, grads: list, names: tuple, mode: str) -> None:
    """check_finite by one read of the loss and every gradient, testing exponent bits (native.c on CPU;
    the kiln dialect's kernel for the guard): exact for huge finite values, no second pass."""
    from kiln.kernels import native
    first = native.first_nonfinite([loss.detach(), *grads])
    if first is not None:
        _refuse(loss, None if first == 0 else names[first - 1], mode)


def _refuse(loss: torch.Tensor, param, mode: str) -> None:
    """Skip or raise for a non-finite loss (param None) or the gradient of `param`."""
    if param is None:
        what = (f"the loss is {loss.item()}" + (" (a mean over no elements? e.g. every label is the ignore index)"
                                                 if torch.isnan(loss) else ""))
    else:
        what = f"the gradient of parameter {param!r} is not finite"
    not_finite(what, loss, mode)


def not_finite(what: str, loss: torch.Tensor, mode: str, where: str = "") -> None:
    """Skip the step (mode "skip") or raise NonFiniteError: `what` is not finite; nothing was written."""
    if mode == "skip":
        raise SkippedStep(what, loss.detach())
    raise NonFiniteError(f"{what}; parameters and optimizer state are unchanged{where}. Lower the learning rate, "
                         "clip gradients (max_grad_norm=), check the batch, or pass kiln.compile(..., "
                         "nonfinite='skip') to skip such steps")


CHECK_FINITE = register(OpDef("kiln.check_finite", (check_finite,), None, Kind.OPTIMIZER, Cast.FP32,
                              differentiable=False, side_effects=True, infer=lambda args, kwargs: [],
                              reads_narrow=True,     # a bf16 gradient is finite exactly when its fp32 copy is
                              cost=lambda n: float(sum(hint(g.meta.numel) for g in n.args[1])),
                              doc="raises (or skips the step) when the loss or a gradient is not finite"))


def branch_guard(values: list, decisions: tuple, line: str) -> None:
    """The value-dependent decisions the program was compiled with still hold for this batch."""
    if not all(d.check(*values) for d in decisions):
        raise BranchChanged(f"this batch takes another branch than the one compiled, {line}")


BRANCH_GUARD = register(OpDef("kiln.branch_guard", (branch_guard,), None, Kind.OPAQUE, Cast.FOLLOW,
                              differentiable=False, side_effects=True, infer=lambda args, kwargs: [],
                              cost=lambda n: 1.0,
                              doc="a Python branch on tensor values, decided at capture: raises BranchChanged "
                                  "(the step compiles a variant) when a batch decides it otherwise"))


def emit_check(b, loss, grads: list, names: list[str], mode: str) -> None:
    """Add the guard before the update (nothing for mode "ignore")."""
    if mode != "ignore":
        b.emit(CHECK_FINITE, (loss, list(grads), tuple(names), mode), {}, metas=[])
