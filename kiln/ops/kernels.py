"""Kiln's fused kernels (`kiln.kernels`, custom ops `torch.ops.kiln.*`) as compiler ops.

One block per kernel. Each VJP rule emits the kernel's own fused backward op, so a model that calls
a kernel keeps it fused in the compiled step; the values the backward needs (rstd, the dropout
mask, the gate/up product, the log-sum-exp) are extra outputs of the forward op, which is how a
graph node "saves" them. Backward ops are registered with differentiable=False: Kiln never
differentiates a backward.
"""
from __future__ import annotations

import torch

import kiln.kernels  # noqa: F401  (defines torch.ops.kiln.*)
from kiln.kernels._common import acc_dtype
from kiln.kernels.cross_entropy import LOGIT_BUDGET, SOFTMAX_BLOCK, chunk_rows, grads_budget
from kiln.kernels.norms import dropout_scale
from kiln.ops.common import arg, shape, sum_to
from kiln.ops.nn import last_dim_rows
from kiln.ops.registry import Cast, Kind, defop
from kiln.ir.symbolic import hint

aten = torch.ops.aten
kiln_ops = torch.ops.kiln
LOW, F32, FOLLOW = Cast.LOWER, Cast.FP32, Cast.FOLLOW


def _numel(v) -> float:
    return float(hint(v.meta.numel))


def _backward_op(target, kind: Kind, cast: Cast, **facts) -> None:
    defop(target, None, kind, cast, differentiable=False, **facts)


# ---- RMSNorm ----------------------------------------------------------------------------------
def vjp_rms_norm(b, n, g, _g_rstd=None):
    x, w = n.args[0], n.args[1]
    gx, gw, _low = b(kiln_ops.rms_norm_backward.default, g, None, x, w, n.outputs[1])
    return gx, gw, None


def vjp_add_rms_norm(b, n, g_out, g_sum, _g_rstd=None):
    w = n.args[2]
    _, s, rstd = n.outputs
    gs, gw, _low = b(kiln_ops.rms_norm_backward.default, g_out, g_sum, s, w, rstd)
    return gs, gs, gw, None       # x and residual both get d(out)/d(sum) + the sum's own gradient


defop(kiln_ops.rms_norm.default, vjp_rms_norm, Kind.NORM, F32, out_dtype=(0,), rows=last_dim_rows(0))
# the sum in the inputs' promoted dtype, as the add it replaces (`kiln` dialect's add_rms_norm fusion): reads mixed
# inputs as they are (a float32 residual stream and a bf16 branch, widened exactly inside), statistics in fp32
defop(kiln_ops.add_rms_norm.default, vjp_add_rms_norm, Kind.NORM, FOLLOW, promotes=True, out_dtype=(0,),
      rows=last_dim_rows(0, 1))
# reads a bf16 output gradient as it is (converted exactly inside): no widening cast before it; writes its
# fp32 input gradient in bf16 too where a cast of it feeds a bf16 matmul's backward (the residual branch);
# adds the residual stream's other gradient to its own (grad_sum) where the graph added them
_backward_op(kiln_ops.rms_norm_backward.default, Kind.NORM, F32, promotes=True, also_low=(0, 2),
             accumulates=(0, 1))   # grad_sum: added to grad_input in the same pass

# LayerNorm's backward with the residual stream's gradient sums (the `kiln` dialect's training fusion puts it
# in place of ATen's): reads a bf16 output gradient as it is, adds the input's other gradient in the same pass,
# and writes the bf16 copy of its input gradient that the next matmul's backward reads
# the twin: also the column sums of the low-precision copy, the gradient of the bias of the linear layer whose
# output gradient that copy is (kiln/passes/accumulate.py `fold_column_sums`, after the copy is folded in)
_LN_BACKWARD_SUMS = defop(kiln_ops.layer_norm_backward_sums.default, None, Kind.NORM, F32, differentiable=False,
                          promotes=True)
_backward_op(kiln_ops.layer_norm_backward.default, Kind.NORM, F32, promotes=True, also_low=(0, 3),
             accumulates=(0, 7), column_sums=_LN_BACKWARD_SUMS, sums_output=3)

