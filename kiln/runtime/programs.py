"""The programs a compiled step keeps: one per signature (kiln/runtime/shapes.py), found per call.

A call is described by its *structure* (`base`: the argument tree, each leaf's dtype/device/rank or value,
train/eval mode, the enabled dialects, the optimizer hyper-parameters baked into the code) and its sizes.
`candidates(base, sizes)` gives the programs that may run it, the most recently used first: a static
program of exactly these sizes, then dynamic programs whose guards accept them. Several may (a Python
branch on tensor values compiles one variant per way it goes: the step tries them in turn).

At most `max_programs` are kept. Beyond that the step warns once and makes room by dropping the least
recently used program (and compiles dynamic programs from then on, which serve any size), so a run is
never stopped by the cache; `fail_on_max_programs=True` raises `InputError` instead.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.ir.graph import Graph
from kiln.runtime.shapes import Signature


@dataclass(eq=False)
class Program:
    """One compiled training step for one signature."""

    graph: Graph
    source: str
    fn: Callable
    fetch: list[Callable[[list, dict], Any]]      # one per graph input: (user leaves, optimizer scalars) -> value
    compile_seconds: float
    timings: list
    regions: list                 # every fused region considered, kept or not (kiln.passes.regions.Region)
    signature: Signature | None = None
    base: tuple = ()              # the call structure it serves
    ran: bool = False             # has run to the end once (a program failing on its first call is evicted)
    calls: int = 0
    tuning: tuple = ((), ())      # the background workers and settle hooks its compilation prepared (Tuner.since)
    memory: object = None         # what rematerialization decided under the memory budget (kiln.passes.remat.Plan)
    schedule: object = None       # how the backward was reordered for memory (kiln.passes.schedule.Schedule)
    metrics: tuple = ()           # the numbers its commit reports (step.grad_norm): keys of CompiledStep._metrics

    @property
    def dynamic(self) -> bool:
        return self.signature is not None and self.signature.dynamic


@dataclass
class ProgramInfo:
    """What `step.cache_info()` says about one program."""

    signature: str                # argument sizes, symbolic ones as symbols (`input_ids: [s0, s1]`)
    dynamic: bool
    guards: list[str]             # what a batch must satisfy (sizes the model or Kiln decided on)
    specialized: list[str]        # dimensions asked to be dynamic that the model fixes
    compile_seconds: float
    calls: int

    def __str__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        text = f"{kind} {self.signature}: {self.calls} call(s), compiled in {self.compile_seconds:.2f}s"
        if self.guards:
            text += "\n    guards: " + "; ".join(self.guards)
        if self.specialized:
            text += "\n    fixed by the model: " + "; ".join(self.specialized)
        return text


@dataclass
class CacheInfo:
    """`step.cache_info()`: the programs kept, and what compiling has cost so far."""

    programs: list[ProgramInfo]
    compiles: int                 # programs compiled in all (evicted ones included)
    compile_seconds: float        # seconds spent compiling, in all
    evictions: int
    max_programs: int
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.programs)} program(s) kept of at most {self.max_programs}; {self.compiles} compiled in "
                 f"{self.compile_seconds:.2f}s" + (f"; {self.evictions} evicted" if self.evictions else "")]
        lines += [f"  {p}" for p in self.programs]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class ProgramCache:
    """The programs of one step, by structure, in recency order."""

    def __init__(self, max_programs: int):
        if not isinstance(max_programs, int) or max_programs < 1:
            raise ValueError(f"max_programs must be a positive int, got {max_programs!r}")
        self.max_programs = max_programs
        self._recent: "collections.OrderedDict[int, Program]" = collections.OrderedDict()   # least recent first
        self.compiles = 0
        self.compile_seconds = 0.0
        self.evictions = 0
        self.notes: list[str] = []

    def __len__(self) -> int:
        return len(self._recent)

    def values(self) -> list[Program]:
        return list(self._recent.values())

    def candidates(self, base: tuple, sizes: tuple) -> list[Program]:
        """Programs that may run a call of this structure and these sizes, most recently used first; the
        static ones of exactly these sizes before the dynamic ones."""
        progs = [p for p in reversed(self._recent.values()) if p.base == base]
        static = [p for p in progs if not p.dynamic and p.signature.matches(sizes)]
        return static + [p for p in progs if p.dynamic and p.signature.matches(sizes)]

    def seen_other_sizes(self, base: tuple, sizes: tuple) -> bool:
        """Whether a call of this structure was compiled for other sizes (or a dynamic program serves it)."""
        return any(p.base == base and (p.dynamic or p.signature.sizes != sizes) for p in self._recent.values())

    def add(self, prog: Program) -> None:
        self._recent[id(prog)] = prog
        self.compiles += 1
        self.compile_seconds += prog.compile_seconds

    def used(self, prog: Program) -> None:
        prog.calls += 1
        if id(prog) in self._recent:
            self._recent.move_to_end(id(prog))

    def remove(self, prog: Program) -> None:
        self._recent.pop(id(prog), None)

    def evict_least_recent(self) -> Program | None:
        if not self._recent:
            return None
        _, prog = self._recent.popitem(last=False)
        self.evictions += 1
        return prog

    def info(self) -> CacheInfo:
        programs = [ProgramInfo(p.signature.describe(), p.dynamic, list(p.signature.guards),
                                list(p.signature.specialized), p.compile_seconds, p.calls)
                    for p in reversed(self._recent.values())]
        return CacheInfo(programs, self.compiles, self.compile_seconds, self.evictions, self.max_programs,
                         list(self.notes))
