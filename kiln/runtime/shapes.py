"""Which batches a program serves: the dynamic-shape policy, and each program's signature and guards.

Policy (`kiln.compile(..., dynamic=...)`):
- `None` (default): the first batch compiles a program for its exact sizes (the fastest code: every
  kernel choice measured on them). When a later batch of the same structure (the same arguments, dtypes
  and ranks) has other sizes, the next program is compiled with *every* dimension of every tensor
  argument dynamic, leaving to torch.export the ones the model fixes (a vocabulary, an image size the
  position embeddings need). One recompile then serves every batch a data loader produces: other lengths,
  other batch sizes, the smaller last batch, never one program per size.
- `True`: dynamic from the first batch. `False`: one program per distinct size. ($KILN_DYNAMIC=1/0 sets
  the default for `dynamic=None` without code changes.)
- `{"input_ids": {1: "seq"}, "labels": {1: "seq"}}` (keyword arguments by name, positional ones by
  index): exactly those dimensions are dynamic, from the first batch; dimensions with one name are one
  size. A named dimension the model fixes is refused with torch.export's reason.

A dynamic program's `Signature` records, for each tensor argument, its sizes as expressions of the
program's symbols, and every guard the compilation recorded (the model's own decisions on sizes,
torch.export's, Kiln's; kiln/ir/symbolic.py): `accepts(sizes)` checks them all, in generated Python, before
the program runs on a batch, so a batch outside what the program was compiled for is never run by it
(that batch compiles another program). Sizes 0 and 1 are never symbolic (torch.export specializes them).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from kiln.errors import KilnError
from kiln.ir import symbolic
from kiln.ir.graph import Graph, Role

_count = itertools.count()


def leaf_kind(x: Any) -> tuple:
    """What a program is keyed on for one argument leaf besides its sizes: a tensor's dtype, device, rank
    and requires_grad; any other value as it is."""
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, x.device.type, x.dim(), x.requires_grad)
    return ("V", type(x).__name__, x)


def sizes_of(leaves: list) -> tuple:
    return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves)


class Policy:
    """`kiln.compile(..., dynamic=)`, checked once: which dimensions a new program makes dynamic."""

    def __init__(self, dynamic: Any):
        if dynamic is None:                 # $KILN_DYNAMIC=1/0 sets the default without code changes
            env = os.environ.get("KILN_DYNAMIC", "").strip().lower()
            if env not in ("", "auto", "1", "true", "0", "false"):
                raise KilnError(f"KILN_DYNAMIC must be 1, 0 or auto, got {env!r}")
            dynamic = {"1": True, "true": True, "0": False, "false": False}.get(env)
        if dynamic is not None and not isinstance(dynamic, (bool, dict)):
            raise KilnError("dynamic must be None (automatic), True, False, or a dict such as "
                            "{'input_ids': {1: 'seq'}, 'labels': {1: 'seq'}}, "
                            f"got {type(dynamic).__name__}")
        if isinstance(dynamic, dict):
            for arg, dims in dynamic.items():
                if not isinstance(arg, (str, int)) or not isinstance(dims, dict) or not dims or not all(
                        isinstance(d, int) and (n is None or isinstance(n, str) and n.isidentifier())
                        for d, n in dims.items()):
                    raise KilnError(f"dynamic={{{arg!r}: {dims!r}}}: give each argument (a keyword name, or the "
                                    "index of a positional argument) a dict {dim: name}, e.g. {1: 'seq'}; dims are "
                                    "ints, names identifiers (or None: a size of its own)")
        self.dynamic = dynamic

    @property
    def mode(self) -> str:
        return {None: "auto", True: "dynamic", False: "static"}.get(self.dynamic, "spec") \
            if not isinstance(self.dynamic, dict) else "spec"

    def dims(self, args: tuple, kwargs: dict, leaves: list, go_dynamic: bool) -> dict[int, dict] | None:
        """{leaf index: {dim: torch.export Dim}} for the next program, or None (all static). `go_dynamic`:
        this structure has been seen with other sizes, or a dynamic program already serves it."""
        from torch.export import Dim
        if self.mode == "static" or (self.mode == "auto" and not go_dynamic):
            return None
        if self.mode in ("auto", "dynamic"):
            dims = {i: {d: Dim.AUTO for d in range(x.dim())} for i, x in enumerate(leaves)
                    if isinstance(x, torch.Tensor) and x.dim() > 0}
            return dims or None
        return self._named(args, kwargs, leaves)

    def _named(self, args: tuple, kwargs: dict, leaves: list) -> dict[int, dict]:
        from torch.export import Dim
        index = _top_level_leaves(args, kwargs)
        named: dict[str, Any] = {}
        dims: dict[int, dict] = {}
        for arg, spec in self.dynamic.items():
            where = f"argument {arg}" if isinstance(arg, int) else f"keyword argument {arg!r}"
            if arg not in index:
                raise KilnError(f"dynamic= names {where}, which this call does not pass as a tensor "
                                f"(it passes {', '.join(map(repr, index)) or 'no tensors'})")
            i = index[arg]
            t = leaves[i]
            for d, name in spec.items():
                if not -t.dim() <= d < t.dim():
                    raise KilnError(f"dynamic= gives dim {d} of {where}, which has {t.dim()} dimensions")
                if name is None:
                    name = f"{arg}_{d % t.dim()}" if isinstance(arg, str) else f"arg{arg}_{d % t.dim()}"
                dim = named.setdefault(name, Dim(name))
                dims.setdefault(i, {})[d % t.dim()] = dim
        return dims


def _top_level_leaves(args: tuple, kwargs: dict) -> dict:
    """{positional index or keyword name: flattened leaf index} for top-level tensor arguments (the
    order `pytree.tree_flatten((args, sorted kwargs))` gives)."""
    import torch.utils._pytree as pytree
    out, offset = {}, 0
    for key, value in [(i, a) for i, a in enumerate(args)] + list(kwargs.items()):
        n = len(pytree.tree_leaves(value))
        if isinstance(value, torch.Tensor):
            out[key] = offset
        offset += n
    return out


@dataclass
class Signature:
    """The sizes a program serves. Static: exactly `sizes`. Dynamic: the sizes its guards accept."""

    sizes: tuple                        # per leaf: a tuple of ints and symbolic sizes, or None (not a tensor)
    names: list[str]                    # per leaf: the argument's name
    dynamic: bool = False
    guards: list[str] = field(default_factory=list)        # readable, over argument sizes
    specialized: list[str] = field(default_factory=list)   # dims asked dynamic that the model fixes
    accepts: Any = None                 # (sizes) -> bool, for dynamic programs
    source: str = ""                    # the generated `accepts`

    def matches(self, sizes: tuple) -> bool:
        if not self.dynamic:
            return sizes == self.sizes
        return self.accepts(sizes)

    def describe(self) -> str:
        parts = [f"{n}: [{', '.join(map(str, s))}]" for n, s in zip(self.names, self.sizes) if s is not None]
        return ", ".join(parts)


def static_signature(sizes: tuple, names: list[str]) -> Signature:
    return Signature(sizes, names)


def dynamic_signature(graph: Graph, names: list[str], nleaves: int, asked: dict | None,
                      guards_before: int, extra: list | None = None) -> Signature:
    """The signature of a program captured with symbolic sizes: its inputs' size expressions and every
    guard of its ShapeEnv, compiled to one Python check. `asked`: the dims the policy made dynamic (those
    that came out static are reported as specialized); `guards_before`: how many guards torch.export
    recorded (the rest are Kiln's, reported as such); `extra`: more (sympy condition, why) pairs to check
    (the memory budget)."""
    inputs = {int(v.source): v for v in graph.inputs if v.role is Role.INPUT and v.meta is not None}
    sizes = tuple(tuple(symbolic.concrete(s) for s in inputs[i].meta.shape) if i in inputs else None
                  for i in range(nleaves))
    env = symbolic.shape_env([s for s in sizes if s is not None])
    if env is None:           # every size came out static
        sig = Signature(sizes, names)
        sig.specialized = _specialized(asked, sizes, names)
        return sig
    bound = _sources(sizes)                 # symbol -> the first (leaf, dim) that is that symbol alone
    lines = [f"    {sym} = sizes[{i}][{d}]" for sym, (i, d) in bound.items()]
    printer = symbolic.SizePrinter({sym: str(sym) for sym in bound})
    readable = symbolic.SizePrinter({sym: f"{names[i]}.size({d})" for sym, (i, d) in bound.items()})
    checks, readable_guards, upper = [], [], []
    for i, shape in enumerate(sizes):
        for d, size in enumerate(shape or ()):
            e = symbolic.expr(size)
            if isinstance(e, int):
                checks.append(f"sizes[{i}][{d}] == {e}")
            elif bound.get(e) != (i, d):
                checks.append(f"sizes[{i}][{d}] == {printer(size)}")
    for sym in bound:
        r = env.var_to_range.get(sym)
        if r is not None:
            if isinstance(r.lower, sympy.Integer):
                checks.append(f"{sym} >= {int(r.lower)}")
            if isinstance(r.upper, sympy.Integer):
                checks.append(f"{sym} <= {int(r.upper)}")
                upper.append(_print_bool(sym <= int(r.upper), readable))
    seen = set()
    for k, g in enumerate(env.guards):
        cond = env.simplify(g.expr)
        if cond == sympy.true or cond in seen:
            continue
        seen.add(cond)
        missing = cond.free_symbols - set(bound)
        if missing:
            raise KilnError(f"a guard of the program ({cond}) reads sizes no argument gives "
                            f"({', '.join(map(str, missing))}); compiling for this batch's sizes instead")
        checks.append(_print_bool(cond, printer))
        who = "kiln" if k >= guards_before else "the model"
        where = _location(g)
        text = _print_bool(cond, readable)
        readable_guards.append(f"{text}  ({who}{': ' + where if where else ''})")
        upper = [u for u in upper if u != text]             # a range the guards already say
    for cond, why in extra or ():
        if cond.free_symbols - set(bound):
            continue                       # sizes no argument gives: not checkable, and not needed for exactness
        checks.append(_print_bool(cond, printer))
        readable_guards.append(f"{_print_bool(cond, readable)}  ({why})")
    name = f"kiln_accepts_{next(_count)}"
    body = "\n".join(lines + [f"    return {' and '.join(f'({c})' for c in checks) or 'True'}"])
    source = f"def {name}(sizes):\n{body}\n"
    from kiln.runtime.codegen import define
    fn = define(source, name, {"math": __import__("math"), "torch": torch}, f"<{name}>")
    return Signature(sizes, names, True, upper + readable_guards, _specialized(asked, sizes, names),
                     fn, source)


def _print_bool(cond, printer: symbolic.SizePrinter) -> str:
    from torch.utils._sympy.printers import PythonPrinter
    local = cond.xreplace({s: sympy.Symbol(printer.names[s], integer=True) for s in cond.free_symbols})
    return PythonPrinter().doprint(local)


def _sources(sizes: tuple) -> dict:
    found: dict = {}
    for i, shape in enumerate(sizes):
        for d, size in enumerate(shape or ()):
            e = symbolic.expr(size)
            if not isinstance(e, int) and e.is_Symbol and e not in found:
                found[e] = (i, d)
    return found


def _location(guard) -> str:
    """Where a guard was decided, when that is the model's code or Kiln's (a frame inside torch, where most
    of export's guards are recorded, says nothing to the user)."""
    import os
    sloc = getattr(guard, "sloc", None)
    user = getattr(sloc, "maybe_user_loc", None)
    if user:
        return str(user)
    frame = getattr(sloc, "framework_loc", None)
    filename = getattr(frame, "filename", "")
    if not filename or filename.startswith(os.path.dirname(torch.__file__)):
        return ""
    return f"{filename.rsplit('/', 1)[-1]}:{frame.lineno}"


def _specialized(asked: dict | None, sizes: tuple, names: list[str]) -> list[str]:
    """The dims the policy asked to be dynamic that the model fixed (torch.export kept them static)."""
    out = []
    for i, dims in sorted((asked or {}).items()):
        for d in sorted(dims):
            size = sizes[i][d] if sizes[i] is not None else None
            if isinstance(symbolic.expr(size), int):
                out.append(f"{names[i]}.size({d}) = {size}")
    return out
