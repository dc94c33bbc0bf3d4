"""`step.memory()`: the step's predicted peak memory, where it is, what is live there, what the memory
budget made Kiln recompute, and (`measure=True`) the allocator's own count on a replay of the latest batch.

The prediction is kiln/passes/memory.py's model of the program as generated (after fusion and region
placement). The measurement replays the latest batch like `profile()` (on copies of the parameters and
optimizer state, the random state restored) with the bytes glibc's allocator holds read after every node
(`mallinfo2`: in-use heap chunks plus mmapped ones), so both count the same thing: tensors the step
allocates, persistent ones (parameters, state, the batch) counted apart.

`HeapBudget` is a byte budget's account of the rest of the process (what it holds beyond a step's
tensors), which `CompiledStep` plans with and checks after a program's first step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from kiln.errors import KilnError
from kiln.ir.symbolic import hint
from kiln.passes import memory as model

log = logging.getLogger("kiln")

MIB = 2 ** 20
T = TypeVar("T")
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_budget(value) -> int | float | None:
    """`kiln.compile(memory_budget=...)`: bytes (an int, or a string such as "6GiB", "512 MiB", "1.5GB"), a
    fraction of the peak without rematerialization (a float in (0, 1]), or None (no budget)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise KilnError(f"memory_budget must be bytes (an int or a string like '6GiB'), a fraction of the "
                        f"unconstrained peak (a float in (0, 1]), or None; got {type(value).__name__}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise KilnError(f"memory_budget={value!r}: give a size such as '6GiB', '512MiB' or '1.5GB' "
                            f"(units: {', '.join(u for u in _UNITS if u)})")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if value <= 0:
            raise KilnError("memory_budget must be positive")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise KilnError(f"memory_budget={value}: a float is a fraction of the unconstrained peak, in (0, 1]; "
                            "give bytes as an int or a string like '6GiB'")
        return value
    if value <= 0:
        raise KilnError(f"memory_budget must be positive, got {value}")
    return int(value)


@dataclass
class Live:
    """One buffer live at the peak."""

    name: str
    op: str
    module: str
    nbytes: int
    kept_for_backward: bool


@dataclass
class MemoryReport:
    """What `step.memory()` returns; `str()` is the readable report (`kiln explain --memory`)."""

    predicted_peak: int             # bytes: persistent + the largest transient total
    persistent: int                 # parameters, buffers, optimizer state, the batch
    at: str                         # the node where the peak is (op, phase, module)
    live: list[Live]                # the biggest transient buffers live there
    saved: int                      # activations the backward reads, live when the forward ends
    budget: int | None = None
    outside: int = 0                     # bytes of the budget the process held beyond the step's tensors
    unconstrained: int | None = None     # the predicted peak without rematerialization (a budget was given)
    recomputed: list[str] = field(default_factory=list)
    extra_flops: float = 0.0
    solver: str = ""                     # what chose the recomputed ops: "greedy" or "milp"
    sliced: str = ""                     # row slices the budget needed (kiln/passes/chunk.py), or ""
    reordered: tuple[int, int, int] | None = None     # backward nodes moved, predicted peak before and after
    measured_peak: int | None = None     # persistent + the allocator's largest transient total on a replay
    measured_at: str | None = None
    note: str = ""

    def __str__(self) -> str:
        lines = [f"predicted peak: {self.predicted_peak / MIB:.1f} MiB at {self.at} "
                 f"({self.persistent / MIB:.1f} MiB persistent: parameters, buffers, optimizer state, the batch; "
                 f"{self.saved / MIB:.1f} MiB of activations kept for the backward)"]
        if self.measured_peak is not None:
            err = (self.predicted_peak - self.measured_peak) / max(self.measured_peak, 1)
            lines.append(f"measured peak:  {self.measured_peak / MIB:.1f} MiB at {self.measured_at} (prediction "
                         f"{err:+.1%})")
        if self.budget is not None:
            held = (f" for the process, which held {self.outside / MIB:.1f} MiB beyond the step's tensors when it "
                    f"compiled (torch, the model's Python side, other tensors; {HEAP_GROWTH / MIB:.0f} MiB of it "
                    f"room to grow), leaving "
                    f"{(self.budget - self.outside) / MIB:.1f} MiB for the step") if self.outside else ""
            lines.append(f"budget: {self.budget / MIB:.1f} MiB{held}; without rematerialization the step's peak would "
                         f"be {(self.unconstrained or 0) / MIB:.1f} MiB; {len(self.recomputed)} op(s) recomputed in "
                         f"the backward for {self.extra_flops / 1e9:.2f} GFLOP more per step"
                         + (f" (chosen by the {_SOLVERS.get(self.solver, self.solver)})" if self.recomputed else ""))
            if self.sliced:
                lines.append(f"  sliced: {self.sliced}")
            lines += [f"  recomputed: {r}" for r in self.recomputed]
        if self.reordered:
            moved, before, after = self.reordered
            lines.append(f"backward reordered for memory: {moved} node(s) moved, predicted peak {_size(before)} -> "
                         f"{_size(after)} before any recomputation")
        lines.append("live at the peak (biggest first):")
        lines += [f"  {b.nbytes / MIB:8.1f} MiB  {b.name} ({b.op}{' in ' + b.module if b.module else ''})"
                  f"{', kept for the backward' if b.kept_for_backward else ''}" for b in self.live]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB else f"{nbytes / 1024:.1f} KiB"


