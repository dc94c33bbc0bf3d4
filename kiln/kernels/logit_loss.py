"""Cross-entropy on logits a model has already computed: one read of the logits forward, one read and one
write backward.

`F.cross_entropy(logits, labels)` in eager PyTorch is `log_softmax` (writes a second logits-sized tensor,
kept for the backward) then `nll_loss`; its backward fills a logits-sized zero tensor, scatters into it,
and `log_softmax_backward` reads both big tensors to write the gradient: about eight passes over
(tokens x vocab) values, 262 MB each at 2048 tokens of a 32000-word vocabulary in fp32. Here the forward
keeps one log-sum-exp per row (the logits themselves are the model's output, alive anyway), and the
backward writes `(softmax - onehot) * scale` straight from the logits.

The CPU loops are Kiln's native ones (kiln/kernels/native_loss.c, `kiln_ce_forward` / `kiln_ce_backward`),
for float32 and bfloat16 logits whose rows have a dense last dimension and int64 labels; anything else
(another device or dtype, KILN_NATIVE=0, no compiler) runs the same arithmetic as ATen calls. The loss and
the gradient are computed in fp32 and returned in the logits' dtype, as `F.cross_entropy` returns them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels import native
from kiln.kernels._common import acc_dtype, gpu_impl

REDUCTIONS = ("mean", "sum", "none")


def _check(logits: Tensor, labels: Tensor, reduction: str) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: logits must be (N, C) and labels (N,), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    if labels.dtype != torch.int64:
        raise ValueError(f"cross_entropy: labels must be int64 class indices, got {labels.dtype}")
    if not logits.is_floating_point():
        raise ValueError(f"cross_entropy: logits must be floating point, got {logits.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _out_of_range(labels: Tensor, ignore_index: int, classes: int) -> None:
    bad = labels[(labels != ignore_index) & ((labels < 0) | (labels >= classes))]
    if bad.numel():
        raise IndexError(f"cross_entropy: target {int(bad[0])} is out of bounds for {classes} classes")


def _native(logits: Tensor, labels: Tensor):
    """The native library where it applies to these tensors, else None."""
    lib = native.usable(logits)
    if lib is None or logits.stride(-1) != 1 or labels.device.type != "cpu":
        return None
    return lib


def _row_stats(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(per-row loss, per-row log-sum-exp), fp32 (fp64 for fp64 logits); 0 and 0 on ignored rows."""
    n, c = logits.shape
    lib = _native(logits, labels)
    if lib is not None:
        y = labels.contiguous()
        loss, lse = logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)
        status = lib.kiln_ce_forward(logits.data_ptr(), native.code(logits), logits.stride(0), y.data_ptr(),
                                     int(ignore_index), loss.data_ptr(), lse.data_ptr(), n, c, native.threads())
        if status == 2:
            _out_of_range(labels, ignore_index, c)
        native.check(status, "cross-entropy")
        return loss, lse
    _out_of_range(labels, ignore_index, c)
    keep = labels != ignore_index
    x = logits.to(acc_dtype(logits.dtype))
    m = x.amax(dim=-1, keepdim=True)       # as log_softmax: NaN for a row with NaN, +inf, or only -inf
    lse = (m + torch.exp(x - m).sum(dim=-1, keepdim=True).log()).squeeze(1)
    picked = x.gather(1, torch.where(keep, labels, 0).unsqueeze(1)).squeeze(1)
    zero = lse.new_zeros(())
    return torch.where(keep, lse - picked, zero), torch.where(keep, lse, zero)


def _reduced(per_row: Tensor, labels: Tensor, ignore_index: int, reduction: str, dtype: torch.dtype) -> Tensor:
    if reduction == "none":
        return per_row.to(dtype)
    total = per_row.sum()
    if reduction == "mean":     # over the counted rows (nan when there are none, as PyTorch)
        total = total / (labels != ignore_index).sum().to(total.dtype)
    return total.to(dtype)


@torch.library.custom_op("kiln::softmax_cross_entropy", mutates_args=())
def cross_entropy_op(logits: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> tuple[Tensor, Tensor]:
    """(loss, per-row log-sum-exp in fp32, or fp64 for fp64 logits) of `F.cross_entropy(logits, labels, ignore_index=, reduction=)`."""
    impl = gpu_impl("softmax_cross_entropy", logits)
    if impl is not None:
        return impl(logits, labels, ignore_index, reduction)
    _check(logits, labels, reduction)
    per_row, lse = _row_stats(logits, labels, ignore_index)
    return _reduced(per_row, labels, ignore_index, reduction, logits.dtype), lse


@cross_entropy_op.register_fake
def _(logits, labels, ignore_index, reduction):
    _check(logits, labels, reduction)
    shape = logits.shape[:1] if reduction == "none" else ()
    return logits.new_empty(shape), logits.new_empty(logits.shape[:1], dtype=acc_dtype(logits.dtype))


def _scale(grad: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """What each row's (softmax - onehot) is multiplied by: fp32, one value or one per row."""
    g = grad.to(acc_dtype(grad.dtype)).reshape(-1).contiguous()
    if reduction == "mean":
        g = g / (labels != ignore_index).sum().to(g.dtype)
    return g


@torch.library.custom_op("kiln::softmax_cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(grad: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, ignore_index: int,
                              reduction: str) -> Tensor:
    """The logits' gradient, `(softmax(logits) - onehot(labels)) * d loss`, from the saved log-sum-exp."""
    impl = gpu_impl("softmax_cross_entropy_backward", logits)
    if impl is not None:
        return impl(grad, logits, labels, lse, ignore_index, reduction)
    scale = _scale(grad, labels, ignore_index, reduction)
    n, c = logits.shape
    lib = _native(logits, labels)
    if lib is not None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
        lse_c, y = lse.contiguous(), labels.contiguous()
        native.check(lib.kiln_ce_backward(logits.data_ptr(), native.code(logits), logits.stride(0), y.data_ptr(),
                                          int(ignore_index), lse_c.data_ptr(), scale.data_ptr(),
                                          1 if scale.numel() > 1 else 0, out.data_ptr(), native.code(out),
                                          out.stride(0), n, c, native.threads()), "cross-entropy")
        return out
    keep = labels != ignore_index
    p = torch.exp(logits.to(lse.dtype) - lse.unsqueeze(1))
    rows_kept = keep.nonzero().squeeze(1)
    p[rows_kept, labels[rows_kept]] -= 1.0
    p.mul_((scale if scale.numel() > 1 else scale.expand(n)).unsqueeze(1))
    p.masked_fill_(~keep.unsqueeze(1), 0.0)
    return p.to(logits.dtype)


@cross_entropy_backward_op.register_fake
def _(grad, logits, labels, lse, ignore_index, reduction):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    logits, labels, ignore_index, reduction = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, labels, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _backward(ctx, grad, _grad_lse):
    logits, labels, lse = ctx.saved_tensors
    return (torch.ops.kiln.softmax_cross_entropy_backward(grad, logits, labels, lse, ctx.ignore_index, ctx.reduction),
            None, None, None)


cross_entropy_op.register_autograd(_backward, setup_context=_setup)
