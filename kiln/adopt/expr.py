"""Expression trees over DSL nodes, normalized so that algebraically equal spellings compare equal.

A DSL line reads values; a value used exactly once in the same block is inlined into its reader, so
`y = 0.5 * x * (1 + t)` over several temporaries becomes one tree.  `normalize` then rewrites a tree
into a canonical form:

* `a - b` -> `a + (-1) * b`, `a / c` -> `a * (1/c)` for a constant c, `a / b` -> `a * b ** -1`;
* `*` and `+` are n-ary and unordered; constants are folded (`math.sqrt(2 / math.pi)` is a number);
* products of equal pure factors become powers (`x * x * x` -> `x ** 3`, `pow(x, 3.0)` too);
* products distribute over sums and like terms are collected, so `0.5 * x * (1 + t)` and
  `x * (0.5 + 0.5 * t)` have the same form;
* `sqrt(v) ** -1`, `v ** -0.5` and `1 / sqrt(v)` are `rsqrt(v)`.

Patterns are normalized the same way, so a rule written once matches every spelling.  Each tree
keeps `src` (the libcst expression that computes the same value) and `var` (the named value it was
inlined from), which is how a bound sub-expression is printed back into source.
"""
from __future__ import annotations

import itertools
import math

from kiln.adopt.canon import PURE_OPS
from kiln.adopt.dsl import Attr, Const, Item, Opaque, Ref, Tuple, Var

LEAVES = ("leaf", "const", "pvar")
NUMERIC_REFS = {"math.pi": math.pi, "torch.pi": math.pi, "numpy.pi": math.pi, "math.e": math.e,
                "math.inf": math.inf, "math.tau": math.tau}
_FOLD = {"sqrt": math.sqrt, "exp": math.exp, "tanh": math.tanh, "erf": math.erf, "log": math.log,
         "rsqrt": lambda v: 1.0 / math.sqrt(v)}
MAX_TERMS = 64          # distributing further would only blow trees up; leave such products alone


class Expr:
    """One tree node.  `key` is structural (ignores `src`/`var`); `reads` are the leaf values."""
    __slots__ = ("op", "args", "kw", "value", "src", "var", "pure", "key", "reads", "vars")

    def __init__(self, op, args=(), kw=(), value=None, src=None, var=None, reads=frozenset()):
        self.op, self.args, self.kw, self.value = op, tuple(args), tuple(kw), value
        self.src, self.var = src, var
        children = list(self.args) + [v for _, v in self.kw]
        self.pure = op in LEAVES or op in PURE_OPS or op in (".", "[]", "tuple")
        self.pure = self.pure and all(c.pure for c in children)
        self.reads = frozenset(reads).union(*(c.reads for c in children))
        self.vars = frozenset([var] if var else []).union(*(c.vars for c in children))
        keys = [c.key for c in self.args]
        if op in ("*", "+"):
            keys.sort(key=repr)
        self.key = (op, value, tuple(keys), tuple((k, v.key) for k, v in self.kw))

    def set_origin(self, src, var):
        self.src, self.var = src, var
        if var:
            self.vars = self.vars | {var}

    def is_num(self) -> bool:
        return self.op == "const" and isinstance(self.value, float)

    def walk(self):
        yield self
        for c in list(self.args) + [v for _, v in self.kw]:
            yield from c.walk()

    def __repr__(self):
        if self.op in LEAVES:
            return f"{self.op}:{self.value!r}"
        inner = ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kw])
        return f"{self.op}{'[' + repr(self.value) + ']' if self.value is not None else ''}({inner})"


def const(value) -> Expr:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    return Expr("const", value=value)


# ----------------------------------------------------------------------------------------------
# Building trees from DSL nodes

class TreeBuilder:
    """Builds the (raw) tree of each value over one list of nodes.

    `inline(var)` says whether a value's defining node may be folded into its single reader.
    For rule patterns every `$temporary` is inlined; for source, only single-use values of the
    same block (the analysis decides).  `leaf_key(var)` names a leaf value."""

    def __init__(self, nodes, inline, pattern_vars=frozenset()):
        self.defs = {n.out.name: n for n in nodes if n.out is not None}
        self.inline = inline
        self.pattern_vars = pattern_vars
        self.cache: dict[str, Expr] = {}

    def value(self, name: str) -> Expr:
        if name in self.pattern_vars:
            return Expr("pvar", value=name)
        node = self.defs.get(name)
        if node is None or not self.inline(name):
            return Expr("leaf", value=("var", name), reads={name})
        if name not in self.cache:
            self.cache[name] = self.node(node)
            if not name.startswith(("%", "$")):
                self.cache[name].set_origin(self.cache[name].src, name)
        return self.cache[name]

    def node(self, node) -> Expr:
        if node.op == "=":
            e = self.operand(node.args[0])
            if e.src is None and e.op in (".", "[]"):     # `m = mask[:, :, :T]`: printable from source
                e.set_origin(node.cst, None)
            return e
        args = [self.operand(a) for a in node.args]
        kw = [(k, self.operand(v)) for k, v in node.kwargs]
        if node.module is not None:     # the called module is an operand too: rules bind it ($m)
            kw.append(("__module__", self.operand(node.module)))
        e = Expr(node.op, args, kw)
        e.set_origin(node.cst, None)
        return e

    def operand(self, op) -> Expr:
        if isinstance(op, Var):
            return self.value(op.name)
        if isinstance(op, Const):
            return const(op.value)
        if isinstance(op, Ref):
            if op.name in NUMERIC_REFS:
                return const(NUMERIC_REFS[op.name])
            return Expr("leaf", value=("ref", op.name))
        if isinstance(op, Attr):
            return Expr(".", [self.operand(op.base)], value=op.name)
        if isinstance(op, Item):
            return Expr("[]", [self.operand(op.base)], value=(op.index, op.reads), reads=op.reads)
        if isinstance(op, Tuple):
            return Expr("tuple", [self.operand(i) for i in op.items])
        if isinstance(op, Opaque):
            return Expr("leaf", value=("opaque", op.code, op.reads), reads=op.reads)
        raise TypeError(f"not a DSL operand: {op!r}")


