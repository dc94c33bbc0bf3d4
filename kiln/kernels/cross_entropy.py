"""Linear + cross-entropy computed in chunks of tokens: the (tokens x vocab) logits never exist.

Forward: for each chunk of rows, logits = hidden_chunk @ weight.T, then log-sum-exp and the target
logit, in place in the chunk's buffer. Only one fp32 log-sum-exp per token is saved.
Backward: each chunk's logits are recomputed, turned into softmax - onehot in place, scaled by the
incoming gradient, and multiplied into grad_hidden (rows of the chunk) and grad_weight (accumulated
in fp32). Peak extra memory is one chunk of logits (a fixed budget of elements, so the chunk gets
fewer rows as the vocabulary grows) plus grad_weight, which is parameter-sized anyway.
The price: the backward does one more matmul than eager (the recompute), 4 instead of 3 in all.

`kiln::linear_cross_entropy_grads` is the same loss for training, with the gradient computed in the
forward (the gradient of a mean or a sum of token losses does not depend on anything after the loss but
one scalar): each chunk's logits become softmax - onehot in place and go straight into grad_hidden and
grad_weight, which the backward only scales by its incoming gradient. 3 matmuls, as eager, and no logits
kept: what the step holds between forward and backward is the two gradients, not (tokens x vocab).

Both skip the tokens whose label is `ignore_index` (padding, masked prompts, the last position of a
shifted causal LM): those add nothing to the loss or to any gradient (their grad_hidden rows are 0),
so their logits are never computed. The valid rows of hidden are gathered first (a tokens x hidden
copy, small beside the vocabulary matmuls it shortens).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kiln.kernels import native
from kiln.kernels._common import acc_dtype, gpu_impl, inner_product, rows
from kiln.kernels.logit_loss import _out_of_range

# Elements of one chunk of logits: 16M (64 MiB in fp32). Fewer rows than MIN_ROWS make the matmuls
# slow on a CPU (measured: 65 rows x 128k vocab is 2.7x slower than 131 rows; every chunk streams the
# whole weight), so a chunk never has fewer: then it holds 128 x vocab logits, which is no more than
# the weight itself for hidden >= 128. Either way the chunk does not grow with the number of tokens.
LOGIT_BUDGET = 1 << 24
# The gradient-in-the-forward kernel's chunks: in fp32 their size does not change its speed (2048 tokens x
# vocab 8192 on an AVX-512 Xeon: 204, 200, 202, 199 ms at 2048, 1024, 512, 256 rows), so they are small
# (4M logits, 16 MiB). In half types fewer rows cost time (one grad_weight product per chunk; 51, 63 ms at
# 2048 and 1024 rows in bf16) and a chunk is only its logits in that type (the softmax below is computed in
# fp32 one block at a time): 8M logits, 16 MiB, whose temporaries at the bench models' batch 8 are 29 MiB
# (45 at 16M logits; 60 MiB before the blocks) for the 12 ms.
GRADS_BUDGET = 1 << 22
GRADS_BUDGET_HALF = 1 << 23
# The gradient kernel's softmax runs over blocks of a chunk's rows, this many logits at a time (1 MiB in
# fp32): each block's passes (max, exp, sum, divide) stay in the core's cache, and a half-type chunk needs
# only one block in fp32, rounded once into the place of its logits, not an fp32 copy of the whole chunk.
# Measured as above: bf16 77 -> 63 ms at 1024-row chunks (an fp32 copy of the chunk before), fp32 196 ->
# 187 ms; blocks of 64K and 1M logits were slower (70, 66 ms in bf16), and the whole chunk at once 74 ms.
SOFTMAX_BLOCK = 1 << 18
MIN_ROWS = 128
REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(n_rows: int, vocab: int, chunk_size: int, budget: int = LOGIT_BUDGET) -> int:
    """Rows per chunk: `chunk_size` if given (> 0), else as many as fit `budget` logits (at least MIN_ROWS)."""
    if chunk_size > 0:
        return chunk_size
    return max(1, min(n_rows, max(MIN_ROWS, budget // max(vocab, 1))))


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


def _exp_stats(z: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk of logits z, overwritten in place with exp(z - rowmax) (no second rows x vocab buffer): the
    labels' logits, the rows' log-sum-exp, and the rows' sums of exp (a column)."""
    target = z.gather(1, y).squeeze(1)
    m = z.amax(1, keepdim=True)
    total = z.sub_(m).exp_().sum(1, keepdim=True)
    return target, total.log().add_(m).squeeze(1), total