# ---- dropout + residual + LayerNorm -----------------------------------------------------------
def vjp_dropout_add_layer_norm(b, n, g_out, g_sum, *_stats):
    w, bias = arg(n, 2, "weight"), arg(n, 3, "bias")
    p, training = arg(n, 4, "p"), arg(n, 6, "training")
    _, s, mean, rstd, mask = n.outputs
    gs, gw, gb = b(kiln_ops.dropout_add_layer_norm_backward.default, g_out, g_sum, s, w, bias, mean, rstd)
    # x's gradient goes through the mask the forward drew (an output of the node), never a new draw
    gx = b(aten.native_dropout_backward.default, gs, mask, dropout_scale(p)) if training and p > 0 else gs
    return gx, gs, gw if w is not None else None, gb if bias is not None else None, None, None, None


# RANDOM, not NORM: with p > 0 it draws from the RNG, so CSE must never merge two calls
defop(kiln_ops.dropout_add_layer_norm.default, vjp_dropout_add_layer_norm, Kind.RANDOM, F32)
_backward_op(kiln_ops.dropout_add_layer_norm_backward.default, Kind.NORM, F32)


# ---- SwiGLU -----------------------------------------------------------------------------------
def vjp_swiglu(b, n, g):
    gate, up = n.args[0], n.args[1]
    return b(kiln_ops.swiglu_backward.default, g, gate, up)


def vjp_swiglu_linear(b, n, g, _g_gate_up=None):
    x, wg, wu = n.args[:3]
    return b(kiln_ops.swiglu_linear_backward.default, g, x, wg, wu, n.outputs[1])


def _swiglu_linear_flops(n) -> float:
    return 2.0 * _numel(n.outputs[1]) * shape(n.args[0])[-1]           # x @ [Wg | Wu].T


def _swiglu_linear_bwd_flops(n) -> float:
    return 4.0 * _numel(n.args[4]) * shape(n.args[1])[-1]              # grad_x and the two weight grads


defop(kiln_ops.swiglu.default, vjp_swiglu, Kind.POINTWISE, FOLLOW)
_backward_op(kiln_ops.swiglu_backward.default, Kind.POINTWISE, FOLLOW)
defop(kiln_ops.swiglu_linear.default, vjp_swiglu_linear, Kind.MATMUL, LOW, cost=_swiglu_linear_flops,
      rows=last_dim_rows(0))
_backward_op(kiln_ops.swiglu_linear_backward.default, Kind.MATMUL, LOW, cost=_swiglu_linear_bwd_flops)


# ---- Linear + GELU ----------------------------------------------------------------------------
def vjp_linear_gelu(b, n, g):
    x, w, bias, approximate = n.args[0], n.args[1], arg(n, 2, "bias"), arg(n, 3, "approximate", "none")
    gx, gw, gb = b(kiln_ops.linear_gelu_backward.default, g, x, w, bias, approximate)
    return gx, gw, gb if bias is not None else None, None


def _linear_gelu_flops(n) -> float:
    return 2.0 * _numel(n.out) * hint(shape(n.args[0])[-1])


def _linear_gelu_bwd_flops(n) -> float:
    # recompute + grad_x + grad_weight: three matmuls of the forward's size
    x, w = n.args[1], n.args[2]
    return 6.0 * _numel(x) * hint(shape(w)[0])


defop(kiln_ops.linear_gelu.default, vjp_linear_gelu, Kind.MATMUL, LOW, cost=_linear_gelu_flops,
      rows=last_dim_rows(0))
_backward_op(kiln_ops.linear_gelu_backward.default, Kind.MATMUL, LOW, cost=_linear_gelu_bwd_flops)


# ---- RoPE -------------------------------------------------------------------------------------
def _rotate_half(b, t):
    h = shape(t)[-1] // 2
    t1, t2 = b(aten.slice.Tensor, t, -1, 0, h), b(aten.slice.Tensor, t, -1, h, 2 * h)
    return b(aten.cat.default, [b(aten.neg.default, t2), t1], -1)


def _zeros_like(b, v):
    return b(aten.zeros.default, shape(v), dtype=v.meta.dtype, device=v.meta.device)


