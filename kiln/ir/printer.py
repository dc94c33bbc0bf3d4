"""Graph -> readable Python, one kernel call per line. Used by codegen (what runs) and by debug dumps."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch._ops import OpOverload

from kiln.ir import symbolic
from kiln.ir.graph import Graph, Node, Value


class Symbols:
    """Names for kernels and non-literal constants referenced by the generated code."""

    def __init__(self, taken: set[str] = frozenset(), sizes: dict | None = None) -> None:
        self.globals: dict[str, Any] = {"torch": torch}
        self._names: dict[int, str] = {}
        self._taken = taken            # local variable names of the generated code: never shadowed
        # symbolic sizes print as expressions over the locals the code binds them to (codegen.bind_sizes);
        # without bindings (debug listings) a symbol prints as its own name
        self.sizes = symbolic.SizePrinter(sizes)
        self._bound = sizes is not None

    def kernel(self, fn: Any) -> str:
        if id(fn) in self._names:
            return self._names[id(fn)]
        if isinstance(fn, OpOverload):
            base = f"{fn.namespace}_{fn._schema.name.split('::')[1]}" + \
                ("" if fn._overloadname == "default" else f"_{fn._overloadname}")
        else:
            base = getattr(fn, "__name__", "kernel")
        name, i = base, 1
        while name in self.globals or name in self._taken:
            i += 1
            name = f"{base}_{i}"
        self.globals[name] = fn
        self._names[id(fn)] = name
        return name

    def size(self, x: Any) -> str:
        """A (symbolic) size as a Python expression: never embedded as an object, whose value would be the
        compiled batch's."""
        if not self._bound:
            return str(symbolic.expr(x))
        return self.sizes(x)

    def constant(self, obj: Any) -> str:
        if symbolic.any_symbolic(obj) or isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise AssertionError(f"Kiln bug: a symbolic size inside a constant {type(obj).__name__} would run as the "
                                 "compiled batch's size")
        if id(obj) not in self._names:
            name, i = f"const{len(self._names)}", len(self._names)
            while name in self.globals or name in self._taken:
                i += 1
                name = f"const{i}"
            self.globals[name] = obj
            self._names[id(obj)] = name
        return self._names[id(obj)]


def literal(x: Any, syms: Symbols) -> str:
    if isinstance(x, Value):
        return x.name
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return syms.size(x)
    if x is None or isinstance(x, (bool, int, str)):
        return repr(x)
    if isinstance(x, float):
        if math.isinf(x):
            return "float('inf')" if x > 0 else "float('-inf')"
        return "float('nan')" if math.isnan(x) else repr(x)
    if isinstance(x, list):
        return "[" + ", ".join(literal(i, syms) for i in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(literal(i, syms) for i in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, torch.device):
        return f"torch.device({str(x)!r})"
    if isinstance(x, (torch.memory_format, torch.layout)):
        return str(x)
    return syms.constant(x)


def call_line(n: Node, syms: Symbols) -> str:
    fn = n.impl.runnable if n.impl is not None else n.target
    args = [literal(a, syms) for a in n.args] + [f"{k}={literal(v, syms)}" for k, v in n.kwargs.items()]
    call = f"{syms.kernel(fn)}({', '.join(args)})"
    outs = n.outputs
    if not outs:
        lhs = ""
    elif len(outs) == 1 and not _returns_sequence(n):
        lhs = f"{outs[0].name} = "
    else:
        lhs = ", ".join(o.name for o in outs) + (",", "")[len(outs) > 1] + " = "
    return lhs + call


def _returns_sequence(n: Node) -> bool:
    t = n.target
    if isinstance(t, OpOverload):
        rets = t._schema.returns
        return len(rets) != 1 or str(rets[0].type).startswith("List")
    return True


def annotate(n: Node) -> str:
    parts = []
    if n.scope:
        parts.append(n.scope)
    if n.impl is not None and n.impl.dialect.name != "aten":
        parts.append(f"[{n.impl.label}]")
    if n.op.name == "kiln.fallback_forward":
        parts.append(f"[autograd: {n.args[0]!r}]")     # the op, or the user's Function (`RoundSTE.apply`)
    elif n.op.name == "kiln.fallback_backward":
        parts.append("[autograd]")
    return ("  # " + " ".join(parts)) if parts else ""


def format_graph(graph: Graph) -> str:
    """A debug listing of the graph (same line format as the generated code, no frees)."""
    syms = Symbols()
    lines = [f"inputs: {', '.join(f'{v.name}: {v.role.value} {v.meta}' for v in graph.inputs)}"]
    phase = None
    for n in graph.nodes:
        if n.phase is not phase:
            phase = n.phase
            lines.append(f"# ---- {phase.value} ----")
        lines.append(call_line(n, syms) + annotate(n))
    lines.append(f"outputs: {graph.outputs}; mutations: {graph.mutations}")
    return "\n".join(lines)
