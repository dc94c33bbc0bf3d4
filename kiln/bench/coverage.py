"""Model-coverage sweep, part 2: train one architecture with Kiln and with eager PyTorch, and judge.

`run_entry(entry)` builds the shrunk model (`kiln.bench.coverage_configs`), finds a batch eager trains on,
then compares:
- gradients: one Kiln step with `SGD(lr=1)` (the parameter delta is the gradient) against eager's
  backward: |g_kiln - g_eager| <= 1e-5 x the largest eager gradient, after allowing one float spacing of
  the parameter (the delta cannot resolve less); a parameter eager gives no gradient must not move;
- training: 3 steps of `kiln.optim.AdamW` against `torch.optim.AdamW` (same hyper-parameters): losses to
  rtol 1e-4; parameters to lr x steps x max(1e-3, 1e-5 x max|g| / |g_elem|) (the gradient tolerance
  carried through Adam's normalization), except elements whose eager gradient is below 1e-4 of the largest
  at some step (rounding noise that Adam scales up to lr); buffers (BatchNorm statistics) to rtol 1e-4
  after the first step, 1e-2 after the third (they see parameters whose noise elements Adam moved).
Where Kiln's gradient misses eager's, eager's own float32 gradient may be the imprecise one (a sum with
heavy cancellation): the entry's gradient is then computed by eager in float64, and a parameter passes
if Kiln's distance to that float64 gradient exceeds eager float32's own distance to it by at most the
tolerance (`float64_referee`: Kiln is no further from the true gradient than eager is).
Eager runs twice; if the two runs differ, the entry is `nondeterministic` and the tolerances grow to 10x
the eager-vs-eager difference. If the AdamW comparison fails, eager trains once more from parameters
changed by a relative 1e-7: where that moves eager beyond the tolerances too, the model is
`ill_conditioned` and Kiln is judged against 10x that spread (the gradient check stays strict).

Outcomes: exact; refused (a KilnError before the step runs); wrong (numbers beyond the tolerances, or a
non-finite loss where eager's is finite); error (a compiled step that failed while running, or any other
exception from Kiln: a bug); unbuildable (eager itself cannot build, run or train it); timeout (set by the
caller running each entry in its own process). `render_markdown(results)` writes the report.
"""
from __future__ import annotations

import collections
import copy
import re
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from kiln.bench.coverage_configs import Entry, candidate_batches, shrunk_config

LR_ADAMW, STEPS, GRAD_RTOL, LOSS_RTOL, PARAM_TOL, NOISE = 1e-3, 3, 1e-5, 1e-4, 1e-3, 1e-4
BUFFER_RTOL, BUFFER_RTOL_ADAMW = 1e-4, 1e-2
ADAMW = dict(lr=LR_ADAMW, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
OUTCOMES = ("exact", "close", "refused", "wrong", "error", "timeout", "unbuildable")   # close: the amp sweep


@dataclass
class Result:
    model_type: str
    class_name: str
    head: str
    outcome: str = "error"
    grad_rel_err: float | None = None       # max |g_kiln - g_eager| / max |g_eager|
    loss_diffs: list[float] = field(default_factory=list)   # per AdamW step, |l_kiln - l_eager| / |l_eager|
    param_err: float | None = None          # max |p_kiln - p_eager| / its tolerance over compared elements
    why: str = ""                           # first failing check (wrong), or the error's first line
    exception: str = ""
    traceback: str = ""
    batch: str = ""                         # which candidate batch eager trained on
    loss: str = "model"                     # "model" (.loss) or "logits-l2" (the head returned no loss)
    nondeterministic: bool = False          # two eager runs differ: tolerances grow to 10x their difference
    ill_conditioned: bool = False           # eager from 1e-7-perturbed parameters moves beyond the tolerances;
                                            # exact means Kiln is within 10x that spread
    float64_referee: bool = False           # the gradient check was settled against eager in float64
    fallbacks: list[str] = field(default_factory=list)   # ops Kiln differentiated with torch.func.vjp
    names_module: bool | None = None        # refused: does the message name a module path of the model
    unjudged: list[str] = field(default_factory=list)   # amp sweep: parameters bf16 cannot resolve (autocast)
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.model_type}/{self.class_name}"


