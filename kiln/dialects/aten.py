"""The `aten` dialect: PyTorch's own ATen kernels. The reference and the fallback for every op.

Any ATen overload without a more specific implementation runs as itself; the entries below are the
lowerings for composite ops that the aten dialect implements with other ATen ops.
"""
from __future__ import annotations

import math

import torch

from kiln.dialects.registry import dialect, lowering
from kiln.ops.common import arg, reshape, shape

aten = torch.ops.aten

ATEN = dialect("aten", priority=0, devices=("cpu", "cuda", "mps", "xpu"),
               doc="PyTorch ATen kernels: the reference implementation of every op")


def sdpa_args(n):
    """(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) of a scaled_dot_product_attention node."""
    return (n.args[0], n.args[1], n.args[2], arg(n, 3, "attn_mask"), arg(n, 4, "dropout_p", 0.0),
            arg(n, 5, "is_causal", False), n.kwargs.get("scale"), n.kwargs.get("enable_gqa", False))


def expand_kv_heads(b, q, k, v):
    """Grouped-query attention: repeat each K/V head for its group of query heads (B, Hkv, S, E) ->
    (B, Hq, S, E), as explicit expand + reshape so autodiff sums the groups back."""
    hq, hkv = shape(q)[-3], shape(k)[-3]
    if hq == hkv:
        return k, v
    group = hq // hkv

    def rep(t):
        s = shape(t)
        t = b(aten.unsqueeze.default, t, -3)                                   # (B, Hkv, 1, S, E)
        t = b(aten.expand.default, t, s[:-2] + [group] + s[-2:])             # (B, Hkv, g, S, E)
        return b(aten.reshape.default, t, s[:-3] + [hq] + s[-2:])            # (B, Hq, S, E)
    return rep(k), rep(v)


