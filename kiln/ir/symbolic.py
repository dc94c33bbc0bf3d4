"""Symbolic sizes: sizes that vary from batch to batch, carried through the IR as `torch.SymInt`s.

A program compiled for dynamic shapes (kiln/runtime/shapes.py decides which dimensions) is captured by
`torch.export` with those dimensions symbolic: each becomes a symbol (`s0`, `s1`, ...) of the export's
`ShapeEnv`, and every size computed from it a `torch.SymInt` whose expression is a sympy expression over
the symbols (`s0*s1`, `(s1 + 1)//2`). Kiln keeps those SymInts as they are: in `TensorMeta`s, in node
arguments (`view(x, [s0*s1, 512])`), in what gradient rules compute from shapes. So one program serves
every size, and the generated step computes each size from its inputs' (`s0 = input_ids.size(0)`).

Three rules keep this exact:
- A decision on a symbolic size (`if shape[d] == 1`, a pass comparing sizes) goes through the `ShapeEnv`,
  which records it as a *guard* (`Ne(s0, 1)`, `s1 <= 1024`); every guard is checked on every batch before
  the program runs (`kiln/runtime/shapes.py`), so a decision can narrow the sizes a program serves, never
  make it wrong. `int(size)` specializes the size (a guard `Eq(s0, 8)`): correct, only less general.
- Heuristics (cost estimates, "is this tensor big enough to be worth a kernel") read `hint()`: the size in
  the batch the program was compiled for, which records no guard. A hint never goes into a program.
- Structural comparisons that are not decisions about the batch ("did this rewrite keep the shape?") use
  `same()`, which compares expressions and records nothing.

Metas of symbolic tensors are inferred on fake tensors in the export's `FakeTensorMode` (`fake_mode`);
static ones stay on the faster meta device (kiln/ir/builder.py).
"""
from __future__ import annotations

from typing import Any, Iterable

import sympy
import torch

Size = "int | torch.SymInt"


def is_symbolic(x: Any) -> bool:
    """Whether `x` is a size that is not a known integer (a SymInt with free symbols)."""
    return isinstance(x, torch.SymInt) and x.node.maybe_as_int() is None


def concrete(x: Any) -> Any:
    """`x` with every SymInt whose value is known (a specialized size) replaced by that int."""
    if isinstance(x, torch.SymInt):
        known = x.node.maybe_as_int()
        if known is not None:
            return int(known)
        simplified = x.node.shape_env.replace(x.node.expr)
        return int(simplified) if simplified.is_number else x
    if isinstance(x, (list, tuple)):
        return type(x)(concrete(i) for i in x)
    return x


def any_symbolic(obj: Any) -> bool:
    """Whether a (nested list/tuple/dict) structure holds a symbolic size."""
    if isinstance(obj, torch.SymInt):
        return is_symbolic(obj)
    if isinstance(obj, (list, tuple)):
        return any(any_symbolic(i) for i in obj)
    if isinstance(obj, dict):
        return any(any_symbolic(i) for i in obj.values())
    return False


def expr(x: Any) -> Any:
    """The sympy expression of a size (an int stays an int), with the ShapeEnv's replacements applied
    (`s7` after a guard `Eq(s7, s3)` is `s3`)."""
    if isinstance(x, torch.SymInt):
        e = x.node.shape_env.replace(x.node.expr)
        return int(e) if e.is_number else e
    if isinstance(x, (torch.SymFloat, torch.SymBool)):
        return x.node.shape_env.replace(x.node.expr)
    return x


def hint(x: Any) -> int:
    """The value of a size in the batch the program was compiled for, recording no guard (heuristics
    only: a hint never goes into a program). Lists and tuples give lists of hints."""
    if isinstance(x, (list, tuple)):
        return [hint(i) for i in x]
    if isinstance(x, torch.SymInt):
        known = x.node.maybe_as_int()
        if known is not None:
            return int(known)
        from torch.fx.experimental.symbolic_shapes import optimization_hint
        return int(optimization_hint(x))
    return int(x)


def estimate(x: Any) -> float:
    """A number computed from sizes (a cost, a symbolic float) at the compiled batch's sizes, recording no
    guard (float() of a symbolic value would specialize the program to this batch)."""
    if isinstance(x, torch.SymFloat):
        return float(x.node.hint)
    return float(hint(x)) if isinstance(x, torch.SymInt) else float(x)