# ---- eager side ---------------------------------------------------------------------------------
def _first_float(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if hasattr(out, "values") else out
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise ValueError("the model returned no floating-point tensor")


def logits_l2(model, **batch):
    """The loss for a head that returns none: mean square of its first floating output."""
    return _first_float(model(**batch)).float().square().mean()


def _loss(model, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, **batch)
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else (out["loss"] if isinstance(out, dict) else out[0])


def build(entry: Entry):
    """(model in train mode, batch, batch description, loss_fn or None); raises if eager cannot train it."""
    import transformers
    config, specials = shrunk_config(entry.model_type)
    cls = getattr(transformers, entry.class_name)
    model = _construct(cls, config)
    if hasattr(model, "set_default_language") and getattr(model.config, "languages", None):
        model.set_default_language(model.config.languages[0])      # X-MOD: which language adapter to train
    model.train()
    errors = []
    for desc, batch in candidate_batches(model, entry.head, specials):
        trial = copy.deepcopy(model)
        try:
            torch.manual_seed(1000)
            out = trial(**batch)
            loss_fn = None
            loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
            if loss is None:
                loss_fn, loss = logits_l2, logits_l2(trial, **batch)
            if not torch.isfinite(loss):
                raise ValueError(f"eager loss is {loss.item()}")
            loss.backward()
            return model, batch, desc, loss_fn
        except Exception as e:          # noqa: BLE001 - any failure of eager: try the next batch
            errors.append(f"{desc}: {type(e).__name__}: {_first_line(e)}")
    raise Unbuildable("; ".join(errors) or "no batch for this head")


class Unbuildable(Exception):
    pass


def _construct(cls, config):
    """cls(config); a causal-LM class of a composite model type (a VLM's text model) takes its text config."""
    try:
        torch.manual_seed(0)
        return cls(config)
    except Exception as first:          # noqa: BLE001
        try:
            text = config.get_text_config()
            if text is config:
                raise first
            torch.manual_seed(0)
            return cls(text)
        except Exception:               # noqa: BLE001
            raise first from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def eager_train(model0, batch, loss_fn, steps=STEPS, in_place=False):
    """Losses, per-step gradients (None where eager gives none), final parameters and buffers, buffers
    after the first step. Trains a copy of `model0` (or `model0` itself if `in_place`)."""
    model = model0 if in_place else copy.deepcopy(model0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, grads, first_buffers = [], [], None
    for i in range(steps):
        torch.manual_seed(1000 + i)
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch, loss_fn)
        loss.backward()
        grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
        first_buffers = first_buffers if first_buffers is not None else _buffers(model)
    return losses, grads, _params(model), _buffers(model), first_buffers


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _buffers(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _max_abs(a: dict) -> float:
    return max([0.0] + [x.abs().max().item() for x in a.values() if x is not None and x.numel()])


def _max_diff(a: dict, b: dict) -> float:
    return max([0.0] + [(x - b[n]).abs().max().item() for n, x in a.items() if x is not None and b.get(n) is not None
                        and x.numel() and x.is_floating_point()])


# ---- Kiln side -----------------------------------------------------------------------------------
def _kiln_step(model, optimizer, batch, loss_fn, steps, dialects):
    import kiln
    step = kiln.compile(model, optimizer=optimizer, loss_fn=loss_fn, dialects=dialects, tuning="ahead")
    losses = []
    for i in range(steps):
        torch.manual_seed(1000 + i)
        losses.append(step(**batch).item())
    return step, losses


def _spacing(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def check_buffers(want: dict, model_k, rtol: float, when: str) -> str:
    got = _buffers(model_k)
    for n, w in want.items():
        if got[n].shape != w.shape:         # the forward rebinds the buffer (a table grown for a longer input)
            return f"buffer {n} {when} has shape {tuple(got[n].shape)}, eager's {tuple(w.shape)}"
        ok = torch.allclose(got[n].double(), w.double(), rtol=rtol, atol=rtol / 10, equal_nan=True) \
            if w.is_floating_point() else torch.equal(got[n], w)
        if not ok:
            err = (got[n].double() - w.double()).abs().max().item() if w.is_floating_point() else float("nan")
            return f"buffer {n} {when} differs by {err:.1e}"
    return ""


def check_grads(model0, model_k, grads: dict, loosen: float, truth: dict | None = None) -> tuple[float, str]:
    """Relative gradient error of a Kiln SGD(lr=1) step and the first failing parameter ('' if none).
    With `truth` (eager's gradients in float64), the error of a parameter is how much further Kiln is from
    the float64 gradient than eager's float32 gradient is."""
    p0, p1 = _params(model0), _params(model_k)
    gmax = _max_abs(grads) or 1.0
    worst, why = 0.0, ""
    for n, g in grads.items():
        if g is None:
            if not torch.equal(p0[n], p1[n]):
                return float("inf"), f"{n}: eager gives no gradient but Kiln changed it"
            continue
        d_kiln = p0[n] - p1[n]
        d_eager = p0[n] - p0[n].clone().add_(g, alpha=-1.0)
        spacing = _spacing(torch.maximum(p0[n].abs(), p1[n].abs()))
        if truth is not None and truth.get(n) is not None:
            t = truth[n]
            err = ((d_kiln.double() - t).abs() - (g.double() - t).abs() - spacing.double()).clamp_min(0)
        else:
            err = ((d_kiln - d_eager).abs() - spacing).clamp_min(0)
        rel = err.max().item() / gmax if err.numel() else 0.0
        if not rel <= GRAD_RTOL * loosen and not why:
            why = f"gradient of {n}: relative error {rel:.2e} > {GRAD_RTOL * loosen:.0e}"
        worst = max(worst, rel) if rel == rel else float("inf")
    return worst, why


def check_training(p_eager, b_eager, model_k, grads: list[dict], loosen: float) -> tuple[float, str]:
    p_kiln = _params(model_k)
    worst, why = 0.0, ""
    gmax_all = [_max_abs(step) for step in grads]
    for n, want in p_eager.items():
        gs = [g[n] for g in grads]
        if all(g is None for g in gs):
            if not torch.equal(want, p_kiln[n]):
                return float("inf"), f"{n}: eager gives no gradient (AdamW leaves it), Kiln changed it"
            continue
        if any(g is None for g in gs):
            continue
        # an element's gradient error (up to GRAD_RTOL x the largest) moves its Adam step by about that error
        # over the element's own gradient: the tolerance is that much of lr x steps, and at least PARAM_TOL
        rel = torch.stack([g.abs() / top if top else torch.zeros_like(g) for g, top in zip(gs, gmax_all)]).amin(0)
        keep = rel >= NOISE
        if not keep.any():
            continue
        tol = LR_ADAMW * STEPS * loosen * torch.clamp(GRAD_RTOL / rel[keep], min=PARAM_TOL)
        ratio = ((p_kiln[n] - want).abs()[keep] / tol).max().item()
        if not ratio <= 1.0 and not why:
            why = f"parameter {n} after {STEPS} AdamW steps: error {ratio:.2f} x its tolerance"
        worst = max(worst, ratio) if ratio == ratio else float("inf")
    # running statistics of later steps see parameters whose noise elements Adam moved by up to lr
    why = why or check_buffers(b_eager, model_k, BUFFER_RTOL_ADAMW * loosen, f"after {STEPS} AdamW steps")
    return worst, why


def float64_gradient(model0, batch, loss_fn) -> dict | None:
    """Eager's first-step gradients with the model and the batch's floats in float64 (None if the model
    cannot run in float64)."""
    model = copy.deepcopy(model0).double()
    batch = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}
    try:
        torch.manual_seed(1000)
        loss = _loss(model, batch, loss_fn)
        loss.backward()
    except Exception:                   # noqa: BLE001 - a model that only runs in float32: no referee
        return None
    return {n: None if p.grad is None else p.grad.detach() for n, p in model.named_parameters()}


def _names_module(message: str, model) -> bool:
    """Does `message` name one of the model's module paths (with or without the top-level prefix)?"""
    names = [n for n, _ in model.named_modules() if "." in n]
    return any(n in message or "." + n.split(".", 1)[1] in message for n in names)


def run_entry(entry: Entry, dialects: list[str] | None = None) -> Result:
    """Build, train both ways, judge. Never raises (other than KeyboardInterrupt)."""
    import kiln
    r = Result(entry.model_type, entry.class_name, entry.head)
    t0 = time.perf_counter()
    try:
        try:
            model0, batch, r.batch, loss_fn = build(entry)
            e1 = eager_train(model0, batch, loss_fn)
            e2 = eager_train(model0, batch, loss_fn)
        except Exception as e:          # noqa: BLE001
            return record_failure(r, e)
        r.loss = "model" if loss_fn is None else "logits-l2"
        (losses, grads, p_eager, b_eager, b_first), (losses2, grads2, _, _, _) = e1, e2
        drift = max([abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses, losses2)] +
                    [_max_diff(g, h) / max(_max_abs(g), 1e-30) for g, h in zip(grads, grads2)])
        r.nondeterministic = drift > 0
        loosen = max(1.0, 10 * drift / GRAD_RTOL) if r.nondeterministic else 1.0
        try:
            model_s = copy.deepcopy(model0)
            step, _ = _kiln_step(model_s, kiln.optim.SGD(lr=1.0), batch, loss_fn, 1, dialects)
            r.fallbacks = sorted({str(n.args[0]) for n in step.graph.nodes if n.op.name == "kiln.fallback_forward"})
            r.grad_rel_err, why_g = check_grads(model0, model_s, grads[0], loosen)
            if why_g and not why_g.endswith("Kiln changed it"):
                truth = float64_gradient(model0, batch, loss_fn)
                if truth is not None:
                    err64, why64 = check_grads(model0, model_s, grads[0], loosen, truth)
                    if not why64:
                        r.float64_referee, r.grad_rel_err, why_g = True, err64, ""
            why_g = why_g or check_buffers(b_first, model_s, BUFFER_RTOL * loosen, "after one step")
            model_a = copy.deepcopy(model0)
            _, k_losses = _kiln_step(model_a, kiln.optim.AdamW(**ADAMW), batch, loss_fn, STEPS, dialects)
        except Exception as e:          # noqa: BLE001
            return record_failure(r, e, model0)
        r.loss_diffs = _rel_diffs(k_losses, losses)

        def judge(loosen):
            why_l = next((f"loss of AdamW step {i + 1}: {k_losses[i]!r} vs eager {losses[i]!r}" for i, d in
                          enumerate(r.loss_diffs) if not d <= LOSS_RTOL * loosen), "")
            r.param_err, why_p = check_training(p_eager, b_eager, model_a, grads, loosen)
            return why_l or why_p
        r.why = why_g or judge(loosen)
        strict_err = r.param_err
        if r.why and not why_g:
            # some models are chaotic (BatchNorm over two 1x1 maps, ...): eager itself, started from
            # parameters changed by 1e-7, ends elsewhere. Kiln is judged against that spread.
            spread = eager_spread(model0, batch, loss_fn, losses, p_eager, b_eager, grads)
            if spread > loosen and not judge(10 * spread):
                r.ill_conditioned, r.why = True, f"eager moves by {spread:.0f}x the tolerance under 1e-7 changes"
            r.param_err = strict_err
        r.outcome = "exact" if not r.why or r.ill_conditioned else "wrong"
        return r
    finally:
        r.seconds = round(time.perf_counter() - t0, 2)


def record_failure(r: Result, e: Exception, model0=None) -> Result:
    """An exception as the entry's outcome, from the `except` block: without `model0` (eager could not build,
    run or train it) unbuildable; else out of Kiln: wrong (a non-finite loss where eager's on the same batch is
    finite), error (a compiled step that failed while running, or any exception that is not a KilnError: a
    bug) or refused (a KilnError before the step ran; does it name a module?)."""
    import kiln
    from kiln.guards import NonFiniteError
    refused = isinstance(e, kiln.KilnError) and not isinstance(e, kiln.StepError)
    outcome = ("unbuildable" if model0 is None else "wrong" if isinstance(e, NonFiniteError)
               else "refused" if refused else "error")
    r.outcome, r.why, r.exception = outcome, _first_line(e), type(e).__name__
    if outcome == "refused":
        r.names_module = _names_module(str(e), model0)
    if not isinstance(e, Unbuildable):
        r.traceback = _tail(traceback.format_exc())
    return r


def _rel_diffs(got: list[float], want: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)]


