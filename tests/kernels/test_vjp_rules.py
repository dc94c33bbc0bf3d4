"""Kiln's VJP rule of each kernel op, one op call at a time (tests/ops/helpers.check_vjp), against
torch.autograd of an unfused PyTorch reference: Kiln builds the graph, differentiates it with the
rule (which emits the kernel's backward op) and runs the generated code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels._common import acc_dtype

import kiln.kernels  # noqa: F401  (defines torch.ops.kiln.*)
from kiln.ops.registry import lookup
from tests.kernels import refs
from tests.ops.helpers import check_vjp

k = torch.ops.kiln
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _rstd(s, eps=1e-6):
    return torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps).detach()


def _ln_stats(s, eps=1e-5):
    var, mean = torch.var_mean(s.detach(), -1, correction=0, keepdim=True)
    return mean, torch.rsqrt(var + eps)


def _dal_ref(x, r, w, b, p, eps, training):
    s = x + r                                     # p = 0 / eval: the op's mask is empty
    return (F.layer_norm(s, (s.shape[-1],), w, b, eps), s, *_ln_stats(s, eps), torch.empty(0, dtype=torch.bool))


def _lce_ref(h, w, y, ignore_index, reduction, chunk=None):
    """(loss, lse) as the chunked op returns them: the log-sum-exp of each token's logits, 0 at ignored
    tokens."""
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=ignore_index, reduction=reduction)
    loss = loss.reshape(y.shape) if reduction == "none" else loss
    valid = y != ignore_index
    return loss, torch.logsumexp(logits, -1).detach() * valid


def _lce_grads_ref(h, w, y, ignore_index, reduction, chunk):
    """(loss, grad_hidden, grad_weight, scale) as the gradient-in-the-forward op returns them: the gradients
    of the sum of the counted tokens' losses (softmax - onehot, 0 at ignored tokens, times hidden or
    weight) and what turns them into the loss's."""
    loss = _lce_ref(h, w, y, ignore_index, reduction)[0]
    valid = (y != ignore_index).flatten()
    p = F.linear(h, w).detach().flatten(0, -2).softmax(-1)
    d = (p - F.one_hot(y.flatten().clamp(min=0), w.shape[0]).to(p.dtype)) * valid[:, None]
    count = int(valid.sum())
    scale = torch.tensor(1.0 / count if reduction == "mean" and count else 1.0, dtype=p.dtype)
    return loss, (d @ w.detach()).reshape(h.shape), d.t() @ h.detach().flatten(0, -2), scale


@dataclass
class Case:
    id: str
    target: object
    make: Callable                 # dtype -> args
    ref: Callable                  # unfused PyTorch, same outputs as the op
    outputs: tuple = (0,)          # outputs that get a cotangent (the differentiable ones)


def _r(*s, dtype):
    return torch.randn(*s, dtype=dtype)


def _ce_ref(x, y, ignore_index, reduction):
    """F.cross_entropy and the per-row log-sum-exp (0 on ignored rows; not differentiable)."""
    lse = torch.where(y != ignore_index, torch.logsumexp(x.detach(), -1), 0.0).to(acc_dtype(x.dtype))
    return F.cross_entropy(x, y, ignore_index=ignore_index, reduction=reduction), lse


