"""Optimizers as graph code: the update is part of the compiled training step.

Each optimizer emits, after the backward, optional global-norm gradient clipping (plain graph ops)
and one in-place update node per parameter. Update nodes are Kiln ops (side effects, kind OPTIMIZER)
with kernels from the dialects: the fused ATen kernel (`_fused_adamw_`, `_fused_adam_`, `_fused_sgd_`)
where it accepts the tensors, and a reference kernel that follows `torch.optim`'s single-tensor code
otherwise. Parameters and states stay in their own dtype (fp32 master weights). The numeric
hyper-parameters (lr, betas, eps, weight decay, momentum, dampening) are *runtime scalar inputs* of the
program, one set per parameter group, read at every call: schedules work by setting `optimizer.lr` (or a
torch optimizer's `param_groups`, kiln/torch_optim.py) and never recompile; only structural choices
(nesterov, clipping, which parameters form a group) are baked into the code. No kernel writes while the
step runs: each stages its writes, and the step commits them all at once at the end
(kiln/transaction.py), so a failure or an interrupt leaves parameters and state either as they were or
fully updated.
"""
from __future__ import annotations

import copy
import ctypes
import fnmatch
import math

import torch

from kiln.errors import KilnError
from kiln.kernels import native
from kiln.ir.graph import Value
from kiln.ops.registry import Cast, Kind, OpDef, register
from kiln.transaction import stage, stage_first
from kiln.ir.symbolic import hint

aten = torch.ops.aten


# ---- update kernels ------------------------------------------------------------------------------
# Each kernel computes out of place and stages its in-place writes (kiln/transaction.py): the step
# commits all of them at once after everything else succeeded. Writes that can fail (the fused kernels)
# are staged with `stage_first`, so they run before any copy, which cannot fail.
def _skip(found_inf) -> bool:
    """fp16 overflow: the update is skipped, parameter and state left bit-identical."""
    return found_inf is not None and bool(found_inf.item())


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, found_inf=None,
                 decoupled=True):
    """The reference: the same arithmetic as torch.optim's single-tensor AdamW (`decoupled`) or Adam (weight
    decay added to the gradient), out of place."""
    if _skip(found_inf):
        return
    t = step.item() + 1
    if not decoupled and weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    new_avg = exp_avg.lerp(grad, 1 - beta1)
    new_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_c1, bias_c2 = 1 - beta1 ** t, 1 - beta2 ** t
    denom = (new_sq.sqrt() / math.sqrt(bias_c2)).add_(eps)
    new_param = param.mul(1 - lr * weight_decay) if decoupled else param.clone()
    new_param.addcdiv_(new_avg, denom, value=-lr / bias_c1)
    stage(torch._foreach_copy_, [param, exp_avg, exp_avg_sq, step], [new_param, new_avg, new_sq, step + 1])


