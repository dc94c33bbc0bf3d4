"""Model-coverage sweep under mixed precision: does Kiln's `amp="bf16"` step give gradients as close to the
true ones as eager PyTorch under `torch.autocast(bfloat16)` does? (`amp="fp16"` likewise.)

bf16 has 8 bits of mantissa, so there is no exact answer to compare with; what must never happen is a
gradient that is *wrong* (a missing term, a cast in the wrong place, a dtype mix-up) and trains silently.
`run_entry_amp(entry)` builds the shrunk model like the float32 sweep (`kiln.bench.coverage.build`) and
computes, for every parameter, its first-step gradient three ways:
- the truth: eager in float64 (eager in float32 where the model cannot run in float64);
- eager under `torch.autocast("cpu", torch.bfloat16)`, the reference user's mixed precision;
- Kiln, `kiln.compile(..., amp="bf16")` with `SGD(lr=1)` (the parameter delta is the gradient; the
  float32 master weight's spacing is allowed for, as in the float32 sweep).
A parameter's error is |g - truth| / |truth| (norms over the tensor). Kiln passes where its error is at
most `FACTOR` x autocast's, or under `FLOOR` (bf16 rounding through a few layers reaches a few 1e-2, and
Kiln keeps different ops in low precision than autocast does). Parameters whose true gradient is below
`SMALL` of the largest parameter's are not judged (both sides are rounding noise there), nor those where
autocast's own error is over `IMPRECISE` (a sum that cancels, such as a BatchNorm weight's gradient in a
small model: bf16 cannot resolve it, so no mixed-precision result can be judged by it; the report counts
them); a parameter eager gives no gradient must not move. The loss is judged the same way.

Where Kiln misses, autocast runs `ROUNDINGS` more times with every low-precision result moved by up to one
unit in its last place (`_Reround`: another valid rounding, as another GEMM kernel would give): a model
whose discrete choices (MoE routing over a handful of tokens, top-k) flip under that moves autocast
itself, and Kiln is allowed FACTOR times the largest move (the entry is marked ill-conditioned). A wrong
gradient is off by O(1); the bounds sit well below that and well above bf16 rounding.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.bench.coverage import Result, _loss, _params, _spacing, build, float64_gradient, record_failure

FACTOR, FLOOR, SMALL, LOSS_FLOOR, IMPRECISE, ROUNDINGS = 4.0, 0.1, 1e-3, 2e-2, 0.5, 4


def _low(amp: str | None) -> torch.dtype:
    return torch.float16 if amp == "fp16" else torch.bfloat16


class _Reround(TorchDispatchMode):
    """Every new low-precision tensor an op makes (not views, not in-place writes) moved by up to one unit in
    its last place at random: the same computation under another valid rounding (another GEMM kernel, another
    summation order)."""

    def __init__(self, dtype: torch.dtype, seed: int):
        super().__init__()
        self.dtype, self.gen = dtype, torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if (isinstance(out, torch.Tensor) and out.dtype == self.dtype and not schema.is_mutable
                and not any(r.alias_info is not None for r in schema.returns)):
            noise = torch.rand(out.shape, generator=self.gen).sub_(0.5).mul_(torch.finfo(self.dtype).eps)
            out = out.float().mul_(noise.add_(1)).to(self.dtype)
        return out


def _eager_grads(model0, batch, loss_fn, autocast: str | None, reround: int = 0):
    """(loss, gradients in float64) of eager, under autocast(`autocast`) or in float32; with `reround` (a
    seed), under `_Reround` (autocast's results under another valid rounding)."""
    model = copy.deepcopy(model0)
    dtype = _low(autocast)
    torch.manual_seed(1000)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast is not None), \
            (_Reround(dtype, reround) if reround else contextlib.nullcontext()):
        loss = _loss(model, batch, loss_fn)
    loss.float().backward()
    return loss.item(), {n: None if p.grad is None else p.grad.detach().double() for n, p in model.named_parameters()}


def _kiln_grads(model0, batch, loss_fn, dialects, amp: str):
    import kiln
    model = copy.deepcopy(model0)
    step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=1.0), loss_fn=loss_fn, dialects=dialects,
                        tuning="ahead", amp=amp)
    torch.manual_seed(1000)
    loss = step(**batch).item()
    p0, p1 = _params(model0), _params(model)
    deltas = {n: (p0[n].double() - p1[n].double(), _spacing(torch.maximum(p0[n].abs(), p1[n].abs())).double())
              for n in p0}
    fallbacks = sorted({str(n.args[0]) for n in step.graph.nodes if n.op.name == "kiln.fallback_forward"})
    return loss, deltas, fallbacks