_SOLVERS = {"greedy": "greedy pass", "milp": "covering integer program, cheaper than the greedy pass's choice"}


def _where(graph, i: int) -> str:
    n = graph.nodes[i]
    return f"node {i} {n.op.name} ({n.phase.value}{', ' + n.scope if n.scope else ''})"


def report(prog, plan=None, measured: list[int] | None = None, top: int = 8) -> MemoryReport:
    """The report of compiled program `prog` (its remat `plan`, a measured per-node profile)."""
    g = prog.graph
    prof = model.profile(g)
    live = [Live(b.owner.name, b.owner.producer.op.name if b.owner.producer else "input",
                 b.owner.producer.scope if b.owner.producer else "", b.nbytes, b.saved)
            for b in prof.live_at(prof.at)[:top]]
    if g.nodes and prof.workspace[prof.at]:
        n = g.nodes[prof.at]
        live.insert(0, Live("(its kernel's temporaries)", n.op.name, n.scope, prof.workspace[prof.at], False))
        live.sort(key=lambda b: -b.nbytes)
    rep = MemoryReport(prof.peak, prof.persistent, _where(g, prof.at) if g.nodes else "-", live, prof.saved_bytes)
    sched = getattr(prog, "schedule", None)
    if sched is not None and sched.moved:
        rep.reordered = (sched.moved, sched.before, sched.after)
    if plan is not None:
        rep.budget, rep.unconstrained, rep.outside = plan.budget, plan.before, plan.outside
        rep.recomputed = [str(r) for r in plan.chosen]
        rep.extra_flops = plan.extra_flops
        rep.solver = plan.solver
        rep.sliced = str(plan.chunking or "")
    if measured is not None:
        i = max(range(len(measured)), key=measured.__getitem__)
        rep.measured_peak, rep.measured_at = prof.persistent + measured[i], _where(g, i)
    return rep


@functools.cache
def _mallinfo2():
    """glibc's `mallinfo2`, or None where there is none (other C libraries, glibc < 2.33)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None

    class Info(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
    fn.restype = Info
    return fn


def allocated() -> int | None:
    """Bytes the C allocator holds for the process now (None where it cannot tell)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


# What a byte budget keeps aside for the process's heap to grow after a program's first step, beyond what
# `CompiledStep._recheck_budget` saw then: the Llama bench model's heap grew by 10 MiB more while the
# tuner settled (a budget of eager's batch-8 peak, 951 MiB, was exceeded by 2 MiB without it).
HEAP_GROWTH = 16 * MIB


def outside_heap(tensors) -> int | None:
    """Bytes the C allocator holds for the process now beyond the storages of `tensors` (the ones a step's
    prediction counts as persistent: parameters, buffers, optimizer state, the batch): torch's and the
    model's own allocations, other models, whatever the caller keeps. A byte budget is a budget for the
    whole process's heap, so the step gets what this leaves. None where the allocator cannot tell."""
    if _mallinfo2() is None:
        return None
    import gc
    import torch
    gc.collect()                        # garbage cycles holding tensors are not the process's to keep
    held = allocated()
    seen, own = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):    # subclasses without a plain storage
            continue
        if key and key not in seen:
            seen.add(key)
            own += storage.nbytes()
    return max(0, held - own)