def _valid_rows(hidden: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor | None, Tensor, Tensor, int]:
    """(index of the tokens whose label counts, or None when all do; hidden's rows of those tokens;
    their labels as a column; the number of tokens)."""
    h2, y = rows(hidden), labels.reshape(-1)
    valid = y != ignore_index
    if bool(valid.all()):
        return None, h2, y.unsqueeze(1), y.shape[0]
    idx = valid.nonzero().squeeze(1)
    return idx, h2.index_select(0, idx), y.index_select(0, idx).unsqueeze(1), y.shape[0]


def _at_rows(values: Tensor, idx: Tensor | None, n: int) -> Tensor:
    """The valid tokens' `values` put back at their rows of an n-row tensor, 0 at the ignored ones."""
    if idx is None:
        return values
    return values.new_zeros((n, *values.shape[1:])).index_copy_(0, idx, values)


def _reduce(per_token: Tensor, idx: Tensor | None, labels: Tensor, reduction: str) -> Tensor:
    """The loss from the valid tokens' losses: their mean (0/0 = nan when every label is ignored, as
    PyTorch), their sum, or one per token (0 at ignored tokens, labels' shape)."""
    if reduction == "none":
        return _at_rows(per_token, idx, labels.numel()).reshape(labels.shape)
    total = per_token.sum()
    return total if reduction == "sum" else total / per_token.shape[0]


def _row_scale(grad: Tensor, idx: Tensor | None, k: int, reduction: str, acc: torch.dtype) -> Tensor:
    """d loss / d (each valid token's loss), as a (k, 1) column."""
    if reduction == "none":
        g = grad.reshape(-1).to(acc)
        return (g if idx is None else g.index_select(0, idx)).unsqueeze(1)
    g = grad.to(acc).reshape(1, 1)
    return g / k if reduction == "mean" and k else g


def _widened(x: Tensor, acc: Tensor | None) -> Tensor:
    """`x.to(acc_dtype(x.dtype))` (acc None) or `acc.add_(x)`: for dense CPU bf16 x into fp32 one native pass
    (`kiln_widen_acc`, the same bits: widening is exact), not ATen's conversion into a temporary first."""
    lib = native.usable(x)
    if (lib is None or x.dtype != torch.bfloat16 or not x.is_contiguous()
            or (acc is not None and (acc.dtype != torch.float32 or acc.shape != x.shape or not acc.is_contiguous()))):
        return x.to(acc_dtype(x.dtype)) if acc is None else acc.add_(x)
    out = torch.empty(x.shape, dtype=torch.float32) if acc is None else acc
    native.check(lib.kiln_widen_acc(out.data_ptr(), x.data_ptr(), x.numel(), int(acc is None), native.threads()),
                 "widen")
    return out


class _Grads:
    """grad_hidden (valid rows) and grad_weight, summed over blocks of d loss / d logits. `onednn`: grad_hidden's
    products are oneDNN's inner products (`linear_cross_entropy_grads`)."""

    def __init__(self, hv: Tensor, weight: Tensor, blocks: int, acc_weight: bool = False, onednn: bool = False):
        self.hv, self.weight, self.blocks, self.onednn = hv, weight, blocks, onednn
        self.hidden = torch.empty_like(hv)
        self.w: Tensor | None = None
        self.acc_weight = acc_weight        # grad_weight returned in fp32 for half types (scaled later)

    def add(self, s: int, e: int, p: Tensor) -> None:
        pw = p if p.dtype == self.weight.dtype else p.to(self.weight.dtype)
        if self.onednn:
            self.hidden[s:e] = inner_product(pw, self.weight.t())
        else:
            torch.mm(pw, self.weight, out=self.hidden[s:e])
        h = self.hv[s:e]
        if self.w is None:
            w = torch.mm(pw.t(), h)             # the first block initializes: no zero fill
            # more blocks follow: half types accumulate in fp32 (one weight-sized buffer, which a single
            # block, as for a short sequence, does not need)
            self.w = _widened(w, None) if self.blocks > 1 or self.acc_weight else w
        elif self.w.dtype == pw.dtype:
            self.w.addmm_(pw.t(), h)
        else:
            _widened(torch.mm(pw.t(), h), self.w)

    def result(self, hidden: Tensor, idx: Tensor | None) -> tuple[Tensor, Tensor]:
        dtype = acc_dtype(self.weight.dtype) if self.acc_weight else self.weight.dtype
        gw = torch.zeros_like(self.weight, dtype=dtype) if self.w is None else self.w.to(dtype)  # no tokens: 0
        return _at_rows(self.hidden, idx, rows(hidden).shape[0]).reshape(hidden.shape), gw


