"""torch.optim optimizers inside a compiled step: `kiln.compile(model, optimizer=torch.optim.AdamW(groups))`.

`torch.optim.AdamW`, `Adam` (also `decoupled_weight_decay=True`) and `SGD` (momentum, dampening, nesterov,
weight decay) are accepted, with parameter groups. The torch optimizer stays the owner of everything:
- **Hyper-parameters** are read from `optimizer.param_groups` at every step call and given to the program
  as runtime scalar inputs, one set per group (kiln/passes/pipeline.py `add_update`): an lr scheduler
  attached to the optimizer (`scheduler.step()` as usual) changes them without recompiling. What the code
  bakes in (which parameters form each group, nesterov, momentum on or off, Adam's weight-decay kind) is
  `structure()`, part of a program's key.
- **State**: Kiln's state tensors ARE the tensors of `optimizer.state[p]`, in torch's format (Adam/AdamW:
  `step` (0-dim float32), `exp_avg`, `exp_avg_sq`; SGD: `momentum_buffer`). `state_view()` looks them up
  again at every call, so `optimizer.load_state_dict(...)` (which replaces them) takes effect at the next
  step and `optimizer.state_dict()` is torch's own at any time. The compiled update stages its writes into
  these tensors and the step commits them at once (kiln/transaction.py): a failed step leaves them
  unchanged. torch creates state lazily at a parameter's first step; so does Kiln: fresh tensors are
  given to the program and put into `optimizer.state[p]` (`install`) only after a step has committed an
  update to them (not after a failed or skipped one).
- SGD keeps no step count: a parameter without a momentum buffer takes the gradient as its buffer (torch's
  first-step rule), so the program gets a per-call counter, 0 without a buffer and 1 with one.
Options that change the math and that Kiln does not implement (amsgrad, maximize, capturable,
differentiable) are refused with a KilnError; `foreach` and `fused` only choose torch's kernels and are
ignored (Kiln picks its own). Other optimizer classes (and subclasses, which may override `step`), and
optimizers with step hooks (which `optimizer.step()` would run and the compiled update cannot), are refused.
"""
from __future__ import annotations

import copy

import torch

from kiln.errors import KilnError
from kiln.optim import ADAM_KEYS, SGD_KEYS, Optimizer, _number, emit_adam, emit_sgd, grad_norm_limit

