"""Training graph -> one straight-line Python function that calls the chosen kernels directly.

Each tensor is deleted right after its last use, so forward activations live exactly as long as the
backward needs them. What `step.source()` shows is exactly the code that runs.
"""
from __future__ import annotations

import itertools
import linecache
import time
from typing import Callable

from kiln.ir import symbolic
from kiln.ir.graph import Graph, Role
from kiln.ir.printer import Symbols, annotate, call_line
from kiln.transaction import stage

_counter = itertools.count()


def generate(graph: Graph, name: str = "kiln_step", return_all: bool = False,
             times: list | None = None, memory: tuple | None = None) -> tuple[str, Callable]:
    """Source and function of `graph`. The function returns outputs[0] (the loss), or, with
    `return_all`, a tuple of every graph output (used by the VJP tests to read the gradients).

    With `times` (a list of len(graph.nodes) floats), every call is timed and its seconds added to
    `times[i]` (`kiln.explain(step, profile=True)`); the CPU kernels are synchronous, so the
    wall-clock time around a call is the kernel's time. With `memory` (a list of len(graph.nodes) ints and
    a function returning the bytes allocated now), `memory[0][i]` is set to that count right after node i
    runs, before anything it read last is freed (`step.memory(measure=True)`)."""
    taken = {v.name for n in graph.nodes for v in n.outputs} | {v.name for v in graph.inputs}
    sources = size_sources(graph.inputs)
    names = size_names(sources, taken)
    syms = Symbols(taken=taken | set(names.values()), sizes=names)
    last_use: dict = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            last_use[v] = i
    keep = set(graph.outputs) | {new for _, new in graph.mutations} | set(graph.inputs)

    params = ", ".join(v.name for v in graph.inputs)
    lines = [f"def {name}({params}):"]
    at_line: dict[int, object] = {}                    # generated line number -> the node it calls
    phase = None
    for i, n in enumerate(graph.nodes):
        if n.phase is not phase:
            phase = n.phase
            lines.append(f"    # ---- {phase.value} ----")
        if times is None:
            lines.append("    " + call_line(n, syms) + annotate(n))
            at_line[len(lines)] = n
        else:
            lines += ["    _t0 = _clock()", "    " + call_line(n, syms), f"    _times[{i}] += _clock() - _t0"]
            at_line[len(lines) - 1] = n
        if memory is not None:
            lines.append(f"    _mem[{i}] = _allocated()")
        dead = [v.name for v in n.inputs if last_use.get(v) == i and v not in keep]
        dead += [o.name for o in n.outputs if o not in last_use and o not in keep]
        if dead:
            lines.append(f"    del {', '.join(dict.fromkeys(dead))}")
    if graph.mutations:
        lines.append("    # ---- buffer updates ----")
        for target, new in graph.mutations:     # written at the step's commit, with the parameters
            lines.append(f"    _stage({target.name}.copy_, {new.name})")
    if return_all:
        lines.append(f"    return ({''.join(v.name + ', ' for v in graph.outputs)})")
    else:
        lines.append(f"    return {graph.outputs[0].name}")
    binds = bind_sizes(syms, sources)
    if binds:                       # the symbolic sizes this batch has, read from the inputs (after the def line)
        lines[1:1] = binds
        at_line = {i + len(binds): n for i, n in at_line.items()}
    source = "\n".join(lines) + "\n"

    namespace = dict(syms.globals, _stage=stage)
    if times is not None:
        namespace.update(_clock=time.perf_counter, _times=times)
    if memory is not None:
        namespace.update(_mem=memory[0], _allocated=memory[1])
    fn = define(source, name, namespace, f"<kiln-step-{next(_counter)}>")
    fn.node_at_line = at_line            # read by the runtime to name the op a failure came from
    return source, fn


def size_sources(values) -> dict:
    """{sympy symbol: (value, dim)}: where each symbolic size of a program can be read from its inputs (the
    first input dimension that is that symbol alone)."""
    sources: dict = {}
    for v in values:
        if v.meta is None:
            continue
        for d, size in enumerate(v.meta.shape):
            e = symbolic.expr(size)
            if not isinstance(e, int) and e.is_Symbol and e not in sources:
                sources[e] = (v, d)
    return sources


def size_names(sources, taken: set) -> dict:
    """A local variable name for every symbol of `sources` (a dict or list of symbols): its own (`s44`),
    unless the code uses that name."""
    names = {}
    for sym in sources:
        name, i = str(sym), 1
        while name in taken or name in names.values():
            i += 1
            name = f"{sym}_{i}"
        names[sym] = name
    return names


def bind_sizes(syms: Symbols, sources: dict, indent: str = "    ") -> list[str]:
    """The lines that read the symbolic sizes the generated code used from its inputs."""
    return [f"{indent}{syms.sizes.names[s]} = {sources[s][0].name}.size({sources[s][1]})"
            for s in sorted(syms.sizes.used, key=str)]


def define(source: str, name: str, namespace: dict, filename: str) -> Callable:
    """Execute generated `source` and return the function `name` it defines; the source is registered
    with linecache under `filename`, so tracebacks show the generated lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def input_roles(graph: Graph) -> list[tuple[Role, str]]:
    return [(v.role, v.source) for v in graph.inputs]
