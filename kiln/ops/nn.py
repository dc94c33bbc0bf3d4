"""Neural-network ops: matmuls, convolution, normalization, pooling, dropout, softmax, losses,
attention. One block per op; rules call ATen's fused backward kernels wherever they exist.
Complex matmuls multiply by the other operand's conjugate (kiln/ops/spectral.py); the other ops here
take real tensors only."""
from __future__ import annotations

import math

import torch

from kiln.ir.graph import Value
from kiln.kernels.activations import gelu_backward_sums
from kiln.kernels.attention import backward_from_probs, backward_packed, forward_keeping_probs, probs_shape
from kiln.ops.common import arg, reshape, shape
from kiln.ops.registry import Cast, Kind, OpDef, defop, nondiff, register
from kiln.ops.spectral import conj, is_complex
from kiln.ir.symbolic import hint

aten = torch.ops.aten
LOW, F32 = Cast.LOWER, Cast.FP32


def _matmul_flops(n) -> float:
    """2*M*N*K for the node's matmul (batch dims folded into M)."""
    a = n.args[1] if n.target is aten.addmm.default else n.args[0]
    k = shape(a)[-1]
    return 2.0 * hint(n.out.meta.numel) * hint(k)


# ---- matmuls ----------------------------------------------------------------------------------
def vjp_linear(b, n, g):
    x, w = n.args[0], n.args[1]
    bias = arg(n, 2, "bias")
    w2 = w if len(shape(w)) == 2 else reshape(b, w, [1, -1])      # a 1-D weight is one output feature
    out_f, in_f = shape(w2)
    g2 = reshape(b, g, [-1, out_f])                               # (tokens, out)
    gx = reshape(b, b(aten.mm.default, g2, conj(b, w2)), shape(x))          # (tokens, in)
    x2 = reshape(b, conj(b, x), [-1, in_f])
    gw = reshape(b, b(aten.mm.default, b(aten.t.default, g2), x2), shape(w))   # (out, in)
    gb = b(aten.sum.dim_IntList, g2, [0]) if bias is not None else None
    return gx, gw, gb


def last_dim_rows(*positions: int):
    """`OpDef.rows` of an op acting on the last dim of the arguments at `positions` (every leading dim a row)."""
    return lambda n: (positions, len(shape(n.args[positions[0]])) - 1)


defop(aten.linear.default, vjp_linear, Kind.MATMUL, LOW, cost=_matmul_flops, rows=last_dim_rows(0))


def vjp_addmm(b, n, g):
    bias, x, w = n.args
    beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
    scale = (lambda t, s: t if s == 1 else b(aten.mul.Tensor, t, s))
    beta, alpha = conj(b, beta), conj(b, alpha)
    gx = scale(b(aten.mm.default, g, b(aten.t.default, conj(b, w))), alpha)
    gw = scale(b(aten.mm.default, b(aten.t.default, conj(b, x)), g), alpha)
    return scale(g, beta), gx, gw


def _addmm_rows(n):
    bias = n.args[0]                   # a (rows, out) bias is sliced with the rows; a (out,) one is not
    return ((0, 1) if isinstance(bias, Value) and len(shape(bias)) == 2 else (1,)), 1


defop(aten.addmm.default, vjp_addmm, Kind.MATMUL, LOW, cost=_matmul_flops, rows=_addmm_rows)
defop(aten.mm.default, lambda b, n, g: (b(aten.mm.default, g, b(aten.t.default, conj(b, n.args[1]))),
                                        b(aten.mm.default, b(aten.t.default, conj(b, n.args[0])), g)),
      Kind.MATMUL, LOW, cost=_matmul_flops, rows=lambda n: ((0,), 1))
defop(aten.bmm.default, lambda b, n, g: (b(aten.bmm.default, g, b(aten.transpose.int, conj(b, n.args[1]), 1, 2)),
                                         b(aten.bmm.default, b(aten.transpose.int, conj(b, n.args[0]), 1, 2), g)),
      Kind.MATMUL, LOW, cost=_matmul_flops)