_KINDS = {torch.optim.AdamW: "adam", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
_REFUSED = {
    "amsgrad": "amsgrad=True (keeps max_exp_avg_sq) is not implemented by Kiln's update",
    "maximize": "maximize=True is not implemented by Kiln's update; negate the loss instead",
    "capturable": "capturable=True (state on the accelerator for CUDA graphs) is not supported; "
                  "Kiln compiles the step itself",
    "differentiable": "differentiable=True (autograd through the update) is not supported",
}
ADAM_SLOTS = ("step", "exp_avg", "exp_avg_sq")
SGD_SLOTS = ("momentum_buffer", "step")


def _qualname(opt) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


class TorchOptimizer(Optimizer):
    """A `torch.optim` optimizer as a Kiln optimizer (see the module docstring). `torch` is the wrapped one."""

    def __init__(self, opt: torch.optim.Optimizer, max_grad_norm: float | None = None):
        kind = _KINDS.get(type(opt))
        if kind is None:
            raise KilnError(f"kiln.compile accepts torch.optim.AdamW, torch.optim.Adam and torch.optim.SGD, got "
                            f"{_qualname(opt)} (Kiln compiles the update itself, so it must know its math; a "
                            "subclass may change it). Use one of those, or kiln.optim.AdamW / kiln.optim.SGD")
        self.torch, self.kind = opt, kind
        # torch optimizers do not clip: eager calls clip_grad_norm_(params, max_norm) before opt.step(), which
        # kiln.compile(..., max_grad_norm=) puts into the step (over every gradient, as that call over
        # model.parameters())
        self.max_grad_norm = max_grad_norm
        self.scalar_keys = ADAM_KEYS if kind == "adam" else SGD_KEYS
        self._groups: dict[str, int] = {}     # canonical trainable parameter name -> group index (bind)
        self._alias: dict[str, str] = {}      # every name of a trainable parameter -> its canonical name
        self._params: dict[str, torch.Tensor] = {}
        self._bound: tuple | None = None      # what bind() mapped last (the groups' parameters, the model's)
        self._view: dict[str, dict] = {}      # per parameter: torch's state tensors checked last, and their view
        self.groups = []                      # kiln.optim's name-pattern groups: torch's param_groups instead
        self.check()

    # ---- hyper-parameters, read from param_groups at every call --------------------------------
    def check(self) -> None:
        name = type(self.torch).__name__
        if self.max_grad_norm is not None:
            self.max_grad_norm = grad_norm_limit(self.max_grad_norm)
        from torch.optim import optimizer as torch_optimizer
        hooks = (getattr(self.torch, "_optimizer_step_pre_hooks", None), getattr(self.torch, "_optimizer_step_post_hooks",
                 None), torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
        if any(hooks):
            raise KilnError(f"{name} has optimizer step hooks (register_step_pre_hook / register_step_post_hook, or "
                            "global ones): Kiln's compiled update does not call optimizer.step(), so they would "
                            "never run; remove them, or train this model eagerly")
        for i, g in enumerate(self.torch.param_groups):
            for opt, why in _REFUSED.items():
                if g.get(opt):
                    raise KilnError(f"{name}(..., {opt}=True) in param_groups[{i}]: {why}. Set {opt}=False, "
                                    "or train this model eagerly")
            for k, v in zip(self.scalar_keys, self._group_values(g)):
                _number(f"{name} param_groups[{i}][{k!r}]", float(v) if isinstance(v, torch.Tensor) else v,
                        high=1.0 if k in ("beta1", "beta2") else float("inf"), high_open=k in ("beta1", "beta2"))
            if self.kind == "sgd" and g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
                raise KilnError(f"{name} param_groups[{i}]: nesterov momentum requires momentum > 0 and dampening = 0")

    def _group_values(self, g: dict) -> tuple:
        if self.kind == "adam":
            return (g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"])
        return (g["lr"], g["momentum"], g["dampening"], g["weight_decay"])

    def scalars(self) -> dict[str, float]:
        return {f"{i}:{k}": float(v) for i, g in enumerate(self.torch.param_groups)
                for k, v in zip(self.scalar_keys, self._group_values(g))}

    def hyperparameters(self) -> dict:
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.torch.param_groups]}

    def __repr__(self) -> str:
        return f"TorchOptimizer({_qualname(self.torch)}, {len(self.torch.param_groups)} group(s))"

    # ---- which parameter is in which group --------------------------------------------------
    def bind(self, model: torch.nn.Module, trainable: dict[str, torch.Tensor]) -> None:
        """Map the optimizer's parameters to the model's names (checked at every call: groups may change; the
        mapping is redone only when the groups' parameters or the model's tensors did change)."""
        key = (id(trainable), tuple(id(p) for g in self.torch.param_groups for p in g["params"]),
               tuple(len(g["params"]) for g in self.torch.param_groups))
        if key == self._bound:
            return
        canonical = {id(p): n for n, p in trainable.items()}
        every = dict(model.named_parameters(remove_duplicate=False))
        known = {id(p) for p in every.values()}
        self._alias = {n: canonical[id(p)] for n, p in every.items() if id(p) in canonical}
        self._params, self._groups = trainable, {}
        for i, g in enumerate(self.torch.param_groups):
            for p in g["params"]:
                if id(p) in canonical:
                    self._groups[canonical[id(p)]] = i
                elif id(p) not in known:
                    raise KilnError(f"{type(self.torch).__name__} param_groups[{i}] holds a tensor of shape "
                                    f"{tuple(p.shape)} that is not a parameter of {type(model).__name__} (were the "
                                    "model's parameters replaced after the optimizer was made?); build the "
                                    "optimizer from this model's parameters")
                # a frozen parameter (requires_grad=False) gets no gradient: torch skips it, so does Kiln
        self._bound, self._view = key, {}

    def group_of(self, name: str) -> int | None:
        return self._groups.get(self._alias.get(name, name))

    def _group(self, group: int) -> dict:
        return self.torch.param_groups[group]

    def slots_of(self, group: int) -> tuple[str, ...]:
        if self.kind == "adam":
            return ADAM_SLOTS
        return SGD_SLOTS if self._group(group)["momentum"] != 0 else ()

    def _decoupled(self, group: int) -> bool:
        return type(self.torch) is torch.optim.AdamW or bool(self._group(group).get("decoupled_weight_decay"))

    def structure(self) -> tuple:
        """The groups' members and the choices the code bakes in."""
        members: dict[int, list[str]] = {}
        for n, i in self._groups.items():
            members.setdefault(i, []).append(n)
        shape = []
        for i, g in enumerate(self.torch.param_groups):
            flags = (self._decoupled(i),) if self.kind == "adam" else (bool(g["nesterov"]), g["momentum"] != 0)
            shape.append((tuple(members.get(i, ())), flags))
        return ("torch", type(self.torch).__name__, self.max_grad_norm, tuple(shape))

    def emit_update(self, b, param, grad, state, hyper, found_inf=None, group=0):
        if self.kind == "adam":
            emit_adam(b, param, grad, state, hyper, found_inf, self._decoupled(group), out_of_place=False)
        else:
            emit_sgd(b, param, grad, state, hyper, found_inf, bool(self._group(group)["nesterov"]), out_of_place=False)

    def init_state(self, param):
        raise KilnError("a torch.optim optimizer's state is torch's own (optimizer.state); Kiln does not make it")

    # ---- state: the torch optimizer's own tensors -------------------------------------------
    def state_view(self) -> tuple[dict[str, dict[str, torch.Tensor]], list]:
        """Kiln's per-parameter state for this call: `optimizer.state[p]`'s tensors (checked to fit the
        program: shape, dtype, device, layout; once per tensor), fresh ones where torch has none yet. Returns
        it and the pending fresh entries for `install`."""
        view: dict[str, dict[str, torch.Tensor]] = {}
        pending = []
        for name, i in self._groups.items():
            p = self._params[name]
            s = self.torch.state.get(p) or {}
            momentum = self.kind == "sgd" and self._group(i)["momentum"] != 0
            seen = self._view.get(name)          # the very tensors checked at an earlier call: no check again
            if (seen is not None and seen[0] == momentum and len(seen[1]) == len(s)
                    and all(a is b for a, b in zip(seen[1], s.values()))):
                view[name] = seen[2]
                continue
            if self.kind == "adam":
                if not s:
                    fresh = {"step": torch.zeros((), dtype=torch.float32),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                    view[name] = fresh
                    pending.append((p, fresh, fresh["step"]))
                    continue
                extra = sorted(set(s) - set(ADAM_SLOTS))
                if extra:
                    raise KilnError(f"optimizer.state of parameter {name!r} has {extra} (amsgrad state?): Kiln's "
                                    f"Adam keeps {list(ADAM_SLOTS)}")
                view[name] = {"step": self._step_count(name, s), "exp_avg": self._fit(name, p, s, "exp_avg"),
                              "exp_avg_sq": self._fit(name, p, s, "exp_avg_sq")}
            elif momentum:
                if s.get("momentum_buffer") is None:
                    fresh = torch.zeros_like(p, memory_format=torch.preserve_format)
                    counter = torch.zeros((), dtype=torch.float32)
                    view[name] = {"momentum_buffer": fresh, "step": counter}
                    pending.append((p, {"momentum_buffer": fresh}, counter))
                    continue
                # torch's SGD counts no steps: any nonzero count means "the buffer exists" to the update
                view[name] = {"momentum_buffer": self._fit(name, p, s, "momentum_buffer"),
                              "step": torch.ones((), dtype=torch.float32)}
            else:
                view[name] = {}
            self._view[name] = (momentum, tuple(s.values()), view[name])
        return view, pending

    def install(self, pending: list) -> None:
        """After a committed step: the fresh state the update has written becomes torch's `state[p]`."""
        for p, entries, counter in pending:
            if counter.item() > 0:
                self.torch.state[p].update(entries)

    def stepped(self) -> None:
        """After a committed update: what torch's lr schedulers read to tell that `optimizer.step()` ran (their
        wrapper of `step` sets it; Kiln never calls `step`), so `scheduler.step()` does not warn."""
        self.torch._opt_called = True

    @staticmethod
    def _step_count(name: str, s: dict) -> torch.Tensor:
        t = s.get("step")
        if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float32 and t.device.type == "cpu"):
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise KilnError(f"optimizer.state of parameter {name!r}: 'step' must be a 0-dim float32 tensor on the "
                            f"CPU (torch's default, not capturable/fused), got {got}")
        return t

    @staticmethod
    def _fit(name: str, p: torch.Tensor, s: dict, key: str) -> torch.Tensor:
        """`s[key]`, which must have `p`'s shape, dtype and device; a tensor of another memory layout is
        copied into `p`'s (the fused kernels read state as one flat buffer in the parameter's order)."""
        t = s.get(key)
        if not isinstance(t, torch.Tensor) or (t.shape, t.dtype, t.device) != (p.shape, p.dtype, p.device):
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            raise KilnError(f"optimizer.state of parameter {name!r}: {key!r} is {got}, expected {tuple(p.shape)} "
                            f"{p.dtype} on {p.device}")
        if t.stride() != p.stride():
            s[key] = t = torch.empty_like(p).copy_(t)
        return t


# ---- the step's checkpoint with a torch optimizer ---------------------------------------------------
def state_dict(step) -> dict:
    """`{"torch_optimizer": optimizer.state_dict() (tensors copied), "amp": the fp16 loss scale, if any}`."""
    sd = step.optimizer.torch.state_dict()
    out = {"torch_optimizer": {"state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                                         for i, s in sd["state"].items()},
                               "param_groups": copy.deepcopy(sd["param_groups"])}}
    amp = step.state.get("__amp__")
    if amp is not None:
        out["amp"] = {k: t.clone() for k, t in amp.items()}
    return out


def load_state_dict(step, sd) -> None:
    """Load what `state_dict` gave (or, as `{"torch_optimizer": opt_sd}`, an eager run's optimizer state):
    torch's `load_state_dict`, then every tensor checked against the model; on any error the optimizer
    is restored as it was (nothing loaded)."""
    from kiln.runtime.checkpoint import refuse
    if not isinstance(sd, dict) or "torch_optimizer" not in sd or set(sd) - {"torch_optimizer", "amp"}:
        raise refuse("with a torch.optim optimizer the checkpoint is {'torch_optimizer': optimizer.state_dict()} "
                     f"(and 'amp' with fp16), got {sorted(sd) if isinstance(sd, dict) else type(sd).__name__}; or "
                     "call optimizer.load_state_dict(...) directly")
    opt = step.optimizer.torch
    before = opt.__getstate__()
    before = {"defaults": before["defaults"], "state": before["state"], "param_groups": list(before["param_groups"])}
    amp = step.state.get("__amp__")
    try:
        opt.load_state_dict(sd["torch_optimizer"])
        step.optimizer.check()
        step.optimizer.bind(step.model, step.params)
        step.optimizer.state_view()
        if "amp" in sd:
            if amp is None or set(sd["amp"]) != set(amp):
                raise KilnError(f"'amp' holds {sorted(sd['amp'])}, this step keeps {sorted(amp or {})}")
            for k, t in amp.items():
                if not isinstance(sd["amp"][k], torch.Tensor) or sd["amp"][k].shape != t.shape:
                    raise KilnError(f"amp[{k!r}] must be a tensor of shape {tuple(t.shape)}")
    except Exception as e:
        opt.__setstate__(before)
        raise refuse(f"{type(e).__name__}: {e}") from None
    if "amp" in sd:
        with torch.no_grad():
            for k, t in amp.items():
                t.copy_(sd["amp"][k])
