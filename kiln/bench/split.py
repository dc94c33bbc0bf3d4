"""Where a training step's time goes, by category, measured the same way for every mode
(`kiln explain --profile --vs compile`, `benchmarks/step_compare.py --split N`).

A few steps run under `torch.profiler` and each profiler event's *self* time (its time less its children's)
goes to one category, so nothing is counted twice and the categories add up to the traced time:

- matmul: ATen's matrix products (`mm`, `addmm`, `bmm`, `baddbmm`, oneDNN linear and convolution), wherever
  they are called from outside attention: eager, torch.compile's extern kernels, Kiln's kernels (the fused
  loss's three products count here, as the lm_head's do in the other modes); and all of a low-precision
  product that the `upcast` dialect computes on fp32 copies, the copies and the rounding included (they are
  how that kernel multiplies, as oneDNN's reorders are inside a bf16 `aten::mm`; the profile of such a
  kernel, `kiln.kernel:matmul:... (upcast:fp32)`, shows them apart);
- attention: the attention ops (flash, efficient, math sdpa; Kiln's attention kernels) and everything they
  call, products included (ATen's flash kernels do their products inside, where the profiler cannot tell
  them apart, so Kiln's count here too);
- fused: generated and hand-fused kernels: torch.compile's compiled regions (the time of its generated C++,
  which the profiler sees as the region's own), Kiln's Inductor regions and the non-matmul work of Kiln's
  kernels (`kiln::...` ops);
- casts: stand-alone dtype conversions (`aten::_to_copy` outside a fused kernel);
- optimizer: `torch.optim` steps and the fused optimizer kernels (`_fused_adamw_`, `_foreach_*`);
- other: every other ATen op (elementwise and reductions left unfused, copies, embedding, losses);
- untraced: the step's time outside any op: Python, dispatch, and kernels the profiler cannot see.

Kiln's dialect kernels and its step's commit (where the update kernels staged by the optimizer ops run) are
profiler events of their own while a profiler records (`kiln.kernel:<kind>:<op> (<dialect>:<name>)`,
kiln/dialects/registry.py; `kiln.kernel:optimizer:commit`, kiln/transaction.py), so the native loops inside
them count in their op's category, not as untraced time.

Eager, torch.compile and Kiln steps are split by the same rules, so a category's ratio between two modes is
the gap there. (`kiln.explain(step, profile=True)` splits Kiln's step by its own ops instead, timed one by one
on a replay; the two agree on Kiln's matmul and attention time, and differ where a kernel mixes categories.)
"""
from __future__ import annotations

from typing import Callable, Iterable

CATEGORIES = ("matmul", "attention", "fused", "casts", "optimizer", "other", "untraced")
STEP_EVENT = "kiln.bench.step"          # the record_function around each profiled step

_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation", "aten::addbmm",
           "aten::mkldnn_convolution", "aten::_convolution", "aten::convolution_backward", "aten::mkldnn_linear",
           "mkldnn::_linear_pointwise", "aten::_int_mm", "aten::mv", "aten::dot", "aten::addmv",
           # the in-place forms: a product accumulated into its output (the fused loss's fp32 weight gradient
           # over its chunks, `addmm_`, counted as fused work until 2026-12-06)
           "aten::addmm_", "aten::baddbmm_", "aten::addbmm_", "aten::addmv_"}
_ATTENTION = ("attention", "flash", "sdpa")
_OPTIMIZER = ("Optimizer.", "aten::_fused_adam", "aten::_fused_sgd", "aten::_foreach_", "kiln.kernel:optimizer:")
_FUSED = ("kiln::", "kiln.region", "kiln.kernel", "CompiledFunction", "Torch-Compiled Region", "## Call CompiledFxGraph",
          "cpp_fused", "inductor")
_CASTS = {"aten::_to_copy"}
_UPCAST_PRODUCT = "kiln.kernel:matmul:"     # ... (upcast:fp32): a product on fp32 copies (kiln/dialects/upcast.py)


def category(name: str, ancestors: Iterable[str]) -> str:
    """The category of an event's self time, from its name and its enclosing events' names (innermost first).
    The profiled step's own event is no evidence (its name carries the mode's, e.g. `kiln-bf16-noattention`)."""
    chain = [n for n in (name, *ancestors) if not is_step(n)]
    if any(n.startswith(_OPTIMIZER) for n in chain):
        return "optimizer"
    if any(a in n.lower() for n in chain for a in _ATTENTION):
        return "attention"
    if name in _MATMUL or any(n.startswith(_UPCAST_PRODUCT) and "(upcast:" in n for n in chain):
        return "matmul"
    if is_step(name):
        return "untraced"
    if any(n.startswith(_FUSED) or "cpp_fused" in n for n in chain):
        return "fused"
    if any(n in _CASTS for n in chain):
        return "casts"
    return "other"


def is_step(name: str) -> bool:
    """Whether a profiler event is a profiled step: STEP_EVENT, or STEP_EVENT:<mode> (`profile_modes`)."""
    return name == STEP_EVENT or name.startswith(STEP_EVENT + ":")


def split_events(events, skip: int = 0, step_event: str = STEP_EVENT) -> dict[str, float]:
    """Self seconds per category over profiler `events` (torch.autograd.profiler FunctionEvents), counting
    only the events inside a `step_event` (the step, not the profiler's own setup), less the first `skip` steps."""
    steps = sorted((e for e in events if e.name == step_event and e.cpu_parent is None), key=lambda e: e.time_range.start)
    skipped = {id(e) for e in steps[:skip]}
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        names, parent, top = [], e.cpu_parent, e
        while parent is not None:
            names.append(parent.name)
            top, parent = parent, parent.cpu_parent
        if top.name != step_event or id(top) in skipped:
            continue
        out[category(e.name, names)] += e.self_cpu_time_total / 1e6
    return out