def vjp_convolution(b, n, g):
    x, w, bias, stride, padding, dilation, transposed, out_pad, groups = n.args
    if is_complex(x) or is_complex(w):
        raise NotImplementedError("a complex convolution (the autograd fallback takes it)")
    mask = [True, True, bias is not None]
    gx, gw, gb = b(aten.convolution_backward.default, g, x, w, shape(bias) if bias is not None else None,
                   stride, padding, dilation, transposed, out_pad, groups, mask)
    return gx, gw, gb if bias is not None else None


def _conv_flops(n) -> float:
    w = shape(n.args[1])
    return 2.0 * hint(n.out.meta.numel) * math.prod(hint(w[1:]))


defop(aten.convolution.default, vjp_convolution, Kind.MATMUL, LOW, cost=_conv_flops)


# ---- normalization ----------------------------------------------------------------------------
def vjp_layer_norm(b, n, g, g_mean=None, g_rstd=None):
    x, normalized_shape, w, bias = n.args[0], n.args[1], arg(n, 2, "weight"), arg(n, 3, "bias")
    _, mean, rstd = n.outputs
    gx, gw, gb = b(aten.native_layer_norm_backward.default, g, x, normalized_shape, mean, rstd, w, bias,
                   [True, w is not None, bias is not None])
    return gx, None, gw if w is not None else None, gb if bias is not None else None, None


defop(aten.native_layer_norm.default, vjp_layer_norm, Kind.NORM, F32,
      rows=lambda n: ((0,), len(shape(n.args[0])) - len(n.args[1])))


def vjp_batch_norm_train(b, n, g, *unused):
    x, w, bias, rmean, rvar, training, momentum, eps = n.args
    _, save_mean, save_invstd, _, _ = n.outputs
    gx, gw, gb = b(aten.native_batch_norm_backward.default, g, x, w, rmean, rvar, save_mean, save_invstd,
                   True, eps, [True, w is not None, bias is not None])
    return gx, gw if w is not None else None, gb if bias is not None else None, None, None, None, None, None


defop(aten._native_batch_norm_legit_functional.default, vjp_batch_norm_train, Kind.NORM, F32)


def vjp_batch_norm_eval(b, n, g, *unused):
    x, w, bias, rmean, rvar, momentum, eps = n.args
    gx, gw, gb = b(aten.native_batch_norm_backward.default, g, x, w, rmean, rvar, None, None,
                   False, eps, [True, w is not None, bias is not None])
    return gx, gw if w is not None else None, gb if bias is not None else None, None, None, None, None


defop(aten._native_batch_norm_legit_no_training.default, vjp_batch_norm_eval, Kind.NORM, F32)


# ---- pooling ----------------------------------------------------------------------------------
def vjp_max_pool2d(b, n, g, g_idx=None):
    x, kernel = n.args[0], n.args[1]
    stride, padding = arg(n, 2, "stride", []) or kernel, arg(n, 3, "padding", 0)
    dilation, ceil = arg(n, 4, "dilation", 1), arg(n, 5, "ceil_mode", False)
    return (b(aten.max_pool2d_with_indices_backward.default, g, x, kernel, stride, padding, dilation, ceil,
              n.outputs[1]),)


defop(aten.max_pool2d_with_indices.default, vjp_max_pool2d, Kind.REDUCTION)


def vjp_avg_pool2d(b, n, g):
    x, kernel = n.args[0], n.args[1]
    rest = [arg(n, 2, "stride", []), arg(n, 3, "padding", 0), arg(n, 4, "ceil_mode", False),
            arg(n, 5, "count_include_pad", True), arg(n, 6, "divisor_override")]
    return (b(aten.avg_pool2d_backward.default, g, x, kernel, *rest),)


defop(aten.avg_pool2d.default, vjp_avg_pool2d, Kind.REDUCTION)
defop(aten._adaptive_avg_pool2d.default, lambda b, n, g: (
    b(aten._adaptive_avg_pool2d_backward.default, g, n.args[0]), None), Kind.REDUCTION)


# ---- dropout ----------------------------------------------------------------------------------
def vjp_dropout(b, n, g, g_mask=None):
    x, p, train = n.args
    if train is not None and not train:      # train=None means training, as in ATen's kernel
        return g, None, None
    return b(aten.native_dropout_backward.default, g, n.outputs[1], 1.0 / (1.0 - p) if p < 1 else 0.0), None, None


