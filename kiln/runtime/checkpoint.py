"""`CompiledStep.state_dict()` / `load_state_dict()`: the optimizer state and hyper-parameters, checked
whole before anything is applied, and applied as one commit. Data-parallel steps: kiln/runtime/parallel.py
(consolidated on rank 0, or sharded per rank)."""
from __future__ import annotations

import copy

import torch

from kiln.errors import KilnError
from kiln.transaction import stage, step_transaction

KEYS = ("optimizer", "hyperparameters", "state")
AMP = "__amp__"            # the fp16 loss scale's entry (kiln.passes.pipeline.AMP_STATE)


def state_dict(step) -> dict:
    """Optimizer name, hyper-parameters and state (per parameter name); tensors are copies."""
    return {"optimizer": type(step.optimizer).__name__, "hyperparameters": step.optimizer.hyperparameters(),
            "state": {n: {k: t.clone() for k, t in s.items()} for n, s in step.state.items()}}


def refuse(what: str) -> KilnError:
    return KilnError(f"load_state_dict: {what}; nothing was loaded")



def checked_optimizer(optimizer, sd: dict):
    """A copy of `optimizer` with the checkpoint's hyper-parameters, validated (the original is untouched)."""
    hyper = sd.get("hyperparameters", {})
    if not isinstance(hyper, dict):
        raise refuse(f"'hyperparameters' must be a dict, got {type(hyper).__name__}")
    known = optimizer.hyperparameters()
    unknown = sorted(set(hyper) - set(known))
    if unknown:
        raise refuse(f"unknown hyper-parameter(s) {unknown} for {type(optimizer).__name__} (known: {sorted(known)})")
    candidate = copy.copy(optimizer)
    for k, v in hyper.items():
        setattr(candidate, k, tuple(v) if isinstance(v, list) else v)
    try:
        candidate.check()
    except KilnError as e:
        raise refuse(f"bad hyper-parameter: {e}") from None
    return candidate


def check_state(current: dict, loaded) -> None:
    """Every parameter and slot present, nothing extra, each a tensor of the same shape, dtype and device."""
    if not isinstance(loaded, dict):
        raise refuse(f"'state' must be a dict of per-parameter dicts, got {type(loaded).__name__}")
    missing, unexpected = sorted(set(current) - set(loaded)), sorted(set(loaded) - set(current))
    if missing or unexpected:
        raise refuse(f"the state does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, slots in current.items():
        got = loaded[name]
        if not isinstance(got, dict):
            raise refuse(f"state[{name!r}] must be a dict of tensors, got {type(got).__name__}")
        if set(got) != set(slots):
            raise refuse(f"state[{name!r}] has slots {sorted(got)}, this optimizer keeps {sorted(slots)}")
        for k, t in slots.items():
            v = got[k]
            if not isinstance(v, torch.Tensor):
                raise refuse(f"state[{name!r}][{k!r}] must be a tensor, got {type(v).__name__}")
            if (v.shape, v.dtype, v.device) != (t.shape, t.dtype, t.device):
                raise refuse(f"state[{name!r}][{k!r}] is {tuple(v.shape)} {v.dtype} on {v.device}, expected "
                              f"{tuple(t.shape)} {t.dtype} on {t.device}")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise refuse(f"state[{name!r}][{k!r}] holds non-finite values")


def check_keys(step, sd) -> None:
    if not isinstance(sd, dict):
        raise refuse(f"expected the dict that step.state_dict() returns, got {type(sd).__name__}")
    extra = sorted(set(sd) - set(KEYS))
    if extra or "state" not in sd:
        raise refuse(f"expected keys {list(KEYS)}, got {sorted(sd)}")
    if sd.get("optimizer") != type(step.optimizer).__name__:
        raise refuse(f"the checkpoint is for optimizer {sd.get('optimizer')!r}, this step uses "
                      f"{type(step.optimizer).__name__}")


def load_state_dict(step, sd) -> None:
    check_keys(step, sd)
    candidate = checked_optimizer(step.optimizer, sd)
    check_state(step.state, sd["state"])
    dst = [t for n, slots in step.state.items() for t in slots.values()]
    src = [sd["state"][n][k] for n, slots in step.state.items() for k in slots]
    with step_transaction() as txn:           # every tensor in one commit
        stage(torch._foreach_copy_, dst, src)
    with torch.no_grad():
        txn.commit()
    step.optimizer.__dict__.update(candidate.__dict__)