# ----------------------------------------------------------------------------------------------
# Normalization

def normalize(e: Expr, memo: dict | None = None) -> Expr:
    """The canonical form of `e` (see the module docstring); `memo` caches by node identity."""
    memo = {} if memo is None else memo
    hit = memo.get(id(e))
    if hit is not None:
        return hit[1]
    if e.op in LEAVES:
        result = e
    else:
        args = [normalize(a, memo) for a in e.args]
        kw = [(k, normalize(v, memo)) for k, v in e.kw]
        result = _rebuild(e.op, args, kw, e.value)
        if result.src is None and result.var is None:
            result.set_origin(e.src, e.var)
    memo[id(e)] = (e, result)     # keep `e` alive so its id is not reused
    return result


def _rebuild(op, args, kw, value) -> Expr:
    if op == "-" and len(args) == 2:
        return _add([args[0], _mul([const(-1.0), args[1]])])
    if op == "neg":
        return _mul([const(-1.0), args[0]])
    if op == "/" and len(args) == 2:
        if args[1].is_num() and args[1].value != 0:
            return _mul([args[0], const(1.0 / args[1].value)])
        return _mul([args[0], _pow(args[1], const(-1.0))])
    if op == "**" and len(args) == 2:
        return _pow(args[0], args[1])
    if op == "*":
        return _mul(args)
    if op == "+":
        return _add(args)
    if op in _FOLD and len(args) == 1 and not kw and args[0].is_num():
        try:
            return const(_FOLD[op](args[0].value))
        except (ValueError, ZeroDivisionError, OverflowError):
            pass
    return Expr(op, args, kw, value=value)


def _pow(base: Expr, exp: Expr) -> Expr:
    if base.is_num() and exp.is_num():
        try:
            return const(base.value ** exp.value)
        except (ZeroDivisionError, OverflowError):
            pass
    if exp.is_num():
        if exp.value == 1:
            return base
        if exp.value == 0.5:
            return Expr("sqrt", [base])
        if exp.value == -0.5:
            return Expr("rsqrt", [base])
        if exp.value == -1 and base.op == "sqrt":
            return Expr("rsqrt", base.args)
        if exp.value == -1 and base.op == "rsqrt":
            return Expr("sqrt", base.args)
    return Expr("**", [base, exp])


def _mul(factors: list[Expr]) -> Expr:
    flat = []
    for f in factors:
        flat.extend(f.args if f.op == "*" else [f])
    coeff, rest = 1.0, []
    for f in flat:
        if f.is_num():
            coeff *= f.value
        else:
            rest.append(f)
    sums = [f for f in rest if f.op == "+"]
    others = [f for f in rest if f.op != "+"]
    if sums and all(f.pure for f in rest) and math.prod(len(s.args) for s in sums) <= MAX_TERMS:
        # (a + b) * c -> a*c + b*c: one canonical form for every arrangement of a polynomial
        return _add([_mul([const(coeff)] + others + list(combo))
                     for combo in itertools.product(*(s.args for s in sums))])
    # Equal pure factors become one power: x * x ** 2 -> x ** 3.
    powers: dict = {}
    order = []
    for f in rest:
        base, exp = f, 1.0
        if f.op == "**" and f.args[1].is_num():
            base, exp = f.args[0], f.args[1].value
        key = base.key if base.pure else ("impure", id(f))
        if key not in powers:
            order.append(key)
            powers[key] = [base, 0.0, f]
        powers[key][1] += exp
    rest = []
    for key in order:
        base, exp, original = powers[key]
        if exp == 0:
            continue
        rest.append(original if original.key == _pow(base, const(exp)).key else _pow(base, const(exp)))
    if coeff != 1.0 or not rest:
        rest.insert(0, const(coeff))
    return rest[0] if len(rest) == 1 else Expr("*", rest)


def _add(terms: list[Expr]) -> Expr:
    flat = []
    for t in terms:
        flat.extend(t.args if t.op == "+" else [t])
    total, groups, order = 0.0, {}, []
    for t in flat:
        if t.is_num():
            total += t.value
            continue
        coeff, body = 1.0, t
        if t.op == "*" and t.args[0].is_num():
            coeff = t.args[0].value
            body = t.args[1] if len(t.args) == 2 else Expr("*", t.args[1:])
        key = body.key if body.pure else ("impure", id(t))
        if key not in groups:
            order.append(key)
            groups[key] = [body, 0.0]
        groups[key][1] += coeff
    out = []
    for key in order:
        body, coeff = groups[key]
        if coeff == 0 and body.pure:
            continue
        out.append(body if coeff == 1 else _mul([const(coeff), body]))
    if total != 0 or not out:
        out.append(const(total))
    return out[0] if len(out) == 1 else Expr("+", out)