def guards(graph, plan) -> list:
    """Under a memory budget, a dynamic program's extra guard: the transient bytes at its predicted peak, an
    expression of the batch's sizes, within the budget (a bigger batch compiles a program of its own, which
    recomputes more)."""
    if plan is None or plan.budget is None:
        return []
    import sympy
    expr = model.peak_expr(graph)
    if isinstance(expr, int):
        return []
    # The plan fits the budget as rematerialization left the graph; the passes after it (regions) can move the
    # predicted peak of the compiled batch a little above it. That batch is the one the program was made for:
    # the bound is never below its own peak, so the guard turns away bigger batches, never the compiled one.
    bound = max(plan.step_budget, model.profile(graph).peak)
    if bound > plan.step_budget:
        log.info("kiln: the program's predicted peak for the compiled batch is %.1f MiB, %.1f MiB above what "
                 "rematerialization planned for the budget (the passes after it moved it)", bound / MIB,
                 (bound - plan.after) / MIB)
    return [(sympy.Le(expr + plan.persistent, bound),
             f"memory: the predicted peak of a batch of these sizes within the budget of {plan.budget / MIB:.0f} MiB")]


class HeapBudget:
    """A byte budget's view of the process: what it holds beyond a step's tensors when a program is planned,
    and again after the program's first step, for one re-plan if torch's first-run allocations (thread
    pools' buffers, kernel caches: 16 MiB for the Llama bench model) no longer leave the plan room.
    `gather` (data parallel: `comm.gather_objects`) makes every rank take the largest heap any rank holds,
    so they plan the same program and re-plan together (a re-plan compiles, and the ranks check their
    compiles together)."""

    def __init__(self, gather=None):
        self.gather = gather
        self.seen = 0                   # what a first step showed, once it showed more than the plan allowed

    def _agreed(self, outside: int) -> int:
        return outside if self.gather is None else max(self.gather(outside, "the heap each process holds beyond "
                                                                            "its step"))

    def outside(self, tensors) -> int:
        """The heap beyond `tensors` (`outside_heap`) and `HEAP_GROWTH`, or what a first step showed if more;
        0 where the allocator cannot say."""
        held = outside_heap(tensors)
        if held is None:
            log.info("kiln: memory_budget counts the step's tensors only: this platform's allocator cannot say "
                     "what else the process holds")
            return self.seen
        return max(self._agreed(held) + HEAP_GROWTH, self.seen)

    def recheck(self, plan, inputs) -> str | None:
        """After a program's first step: whether its `plan` (kiln.passes.remat.Plan) still fits beside what the
        process holds beyond the program's `inputs`; if not, the note to record (the caller drops the
        program, and the next compile plans with `seen`). At most once per step."""
        if self.seen:
            return None
        held = outside_heap(inputs)
        if held is None:
            return None
        held = self._agreed(held) + HEAP_GROWTH
        if plan.after + held <= plan.budget:
            return None
        self.seen = held
        log.info("kiln: after its first step the process holds %.0f MiB beyond the step's tensors (%.0f MiB when the "
                 "step was planned): compiling it again to keep within memory_budget=%.0f MiB", held / MIB,
                 plan.outside / MIB, plan.budget / MIB)
        return (f"re-planned for memory_budget: the process held {held / MIB:.0f} MiB beyond the step's tensors after "
                f"the first step, {plan.outside / MIB:.0f} MiB when compiling")


def in_slices(attempt: Callable[[int, int | None], T]) -> T:
    """`attempt(chunks, reference)` (a capture and the pipeline) with no row slices, then, while its budget is
    not met (`remat.BudgetUnmet`) and the graph has row-wise blocks, with 2, 4, 8, 16 (`chunk.CHUNKS`: 2 may
    not lower the peak where 4 do). `reference` is the unsliced program's unconstrained peak, of which a
    fractional budget stays a fraction. If none meets it, the error of the smallest peak reached is raised."""
    from kiln.passes.chunk import CHUNKS
    from kiln.passes.remat import BudgetUnmet
    reference, best = None, None
    for chunks in (1, *CHUNKS):
        try:
            return attempt(chunks, reference)
        except BudgetUnmet as e:
            best = e if best is None or e.plan.floor < best.plan.floor else best
            if e.plan.chunking is None or not e.plan.chunking.blocks:
                raise best from None
            reference = reference or e.plan.before
            log.info("kiln: memory_budget not met with %s; compiling again with row-wise blocks in slices "
                     "(smallest peak so far %.0f MiB)", f"{chunks} slice(s)" if chunks > 1 else "recomputation",
                     e.plan.floor / MIB)
    raise best
