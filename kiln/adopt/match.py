"""Matching normalized pattern trees against normalized source trees.

`match(pattern, subject, types)` yields every consistent binding of `$variables`.  `*` and `+` are
n-ary and unordered, so their operands are matched as multisets (backtracking; operand lists are
short).  A variable that occurs more than once must bind equal *pure* trees: in practice the same
SSA value (`x * sigmoid(x)`), never two evaluations of a call that could differ (dropout, a
module), and never two unrelated tensors that merely share a Python name (versions differ).
"""
from __future__ import annotations

import math
from typing import Iterator

from kiln.adopt.expr import Expr

REL_TOL = 1e-6   # constants written with ~7+ significant digits still match (0.7978845608)


def const_equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12)
    return type(a) is type(b) and a == b


def type_ok(kind: str, e: Expr) -> bool:
    if kind == "tensor":
        return e.op != "const"
    if kind == "number":
        return e.is_num()
    return True


def match(p: Expr, s: Expr, types: dict, env: dict | None = None) -> Iterator[dict]:
    env = {} if env is None else env
    if p.op == "pvar":
        bound = env.get(p.value)
        if bound is None:
            if type_ok(types.get(p.value, "tensor"), s):
                yield {**env, p.value: s}
        elif bound is s or (bound.key == s.key and s.pure):
            yield env
        return
    if p.op == "const":
        if s.op == "const" and const_equal(p.value, s.value):
            yield env
        return
    if p.op != s.op or len(p.args) != len(s.args) or len(p.kw) != len(s.kw):
        return
    if p.op == "leaf":
        if p.key == s.key:
            yield env
        return
    if p.value != s.value or sorted(k for k, _ in p.kw) != sorted(k for k, _ in s.kw):
        return
    s_kw = dict(s.kw)
    pairs = list(zip(p.args, s.args)) + [(v, s_kw[k]) for k, v in p.kw]
    if p.op in ("*", "+"):
        yield from _match_unordered(list(p.args), list(s.args), types, env)
    else:
        yield from _match_seq(pairs, types, env)


def _match_seq(pairs, types, env) -> Iterator[dict]:
    if not pairs:
        yield env
        return
    (p, s), rest = pairs[0], pairs[1:]
    for env2 in match(p, s, types, env):
        yield from _match_seq(rest, types, env2)


def _match_unordered(ps: list[Expr], ss: list[Expr], types, env) -> Iterator[dict]:
    if not ps:
        if not ss:
            yield env
        return
    # Structured operands first: they bind the variables that the bare `$x` operands then check.
    ps = sorted(ps, key=lambda e: e.op == "pvar" and e.value not in env)
    first, rest = ps[0], ps[1:]
    for i, s in enumerate(ss):
        for env2 in match(first, s, types, env):
            yield from _match_unordered(rest, ss[:i] + ss[i + 1:], types, env2)