defop(aten.native_dropout.default, vjp_dropout, Kind.RANDOM)


# ---- softmax and losses -----------------------------------------------------------------------
defop(aten._softmax.default, lambda b, n, g: (
    b(aten._softmax_backward_data.default, g, n.out, n.args[1], n.args[0].meta.dtype), None, None), Kind.REDUCTION, F32,
    rows=lambda n: ((0,), n.args[1] % len(shape(n.args[0]))))      # rows: the dims before the softmax's
defop(aten._log_softmax.default, lambda b, n, g: (
    b(aten._log_softmax_backward_data.default, g, n.out, n.args[1], n.args[0].meta.dtype), None, None),
    Kind.REDUCTION, F32, rows=lambda n: ((0,), n.args[1] % len(shape(n.args[0]))))


def _nll_rule(backward):
    def rule(b, n, g, g_total=None):
        x, target, weight, reduction, ignore_index = n.args
        return (b(backward, g, x, target, weight, reduction, ignore_index, n.outputs[1]),)
    return rule


defop(aten.nll_loss_forward.default, _nll_rule(aten.nll_loss_backward.default), Kind.LOSS, F32)
defop(aten.nll_loss2d_forward.default, _nll_rule(aten.nll_loss2d_backward.default), Kind.LOSS, F32)


def _difference_loss(backward, extra: tuple = ()):
    """Losses of input - target (MSE, smooth L1, Huber): ATen's backward kernel gives the input's
    gradient, the target's is its negative. `extra`: the (name, default) of a last scalar argument."""
    def rule(b, n, g):
        x, target = n.args[0], n.args[1]
        more = [arg(n, 3, name, default) for name, default in extra]
        gx = b(backward, g, x, target, arg(n, 2, "reduction", 1), *more)
        return gx, b(aten.neg.default, gx) if hasattr(target, "meta") else None
    return rule


defop(aten.mse_loss.default, _difference_loss(aten.mse_loss_backward.default), Kind.LOSS, F32)
defop(aten.smooth_l1_loss.default, _difference_loss(aten.smooth_l1_loss_backward.default, (("beta", 1.0),)),
      Kind.LOSS, F32)
defop(aten.huber_loss.default, _difference_loss(aten.huber_loss_backward.default, (("delta", 1.0),)),
      Kind.LOSS, F32)


def cross_entropy_backward(grad, log_probs, target, reduction, ignore_index, total_weight):
    """The logits' gradient of nll_loss(log_softmax(logits, 1), target) (no class weights) in one (N, C)
    buffer: (softmax - onehot(target)) * scale, 0 on ignored rows. The unfused backward materializes
    nll_loss_backward's (N, C) one-hot gradient and then log_softmax's: two more logits-sized buffers."""
    out = torch.exp(log_probs)
    valid = target != ignore_index
    out.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1), -valid.to(out.dtype).unsqueeze(1))
    per_row = grad / total_weight if reduction == 1 else grad          # mean: over the non-ignored rows
    scale = torch.where(valid, per_row, torch.zeros((), dtype=per_row.dtype))
    return (out.mul_(scale.to(out.dtype).unsqueeze(1)),)    # Kiln ops that are functions return tuples


CROSS_ENTROPY_BACKWARD = register(OpDef(
    "kiln.cross_entropy_backward", (cross_entropy_backward,), None, Kind.LOSS, F32, differentiable=False,
    infer=lambda args, kwargs: [args[1].meta],
    doc="d loss / d logits of nll_loss(log_softmax(x)): softmax - onehot, scaled (fused backward)"))


# ---- attention --------------------------------------------------------------------------------
def vjp_flash_cpu(b, n, g, g_lse=None):
    q, k, v = n.args[:3]
    dropout_p, causal = arg(n, 3, "dropout_p", 0.0), arg(n, 4, "is_causal", False)
    out, lse = n.outputs
    gq, gk, gv = b(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, g, q, k, v, out, lse,
                   dropout_p, causal, attn_mask=n.kwargs.get("attn_mask"), scale=n.kwargs.get("scale"))
    return gq, gk, gv


def _attention_flops(n) -> float:
    q, k = shape(n.args[0]), shape(n.args[1])
    return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]