def eager_spread(model0, batch, loss_fn, losses, p_eager, b_eager, grads) -> float:
    """How far (in units of the tolerances) eager itself lands from `losses`/`p_eager` when every
    parameter starts changed by a relative 1e-7 (float32 rounding is 6e-8)."""
    model = copy.deepcopy(model0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    pert_losses = eager_train(model, batch, loss_fn, in_place=True)[0]
    loss_spread = max(_rel_diffs(pert_losses, losses), default=0.0) / LOSS_RTOL
    param_spread, _ = check_training(p_eager, b_eager, model, grads, 1.0)
    return max(loss_spread, param_spread)


def _tail(tb: str, lines: int = 25) -> str:
    return "\n".join(tb.rstrip().splitlines()[-lines:])


def result_dict(r: Result) -> dict[str, Any]:
    d = asdict(r)
    d["class"] = d.pop("class_name")
    return d


def result_from_dict(d: dict[str, Any]) -> Result:
    d = dict(d)
    d["class_name"] = d.pop("class")
    return Result(**{k: v for k, v in d.items() if k in Result.__dataclass_fields__})


# ---- report ------------------------------------------------------------------------------------
def cause_key(r: Result) -> str:
    """The first line without its specifics (quoted code, numbers, sizes): entries failing for one cause
    group together; a wrong entry groups by the check that failed."""
    if r.outcome == "wrong":
        return r.why.split(" ")[0] + (" (eager gives none)" if "no gradient" in r.why else "")
    text = re.sub(r"in module `[^`]*`( \([^)]*\))?", "in module M", r.why)     # where: not the cause
    text = re.sub(r"in \w+\.forward\b", "in X.forward", text)
    text = re.sub(r"at \S+\.py:\d+", "at F", text)
    text = re.sub(r"at line \d+ of the generated step: `[^`]*`", "at line N of the generated step", text)
    text = re.sub(r"'[^']*'", "'.'", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return f"{r.exception}: {text[:200]}"


def _fmt(x: float | None) -> str:
    return "" if x is None else ("inf" if x == float("inf") else f"{x:.1e}")


def _cell(text: str, n: int = 110) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


FP32_METHOD = ("Each architecture is built from its shrunk default config with random weights and trained with Kiln and "
               "with eager PyTorch: gradients by one SGD(lr=1) step (|g_kiln - g_eager| <= 1e-5 x max |g_eager|), then "
               "3 AdamW steps (loss rtol 1e-4; parameters within lr x steps x max(1e-3, 1e-5 max|g| / |g_elem|), "
               "elements with eager gradient below 1e-4 of the largest not compared; param err is the worst error over "
               "its tolerance). See `kiln/bench/coverage.py`.")


def render_markdown(results: list[Result], command: str = "python benchmarks/coverage.py",
                    notes: str = "", title: str = "Model coverage", method: str = FP32_METHOD) -> str:
    import transformers
    counts = collections.Counter(r.outcome for r in results)
    buildable = len(results) - counts["unbuildable"]
    good, word = (counts["close"], "as close as autocast") if counts["close"] else (counts["exact"], "exact")
    pct = 100.0 * good / buildable if buildable else 0.0
    out = [f"# {title}", "",
           f"Generated by `{command}` (torch {torch.__version__}, transformers {transformers.__version__}); do not "
           f"edit by hand. {method}", ""]
    if notes:
        out += [notes, ""]
    out += ["| outcome | count |", "|---|---|"] + [f"| {o} | {counts[o]} |" for o in OUTCOMES if counts[o]]
    out += [f"| **total** | {len(results)} |", "",
            f"**{good} of {buildable} buildable architectures {word} ({pct:.1f} %).**", ""]
    groups: dict[tuple[str, str], list[Result]] = collections.defaultdict(list)
    for r in results:
        if r.outcome not in ("exact", "close"):
            groups[(r.outcome, cause_key(r))].append(r)
    for outcome in ("error", "wrong", "refused", "timeout", "unbuildable"):
        items = sorted(((k[1], v) for k, v in groups.items() if k[0] == outcome), key=lambda kv: -len(kv[1]))
        if not items:
            continue
        out += [f"## {outcome} ({counts[outcome]}), grouped by first line", ""]
        for cause, rs in items:
            example = f"{rs[0].exception}: {rs[0].why}" if rs[0].exception else rs[0].why
            out.append(f"- **{len(rs)}** {', '.join(sorted({r.model_type for r in rs}))}  ")
            out.append(f"  e.g. `{_cell(example, 400).replace('`', chr(39))}`")
        out.append("")
    out += ["## All entries", "", "| model_type | class | head | outcome | grad err | max loss diff | param err/tol | "
            "s | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.model_type, r.class_name)):
        note = r.why
        if r.nondeterministic:
            note = "nondeterministic eager; " + note
        if r.ill_conditioned:
            note = "ill-conditioned: " + note
        if r.float64_referee:
            note = "gradient judged against float64 eager; " + note
        if r.fallbacks:
            note = f"vjp fallback in {', '.join(r.fallbacks)}; " + note
        if r.unjudged:
            note = f"{len(r.unjudged)} parameters not judged (autocast's error over 0.5); " + note
        loss = max(r.loss_diffs) if r.loss_diffs else None
        out.append(f"| {r.model_type} | {r.class_name} | {r.head} | {r.outcome} | {_fmt(r.grad_rel_err)} | "
                   f"{_fmt(loss)} | {_fmt(r.param_err)} | {r.seconds:.0f} | {_cell(note)} |")
    return "\n".join(out) + "\n"


def run_in_process(keys: list[str], dialects: list[str] | None = None,
                   on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """run_entry for each `model_type/Class` key, in this process (tests)."""
    from kiln.bench.coverage_configs import entries
    table = {e.key: e for e in entries()}
    out = []
    for k in keys:
        r = run_entry(table[k], dialects)
        out.append(r)
        if on_result:
            on_result(r)
    return out
