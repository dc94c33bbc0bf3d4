"""Optimizers as graph code: the update is part of the compiled training step.

Each optimizer emits, after the backward, optional global-norm gradient clipping (plain graph ops)
and one in-place update node per parameter. Update nodes are Kiln ops (side effects, kind OPTIMIZER)
with kernels from the dialects: the fused ATen kernel (`_fused_adamw_`, `_fused_sgd_`) where it
accepts the tensors, and a reference kernel that follows `torch.optim`'s single-tensor code otherwise.
Parameters and states stay in their own dtype (fp32 master weights); learning rate is read at every
call, so schedules work by setting `optimizer.lr`.
"""
from __future__ import annotations

import math

import torch

from kiln.errors import KilnError
from kiln.ir.graph import Value
from kiln.ops.registry import Cast, Kind, OpDef, register

aten = torch.ops.aten


# ---- update kernels (reference: the same arithmetic as torch.optim's single-tensor path) -------
def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, found_inf=None):
    if found_inf is not None and found_inf.item():
        return                      # fp16 overflow: skip, leaving parameter and state bit-identical
    step += 1
    t = step.item()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_c1, bias_c2 = 1 - beta1 ** t, 1 - beta2 ** t
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_c2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_c1)


def same_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` in `param`'s memory layout. The fused ATen optimizer kernels walk every tensor of an update
    as one flat buffer: a gradient with other strides than its parameter (a weight used transposed, as in
    `x @ W.T`) would be read in the wrong element order, silently, so it is copied into the parameter's
    layout first (a no-op when the strides already agree, the usual case)."""
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param, dtype=grad.dtype).copy_(grad)


def adamw_update_fused(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                       found_inf=None):
    if found_inf is not None and found_inf.item():
        return
    step += 1
    grad = same_layout(grad, param)
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def adamw_update_multi(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                       found_inf=None):
    """The AdamW step of many parameters (same dtype and device) in one multi-tensor kernel."""
    if found_inf is not None and found_inf.item():
        return
    torch._foreach_add_(steps, 1)
    grads = [same_layout(g, p) for g, p in zip(grads, params)]
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def sgd_update(param, grad, momentum_buffer, step, lr, momentum, dampening, nesterov, weight_decay,
               found_inf=None):
    if found_inf is not None and found_inf.item():
        return
    if weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    if momentum:
        if step.item() == 0:
            momentum_buffer.copy_(grad)
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    step += 1
    param.add_(grad, alpha=-lr)


def loss_scale_update(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Dynamic loss scaling (as torch.amp.GradScaler): halve on overflow, grow after clean steps."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)


def _no_outputs(args, kwargs):
    return []


ADAMW = register(OpDef("kiln.adamw_update", (adamw_update,), None, Kind.OPTIMIZER, Cast.FP32,
                       differentiable=False, side_effects=True, infer=_no_outputs,
                       cost=lambda n: 10.0 * n.args[0].meta.numel,
                       doc="in-place AdamW step of one parameter and its state"))
ADAMW_MULTI = register(OpDef("kiln.adamw_update_multi", (adamw_update_multi,), None, Kind.OPTIMIZER, Cast.FP32,
                             differentiable=False, side_effects=True, infer=_no_outputs,
                             cost=lambda n: 10.0 * sum(p.meta.numel for p in n.args[0]),
                             doc="in-place AdamW step of a list of parameters (one multi-tensor kernel)"))
SGD_OP = register(OpDef("kiln.sgd_update", (sgd_update,), None, Kind.OPTIMIZER, Cast.FP32,
                        differentiable=False, side_effects=True, infer=_no_outputs,
                        cost=lambda n: 4.0 * n.args[0].meta.numel,
                        doc="in-place SGD (momentum, nesterov, weight decay) step of one parameter"))


LOSS_SCALE = register(OpDef("kiln.loss_scale_update", (loss_scale_update,), None, Kind.OPTIMIZER, Cast.FP32,
                            differentiable=False, side_effects=True, infer=_no_outputs, cost=lambda n: 1.0,
                            doc="fp16 dynamic loss scale update (halve on inf/NaN, grow after clean steps)"))


class Optimizer:
    """Base: hyper-parameters, per-parameter state layout, and the graph code of one update."""

    slots: tuple[str, ...] = ()

    def __init__(self, lr: float, max_grad_norm: float | None):
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise KilnError(f"lr must be a non-negative number, got {lr!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise KilnError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.lr = float(lr)
        self.max_grad_norm = max_grad_norm

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def emit_update(self, b, param: Value, grad: Value, state: dict[str, Value], lr: Value,
                    found_inf: Value | None = None) -> None:
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


class AdamW(Optimizer):
    """AdamW with bias correction and decoupled weight decay (as torch.optim.AdamW)."""

    slots = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, max_grad_norm: float | None = None):
        super().__init__(lr, max_grad_norm)
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise KilnError(f"betas must be in [0, 1), got {betas!r}")
        self.betas, self.eps, self.weight_decay = (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)

    def init_state(self, param):
        return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param)}

    def emit_update(self, b, param, grad, state, lr, found_inf=None):
        b.emit(ADAMW, (param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, *self.betas,
                       self.eps, self.weight_decay, found_inf), {}, metas=[])


class SGD(Optimizer):
    """SGD with momentum, dampening, nesterov and (coupled) weight decay (as torch.optim.SGD)."""

    slots = ("step", "momentum_buffer")

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float | None = None):
        super().__init__(lr, max_grad_norm)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise KilnError("nesterov momentum requires momentum > 0 and dampening = 0")
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.nesterov, self.weight_decay = bool(nesterov), float(weight_decay)

    def init_state(self, param):
        return {"step": torch.zeros((), dtype=torch.float32), "momentum_buffer": torch.zeros_like(param)}

    def emit_update(self, b, param, grad, state, lr, found_inf=None):
        b.emit(SGD_OP, (param, grad, state["momentum_buffer"], state["step"], lr, self.momentum, self.dampening,
                        self.nesterov, self.weight_decay, found_inf), {}, metas=[])


def clip_by_global_norm(b, grads: list[Value], max_norm: float) -> list[Value]:
    """grads * min(1, max_norm / (||grads||_2 + 1e-6)), as torch.nn.utils.clip_grad_norm_."""
    norms = [b(aten.linalg_vector_norm.default, g, 2) for g in grads]
    total = b(aten.linalg_vector_norm.default, b(aten.stack.default, norms), 2)
    limit = b(aten.full.default, [], float(max_norm), dtype=total.meta.dtype, device=total.meta.device)
    coef = b(aten.clamp.default, b(aten.div.Tensor, limit, b(aten.add.Tensor, total, 1e-6)), None, 1.0)
    return [b(aten.mul.Tensor, g, coef) for g in grads]


def unscale_and_check(b, grads: list[Value], scale: Value) -> tuple[list[Value], Value]:
    """fp16 loss scaling: grads / scale, and found_inf = 1.0 if any gradient has an inf or NaN."""
    inv = b(aten.reciprocal.default, scale)
    grads = [b(aten.mul.Tensor, g, inv) for g in grads]
    finite = [b(aten.all.default, b(aten.isfinite.default, g)) for g in grads]
    all_finite = b(aten.all.default, b(aten.stack.default, finite))
    found_inf = b(aten._to_copy.default, b(aten.logical_not.default, all_finite), dtype=torch.float32)
    return grads, found_inf
