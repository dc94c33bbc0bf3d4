"""A small pattern language over the IR, for dialect fusion (after RAF's FuseDialect and tinygrad's UPat).

A pattern describes the tree of producers behind one value:

    Op(aten.mul.Tensor, V("w"), Op(aten.rsqrt.default, V("var")), commutative=True)

- `Op(targets, *args, name=, where=, commutative=)`: a value produced by a node whose target is one of
  `targets`, with arguments matching `args` positionally (arguments the node omits are compared against
  the schema's defaults); `commutative` also tries the first two arguments swapped.
- `V(name, where=)`: any argument (a Value or a Python constant), bound to `name`. A name used twice
  must bind the same Value (by identity) or equal constants, so `mul(V("x"), V("x"))` is x*x only.
- `Lit(value)` / `Lit(predicate)`: a Python constant equal to value / accepted by predicate.
- `Opt(targets, inner)`: either `inner` or one of `targets` applied to it (an optional cast or view).
- `Seq(*items)`: a list argument (the tensors of a `cat`) matched item by item.
- `where=predicate(value)`: a dtype/shape check on the matched value.

`match(pattern, node)` returns a `Match` (bindings and the nodes the match covers) or None. Repetition
over the graph (all optimizer updates, query/key pairs) is the fusion's `group_by`, see
`kiln.dialects.registry.fusion`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch._ops import OpOverload

from kiln.ir.graph import Node, Value

_MISSING = object()


class Pattern:
    def match(self, x: Any, m: "Match") -> bool:
        raise NotImplementedError


@dataclass
class Match:
    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)   # covered nodes, root first

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def copy(self) -> "Match":
        return Match(dict(self.bindings), list(self.nodes))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Value) or isinstance(b, Value):
        return a is b
    return type(a) is type(b) and a == b


class V(Pattern):
    """Any argument, bound to `name` (consistently across the pattern)."""

    def __init__(self, name: str, where: Callable[[Any], bool] | None = None):
        self.name, self.where = name, where

    def match(self, x, m):
        if self.where is not None and not self.where(x):
            return False
        if self.name in m.bindings:
            return _same(m.bindings[self.name], x)
        m.bindings[self.name] = x
        return True


class Lit(Pattern):
    """A Python constant: equal to `value`, or accepted by it when it is callable."""

    def __init__(self, value: Any, name: str | None = None):
        self.value, self.name = value, name

    def match(self, x, m):
        if isinstance(x, Value):
            return False
        ok = self.value(x) if callable(self.value) else x == self.value
        if ok and self.name:
            m.bindings[self.name] = x
        return bool(ok)


class Op(Pattern):
    def __init__(self, targets, *args: Pattern | Any, name: str | None = None,
                 where: Callable[[Value], bool] | None = None, commutative: bool = False):
        self.targets = tuple(targets) if isinstance(targets, (tuple, list, set, frozenset)) else (targets,)
        self.args = tuple(a if isinstance(a, Pattern) else Lit(a) for a in args)
        self.name, self.where, self.commutative = name, where, commutative

    def match(self, x, m):
        if not isinstance(x, Value) or x.producer is None:
            return False
        if self.where is not None and not self.where(x):
            return False
        return self.match_node(x.producer, m, x)

    def match_node(self, n: Node, m: "Match", x: Value | None = None) -> bool:
        if n.target not in self.targets:
            return False
        actual = [_arg(n, i) for i in range(len(self.args))]
        if any(a is _MISSING for a in actual):
            return False
        orders = [actual]
        if self.commutative and len(actual) >= 2:
            orders.append([actual[1], actual[0], *actual[2:]])
        for order in orders:
            trial = m.copy()
            if all(p.match(a, trial) for p, a in zip(self.args, order)):
                if n not in trial.nodes:
                    trial.nodes.append(n)
                if self.name is not None and x is not None:
                    if self.name in trial.bindings and trial.bindings[self.name] is not x:
                        continue
                    trial.bindings[self.name] = x
                m.bindings, m.nodes = trial.bindings, trial.nodes
                return True
        return False


class Seq(Pattern):
    """A Python list/tuple argument (cat's tensors) whose items match `items` one for one."""

    def __init__(self, *items: Pattern | Any):
        self.items = tuple(a if isinstance(a, Pattern) else Lit(a) for a in items)

    def match(self, x, m):
        if not isinstance(x, (list, tuple)) or len(x) != len(self.items):
            return False
        return all(p.match(a, m) for p, a in zip(self.items, x))


class Opt(Pattern):
    """`inner`, optionally wrapped in one of `targets` (e.g. a dtype cast): Opt(aten._to_copy.default, p)."""

    def __init__(self, targets, inner: Pattern, name: str | None = None):
        self.wrapped = Op(targets, inner, name=name)
        self.inner, self.name = inner, name

    def match(self, x, m):
        trial = m.copy()
        if self.wrapped.match(x, trial):
            m.bindings, m.nodes = trial.bindings, trial.nodes
            return True
        trial = m.copy()
        if self.inner.match(x, trial):
            if self.name is not None:
                trial.bindings.setdefault(self.name, x)
            m.bindings, m.nodes = trial.bindings, trial.nodes
            return True
        return False


def _arg(n: Node, i: int) -> Any:
    """Positional argument i of node n, from args, kwargs or the schema's default."""
    if i < len(n.args):
        return n.args[i]
    if not isinstance(n.target, OpOverload):
        return _MISSING
    schema = n.target._schema.arguments
    if i >= len(schema):
        return _MISSING
    a = schema[i]
    if a.name in n.kwargs:
        return n.kwargs[a.name]
    return a.default_value if a.has_default_value() else _MISSING


def match(pattern: Op, node: Node) -> Match | None:
    """Match `pattern` with `node` as its root (the node's first output is the pattern's value); the
    root is the first covered node. Nodes without outputs (optimizer updates) match too."""
    m = Match()
    if not isinstance(pattern, Op):
        raise TypeError("a fusion pattern's root must be an Op pattern")
    out = node.outputs[0] if node.outputs else None
    if pattern.where is not None and (out is None or not pattern.where(out)):
        return None
    if not pattern.match_node(node, m, out):
        return None
    m.nodes.remove(node)
    m.nodes.insert(0, node)
    return m
