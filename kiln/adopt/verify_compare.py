"""The comparison half of `kiln adopt --verify`: the rewritten model's outputs and gradients against
the original's, tensor by tensor, within fp32 rounding.

A tensor passes when `max|rewritten - original| <= ATOL + RTOL * max|original|`.  That bound is
relative to the tensor's own size, which fails a gradient that is exactly zero in exact arithmetic
(a bias before a batch norm, as in mobilevit): all of it is float32 rounding, as large in the
original as in the rewrite.  So where a tensor fails, the original is run once more in float64 (same
weights, same inputs) and its own float32 error, `max|original - float64|`, is the noise floor: the
tensor passes when the difference is within the usual tolerance plus twice that (both runs may err
by as much, in opposite directions).  A rewrite that is wrong by more than the original's own
rounding still fails.
"""
from __future__ import annotations

import copy
import math

ATOL = 1e-4
RTOL = 1e-4


def tolerance(reference) -> float:
    return ATOL + RTOL * float(reference.abs().max()) if reference.numel() else ATOL


def diff(reference, other) -> float:
    if reference.shape != other.shape:
        return math.inf
    d = (other.double() - reference.double()).abs()
    return float(d.max()) if d.numel() else 0.0


def compare(ref: tuple, new: tuple, ref64: tuple | None = None) -> dict:
    """Max abs differences of the outputs and grads (each `(main output, loss, {name: grad})`), and the
    tensors that exceed their tolerance; with `ref64` (the original in float64) each tolerance also
    admits twice the original's own float32 error."""
    out_ref, loss_ref, grads_ref = ref
    out_new, loss_new, grads_new = new
    out64, loss64, grads64 = ref64 if ref64 is not None else (None, None, {})
    failures, floor_used = [], []
    output_diff = grad_diff = 0.0

    def check(what: str, a, b, a64) -> float:
        d = diff(a, b)
        allowed = tolerance(a)
        if a64 is not None and not d <= allowed:
            noise = diff(a64, a)
            if d <= allowed + 2 * noise:
                floor_used.append(what)
            allowed += 2 * noise
        if not d <= allowed:
            failures.append(f"{what}: max diff {d:.3g} > tolerance {allowed:.3g}")
        return d

    for what, a, b, a64 in (("output", out_ref, out_new, out64), ("loss", loss_ref, loss_new, loss64)):
        output_diff = max(output_diff, check(what, a, b, a64))
    for name, a in grads_ref.items():
        b = grads_new.get(name)
        if a is None or b is None:
            if (a is None) != (b is None):
                failures.append(f"grad of {name}: {'missing' if b is None else 'unexpected'} in the rewritten model")
            continue
        grad_diff = max(grad_diff, check(f"grad of {name}", a, b, grads64.get(name)))
    return {"max_output_diff": output_diff, "max_grad_diff": grad_diff, "failures": failures,
            "grads_compared": sum(g is not None for g in grads_ref.values()),
            "within_float32_noise": floor_used}


def in_float64(model, inputs: dict, run_once) -> tuple:
    """`run_once` on a float64 copy of `model` with the float inputs cast to float64."""
    import torch

    model64 = copy.deepcopy(model).double()
    inputs64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in inputs.items()}
    return run_once(model64, inputs64)