def profile_split(step: Callable[[], object], steps: int = 3, warmup: int = 2) -> dict:
    """Run `step` (a zero-argument callable that finishes its work before returning) `warmup` + `steps` times
    under torch.profiler and split the last `steps`; returns {"per_step_s": {category: seconds per step},
    "traced_s": seconds per step the categories add up to, "wall_s": the median step's wall-clock seconds,
    "faults_per_step": minor page faults per step}.

    The warm-up steps are profiled but not counted: the profiler's own allocations, made between the step's,
    leave the heap's free memory in pieces, and the first profiled steps page-fault new memory inside whichever
    op allocates next (measured on the Llama bench model: 3-14 thousand faults a step, 30-90 ms, none in the
    steps timed without the profiler). Faults left after the warm-up are reported, not hidden."""
    return profile_modes({"": step}, rounds=steps, warmup=warmup)[""]


def profile_modes(steps: dict[str, Callable[[], object]], rounds: int = 3, warmup: int = 2) -> dict[str, dict]:
    """`profile_split` for several modes in one profiler session, their steps interleaved: `warmup` + `rounds`
    rounds, each running every mode's step once (the order rotating by one each round), so a machine that drifts
    (clock, a neighbour's load) shifts every mode alike instead of whichever was profiled first. Measured on the
    BERT bench model, profiling Kiln's steps and then torch.compile's had put a 2-4 % difference into the same
    matmuls, against whichever mode went first. Returns mode -> profile_split's dict."""
    import statistics
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    if rounds < 1:
        raise ValueError(f"profiling needs at least one step per mode, got {rounds}")
    names = list(steps)
    walls: dict[str, list[float]] = {m: [] for m in names}
    faults = dict.fromkeys(names, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(warmup + rounds):
            for m in names[i % len(names):] + names[:i % len(names)]:
                before = _faults()
                t = time.perf_counter()
                with record_function(f"{STEP_EVENT}:{m}" if m else STEP_EVENT):
                    steps[m]()
                if i >= warmup:
                    walls[m].append(time.perf_counter() - t)
                    faults[m] += _faults() - before
    events = prof.events()
    out = {}
    for m in names:
        totals = split_events(events, skip=warmup, step_event=f"{STEP_EVENT}:{m}" if m else STEP_EVENT)
        per_step = {k: v / rounds for k, v in totals.items()}
        out[m] = {"per_step_s": per_step, "traced_s": sum(per_step.values()), "wall_s": statistics.median(walls[m]),
                  "steps": rounds, "faults_per_step": faults[m] // rounds}
    return out


def _faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peer_step(model, kind: str, batch: dict, amp: str | None = None, lr: float = 1e-3) -> Callable[[], object]:
    """A zero-argument training step of `model` on `batch` the way people train without Kiln: "eager" or
    "compile", under torch.autocast for `amp` ("bf16"/"fp16"), with torch.optim.AdamW (`kiln bench`'s
    modes); it returns the loss as a float (so the step has finished)."""
    import torch

    from kiln.bench.modes import torch_step

    if kind not in ("eager", "compile"):
        raise ValueError(f"peer must be 'eager' or 'compile', got {kind!r}")
    low = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[amp]
    step = torch_step(model, compiled=kind == "compile", low=low, lr=lr)
    return lambda: float(step(**batch))


def gaps(results: dict[str, dict], base: str, other: str) -> str:
    """One line: per category, how many ms a step `base` spends more (+) or less (-) than `other`."""
    a, b = results[base]["per_step_s"], results[other]["per_step_s"]
    parts = [f"{c} {(a[c] - b[c]) * 1e3:+.1f}" for c in CATEGORIES if abs(a[c] - b[c]) >= 5e-4]
    total = (results[base]["wall_s"] - results[other]["wall_s"]) * 1e3
    return f"{base} against {other}, ms a step: " + ", ".join(parts) + f" (wall {total:+.1f})"


ELSE = ("fused", "casts", "optimizer", "other", "untraced")     # "everything else": not matmul, not attention


def render(results: dict[str, dict]) -> str:
    """A table of milliseconds per step: categories down, modes across (`results`: mode -> profile_split's
    dict, or None for a mode without one)."""
    modes = [m for m, r in results.items() if r]
    if not modes:
        return ""
    head = ["category", *modes]
    rows = [[c] + [f"{results[m]['per_step_s'][c] * 1e3:.1f}" for m in modes] for c in CATEGORIES]
    rows.append(["traced total"] + [f"{results[m]['traced_s'] * 1e3:.1f}" for m in modes])
    rows.append(["wall (profiled)"] + [f"{results[m]['wall_s'] * 1e3:.1f}" for m in modes])
    rows.append(["page faults"] + [str(results[m].get("faults_per_step", "-")) for m in modes])
    rows.append(["everything else"] + [f"{sum(results[m]['per_step_s'][c] for c in ELSE) * 1e3:.1f}" for m in modes])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = ["Where each step's time goes (ms per step, self time of torch.profiler events, kiln/bench/split.py; "
             "everything else: all but matmul and attention):",
             fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    return "\n".join(lines)