def same_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` in `param`'s memory layout. The fused ATen optimizer kernels walk every tensor of an update
    as one flat buffer: a gradient with other strides than its parameter (a weight used transposed, as in
    `x @ W.T`) would be read in the wrong element order, silently, so it is copied into the parameter's
    layout first (a no-op when the strides already agree, the usual case)."""
    if grad.stride() == param.stride():
        return grad
    return torch.empty_like(param, dtype=grad.dtype).copy_(grad)


def adamw_update_fused(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                       found_inf=None, decoupled=True):
    adamw_update_multi([param], [grad], [exp_avg], [exp_avg_sq], [step], lr, beta1, beta2, eps, weight_decay,
                       found_inf, decoupled)


def _fused_adam(decoupled: bool):
    """ATen's fused multi-tensor kernel: AdamW's decoupled weight decay, or Adam's (added to the gradient)."""
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


def adamw_update_multi(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
                       found_inf=None, decoupled=True):
    """The AdamW (Adam) step of many parameters (same dtype and device) in one multi-tensor kernel, which
    reads the incremented step counts; the counters themselves are written after it."""
    if _skip(found_inf):
        return
    grads = [same_layout(g, p) for g, p in zip(grads, params)]
    if any(g.dtype != p.dtype for g, p in zip(grads, params)):
        # narrow gradients (amp: a bf16 weight copy's gradient, whose widening cast fold_casts dropped): read
        # as they are by the native loops, else widened here (the fused kernel takes one dtype)
        if decoupled and _adamw_native_in_place(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2,
                                                eps, weight_decay):
            return
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
    new_steps = torch._foreach_add(steps, 1)
    stage_first(_fused_adam(decoupled), params, grads, exp_avgs, exp_avg_sqs, [], new_steps, lr=lr, beta1=beta1,
                beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    stage(torch._foreach_copy_, steps, new_steps)


def _adamw_native_in_place(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
                           weight_decay) -> bool:
    """Stage the AdamW step of every parameter by native.c's kiln_adamw_step (fp32 parameters and moments,
    fp32 or bf16 gradients read as they are; the parameter bit for bit `_fused_adamw_`'s on the widened
    gradient), and the step counts' increments; False where the loops do not apply (nothing staged)."""
    lib = native.usable(*params, *grads, *exp_avgs, *exp_avg_sqs)
    if lib is None or any(t.dtype != torch.float32 or not t.is_contiguous()
                          for t in (*params, *exp_avgs, *exp_avg_sqs)):
        return False
    if any(not g.is_contiguous() or g.numel() != p.numel() for g, p in zip(grads, params)):
        return False
    lr, beta1, beta2, eps, wd = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    threads = native.threads()
    # one staged write per parameter, each a single C call (no Python frame: an interrupt cannot fall inside
    # one, and the commit rolls forward over the rest); the tensors are held by a write that does nothing
    counts = native.read_scalars(steps)
    if counts is None:                          # not fp32 CPU scalars: ATen's ops
        new_steps = torch._foreach_add(steps, 1)
        counts = [float(t) for t in new_steps]
        write = (torch._foreach_copy_, steps, new_steps)
    else:                                       # t + 1 rounded to fp32, as the fp32 add rounds it
        counts = [ctypes.c_float(c + 1.0).value for c in counts]
        write = (native.write_scalars, steps, counts)
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, counts):
        stage_first(lib.kiln_adamw_step, p.data_ptr(), g.data_ptr(), native.code(g), m.data_ptr(), v.data_ptr(),
                    p.numel(), lr, beta1, beta2, eps, wd, 1 - beta1 ** t, math.sqrt(1 - beta2 ** t), threads)
    stage(tuple, [*params, *grads, *exp_avgs, *exp_avg_sqs])
    stage(*write)
    return True


def _sgd(param, grad, momentum_buffer, step, lr, momentum, dampening, nesterov, weight_decay):
    """The SGD step out of place: (new parameter, state tensors to write, their new values). A torch.optim.SGD
    group without momentum keeps no state (`momentum_buffer` and `step` None)."""
    d = grad.add(param, alpha=weight_decay) if weight_decay else grad
    dst, src = ([step], [step + 1]) if step is not None else ([], [])
    if momentum and momentum_buffer is not None:
        buf = d.clone() if step.item() == 0 else momentum_buffer.mul(momentum).add_(d, alpha=1 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
        dst.append(momentum_buffer)
        src.append(buf)
    return param.add(d, alpha=-lr), dst, src


def sgd_update(param, grad, momentum_buffer, step, lr, momentum, dampening, nesterov, weight_decay,
               found_inf=None):
    if _skip(found_inf):
        return
    new, dst, src = _sgd(param, grad, momentum_buffer, step, lr, momentum, dampening, nesterov, weight_decay)
    stage(torch._foreach_copy_, [param, *dst], [new, *src])


# ---- out-of-place updates (ZeRO) -------------------------------------------------------------------
# A ZeRO rank updates its shard of the parameters, then the new shards are all-gathered to every rank
# before the step commits: these return the new parameter values and stage only the state's writes.
def adamw_update_out(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, found_inf=None,
                     decoupled=True):
    """AdamW out of place: returns the new parameter and stages the state's writes. With Kiln's native loops
    (float32 AdamW): one pass computes the new parameter from the moments as they will be, writing nothing
    else, and the moments are updated in place at the commit by the same arithmetic; otherwise ATen's fused
    kernel on copies of the parameter and both moments, whose values are copied back at the commit (about
    twice the memory traffic: 108 ms a step of copies on Llama's ZeRO-1 shard, one thread, docs/distributed.md)."""
    if _skip(found_inf):
        return (param,)
    done = _adamw_out_native(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay) \
        if decoupled else None
    if done is not None:
        return (done,)
    new_p, new_avg, new_sq, new_step = param.clone(), exp_avg.clone(), exp_avg_sq.clone(), step + 1
    _fused_adam(decoupled)([new_p], [same_layout(grad, param)], [new_avg], [new_sq], [], [new_step], lr=lr,
                        beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    stage(torch._foreach_copy_, [exp_avg, exp_avg_sq, step], [new_avg, new_sq, new_step])
    return (new_p,)


def _adamw_out_native(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """The new parameter by native.c's kiln_adamw_param, the moments' and step's writes staged; None where the
    native loops do not apply (other dtypes or devices, layouts, no library)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    lib = native.usable(*tensors)
    if (lib is None or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors)
            or len({t.numel() for t in tensors}) != 1):
        return None
    new_step = step + 1
    t = float(new_step)
    lr, beta1, beta2, eps, wd = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    new_p = torch.empty_like(param)
    n, threads = param.numel(), native.threads()
    native.check(lib.kiln_adamw_param(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                      new_p.data_ptr(), n, lr, beta1, beta2, eps, wd, 1 - beta1 ** t,
                                      math.sqrt(1 - beta2 ** t), threads), "adamw")

    # at the commit: one C call (no Python frame an interrupt could split), the same arithmetic; the tensors
    # are held by a write that does nothing
    stage_first(lib.kiln_adamw_moments, grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n, beta1, beta2,
                threads)
    stage(tuple, [grad, exp_avg, exp_avg_sq])
    stage(torch._foreach_copy_, [step], [new_step])
    return new_p


def sgd_update_out(param, grad, momentum_buffer, step, lr, momentum, dampening, nesterov, weight_decay,
                   found_inf=None):
    if _skip(found_inf):
        return (param,)
    new, dst, src = _sgd(param, grad, momentum_buffer, step, lr, momentum, dampening, nesterov, weight_decay)
    stage(torch._foreach_copy_, dst, src)
    return (new,)


def loss_scale_update(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Dynamic loss scaling (as torch.amp.GradScaler): halve on overflow, grow after clean steps."""
    new_scale, new_tracker = scale.clone(), growth_tracker.clone()
    torch._amp_update_scale_(new_scale, new_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    stage(torch._foreach_copy_, [scale, growth_tracker], [new_scale, new_tracker])


def accumulate_grads(sums, grads):
    """Gradient accumulation's micro-step: the sums grow by this micro-batch's gradients at the commit."""
    stage(torch._foreach_add_, list(sums), list(grads))


def zero_accumulated(sums):
    """After the cycle's update: the sums start again from zero (at the commit, with the update)."""
    stage(torch._foreach_zero_, list(sums))


def record_metric(sink, value):
    """A number the step reports (the gradient norm): written into the step's own 0-d tensor at the commit,
    so a failed or skipped step leaves the previous value."""
    stage(torch._foreach_copy_, [sink], [value.detach().reshape(())])


def _no_outputs(args, kwargs):
    return []


ADAMW = register(OpDef("kiln.adamw_update", (adamw_update,), None, Kind.OPTIMIZER, Cast.FP32,
                       differentiable=False, side_effects=True, infer=_no_outputs,
                       cost=lambda n: 10.0 * hint(n.args[0].meta.numel),
                       doc="in-place AdamW (or Adam) step of one parameter and its state"))
ADAMW_MULTI = register(OpDef("kiln.adamw_update_multi", (adamw_update_multi,), None, Kind.OPTIMIZER, Cast.FP32,
                             differentiable=False, side_effects=True, infer=_no_outputs, reads_narrow=True,
                             cost=lambda n: 10.0 * sum(hint(p.meta.numel) for p in n.args[0]),
                             doc="in-place AdamW step of a list of parameters (one multi-tensor kernel)"))
SGD_OP = register(OpDef("kiln.sgd_update", (sgd_update,), None, Kind.OPTIMIZER, Cast.FP32,
                        differentiable=False, side_effects=True, infer=_no_outputs,
                        cost=lambda n: 4.0 * hint(n.args[0].meta.numel),
                        doc="in-place SGD (momentum, nesterov, weight decay) step of one parameter"))


ACCUMULATE = register(OpDef("kiln.accumulate_grads", (accumulate_grads,), None, Kind.OPTIMIZER, Cast.FP32,
                            differentiable=False, side_effects=True, infer=_no_outputs,
                            cost=lambda n: 1.0 * sum(hint(g.meta.numel) for g in n.args[1]),
                            doc="gradient accumulation: add a micro-batch's gradients to the step's sums"))
RECORD_METRIC = register(OpDef("kiln.record_metric", (record_metric,), None, Kind.OPTIMIZER, Cast.FP32,
                               differentiable=False, side_effects=True, infer=_no_outputs, cost=lambda n: 1.0,
                               doc="a number the step reports (step.grad_norm), written at the commit"))
ZERO_ACCUMULATED = register(OpDef("kiln.zero_accumulated", (zero_accumulated,), None, Kind.OPTIMIZER, Cast.FP32,
                                  differentiable=False, side_effects=True, infer=_no_outputs,
                                  cost=lambda n: 1.0 * sum(hint(g.meta.numel) for g in n.args[0]),
                                  doc="gradient accumulation: the sums back to zero after the update"))


def _out_of_place(fn, per_element: float, what: str) -> OpDef:
    """An update op of a ZeRO shard: returns the new values (same meta as the parameter), stages the state."""
    return register(OpDef(f"kiln.{fn.__name__}", (fn,), None, Kind.OPTIMIZER, Cast.FP32, differentiable=False,
                          side_effects=True, infer=lambda args, kwargs: [args[0].meta],
                          cost=lambda n: per_element * n.args[0].meta.numel,
                          doc=f"{what} step of a ZeRO shard, out of place: returns the new values, stages the state"))


ADAMW_OUT = _out_of_place(adamw_update_out, 10.0, "AdamW")
SGD_OUT = _out_of_place(sgd_update_out, 4.0, "SGD")


LOSS_SCALE = register(OpDef("kiln.loss_scale_update", (loss_scale_update,), None, Kind.OPTIMIZER, Cast.FP32,
                            differentiable=False, side_effects=True, infer=_no_outputs, cost=lambda n: 1.0,
                            doc="fp16 dynamic loss scale update (halve on inf/NaN, grow after clean steps)"))


def _number(name: str, v, low: float = 0.0, high: float = math.inf, low_open=False, high_open=False) -> float:
    """A hyper-parameter as a float, or a KilnError naming it and its range."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok:
        v = float(v)
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        rng = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise KilnError(f"{name} must be a number in {rng}, got {v!r}")
    return v


def grad_norm_limit(v) -> float:
    """`max_grad_norm` validated: a number > 0, or math.inf (as `torch.nn.utils.clip_grad_norm_(..., inf)`:
    the global norm is computed, and reported as `step.grad_norm`, but nothing is clipped)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == math.inf:
        return math.inf
    return _number("max_grad_norm", v, low_open=True)


class Optimizer:
    """Base: hyper-parameters, per-parameter state layout, and the graph code of one update.

    Hyper-parameters are plain attributes (`optimizer.lr = 1e-4` between steps works); `check()`
    validates all of them (at construction, before every step and before a checkpoint is loaded).
    The numeric ones named in `scalar_keys` are runtime inputs of the program (`scalars()` gives their
    values at each call); `structure()` is what the code bakes in (a change compiles another program).

    Parameter groups: `groups=[{"params": "*.bias", "weight_decay": 0.0}, {"params": ["*norm*"], "lr": 1e-4}]`.
    Each group names parameters by `fnmatch` patterns on their names (`model.named_parameters()`); the
    first group that matches a parameter gives it its overrides of the optimizer's numeric hyper-parameters
    (`group_keys`); parameters no group matches use the optimizer's own values (group 0; group i + 1 is
    `groups[i]`). Overrides may change between steps (`opt.groups[0]["lr"] = ...`) without recompiling;
    the patterns are baked in. A pattern that matches no parameter is an error at the first step.
    """

    slots: tuple[str, ...] = ()
    scalar_keys: tuple[str, ...] = ("lr",)
    group_keys: tuple[str, ...] = ("lr",)     # what a group may override (the attributes behind scalar_keys)

    def __init__(self, lr: float, max_grad_norm: float | None, groups: list[dict] | None = None):
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.groups = list(groups) if groups is not None else []
        self._bound: tuple | None = None

    def check(self) -> None:
        """Validate every hyper-parameter, normalizing types; a KilnError names the first bad one."""
        self._check_own()
        if not isinstance(self.groups, (list, tuple)):
            raise KilnError(f"groups must be a list of dicts, got {type(self.groups).__name__}")
        self.groups = [self._checked_group(i, g) for i, g in enumerate(self.groups)]

    def _check_own(self) -> None:
        """Validate the optimizer's own (group 0) hyper-parameters; subclasses extend it."""
        self.lr = _number("lr", self.lr)
        if self.max_grad_norm is not None:
            self.max_grad_norm = grad_norm_limit(self.max_grad_norm)

    def _checked_group(self, i: int, g) -> dict:
        if not isinstance(g, dict) or "params" not in g:
            raise KilnError(f"groups[{i}] must be a dict with 'params' (a name pattern or a list of them), got {g!r}")
        pats = g["params"]
        pats = [pats] if isinstance(pats, str) else pats
        if not (isinstance(pats, (list, tuple)) and pats and all(isinstance(x, str) for x in pats)):
            raise KilnError(f"groups[{i}]['params'] must be a name pattern or a non-empty list of them, got {pats!r}")
        extra = sorted(set(g) - {"params", *self.group_keys})
        if extra:
            raise KilnError(f"groups[{i}] sets {extra}; a group may set {list(self.group_keys)}")
        try:
            probe = self._in_group({k: v for k, v in g.items() if k != "params"})
            probe._check_own()
        except KilnError as e:
            raise KilnError(f"groups[{i}]: {e}") from None
        return {"params": list(pats), **{k: getattr(probe, k) for k in g if k != "params"}}

    def _in_group(self, overrides: dict) -> "Optimizer":
        """A copy with one group's overrides (and no groups): its hyper-parameters are the group's."""
        probe = copy.copy(self)
        probe.groups = []
        for k, v in overrides.items():
            setattr(probe, k, tuple(v) if isinstance(v, list) else v)
        return probe

    # ---- parameter groups and runtime scalars ---------------------------------------------------
    def bind(self, model, trainable: dict) -> None:
        """At each call: check that every group's patterns match some parameter (once per model and groups)."""
        names = tuple(n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad)
        key = (names, self._patterns())
        if key == self._bound:
            return
        for i, pats in enumerate(key[1]):
            if not any(fnmatch.fnmatchcase(n, pat) for n in names for pat in pats):
                raise KilnError(f"{type(self).__name__} groups[{i}]['params'] = {list(pats)} matches no trainable "
                                f"parameter of {type(model).__name__} (names look like {list(names[:3])})")
        self._bound = key

    def _patterns(self) -> tuple:
        return tuple(tuple(g["params"]) for g in self.groups)

    def group_of(self, name: str) -> int | None:
        """The parameter group whose hyper-parameters update parameter `name` (None: not updated)."""
        for i, pats in enumerate(self._patterns()):
            if any(fnmatch.fnmatchcase(name, pat) for pat in pats):
                return i + 1
        return 0

    def slots_of(self, group: int) -> tuple[str, ...]:
        """The state slots of a parameter of `group`."""
        return self.slots

    def scalars(self) -> dict[str, float]:
        """The runtime scalar inputs' values now, keyed `"<group>:<key>"` (graph inputs' `source`)."""
        out = {f"0:{k}": float(v) for k, v in zip(self.scalar_keys, self._scalar_values())}
        for i, g in enumerate(self.groups):
            values = self._in_group({k: v for k, v in g.items() if k != "params"})._scalar_values()
            out.update({f"{i + 1}:{k}": float(v) for k, v in zip(self.scalar_keys, values)})
        return out

    def _scalar_values(self) -> tuple:
        return (self.lr,)

    def structure(self) -> tuple:
        """What the generated code bakes in: part of a program's key (a change compiles another program)."""
        return (type(self).__name__, self.max_grad_norm, self._patterns())

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def emit_update(self, b, param: Value, grad: Value, state: dict[str, Value], hyper: dict[str, Value],
                    found_inf: Value | None = None, group: int = 0) -> None:
        """The update of one parameter; `hyper` holds its group's runtime scalars by key."""
        raise NotImplementedError

    def emit_update_out(self, b, param: Value, grad: Value, state: dict[str, Value], hyper: dict[str, Value],
                        found_inf: Value | None = None, group: int = 0) -> Value:
        """The update out of place (ZeRO shards): returns the new parameter value; only state is written."""
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {k: copy.deepcopy(v) if k == "groups" else v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


ADAM_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")
SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay")


def emit_adam(b, param, grad, state, hyper, found_inf, decoupled: bool, out_of_place: bool):
    """One Adam/AdamW update node; its hyper-parameters are the group's runtime scalars."""
    args = (param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], *(hyper[k] for k in ADAM_KEYS),
            found_inf, decoupled)
    if out_of_place:
        return b.emit(ADAMW_OUT, args, {}, metas=[param.meta])[0]
    b.emit(ADAMW, args, {}, metas=[])


def emit_sgd(b, param, grad, state, hyper, found_inf, nesterov: bool, out_of_place: bool):
    """One SGD update node (`state` may lack the momentum buffer and step: torch's SGD without momentum)."""
    args = (param, grad, state.get("momentum_buffer"), state.get("step"), hyper["lr"], hyper["momentum"],
            hyper["dampening"], nesterov, hyper["weight_decay"], found_inf)
    if out_of_place:
        return b.emit(SGD_OUT, args, {}, metas=[param.meta])[0]
    b.emit(SGD_OP, args, {}, metas=[])


class AdamW(Optimizer):
    """AdamW with bias correction and decoupled weight decay (as torch.optim.AdamW)."""

    slots = ("step", "exp_avg", "exp_avg_sq")
    scalar_keys = ADAM_KEYS
    group_keys = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, max_grad_norm: float | None = None, groups: list[dict] | None = None):
        super().__init__(lr, max_grad_norm, groups)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.check()

    def _check_own(self):
        super()._check_own()
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise KilnError(f"betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(_number(f"betas[{i}]", b, high=1.0, high_open=True) for i, b in enumerate(self.betas))
        self.eps = _number("eps", self.eps)
        self.weight_decay = _number("weight_decay", self.weight_decay)

    def _scalar_values(self):
        return (self.lr, *self.betas, self.eps, self.weight_decay)

    def init_state(self, param):
        return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param)}

    def emit_update(self, b, param, grad, state, hyper, found_inf=None, group=0):
        emit_adam(b, param, grad, state, hyper, found_inf, decoupled=True, out_of_place=False)

    def emit_update_out(self, b, param, grad, state, hyper, found_inf=None, group=0):
        return emit_adam(b, param, grad, state, hyper, found_inf, decoupled=True, out_of_place=True)


class SGD(Optimizer):
    """SGD with momentum, dampening, nesterov and (coupled) weight decay (as torch.optim.SGD)."""

    slots = ("step", "momentum_buffer")
    scalar_keys = SGD_KEYS
    group_keys = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float | None = None, groups: list[dict] | None = None):
        super().__init__(lr, max_grad_norm, groups)
        self.momentum, self.dampening, self.nesterov, self.weight_decay = momentum, dampening, nesterov, weight_decay
        self.check()

    def _check_own(self):
        super()._check_own()
        self.momentum = _number("momentum", self.momentum)
        self.dampening = _number("dampening", self.dampening, high=1.0)
        self.weight_decay = _number("weight_decay", self.weight_decay)
        if not isinstance(self.nesterov, bool):
            raise KilnError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise KilnError("nesterov momentum requires momentum > 0 and dampening = 0")

    def _scalar_values(self):
        return (self.lr, self.momentum, self.dampening, self.weight_decay)

    def structure(self):
        return super().structure() + (self.nesterov,)

    def init_state(self, param):
        return {"step": torch.zeros((), dtype=torch.float32), "momentum_buffer": torch.zeros_like(param)}

    def emit_update(self, b, param, grad, state, hyper, found_inf=None, group=0):
        emit_sgd(b, param, grad, state, hyper, found_inf, self.nesterov, out_of_place=False)

    def emit_update_out(self, b, param, grad, state, hyper, found_inf=None, group=0):
        return emit_sgd(b, param, grad, state, hyper, found_inf, self.nesterov, out_of_place=True)


def clip_by_global_norm(b, grads: list[Value], max_norm: float,
                        total: Value | None = None) -> tuple[list[Value], Value]:
    """grads * min(1, max_norm / (||grads||_2 + 1e-6)), as torch.nn.utils.clip_grad_norm_, and the norm
    before clipping. `total`: the norm computed elsewhere (data parallel: over every rank's shards,
    kiln/passes/collectives.py). `max_norm` inf: the norm only (torch's clip with inf scales by 1.0)."""
    if total is None:
        norms = [b(aten.linalg_vector_norm.default, g, 2) for g in grads]
        total = b(aten.linalg_vector_norm.default, b(aten.stack.default, norms), 2)
    if max_norm == math.inf:
        return grads, total
    limit = b(aten.full.default, [], float(max_norm), dtype=total.meta.dtype, device=total.meta.device)
    coef = b(aten.clamp.default, b(aten.div.Tensor, limit, b(aten.add.Tensor, total, 1e-6)), None, 1.0)
    return [b(aten.mul.Tensor, g, coef) for g in grads], total


def unscale_and_check(b, grads: list[Value], scale: Value) -> tuple[list[Value], Value]:
    """fp16 loss scaling: grads / scale, and found_inf = 1.0 if any gradient has an inf or NaN."""
    inv = b(aten.reciprocal.default, scale)
    grads = [b(aten.mul.Tensor, g, inv) for g in grads]
    finite = [b(aten.all.default, b(aten.isfinite.default, g)) for g in grads]
    all_finite = b(aten.all.default, b(aten.stack.default, finite))
    found_inf = b(aten._to_copy.default, b(aten.logical_not.default, all_finite), dtype=torch.float32)
    return grads, found_inf