def sdpa_math(b, n):
    """softmax(q k^T * scale + mask) v, with dropout on the probabilities, in ATen ops."""
    q, k, v, mask, p, causal, scale, gqa = sdpa_args(n)
    if gqa:
        k, v = expand_kv_heads(b, q, k, v)
    qs, ks = shape(q), shape(k)
    L, S, E = qs[-2], ks[-2], qs[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    batch = qs[:-2]
    q3 = reshape(b, q, [-1, L, E])
    kt3 = b(aten.transpose.int, reshape(b, k, [-1, S, E]), 1, 2)              # (N, E, S)
    scores = b(aten.mul.Tensor, b(aten.bmm.default, q3, kt3), scale)          # (N, L, S)
    scores = reshape(b, scores, batch + [L, S])
    if causal:
        keep = b(aten.tril.default, b(aten.ones.default, [L, S], dtype=torch.bool, device=q.meta.device))
        scores = b(aten.masked_fill.Scalar, scores, b(aten.logical_not.default, keep), float("-inf"))
    if mask is not None:
        if mask.meta.dtype == torch.bool:
            scores = b(aten.masked_fill.Scalar, scores, b(aten.logical_not.default, mask), float("-inf"))
        else:
            scores = b(aten.add.Tensor, scores, mask)
    probs = b(aten._softmax.default, scores, -1, False)
    if p > 0:
        probs = b(aten.native_dropout.default, probs, p, True)[0]
    out = b(aten.bmm.default, reshape(b, probs, [-1, L, S]), reshape(b, v, [-1, S, shape(v)[-1]]))
    return [reshape(b, out, batch + [L, shape(v)[-1]])]


lowering(ATEN, aten.scaled_dot_product_attention.default, sdpa_math, name="math")


# ---- optimizer updates: ATen's fused multi-tensor kernel where it accepts the tensors -----------
def _dense(shape, stride) -> bool:
    """Whether a layout covers its storage exactly once (a permutation of a contiguous layout)."""
    expected = 1
    for size, st in sorted((d for d in zip(shape, stride) if d[0] != 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= size
    return True


def _fused_adamw_ok(n) -> bool:
    """The fused kernel treats each tensor as one flat buffer: parameter and state must be dense with the
    same strides (state is made with zeros_like(param)); the kernel copies a gradient of other strides
    into the parameter's layout (`optim.same_layout`)."""
    param, grad = n.args[0], n.args[1]
    ok = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    dense = _dense(param.meta.shape, param.meta.stride)
    same = all(s.meta.stride == param.meta.stride for s in n.args[2:4])
    return (param.meta.dtype in ok and grad.meta.dtype == param.meta.dtype and dense and same
            and param.meta.device.type in ("cpu", "cuda"))


def _register_optimizer_kernels() -> None:
    from kiln import optim
    from kiln.dialects.registry import kernel
    kernel(ATEN, optim.adamw_update, optim.adamw_update_fused, checker=_fused_adamw_ok, priority=1, name="fused")
    kernel(ATEN, optim.adamw_update, optim.adamw_update, name="reference")
    kernel(ATEN, optim.sgd_update, optim.sgd_update, name="reference")
    kernel(ATEN, optim.loss_scale_update, optim.loss_scale_update, name="amp")
    kernel(ATEN, optim.accumulate_grads, optim.accumulate_grads, name="foreach")
    kernel(ATEN, optim.zero_accumulated, optim.zero_accumulated, name="foreach")
    kernel(ATEN, optim.record_metric, optim.record_metric, name="record")
    from kiln import guards
    kernel(ATEN, guards.check_finite, guards.check_finite, name="guard")
    kernel(ATEN, guards.branch_guard, guards.branch_guard, name="branch_guard")


_register_optimizer_kernels()


def _register_collective_kernels() -> None:
    """Data parallel: torch.distributed's collectives (kiln/ops/collectives.py) and the out-of-place
    updates of ZeRO shards. Side effects: never retried on another kernel."""
    from kiln import optim
    from kiln.dialects.registry import kernel
    from kiln.ops import collectives
    for op in (*collectives.STARTS, *collectives.WAITS, collectives.STEP_BEGIN, collectives.SHARD_PARAMS,
               collectives.SUM_OVER_RANKS, collectives.GRAD_NORM, collectives.CHECK_FINITE_RANKS):
        fn = op.targets[0]
        kernel(ATEN, fn, fn, name="c10d")
    kernel(ATEN, optim.adamw_update_out, optim.adamw_update_out, name="fused")
    kernel(ATEN, optim.sgd_update_out, optim.sgd_update_out, name="reference")


_register_collective_kernels()


# ---- fusion: the AdamW updates of all parameters -> one multi-tensor fused kernel ---------------
def _register_optimizer_fusion() -> None:
    from kiln import optim
    from kiln.dialects.registry import fusion, kernel
    from kiln.ir.pattern import Op, V

    tensors = ("param", "grad", "exp_avg", "exp_avg_sq", "step")
    hyper = ("lr", "beta1", "beta2", "eps", "weight_decay", "found_inf", "decoupled")
    pattern = Op(optim.adamw_update, *(V(s) for s in tensors + hyper))

    def key(m):
        """Updates fuse when the multi-tensor kernel takes them and they share every hyper-parameter
        (the runtime scalars of one parameter group and found_inf are graph values: the same value)."""
        if not _fused_adamw_ok(m.root):
            return None
        p = m["param"].meta
        return (p.dtype, p.device) + tuple(getattr(m[h], "uid", m[h]) for h in hyper)

    def build(b, matches):
        b.scope = "optimizer"
        lists = [[m[s] for m in matches] for s in tensors]
        b.emit(optim.ADAMW_MULTI, (*lists, *(matches[0][h] for h in hyper)), {}, metas=[])
        return [[] for _ in matches]

    fusion(ATEN, "adamw_multi_tensor", pattern, build, phase="training", group_by=key, min_group=2,
           doc="per-parameter AdamW/Adam updates with equal hyper-parameters -> one _fused_adamw_ (_fused_adam_) over lists")
    kernel(ATEN, optim.adamw_update_multi, optim.adamw_update_multi, name="fused")


_register_optimizer_fusion()


# ---- fusion: GELU's tanh approximation written out -> ATen's fused gelu(approximate="tanh") ----
def _register_gelu_fusion() -> None:
    from kiln.dialects.registry import fusion
    from kiln.ir.graph import Value
    from kiln.ir.pattern import Lit, Op, V

    def near(c):
        return Lit(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v - c) < 1e-6 * max(1, c))

    x = V("x", where=lambda v: isinstance(v, Value) and v.is_float)
    mul, add = aten.mul.Tensor, aten.add.Tensor
    cubic = Op(add, x, Op(mul, Op(aten.pow.Tensor_Scalar, x, near(3.0)), near(0.044715), commutative=True),
               commutative=True)
    inner = Op(aten.tanh.default, Op(mul, cubic, near(math.sqrt(2 / math.pi)), commutative=True))
    # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))   (GPT-2's gelu_new, NewGELUActivation)
    pattern = Op(mul, Op(mul, x, near(0.5), commutative=True), Op(add, inner, near(1.0), commutative=True),
                 commutative=True)

    def build(b, matches):
        (m,) = matches
        out = b(aten.gelu.default, m["x"], approximate="tanh")
        return [out] if out.meta.dtype == m.root.outputs[0].meta.dtype else None

    fusion(ATEN, "gelu_tanh", pattern, build, priority=5,
           doc="0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) written out -> aten.gelu(approximate='tanh')")


_register_gelu_fusion()


# ---- fusion: the backward of log_softmax + nll_loss -> softmax - onehot in one buffer ----------
def _register_cross_entropy_backward_fusion() -> None:
    from kiln.dialects.registry import fusion, kernel
    from kiln.ir.pattern import Lit, Op, V
    from kiln.ops.nn import CROSS_ENTROPY_BACKWARD, cross_entropy_backward

    pattern = Op(aten._log_softmax_backward_data.default, Op(
        aten.nll_loss_backward.default, V("grad"), V("log_probs"), V("target"), Lit(None), V("reduction"),
        V("ignore_index"), V("total_weight")), V("log_probs"), Lit(lambda d: d in (1, -1)), V("dtype"))

    def build(b, matches):
        (m,) = matches
        lp = m["log_probs"]
        if len(lp.meta.shape) != 2 or m["dtype"] != lp.meta.dtype or m["reduction"] not in (0, 1, 2):
            return None
        (grad,) = b.emit(CROSS_ENTROPY_BACKWARD, (m["grad"], lp, m["target"], m["reduction"], m["ignore_index"],
                                                  m["total_weight"]), {})
        return [grad]

    fusion(ATEN, "cross_entropy_backward", pattern, build, phase="training", priority=5,
           doc="nll_loss_backward + _log_softmax_backward_data -> (softmax - onehot) * scale, one buffer")
    kernel(ATEN, cross_entropy_backward, cross_entropy_backward, name="fused")


_register_cross_entropy_backward_fusion()