CASES = [
    Case("rms_norm", k.rms_norm.default, lambda d: (_r(3, 4, 16, dtype=d), _r(16, dtype=d), 1e-6),
         lambda x, w, eps: (refs.rms_norm(x, w, eps), _rstd(x, eps))),
    Case("add_rms_norm", k.add_rms_norm.default,
         lambda d: (_r(3, 4, 16, dtype=d), _r(3, 4, 16, dtype=d), _r(16, dtype=d), 1e-6),
         lambda x, r, w, eps: (*refs.rms_norm(x, w, eps, residual=r), _rstd(x + r, eps)), outputs=(0, 1)),
    Case("dropout_add_layer_norm", k.dropout_add_layer_norm.default,
         lambda d: (_r(2, 5, 12, dtype=d), _r(2, 5, 12, dtype=d), _r(12, dtype=d), _r(12, dtype=d), 0.0, 1e-5, True),
         _dal_ref, outputs=(0, 1)),
    Case("dropout_add_layer_norm-eval-noaffine", k.dropout_add_layer_norm.default,
         lambda d: (_r(4, 12, dtype=d), _r(4, 12, dtype=d), None, None, 0.5, 1e-5, False), _dal_ref, outputs=(0, 1)),
    Case("swiglu", k.swiglu.default, lambda d: (_r(3, 8, dtype=d) * 2, _r(3, 8, dtype=d)), refs.swiglu),
    Case("swiglu_linear", k.swiglu_linear.default,
         lambda d: (_r(2, 3, 8, dtype=d), _r(10, 8, dtype=d), _r(10, 8, dtype=d)),
         lambda x, wg, wu: (refs.swiglu_linear(x, wg, wu),
                            torch.cat([F.linear(x, wg), F.linear(x, wu)], -1).detach())),
    Case("linear_gelu", k.linear_gelu.default,
         lambda d: (_r(2, 3, 8, dtype=d), _r(6, 8, dtype=d), _r(6, dtype=d), "none"), refs.linear_gelu),
    Case("linear_gelu-tanh-nobias", k.linear_gelu.default,
         lambda d: (_r(5, 8, dtype=d), _r(6, 8, dtype=d), None, "tanh"), refs.linear_gelu),
    # cos/sin are floating, so they are trainable here: the rule's table gradients are checked too
    Case("rope", k.rope.default, lambda d: (_r(2, 3, 4, 8, dtype=d), _r(2, 1, 4, 8, dtype=d), _r(4, 8, dtype=d),
                                            _r(4, 8, dtype=d)), refs.rope, outputs=(0, 1)),
    Case("linear_cross_entropy", k.linear_cross_entropy.default,
         lambda d: (_r(2, 6, 8, dtype=d), _r(20, 8, dtype=d), torch.tensor([[1, -100, 3, 4, 19, 0]] * 2), -100,
                    "mean", 5), _lce_ref),
    Case("linear_cross_entropy-none", k.linear_cross_entropy.default,
         lambda d: (_r(7, 8, dtype=d), _r(20, 8, dtype=d), torch.tensor([1, -100, 3, 4, 19, 0, 2]), -100, "none", 3),
         _lce_ref),
    Case("linear_cross_entropy_grads", k.linear_cross_entropy_grads.default,
         lambda d: (_r(2, 6, 8, dtype=d), _r(20, 8, dtype=d), torch.tensor([[1, -100, 3, 4, 19, 0]] * 2), -100,
                    "mean", 5), _lce_grads_ref),
    Case("linear_cross_entropy_grads-sum", k.linear_cross_entropy_grads.default,
         lambda d: (_r(7, 8, dtype=d), _r(20, 8, dtype=d), torch.tensor([1, -100, 3, 4, 19, 0, -100]), -100, "sum", 0),
         _lce_grads_ref),
    Case("softmax_cross_entropy", k.softmax_cross_entropy.default,
         lambda d: (_r(7, 20, dtype=d) * 3, torch.tensor([1, -100, 3, 4, 19, 0, 2]), -100, "mean"), _ce_ref),
    Case("softmax_cross_entropy-none", k.softmax_cross_entropy.default,
         lambda d: (_r(6, 9, dtype=d), torch.tensor([1, -100, 3, 4, 8, 0]), -100, "none"), _ce_ref),
    # lengths as tensors: the reference is torch's own CTC loss
    Case("ctc_loss", k.ctc_loss.default,
         lambda d: (_r(12, 3, 6, dtype=d).log_softmax(-1), torch.randint(1, 6, (3, 5)), torch.tensor([12, 10, 7]),
                    torch.tensor([5, 3, 1]), 0, "mean", True),
         lambda lp, t, il, tl, blank, red, zi: (F.ctc_loss(lp, t, il, tl, blank, red, zi),)),
]


def covered_ops() -> set[str]:
    """Registry names of the kernel ops whose VJP rules these cases check (for tests/ops'
    every-rule-is-checked test to count)."""
    return {lookup(c.target).name for c in CASES}


@pytest.mark.parametrize("dtype,strided", [(torch.float64, False), (torch.float32, False), (torch.float64, True)],
                         ids=["fp64", "fp32", "fp64-strided-grad"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_vjp_rule(case: Case, dtype, strided):
    torch.manual_seed(0)
    check_vjp(case.target, case.make(dtype), {}, ref=case.ref, outputs=case.outputs, strided_cotangents=strided,
              what=f"[{case.id} {dtype}]", **TOL[dtype])


def test_every_forward_kernel_rule_is_checked():
    from kiln.kernels import OPS
    assert covered_ops() == {lookup(t).name for n, t in OPS.items() if not n.endswith(("_backward", "_backward_sums"))}
