"""Linear + cross-entropy computed in chunks of tokens: the (tokens x vocab) logits never exist.

Forward: for each chunk of rows, logits = hidden_chunk @ weight.T, then log-sum-exp and the target
logit, in place in the chunk's buffer. Only one fp32 log-sum-exp per token is saved.
Backward: each chunk's logits are recomputed, turned into softmax - onehot in place, scaled by the
incoming gradient, and multiplied into grad_hidden (rows of the chunk) and grad_weight (accumulated
in fp32). Peak extra memory is one chunk of logits (a fixed budget of elements, so the chunk gets
fewer rows as the vocabulary grows) plus grad_weight, which is parameter-sized anyway.
The price: the backward does one more matmul than eager (the recompute), 4 instead of 3 in all.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels._common import acc_dtype, gpu_impl, rows

# Elements of one chunk of logits: 16M (64 MiB in fp32). Fewer rows than MIN_ROWS make the matmuls
# slow on a CPU (measured: 65 rows x 128k vocab is 2.7x slower than 131 rows; every chunk streams the
# whole weight), so a chunk never has fewer: then it holds 128 x vocab logits, which is no more than
# the weight itself for hidden >= 128. Either way the chunk does not grow with the number of tokens.
LOGIT_BUDGET = 1 << 24
MIN_ROWS = 128
REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(n_rows: int, vocab: int, chunk_size: int) -> int:
    """Rows per chunk: `chunk_size` if given (> 0), else as many as fit LOGIT_BUDGET (at least MIN_ROWS)."""
    if chunk_size > 0:
        return chunk_size
    return max(1, min(n_rows, max(MIN_ROWS, LOGIT_BUDGET // max(vocab, 1))))


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]}) "
                         f"for hidden {tuple(hidden.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if labels.dtype.is_floating_point:
        raise ValueError("labels must be class indices (an integer tensor)")


def _chunk_logits(h: Tensor, weight: Tensor, acc: torch.dtype) -> Tensor:
    """One chunk of logits in the accumulation dtype, in a buffer the caller may overwrite."""
    logits = torch.mm(h, weight.t())
    return logits if logits.dtype == acc else logits.to(acc)


@torch.library.custom_op("kiln::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                            chunk_size: int) -> tuple[Tensor, Tensor]:
    """(loss, lse): cross_entropy(hidden @ weight.T, labels); lse (labels' shape, fp32) is the
    per-token log-sum-exp the backward needs. chunk_size <= 0 picks the chunk from LOGIT_BUDGET."""
    impl = gpu_impl("linear_cross_entropy", hidden)
    if impl is not None:
        return impl(hidden, weight, labels, ignore_index, reduction, chunk_size)
    _check(hidden, weight, labels, reduction)
    acc = acc_dtype(hidden.dtype)
    h2, y = rows(hidden), labels.reshape(-1)
    n = h2.shape[0]
    valid = y != ignore_index
    safe_y = torch.where(valid, y, 0).unsqueeze(1)    # ignored rows gather class 0 and are masked below
    lse = torch.empty(n, dtype=acc, device=hidden.device)
    target = torch.empty(n, dtype=acc, device=hidden.device)
    step = chunk_rows(n, weight.shape[0], chunk_size)
    for s in range(0, n, step):
        e = min(n, s + step)
        z = _chunk_logits(h2[s:e], weight, acc)
        target[s:e] = z.gather(1, safe_y[s:e]).squeeze(1)
        # log-sum-exp in place: no second (rows x vocab) buffer for exp()
        m = z.amax(1, keepdim=True)
        lse[s:e] = z.sub_(m).exp_().sum(1).log_().add_(m.squeeze(1))
        del z
    per_token = lse.sub(target).masked_fill_(~valid, 0.0)
    if reduction == "none":
        loss = per_token.reshape(labels.shape)
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        loss = per_token.sum() / valid.sum()           # 0/0 = nan when every label is ignored, as PyTorch
    return loss, lse.reshape(labels.shape)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction, chunk_size):
    _check(hidden, weight, labels, reduction)
    acc = acc_dtype(hidden.dtype)
    loss = hidden.new_empty(labels.shape if reduction == "none" else (), dtype=acc)
    return loss, hidden.new_empty(labels.shape, dtype=acc)


@torch.library.custom_op("kiln::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(grad: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, lse: Tensor,
                                     ignore_index: int, reduction: str, chunk_size: int) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight), recomputing each chunk's logits from hidden, weight and lse."""
    impl = gpu_impl("linear_cross_entropy_backward", hidden)
    if impl is not None:
        return impl(grad, hidden, weight, labels, lse, ignore_index, reduction, chunk_size)
    acc = acc_dtype(hidden.dtype)
    h2, y, lse = rows(hidden), labels.reshape(-1), lse.reshape(-1)
    n = h2.shape[0]
    valid = y != ignore_index
    safe_y = torch.where(valid, y, 0).unsqueeze(1)
    # d loss / d logit_row = row_scale * (softmax - onehot); ignored rows get 0
    if reduction == "none":
        row_scale = grad.reshape(-1).to(acc) * valid
    else:
        g = grad.to(acc)
        if reduction == "mean":
            g = g / valid.sum().clamp(min=1)            # all ignored: every row is 0 anyway, as PyTorch
        row_scale = valid.to(acc) * g
    grad_hidden = torch.empty_like(h2)
    grad_weight = None
    step = chunk_rows(n, weight.shape[0], chunk_size)
    for s in range(0, n, step):
        e = min(n, s + step)
        p = _chunk_logits(h2[s:e], weight, acc)
        p.sub_(lse[s:e].unsqueeze(1)).exp_()                     # softmax, in place
        p.scatter_add_(1, safe_y[s:e], -valid[s:e].unsqueeze(1).to(acc))   # - onehot (valid rows only)
        p.mul_(row_scale[s:e].unsqueeze(1))
        pw = p if p.dtype == weight.dtype else p.to(weight.dtype)
        torch.mm(pw, weight, out=grad_hidden[s:e])
        if grad_weight is None:
            grad_weight = torch.mm(pw.t(), h2[s:e])       # the first chunk initializes: no zero fill
            if e < n:
                # more chunks follow: half types accumulate in fp32 (one weight-sized buffer, which a
                # single chunk, as for a short sequence, does not need)
                grad_weight = grad_weight.to(acc_dtype(weight.dtype))
        elif grad_weight.dtype == pw.dtype:
            grad_weight.addmm_(pw.t(), h2[s:e])
        else:
            grad_weight.add_(torch.mm(pw.t(), h2[s:e]))
        del p, pw
    if grad_weight is None:                                # no tokens at all
        grad_weight = torch.zeros_like(weight)
    return grad_hidden.reshape(hidden.shape), grad_weight.to(weight.dtype)


@linear_cross_entropy_backward_op.register_fake
def _(grad, hidden, weight, labels, lse, ignore_index, reduction, chunk_size):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    hidden, weight, labels, ignore_index, reduction, chunk_size = inputs
    loss, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)     # no zeros for lse's (absent) gradient
    ctx.save_for_backward(hidden, weight, labels, lse)
    ctx.args = (ignore_index, reduction, chunk_size)


def _backward(ctx, grad, _grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    gh, gw = torch.ops.kiln.linear_cross_entropy_backward(grad, hidden, weight, labels, lse, *ctx.args)
    return gh, gw, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)