def hinted(obj: Any) -> Any:
    """A nested structure with every symbolic size replaced by its hint (example arguments for measuring a
    kernel on the compiled batch's sizes)."""
    if isinstance(obj, torch.SymInt):
        return hint(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(hinted(i) for i in obj)
    if isinstance(obj, dict):
        return {k: hinted(v) for k, v in obj.items()}
    return obj


def same(a: Any, b: Any) -> bool:
    """Whether two sizes (or shapes) are the same expression: a structural question, recording no guard
    (two different symbols are different sizes, even if this batch happens to make them equal)."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(same(x, y) for x, y in zip(a, b))
    ea, eb = expr(a), expr(b)
    if isinstance(ea, int) and isinstance(eb, int):
        return ea == eb
    return ea == eb or sympy.expand(sympy.sympify(ea) - eb) == 0


def key(x: Any) -> Any:
    """A hashable, process-independent stand-in for a size or shape: ints as they are, symbolic sizes as
    the text of their expression (for cache keys and CSE)."""
    if isinstance(x, (list, tuple)):
        return tuple(key(i) for i in x)
    e = expr(x)
    return e if isinstance(e, int) else f"<{e}>"


def free_symbols(obj: Any) -> set:
    """The sympy symbols a (nested) structure of sizes depends on."""
    out: set = set()
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        e = expr(obj)
        if not isinstance(e, int):
            out |= e.free_symbols
    elif isinstance(obj, (list, tuple)):
        for i in obj:
            out |= free_symbols(i)
    elif isinstance(obj, dict):
        for i in obj.values():
            out |= free_symbols(i)
    return out


def shape_env(objs: Iterable[Any]):
    """The ShapeEnv of the first symbolic size found in `objs` (nested structures of sizes), or None."""
    for x in objs:
        if isinstance(x, torch.SymInt) and is_symbolic(x):
            return x.node.shape_env
        if isinstance(x, (list, tuple)):
            env = shape_env(x)
            if env is not None:
                return env
    return None


def fake_mode(env):
    """The FakeTensorMode Kiln infers symbolic metas in, one per ShapeEnv (kept on it)."""
    mode = getattr(env, "_kiln_fake_mode", None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
        env._kiln_fake_mode = mode
    return mode


def unbacked(obj: Any) -> bool:
    """Whether a size (or a tensor's shape) depends on tensor values (`x[mask]`, `nonzero`): an unbacked
    symbol, which no input size determines. Kiln refuses those shapes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    if isinstance(obj, torch.Tensor):
        return bool(free_unbacked_symbols(tuple(obj.shape)) or free_unbacked_symbols(tuple(obj.stride())))
    return bool(free_unbacked_symbols(obj))


class SizePrinter:
    """Prints symbolic sizes as Python expressions over the local names the generated code binds them to
    (`names`: sympy symbol -> local variable name)."""

    def __init__(self, names: dict | None = None):
        self.names = dict(names or {})
        self.used: set = set()

    def __call__(self, x: Any) -> str:
        from torch.utils._sympy.printers import PythonPrinter
        e = expr(x)
        if isinstance(e, int):
            return repr(e)
        missing = [s for s in e.free_symbols if s not in self.names]
        if missing:
            raise KeyError(f"no input size binds {', '.join(map(str, missing))} (in {e})")
        self.used |= e.free_symbols
        local = e.xreplace({s: sympy.Symbol(self.names[s], integer=True) for s in e.free_symbols})
        text = PythonPrinter().doprint(local)
        return f"({text})" if not text.isidentifier() else text


def seal(env) -> None:
    """After a program's guards are collected into its signature: any guard recorded later (a size decided
    at run time) raises instead of being silently unchecked."""
    env.frozen = True
    env._error_on_new_guards = True


def evaluate(x: Any, values: dict) -> Any:
    """A size (or nested sizes) at run time: its expression with `values` ({symbol: int}) substituted."""
    if isinstance(x, (list, tuple)):
        return type(x)(evaluate(i, values) for i in x)
    e = expr(x)
    return e if isinstance(e, int) else int(e.xreplace({s: sympy.Integer(values[s]) for s in e.free_symbols}))


def symint(env, sym) -> "torch.SymInt":
    """A SymInt standing for the bare symbol `sym` of `env` (to put a size into a node's arguments)."""
    value = env.backed_var_to_val.get(sym)
    return env.create_symintnode(sym, hint=None if value is None else int(value))


def canonical(symbols: list) -> dict:
    """{symbol: z0, z1, ...}: names independent of the program a structure came from, for cache keys
    (repeated layers of two programs, or two runs, share one kernel)."""
    return {s: sympy.Symbol(f"z{i}", integer=True, positive=True) for i, s in enumerate(symbols)}


def rename(x: Any, names: dict) -> Any:
    """A size, or nested sizes, as plain ints and sympy expressions over the canonical `names` (picklable,
    hashable, independent of any ShapeEnv)."""
    if isinstance(x, (list, tuple)):
        return type(x)(rename(i, names) for i in x)
    e = expr(x)
    return e if isinstance(e, int) else e.xreplace(names)


def to_fx(e, graph, nodes: dict):
    """An FX node computing sympy expression `e` from the FX nodes of its symbols (`nodes`), with Python
    integer arithmetic (so tracing it on SymInts gives the same expression)."""
    import operator
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod
    if isinstance(e, int) or (isinstance(e, sympy.Basic) and e.is_Integer):
        return int(e)
    if e.is_Symbol:
        return nodes[e]
    args = [to_fx(a, graph, nodes) for a in e.args]
    if e.is_Add or e.is_Mul:
        fn = operator.add if e.is_Add else operator.mul
        out = args[0]
        for a in args[1:]:
            out = graph.call_function(fn, (out, a))
        return out
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        out = args[0]
        for _ in range(int(e.exp) - 1):
            out = graph.call_function(operator.mul, (out, args[0]))
        return out
    if isinstance(e, FloorDiv):
        return graph.call_function(operator.floordiv, tuple(args))
    if isinstance(e, (Mod, PythonMod)):
        return graph.call_function(operator.mod, tuple(args))
    raise NotImplementedError(f"size expression {e} ({type(e).__name__})")