def _backward_by_blocks(grad, hidden, weight, idx, hv, yv, reduction, step, softmax) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight): for each block of `step` valid rows, d loss / d logits = scale * (softmax -
    onehot), in place in the block's `softmax(s, e)` (a fresh buffer), into both gradients."""
    k = hv.shape[0]
    scale = _row_scale(grad, idx, k, reduction, acc_dtype(hidden.dtype))
    grads = _Grads(hv, weight, blocks=-(-k // step))
    for s in range(0, k, step):
        e = min(k, s + step)
        p = softmax(s, e)
        p.scatter_add_(1, yv[s:e], p.new_full((e - s, 1), -1.0)).mul_(scale if scale.shape[0] == 1 else scale[s:e])
        grads.add(s, e, p)
        del p
    return grads.result(hidden, idx)


# ---- chunked: the logits recomputed in the backward -------------------------------------------
@torch.library.custom_op("kiln::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                            chunk_size: int) -> tuple[Tensor, Tensor]:
    """(loss, lse): cross_entropy(hidden @ weight.T, labels); lse (labels' shape, fp32; 0 at ignored
    tokens) is the per-token log-sum-exp the backward needs. chunk_size <= 0 picks the chunk from
    LOGIT_BUDGET."""
    impl = gpu_impl("linear_cross_entropy", hidden)
    if impl is not None:
        return impl(hidden, weight, labels, ignore_index, reduction, chunk_size)
    _check(hidden, weight, labels, reduction)
    acc = acc_dtype(hidden.dtype)
    idx, hv, yv, n = _valid_rows(hidden, labels, ignore_index)
    k = hv.shape[0]
    lse = torch.empty(k, dtype=acc, device=hidden.device)
    target = torch.empty(k, dtype=acc, device=hidden.device)
    step = chunk_rows(k, weight.shape[0], chunk_size)
    for s in range(0, k, step):
        e = min(k, s + step)
        z = _chunk_logits(hv[s:e], weight, acc)
        target[s:e], lse[s:e], _ = _exp_stats(z, yv[s:e])
        del z
    loss = _reduce(lse - target, idx, labels, reduction)
    return loss, _at_rows(lse, idx, n).reshape(labels.shape)


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
    idx, hv, yv, _ = _valid_rows(hidden, labels, ignore_index)
    k = hv.shape[0]
    lse = lse.reshape(-1) if idx is None else lse.reshape(-1).index_select(0, idx)
    # each chunk's softmax, from its recomputed logits (in place)
    return _backward_by_blocks(grad, hidden, weight, idx, hv, yv, reduction, chunk_rows(k, weight.shape[0], chunk_size),
                               lambda s, e: _chunk_logits(hv[s:e], weight, acc).sub_(lse[s:e].unsqueeze(1)).exp_())


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


# ---- the gradient in the forward: 3 matmuls and no logits kept ----------------------------------
def grads_budget(dtype: torch.dtype) -> int:
    """Logits per chunk of `linear_cross_entropy_grads` for hidden states of `dtype` (chunk_size <= 0)."""
    return GRADS_BUDGET_HALF if dtype in (torch.bfloat16, torch.float16) else GRADS_BUDGET


@torch.library.custom_op("kiln::linear_cross_entropy_grads", mutates_args=())
def linear_cross_entropy_grads_op(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                                  chunk_size: int, bias: Optional[Tensor] = None
                                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, grad_hidden, grad_weight, scale, grad_bias) for reduction "mean" or "sum": the loss as
    `linear_cross_entropy`'s, of logits hidden @ weight.T (+ bias, a decoder's: added in fp32 to each row of
    logits as the softmax reads it, not as a column of the product); grad_hidden (hidden's dtype, 0 at ignored
    tokens), grad_weight and grad_bias (fp32 for half types; grad_bias empty without a bias) the gradients of
    the *sum* of the counted tokens' losses; scale (fp32, 0-dim) what turns them into the loss's own (1 /
    counted tokens for "mean", 1 for "sum"). chunk_size <= 0 picks the chunk from `grads_budget`. The backward
    multiplies them by scale times its incoming gradient, after the loss: a half-type gradient is never made
    smaller than the sum's, so it does not underflow before an fp16 loss scale reaches it."""
    impl = gpu_impl("linear_cross_entropy_grads", hidden)
    if impl is not None:
        return impl(hidden, weight, labels, ignore_index, reduction, chunk_size, bias)
    return linear_cross_entropy_grads(hidden, weight, labels, ignore_index, reduction, chunk_size, bias)


def linear_cross_entropy_grads(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, reduction: str,
                               chunk_size: int, bias: Optional[Tensor] = None, onednn: bool = False
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`kiln::linear_cross_entropy_grads` on the CPU. `onednn`: the logits' and grad_hidden's products (two of
    the three) are oneDNN's inner products instead of ATen's `mm` (MKL's in fp32, whose sums run in another
    order): a choice for whoever measured both here (the `onednn` dialect); grad_weight's stays ATen's, which
    oneDNN reads transposed."""
    _check(hidden, weight, labels, reduction)
    if reduction == "none":
        raise ValueError("linear_cross_entropy_grads needs a mean or a sum (one incoming gradient for all tokens)")
    acc = acc_dtype(hidden.dtype)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({weight.shape[0]},) for weight {tuple(weight.shape)}")
    bias_acc = None if bias is None else bias.to(acc).contiguous()
    idx, hv, yv, n = _valid_rows(hidden, labels, ignore_index)
    k = hv.shape[0]
    lse = torch.empty(k, dtype=acc, device=hidden.device)
    target = torch.empty(k, dtype=acc, device=hidden.device)
    step = chunk_rows(k, weight.shape[0], chunk_size, grads_budget(hidden.dtype))
    block = max(1, SOFTMAX_BLOCK // weight.shape[0])
    grads = _Grads(hv, weight, blocks=-(-k // step), acc_weight=True, onednn=onednn)
    per_token = torch.empty(k, dtype=acc, device=hidden.device) if _native_softmax(hidden) else None
    gb = None if bias is None else torch.zeros(
        (native.threads() if per_token is not None else 1, weight.shape[0]), dtype=acc, device=hidden.device)
    for s in range(0, k, step):
        e = min(k, s + step)
        z = inner_product(hv[s:e], weight) if onednn else torch.mm(hv[s:e], weight.t())  # the chunk's logits
        if per_token is not None:                               # one native pass per row, in place
            _softmax_minus_onehot_native(z, yv[s:e], per_token[s:e], lse[s:e], ignore_index, bias_acc, gb)
            grads.add(s, e, z)
            del z
            continue
        for r in range(s, e, block):                            # softmax - onehot over cache-sized blocks
            q = min(e, r + block)
            zb = z[r - s:q - s]
            zf = zb if zb.dtype == acc and bias_acc is None else zb.to(acc)
            if bias_acc is not None:
                zf.add_(bias_acc)
            target[r:q], lse[r:q], total = _exp_stats(zf, yv[r:q])
            zf.div_(total).scatter_add_(1, yv[r:q], zf.new_full((q - r, 1), -1.0))
            if gb is not None:
                gb[0].add_(zf.sum(0))
            if zf is not zb:
                zb.copy_(zf)                                    # rounded once, in place of the logits
        grads.add(s, e, z)
        del z
    loss = _reduce(per_token if per_token is not None else lse - target, idx, labels, reduction)
    gh, gw = grads.result(hidden, idx)
    scale = torch.tensor(1.0 / k if reduction == "mean" and k else 1.0, dtype=acc, device=hidden.device)
    grad_bias = hidden.new_empty(0, dtype=acc) if gb is None else gb.sum(0)
    return loss, gh, gw, scale, grad_bias


def _native_softmax(hidden: Tensor):
    """Whether a chunk's softmax runs as native.c's cross-entropy loop (`kiln_ce_grads`, in place): bf16 or fp32
    logits on the CPU (the loop reads each row into an fp32 buffer and writes it back, rounded for bf16, so in
    place is safe). fp32 chunks took ATen's blocks until 2026-12-07, when the loop still took two exps a logit
    (4.4 against ATen's 3.4 ms at 512 x 8192); with one, 3.1 against 7.0-7.6 ms at 1024 x 8192 on the EPYC
    (docs/kernels.md)."""
    return hidden.dtype in (torch.bfloat16, torch.float32) and native.usable(hidden) is not None


def _softmax_minus_onehot_native(z: Tensor, y: Tensor, per_token: Tensor, lse: Tensor, ignore_index: int,
                                 bias: Tensor | None = None, bias_grad: Tensor | None = None) -> None:
    """A chunk of logits z (rows x vocab, contiguous; bf16 or fp32) overwritten with softmax - onehot (computed in
    fp32, rounded once for bf16), each row's loss written into per_token and its log-sum-exp into lse (contiguous
    fp32). The rows are the counted tokens: no label equals `ignore_index`, and any other outside the vocabulary
    raises.
    One native call (kiln_ce_grads): per row its max, exp(z - max) into an fp32 row buffer with its sum, then
    that buffer over the sum, less the onehot: one exp per logit (the forward-then-backward pair of loops took
    two) and two reads of the row. 2048 x 8192 on the EPYC: see docs/kernels.md."""
    lib = native.library()
    rows, cols = z.shape
    yy = y.reshape(-1).contiguous()
    status = lib.kiln_ce_grads(z.data_ptr(), native.code(z), z.stride(0), yy.data_ptr(), ignore_index,
                               per_token.data_ptr(), lse.data_ptr(), rows, cols, native.ptr(bias),
                               native.ptr(bias_grad), native.threads())
    if status == 2:
        _out_of_range(yy, ignore_index, cols)
    native.check(status, "cross-entropy")


@linear_cross_entropy_grads_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction, chunk_size, bias=None):
    _check(hidden, weight, labels, reduction)
    acc = acc_dtype(hidden.dtype)
    return (hidden.new_empty((), dtype=acc), hidden.new_empty(hidden.shape), weight.new_empty(weight.shape, dtype=acc),
            hidden.new_empty((), dtype=acc), weight.new_empty((0,) if bias is None else (weight.shape[0],), dtype=acc))


@torch.library.custom_op("kiln::linear_cross_entropy_grads_backward", mutates_args=())
def linear_cross_entropy_grads_backward_op(grad: Tensor, grad_hidden: Tensor, grad_weight: Tensor, scale: Tensor,
                                           weight_dtype: torch.dtype, grad_bias: Optional[Tensor] = None
                                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of the loss: the forward's gradients of the sum times scale *
    grad, the weight's and the bias's in `weight_dtype` (grad_bias empty without one)."""
    impl = gpu_impl("linear_cross_entropy_grads_backward", grad_hidden)
    if impl is not None:
        return impl(grad, grad_hidden, grad_weight, scale, weight_dtype, grad_bias)
    g = grad * scale
    gb = grad_weight.new_empty(0, dtype=weight_dtype) if grad_bias is None else (grad_bias * g).to(weight_dtype)
    return _scaled(grad_hidden, g.to(grad_hidden.dtype)), _scaled(grad_weight, g, weight_dtype), gb


def _scaled(x: Tensor, factor: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """`(x * factor).to(dtype)` (factor a 0-dim tensor): native.c's one pass (`kiln_scale`: the product in fp32,
    rounded once, the same bits as ATen's two ops) for a dense CPU float32 x, or bfloat16 x, factor and dtype;
    elsewhere ATen's ops (a bf16 product widened after it is rounded, or a promoting factor)."""
    dtype = x.dtype if dtype is None else dtype
    lib = native.usable(x)
    if (lib is None or not native.supports(dtype) or factor.dtype != x.dtype or factor.device.type != "cpu"
            or (x.dtype != torch.float32 and dtype != x.dtype) or not x.is_contiguous()):
        return (x * factor).to(dtype)
    out = torch.empty(x.shape, dtype=dtype)
    native.check(lib.kiln_scale(x.data_ptr(), native.code(x), out.data_ptr(), native.code(out), x.numel(),
                                factor.item(), native.threads()), "scale")
    return out


@linear_cross_entropy_grads_backward_op.register_fake
def _(grad, grad_hidden, grad_weight, scale, weight_dtype, grad_bias=None):
    return (grad_hidden.new_empty(grad_hidden.shape), grad_weight.new_empty(grad_weight.shape, dtype=weight_dtype),
            grad_weight.new_empty((0,) if grad_bias is None else grad_bias.shape, dtype=weight_dtype))


def _setup_grads(ctx, inputs, output):
    _loss, gh, gw, scale, gb = output
    ctx.mark_non_differentiable(gh, gw, scale, gb)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(gh, gw, scale, gb)
    ctx.dtype = inputs[1].dtype
    ctx.biased = len(inputs) > 6 and inputs[6] is not None


def _backward_grads(ctx, grad, *_unused):
    gh, gw, scale, gb = ctx.saved_tensors
    grad_hidden, grad_weight, grad_bias = torch.ops.kiln.linear_cross_entropy_grads_backward(
        grad, gh, gw, scale, ctx.dtype, gb if ctx.biased else None)
    return grad_hidden, grad_weight, None, None, None, None, grad_bias if ctx.biased else None


linear_cross_entropy_grads_op.register_autograd(_backward_grads, setup_context=_setup_grads)