defop(aten._scaled_dot_product_flash_attention_for_cpu.default, vjp_flash_cpu, Kind.ATTENTION, LOW,
      cost=_attention_flops)


# The flash pair with the forward's probabilities kept for the backward (kiln/passes/keep_probs.py puts them in
# place of a forward and the backward that reads its log-sum-exp, after autodiff): same arguments, plus the
# probabilities, output 2 of the forward and argument 6 of the backward.
def _keep_probs_infer(args, kwargs):
    from kiln.ir.builder import infer_metas
    from kiln.ir.graph import TensorMeta
    out, lse = infer_metas(aten._scaled_dot_product_flash_attention_for_cpu.default, args, kwargs)
    q, k = args[0].meta, args[1].meta
    probs = TensorMeta(probs_shape(q.shape, k.shape), torch.bfloat16, (), q.device).contiguous()
    return [out, lse, probs]


def _from_probs_infer(args, kwargs):
    from kiln.ir.builder import infer_metas
    return infer_metas(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, args[:6] + args[7:], kwargs)


ATTENTION_KEEPING_PROBS = register(OpDef(
    "kiln.attention_keeping_probs", (forward_keeping_probs,), None, Kind.ATTENTION, LOW, differentiable=False,
    cost=_attention_flops, infer=_keep_probs_infer,
    doc="CPU flash attention's forward that also returns the normalized probabilities (bf16) for its backward"))
ATTENTION_FROM_PROBS = register(OpDef(
    "kiln.attention_backward_from_probs", (backward_from_probs,), None, Kind.ATTENTION, LOW, differentiable=False,
    infer=_from_probs_infer,
    doc="CPU flash attention's backward reading the forward's probabilities instead of computing them again"))


def _packed_infer(args, kwargs):
    from kiln.ir.graph import TensorMeta
    q, k, v = (a.meta for a in args[1:4])
    parts = (q, k, v)
    width = sum(parts[i].shape[1] * parts[i].shape[3] for i in kwargs.get("order", (0, 1, 2)))
    return [TensorMeta((q.shape[0], q.shape[2], width), q.dtype, (), q.device).contiguous()]


ATTENTION_PACKED = register(OpDef(
    "kiln.attention_backward_packed", (backward_packed,), None, Kind.ATTENTION, LOW, differentiable=False,
    infer=_packed_infer,
    doc="kiln.attention_backward_from_probs with its three gradients written into the concatenation of the joined "
        "q/k/v projection's output gradient (GPT-2's c_attn)"))


# ---- backward kernels the rules above emit ------------------------------------------------------
# Facts for the passes after autodiff (region fusion reads the kind); never differentiated again.
def _gelu_backward_sums_infer(args, kwargs):
    from kiln.ir.builder import infer_metas
    from kiln.ir.graph import TensorMeta
    (grad,) = infer_metas(aten.gelu_backward.default, args[:2], {"approximate": _arg_of(args, kwargs, 2, "approximate")})
    return [grad, TensorMeta(tuple(grad.shape[-1:]), grad.dtype, (), grad.device).contiguous()]


def _arg_of(args, kwargs, i, name, default="none"):
    return args[i] if len(args) > i else kwargs.get(name, default)


GELU_BACKWARD_SUMS = register(OpDef(
    "kiln.gelu_backward_sums", (gelu_backward_sums,), None, Kind.OPAQUE, Cast.FOLLOW, differentiable=False,
    infer=_gelu_backward_sums_infer,
    doc="gelu_backward and its sum over the leading dims (a bias's gradient) in one pass"))
defop(aten.gelu_backward.default, None, Kind.POINTWISE, differentiable=False, column_sums=GELU_BACKWARD_SUMS)
nondiff([aten.threshold_backward.default, aten.tanh_backward.default,
         aten.sigmoid_backward.default, aten.silu_backward.default, aten.native_dropout_backward.default,
         aten.elu_backward.default, aten.hardtanh_backward.default, aten.leaky_relu_backward.default],
        Kind.POINTWISE)
nondiff([aten.native_layer_norm_backward.default, aten.native_batch_norm_backward.default], Kind.NORM)
nondiff([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default], Kind.REDUCTION)
