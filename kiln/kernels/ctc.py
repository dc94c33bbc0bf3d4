"""CTC loss with lengths given as tensors, as one op whose output shape does not depend on the data.

ATen's `_ctc_loss.Tensor` also returns the alignment table `log_alpha`, shaped by the longest target
in the batch: a shape that depends on tensor values, which `torch.export` cannot capture. This op
returns the loss only (shape known from the inputs), and its backward recomputes the table with
ATen's own CTC forward and backward kernels, so gradients are exactly eager PyTorch's.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import _reduction

REDUCTIONS = ("mean", "sum", "none")


def _loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    return torch.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank,
                          _reduction.get_enum(reduction), zero_infinity)


@torch.library.custom_op("kiln::ctc_loss", mutates_args=())
def ctc_loss_op(log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
                blank: int = 0, reduction: str = "mean", zero_infinity: bool = False) -> Tensor:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return _loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)


@ctc_loss_op.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    batch = (log_probs.shape[1],) if log_probs.dim() == 3 else ()
    return log_probs.new_empty(batch if reduction == "none" else ())


@torch.library.custom_op("kiln::ctc_loss_backward", mutates_args=())
def ctc_loss_backward_op(grad: Tensor, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                         target_lengths: Tensor, blank: int, reduction: str, zero_infinity: bool) -> Tensor:
    """d(loss)/d(log_probs) by ATen's CTC kernels; the alignment table is recomputed here, and the
    reduction is undone as `torch.ctc_loss` applies it (mean: each loss over its target length, then
    over the batch)."""
    batched = log_probs.dim() == 3
    if not batched:                     # one sequence: (T, C) and (S,), as torch.ctc_loss handles it
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
        input_lengths, target_lengths = input_lengths.reshape(1), target_lengths.reshape(1)
    aten = torch.ops.aten
    nll, log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    if reduction == "mean":
        per = target_lengths.clamp_min(1).to(nll.dtype)
        g = grad.expand_as(nll) / per / nll.numel()
    elif reduction == "sum":
        g = grad.expand_as(nll)
    else:
        g = grad.reshape(nll.shape)
    if zero_infinity:                   # an infinite loss was replaced by 0: it passes no gradient
        g = torch.where(nll == float("inf"), torch.zeros_like(g), g)
    out = aten._ctc_loss_backward.Tensor(g.contiguous(), log_probs, targets, input_lengths, target_lengths, nll,
                                         log_alpha, blank, zero_infinity)
    return out if batched else out.squeeze(1)


@ctc_loss_backward_op.register_fake
def _(grad, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    return torch.empty_like(log_probs)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.options = inputs[4:]


def _backward(ctx, grad):
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    g = ctc_loss_backward_op(grad, log_probs, targets, input_lengths, target_lengths, *ctx.options)
    return g, None, None, None, None, None, None


ctc_loss_op.register_autograd(_backward, setup_context=_setup)


def ctc_loss(log_probs: Tensor, targets: Tensor, input_lengths, target_lengths, blank: int = 0,
             reduction: str = "mean", zero_infinity: bool = False) -> Tensor:
    """`torch.nn.functional.ctc_loss` with the same arguments and results, as one capturable op."""
    device = log_probs.device
    il = torch.as_tensor(input_lengths, dtype=torch.long, device=device)
    tl = torch.as_tensor(target_lengths, dtype=torch.long, device=device)
    return ctc_loss_op(log_probs, targets, il, tl, blank, reduction, zero_infinity)