def vjp_rope(b, n, g_q, g_k):
    q, k, cos, sin = n.args[:4]
    g_q = g_q if g_q is not None else _zeros_like(b, n.outputs[0])
    g_k = g_k if g_k is not None else _zeros_like(b, n.outputs[1])
    gq, gk = b(kiln_ops.rope_backward.default, g_q, g_k, cos, sin)

    # gradients of the cos/sin tables, for the rare learned table; dead code (removed by dce) otherwise
    def table(tab, rotate):
        parts = [sum_to(b, b(aten.mul.Tensor, g, _rotate_half(b, t) if rotate else t), shape(tab))
                 for g, t in ((g_q, q), (g_k, k))]
        return b(aten.add.Tensor, parts[0], parts[1])
    return gq, gk, table(cos, False), table(sin, True)


# bf16 q, k with fp32 tables: computed in fp32; a cast of both results back to bf16 folds into out_dtype
defop(kiln_ops.rope.default, vjp_rope, Kind.POINTWISE, FOLLOW, promotes=True, out_dtype=(0, 1))
_backward_op(kiln_ops.rope_backward.default, Kind.POINTWISE, FOLLOW, promotes=True, out_dtype=(0, 1))


# ---- Linear + cross-entropy -------------------------------------------------------------------
def vjp_linear_cross_entropy(b, n, g, _g_lse=None):
    hidden, weight, labels, ignore_index, reduction, chunk = n.args[:6]
    gh, gw = b(kiln_ops.linear_cross_entropy_backward.default, g, hidden, weight, labels, n.outputs[1],
               ignore_index, reduction, chunk)
    return gh, gw, None, None, None, None


def _lce_flops(n, factor: float = 2.0) -> float:
    hidden, weight = (n.args[0], n.args[1]) if n.op.differentiable else (n.args[1], n.args[2])
    return factor * _numel(hidden) * hint(shape(weight)[0])


