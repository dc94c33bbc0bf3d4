"""`kiln.explain(step)`: a table of every op in the compiled step, its dialect and its output.

With `profile=True` each op also gets its measured time (`CompiledStep.profile`: the latest batch
replayed on copies of the parameters and optimizer state, median of 3 runs after a warm-up) and a
summary splits the step's time between matmul, attention, fused regions, casts, the optimizer and
the rest."""
from __future__ import annotations

import collections
import itertools
import sys

import torch

from kiln.errors import KilnError
from kiln.kernels import native
from kiln.ir.graph import Phase, Role
from kiln.ops.functions import Call
from kiln.ops.registry import Kind, lookup
from kiln.passes.memory import aliases
from kiln.runtime import heap


def compute_dtype(n) -> str:
    """The dtype an op computes in: its floating inputs' (the widest), else its output's."""
    floats = [v.meta.dtype for v in n.inputs if v.is_float]
    if n.target is torch.ops.aten._to_copy.default or not floats:
        floats = [o.meta.dtype for o in n.outputs if o.meta is not None] or floats
    if not floats:
        return "-"
    widest = max(floats, key=lambda d: d.itemsize)
    return str(widest).replace("torch.", "")


def _short(ops: tuple[str, ...]) -> str:
    """aten.mul.Tensor -> mul; runs of one op are counted: [adamw_update x21]."""
    names = [o.split(".")[1] if "." in o else o for o in ops]
    runs = [(k, len(list(g))) for k, g in itertools.groupby(names)]
    return "[" + " ".join(k if c == 1 else f"{k} x{c}" for k, c in runs) + "]"


# op-name fragments of matrix products and attention (ATen, kiln kernels and their upcast forms)
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution", "linear_gelu", "swiglu_linear",
           "linear_cross_entropy")
_ATTENTION = ("attention", "flash", "sdpa", "efficient")


def category(n) -> str:
    """Which part of the time split an op belongs to."""
    if n.phase.value == "optimizer":
        return "optimizer"
    if n.target is torch.ops.aten._to_copy.default:
        return "casts"
    name = n.op.name.lower()
    if any(a in name for a in _ATTENTION):
        return "attention"
    base = name.split(".")[1] if name.startswith(("aten.", "kiln.")) and name.count(".") else name
    if any(base == m or base.startswith(m + "_") or base.startswith("upcast_" + m) for m in _MATMUL) \
            or base.endswith(("_mm", "_addmm", "_linear")):
        return "matmul"
    if n.fused is not None:
        return "fused"
    return "other"


def fallback_of(n) -> str:
    """What a fallback node runs under autograd: the op's name, or the user's autograd.Function."""
    forward = n if n.op.name == "kiln.fallback_forward" else n.args[0].producer
    target = forward.args[0]
    if isinstance(target, Call):
        return f"autograd.Function {target.name}"
    return lookup(target).name if isinstance(target, torch._ops.OpOverload) else str(target)