def judge(truth: dict, loss_truth: float, ref: tuple, kiln_side: tuple,
          spreads: list[tuple] = ()) -> tuple[float, float, str, list[str]]:
    """(Kiln's worst relative gradient error, its worst error over the allowed one, why it fails or '', the
    parameters not judged because autocast's own error on them is over IMPRECISE). With `spread` (autocast's
    loss and gradients under other roundings), the most autocast itself moves by there is allowed too, FACTOR
    times."""
    loss_ref, g_ref = ref
    loss_k, deltas = kiln_side
    norms = {n: t.norm().item() for n, t in truth.items() if t is not None}
    top = max(norms.values(), default=0.0) or 1.0
    worst_err, worst_ratio, why, unjudged = 0.0, 0.0, "", []
    for n, t in truth.items():
        d, spacing = deltas[n]
        if t is None:
            if d.abs().max().item() > 0 if d.numel() else False:
                return float("inf"), float("inf"), f"{n}: eager gives no gradient but Kiln changed it", []
            continue
        if norms[n] < SMALL * top or g_ref.get(n) is None:
            continue
        err_k = ((d - t).abs() - spacing).clamp_min(0).norm().item() / norms[n]
        err_ref = (g_ref[n] - t).norm().item() / norms[n]
        if err_ref > IMPRECISE:
            unjudged.append(n)
            continue
        moved = max([(g_sp[n] - g_ref[n]).norm().item() / norms[n] for _, g_sp in spreads
                     if g_sp.get(n) is not None], default=0.0)
        allowed = max(FACTOR * err_ref, FACTOR * moved, FLOOR)
        ratio = err_k / allowed if err_k == err_k else float("inf")
        worst_err, worst_ratio = max(worst_err, err_k), max(worst_ratio, ratio)
        if ratio > 1 and not why:
            why = (f"gradient of {n}: relative error {err_k:.2e} (autocast's {err_ref:.2e}; allowed "
                   f"{allowed:.2e})")
    scale = max(abs(loss_truth), 1e-12)
    loss_err, loss_ref_err = abs(loss_k - loss_truth) / scale, abs(loss_ref - loss_truth) / scale
    loss_moved = max([abs(loss_sp - loss_ref) / scale for loss_sp, _ in spreads], default=0.0)
    if not loss_err <= max(FACTOR * loss_ref_err, FACTOR * loss_moved, LOSS_FLOOR) and not why:
        why = f"loss {loss_k!r}: relative error {loss_err:.2e} (autocast's {loss_ref_err:.2e})"
    return worst_err, worst_ratio, why, unjudged


def run_entry_amp(entry, dialects: list[str] | None = None, amp: str = "bf16") -> Result:
    """Build, take the three gradients, judge. Never raises (other than KeyboardInterrupt)."""
    r = Result(entry.model_type, entry.class_name, entry.head)
    t0 = time.perf_counter()
    try:
        try:
            model0, batch, r.batch, loss_fn = build(entry)
            loss32, g32 = _eager_grads(model0, batch, loss_fn, autocast=None)
            ref = _eager_grads(model0, batch, loss_fn, autocast=amp)
        except Exception as e:          # noqa: BLE001
            return record_failure(r, e)
        r.loss = "model" if loss_fn is None else "logits-l2"
        truth = float64_gradient(model0, batch, loss_fn)
        loss_truth = loss32
        if truth is None:
            truth = g32
        else:
            r.float64_referee = True
            truth = {n: None if g is None else g.double() for n, g in truth.items()}
            # eager float32 must agree with float64 (else the model is ill-conditioned: judge against float32)
            if any(g32[n] is not None and t is not None and not (g32[n] - t).norm() <= 1e-3 * t.norm() + 1e-30
                   for n, t in truth.items()):
                truth, r.float64_referee = g32, False
        try:
            loss_k, deltas, r.fallbacks = _kiln_grads(model0, batch, loss_fn, dialects, amp)
        except Exception as e:          # noqa: BLE001
            return record_failure(r, e, model0)
        r.grad_rel_err, r.param_err, r.why, r.unjudged = judge(truth, loss_truth, ref, (loss_k, deltas))
        if r.why and "no gradient" not in r.why:
            # discrete choices on computed values (MoE routing, top-k indexers) flip under another rounding:
            # Kiln is judged against what other valid roundings do to autocast itself
            spreads = [_eager_grads(model0, batch, loss_fn, autocast=amp, reround=seed) for seed in range(1, ROUNDINGS + 1)]
            err, ratio, why, unjudged = judge(truth, loss_truth, ref, (loss_k, deltas), spreads)
            if not why:
                r.ill_conditioned = True
                r.grad_rel_err, r.param_err, r.why, r.unjudged = err, ratio, "", unjudged
        r.loss_diffs = [abs(loss_k - loss_truth) / max(abs(loss_truth), 1e-12)]
        r.outcome = "close" if not r.why else "wrong"
        return r
    finally:
        r.seconds = round(time.perf_counter() - t0, 2)


def method(amp: str) -> str:
    """The report's description of the check (render_markdown's `method`)."""
    return (f"Each architecture is built from its shrunk default config with random weights; its first-step gradients "
            f"are taken three ways: eager in float64 (the truth; float32 where the model cannot run in float64), eager "
            f"under torch.autocast({amp}), and Kiln with amp='{amp}' (one SGD(lr=1) step). A parameter's error is "
            f"|g - truth| / |truth|; Kiln is *close* where every parameter's error is at most {FACTOR:g}x autocast's "
            f"or under {FLOOR:g} (parameters with a true gradient under {SMALL:g} of the largest, or on which "
            f"autocast's own error is over {IMPRECISE:g}, not judged: the note counts the latter), and its "
            f"loss likewise (floor {LOSS_FLOOR:g}). 'grad err' is Kiln's worst error, 'param err/tol' that error over "
            f"the allowed one. See `kiln/bench/coverage_amp.py`.")