def _lce_temporaries(hidden, weight, chunk, grads: bool = True, weight_sum: bool = True,
                     budget: int = LOGIT_BUDGET, blocked: bool = False) -> int:
    """Bytes of the loss kernels' own temporaries (kiln/kernels/cross_entropy.py), at most: a chunk of fp32
    logits (or softmax - onehot) and its half-type copy (`blocked`, the gradient kernel: a chunk of logits
    in hidden's dtype and one fp32 block of its rows), the gathered rows of the counted tokens and (if it
    computes `grads`) their grad_hidden rows, a half-type chunk's grad_weight product before it is added to
    the fp32 sum, and that sum (`weight_sum`: when it is not an output)."""
    tokens = int(_numel(hidden)) // hint(shape(hidden)[-1])
    vocab, width = hint(shape(weight)[0]), hint(shape(weight)[1])
    item, acc = hidden.meta.dtype.itemsize, acc_dtype(hidden.meta.dtype).itemsize
    rows = chunk_rows(tokens, vocab, chunk if isinstance(chunk, int) else 0, budget)
    half = item != acc
    if blocked:
        block = rows * vocab * item + (min(rows, max(1, SOFTMAX_BLOCK // vocab)) * vocab * acc if half else 0)
    else:
        block = rows * vocab * (acc + (item if half else 0))
    weight = vocab * width * ((item if grads else 0) + (acc if weight_sum else 0)) if half else 0
    return int(block + (2 if grads else 1) * tokens * width * item + weight)


# Cast LOWER although it is a loss: it is the vocabulary projection (the model's biggest matmul), which
# amp must run in low precision as it would the unfused lm_head; the kernel keeps the softmax
# statistics and the loss in fp32 itself. amp_overrides={"kiln.linear_cross_entropy": "fp32"} opts out
# (for the fused loss of a compiled lm_head: "kiln.linear_cross_entropy_grads").
def _smaller_chunks(budget):
    """`OpDef.smaller` of a loss kernel: about k times fewer rows per chunk of logits (its `chunk_size`)."""
    def smaller(n, k: int) -> tuple:
        hidden, weight, chunk = n.args[0], n.args[1], n.args[5]
        if hidden.meta.symbolic or weight.meta.symbolic:
            return n.args
        tokens = int(_numel(hidden)) // int(shape(hidden)[-1])
        rows = chunk_rows(tokens, int(shape(weight)[0]), chunk if isinstance(chunk, int) else 0, budget(n))
        return (*n.args[:5], max(1, rows // k), *n.args[6:])
    return smaller


defop(kiln_ops.linear_cross_entropy.default, vjp_linear_cross_entropy, Kind.LOSS, LOW, cost=_lce_flops,
      workspace=lambda n: _lce_temporaries(n.args[0], n.args[1], n.args[5], grads=False, weight_sum=False),
      smaller=_smaller_chunks(lambda n: LOGIT_BUDGET))
_backward_op(kiln_ops.linear_cross_entropy_backward.default, Kind.LOSS, LOW,
             cost=lambda n: _lce_flops(n, 6.0),   # recompute + grad_hidden + grad_weight
             workspace=lambda n: _lce_temporaries(n.args[1], n.args[2], n.args[7]))


# The loss with its gradient computed in the forward (the fused loss Kiln's training steps use): the
# backward scales the two gradients, so the step keeps them (hidden- and weight-sized) instead of any
# logits, for the same 3 matmuls as eager. Keeping less would not lower the peak: the backward makes both
# gradients first thing, which is where the forward's activations are all still live.
def vjp_linear_cross_entropy_grads(b, n, g, *_unused):
    _loss, gh, gw, scale, gb = n.outputs
    biased = len(n.args) > 6 and n.args[6] is not None
    gx, gwx, gbx = b(kiln_ops.linear_cross_entropy_grads_backward.default, g, gh, gw, scale, n.args[1].meta.dtype,
                     gb if biased else None)
    return gx, gwx, None, None, None, None, *((gbx,) if biased else ())


defop(kiln_ops.linear_cross_entropy_grads.default, vjp_linear_cross_entropy_grads, Kind.LOSS, LOW,
      cost=lambda n: _lce_flops(n, 6.0),   # the logits, grad_hidden and grad_weight
      workspace=lambda n: _lce_temporaries(n.args[0], n.args[1], n.args[5], weight_sum=False,
                                           budget=grads_budget(n.args[0].meta.dtype), blocked=True),
      smaller=_smaller_chunks(lambda n: grads_budget(n.args[0].meta.dtype)))
_backward_op(kiln_ops.linear_cross_entropy_grads_backward.default, Kind.LOSS, FOLLOW)


# ---- cross-entropy on given logits: one log-sum-exp per row kept, the backward writes the gradient --------
def vjp_cross_entropy(b, n, g, _g_lse=None):
    logits, labels = n.args[0], n.args[1]
    ignore_index, reduction = arg(n, 2, "ignore_index"), arg(n, 3, "reduction")
    return (b(kiln_ops.softmax_cross_entropy_backward.default, g, logits, labels, n.outputs[1], ignore_index, reduction),
            None, None, None)


# fp32 under amp, as autocast runs F.cross_entropy (the kernel would read bf16 logits as they are, but the
# loss would then be rounded to bf16)
defop(kiln_ops.softmax_cross_entropy.default, vjp_cross_entropy, Kind.LOSS, F32,
      cost=lambda n: _numel(n.args[0]))       # one read of the logits (its outputs are a scalar and a row vector)
_backward_op(kiln_ops.softmax_cross_entropy_backward.default, Kind.LOSS, F32)


# ---- CTC loss (lengths as tensors): the backward recomputes ATen's alignment table ---------------
def vjp_ctc_loss(b, n, g):
    lp, targets, il, tl = n.args[:4]
    blank, reduction, zero_inf = arg(n, 4, "blank", 0), arg(n, 5, "reduction", "mean"), arg(n, 6, "zero_infinity", False)
    return (b(kiln_ops.ctc_loss_backward.default, g, lp, targets, il, tl, blank, reduction, zero_inf),
            None, None, None)


defop(kiln_ops.ctc_loss.default, vjp_ctc_loss, Kind.LOSS, F32)
_backward_op(kiln_ops.ctc_loss_backward.default, Kind.LOSS, F32)