def explain(step, file=None, profile: bool = False) -> str:
    if not hasattr(step, "_program"):
        raise KilnError("kiln.explain expects the object returned by kiln.compile")
    prog = step._program()
    g = prog.graph
    seconds = step.profile() if profile else None
    rows = []
    for i, n in enumerate(g.nodes):
        out = ", ".join(str(o.meta) for o in n.outputs if o.meta is not None) or "-"
        dialect = n.impl.label if n.impl is not None else "-"
        if n.op.name.startswith("kiln.fallback"):
            dialect += f" (autograd: {fallback_of(n)})"
        op = n.op.name if n.fused is None else f"{n.op.name} <- {_short(n.fused.ops)}"
        ms = () if seconds is None else (f"{seconds[i] * 1000:.2f}",)
        rows.append((str(i), n.phase.value, op, dialect, compute_dtype(n)) + ms + (out, n.scope))
    head = ("#", "phase", "op", "dialect", "compute") + (() if seconds is None else ("ms",)) + ("output", "module")
    widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
    widths[-1] = 0
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    lines = [fmt(head), fmt(tuple("-" * max(w, 1) for w in widths[:-1]) + ("------",))]
    lines += [fmt(r) for r in rows]
    by_phase = collections.Counter(n.phase.value for n in g.nodes)
    by_dialect = collections.Counter((n.impl.label if n.impl else "-") for n in g.nodes)
    pairs = [n for n in g.nodes if n.op.name == "kiln.fallback_forward"]
    fallbacks = [f"{fallback_of(n)} ({n.scope or '<top>'})" for n in pairs if not isinstance(n.args[0], Call)]
    honoured = [f"{fallback_of(n)} ({n.scope or '<top>'})" for n in pairs if isinstance(n.args[0], Call)]
    lines.append("")
    lines.append(f"{len(g.nodes)} ops: " + ", ".join(f"{k} {v}" for k, v in by_phase.items()) +
                 " | dialects: " + ", ".join(f"{k} {v}" for k, v in sorted(by_dialect.items())))
    casts = [n for n in g.nodes if n.target is torch.ops.aten._to_copy.default]
    kinds = collections.Counter(cast_kinds(g).values())
    lines.append(f"casts: {len(casts)} (forward {sum(n.phase.value == 'forward' for n in casts)}, "
                 f"backward {sum(n.phase.value == 'backward' for n in casts)})" +
                 (f": {kinds['parameters']} of parameters and buffers (once per step), {kinds['gradients']} of "
                  f"their gradients, {kinds['activations']} of activations" if casts else "") +
                 (f"; amp {step.amp.dtype}".replace("torch.", "") if getattr(step, "amp", None) else ""))
    records = {id(n.fused): n.fused for n in g.nodes if n.fused is not None}   # one per fused subgraph
    if records:
        fused = collections.Counter(r.fusion for r in records.values())
        lines.append("fused: " + ", ".join(f"{k} x{v}" for k, v in sorted(fused.items())) +
                     f" ({sum(len(r.ops) for r in records.values())} ops replaced)")
    kernels = {f"kiln.{name}" for name in native.OPS}
    if any(n.op.name in kernels for n in g.nodes) and any(v.meta is not None and v.meta.device.type == "cpu"
                                                          for v in g.inputs):
        lines.append("native loops: " + native.describe())
    if prog.regions:
        from kiln.passes.regions import summary
        lines.append(summary(prog.regions))
    from kiln.passes import collectives       # data parallel: each collective, its bucket, what it overlaps
    lines += collectives.summary(g, seconds)
    lines.append(f"compiled in {prog.compile_seconds:.2f}s; passes: " +
                 ", ".join(f"{name} {sec * 1000:.0f}ms" for name, sec, _ in prog.timings))
    if fallbacks:
        lines.append("gradient fallbacks (no VJP rule; autograd): " + "; ".join(fallbacks))
    if honoured:
        lines.append("torch.autograd.Functions (their own backward, under autograd): " + "; ".join(honoured))
    sig = prog.signature
    if sig is not None:
        kind = "dynamic sizes" if sig.dynamic else "static sizes"
        lines.append(f"program: {kind}: {sig.describe()} ({len(step.programs)} program(s) kept; step.cache_info() "
                     "lists them)")
        if sig.guards:
            lines.append("size guards (sizes the model or Kiln decided on; a batch outside them compiles another "
                         "program): " + "; ".join(sig.guards))
        if sig.specialized:
            lines.append("dimensions the model fixes (static in every program): " + "; ".join(sig.specialized))
    lines.append(heap.describe())
    branches = list(dict.fromkeys(n.args[2] for n in g.nodes if n.op.name == "kiln.branch_guard"))
    if branches:
        variants = len(step.programs)
        lines.append(f"value-dependent branches, decided by the batch that compiled this program and checked on "
                     f"every batch ({variants} program(s) compiled in all): " + "; ".join(branches))
    if seconds is not None:
        total = sum(seconds) or 1e-12
        split = collections.Counter()
        for n, sec in zip(g.nodes, seconds):
            split[category(n)] += sec
        lines.append(f"time: {total * 1000:.1f} ms in ops (median of 3 replays of the latest batch): " + ", ".join(
            f"{k} {split[k] * 1000:.1f} ms ({split[k] / total:.0%})"
            for k in ("matmul", "attention", "fused", "casts", "optimizer", "other") if k in split))
        slowest = sorted(range(len(seconds)), key=lambda i: -seconds[i])[:5]
        lines.append("slowest: " + "; ".join(f"#{i} {g.nodes[i].op.name} {seconds[i] * 1000:.1f} ms" for i in slowest))
    text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    return text


def cast_kinds(g) -> dict:
    """Each stand-alone cast node (`aten._to_copy`) of graph g -> what it casts: "parameters" (a parameter or
    buffer, or a view of one: once per step), "gradients" (a backward value that goes straight to the
    optimizer or a collective: a parameter's gradient back to its dtype) or "activations" (anything else,
    what issue 22 wants inside kernels)."""
    users = g.users()
    out = {}
    for n in g.nodes:
        if n.target is not torch.ops.aten._to_copy.default:
            continue
        src = n.args[0]
        while src.producer is not None and aliases(src.producer):
            src = next(v for v in src.producer.inputs if v.meta is not None)
        readers = users.get(n.outputs[0], [])
        if src.producer is None and src.role in (Role.PARAM, Role.FROZEN, Role.BUFFER):
            out[n] = "parameters"
        elif n.phase is Phase.BACKWARD and readers and all(
                u.phase is Phase.OPTIMIZER or u.op.kind is Kind.COLLECTIVE for u in readers):
            out[n] = "gradients"
        else:
            out[n] = "activations"
    return out
