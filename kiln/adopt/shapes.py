"""How many dimensions a tensor has, when the source says so.

`k.transpose(2, 3)` is `k^T` only for a 4-D `k`; `torch.bmm` takes 3-D tensors.  The number of
dimensions is read from what made the value: `.view(B, T, nh, hs)` / `.reshape` / `.permute` with
that many arguments, a constructor in `__init__` (`torch.zeros((B, T, H, D))` for a cache buffer,
`torch.tril(...).view(1, 1, n, n)`), slices of such a value (`cache[:bsz, :end]`), shape-keeping
ops (transpose, casts, `contiguous`, arithmetic with numbers), `a, b, c = x.unbind(0)`, and the
`return`s of a module-level helper (`repeat_kv(x, n)`: `return x` or `return y.reshape(b, s, h, d)`).
Anything else is unknown (None): the caller then does not rely on the number.

The sizes themselves are known where the source checks them: after `if s.size() != (b * h, t, k):
raise ...` (in the block that made `s`), `s` has those sizes (`asserted`); `view_sizes` reads the sizes
a `.view(...)` call names.  Both are normalized trees over value versions, so `bsz * self.num_heads`
in a check and in a view compare equal.
"""
from __future__ import annotations

import libcst as cst

from kiln.adopt.dsl import Attr, Const, Item, Node, Opaque, Tuple, Var
from kiln.adopt.expr import Expr, const, normalize
from kiln.adopt.structural import _cst_walk, _returns, is_check

_SAME_RANK = {"transpose", "to", ".contiguous", ".float", ".half", ".type_as", "dropout", ".clone", ".detach",
              "neg", "tanh", "sigmoid", "torch.nn.Dropout", "=", ".masked_fill", "softmax", ".expand_as"}
_ELEMENTWISE = {"*", "+", "-", "/"}
_CONSTRUCTORS = ("zeros", "ones", "empty", "randn", "rand", "full")


class Ranks:
    """`Ranks(helpers).of(fn, operand)`: the number of dimensions of a DSL operand of `fn`, or None.

    `helpers` are the file's module-level functions by name (their `return`s are followed)."""

    def __init__(self, helpers: dict):
        self.helpers = helpers

    def of(self, fn, operand, env: dict | None = None, depth: int = 0) -> int | None:
        """`env` maps parameter names of `fn` to known ranks (when `fn` is a helper being called)."""
        if depth > 30:
            return None
        env = env or {}
        if isinstance(operand, Var):
            return self._value(fn, operand.name, env, depth)
        if isinstance(operand, Item):
            base = self.of(fn, operand.base, env, depth + 1)
            return base if base is not None and _plain_slices(operand.index) else None
        if isinstance(operand, Attr) and isinstance(operand.base, Var) and fn.cls is not None \
                and fn.params[:1] == [operand.base.name]:
            ranks = {_cst_rank(e, fn.resolver) for e in fn.init.get(operand.name, [])}
            return ranks.pop() if len(ranks) == 1 else None
        return None

    def _value(self, fn, name: str, env: dict, depth: int) -> int | None:
        if name in env:
            return env[name]
        for preds in (fn.merges.get(name), _phi_preds(fn, name)):
            if preds:
                ranks = {self._value(fn, p, env, depth + 1) for p in preds}
                return ranks.pop() if len(ranks) == 1 else None
        node = fn.defs.get(name)
        if node is None:
            return self._unpacked(fn, name, env, depth)
        return self.node(fn, node, env, depth + 1)

    def node(self, fn, node: Node, env: dict | None = None, depth: int = 0) -> int | None:
        env = env or {}
        op, args = node.op, list(node.args)
        if op in (".view", ".reshape", ".permute", ".expand"):
            dims = args[1:]
            if len(dims) == 1 and isinstance(dims[0], Tuple):
                dims = list(dims[0].items)
            if not dims or any(isinstance(d, Opaque) and d.code.startswith("*") for d in dims):
                return None
            return len(dims)
        if op == ".unsqueeze":
            r = self.of(fn, args[0], env, depth + 1) if args else None
            return r + 1 if r is not None else None
        if op in _SAME_RANK and args:
            return self.of(fn, args[0], env, depth + 1)
        if op in _ELEMENTWISE:
            # broadcasting: the larger rank; a module attribute of unknown rank is taken for the
            # scale it usually is (`q * self.scale`) only next to a tensor of known rank
            ranks = [(a, self.of(fn, a, env, depth + 1)) for a in args if not isinstance(a, Const)]
            known = [r for _, r in ranks if r is not None]
            unknown = [a for a, r in ranks if r is None]
            if not known or any(not isinstance(a, Attr) for a in unknown):
                return None
            return max(known)
        if op in ("torch.bmm", ".bmm"):
            return 3
        if op == "torch.cat" and args and isinstance(args[0], Tuple) and args[0].items:
            return self.of(fn, args[0].items[0], env, depth + 1)
        helper = self.helpers.get(op)
        if helper is not None and helper is not fn and len(args) <= len(helper.params) and not node.kwargs:
            inner = {p: self.of(fn, a, env, depth + 1) for p, a in zip(helper.params, args)}
            returns = [n for n in _returns(helper) if n.args]
            ranks = {self.of(helper, n.args[0], {k: v for k, v in inner.items() if v is not None}, depth + 1)
                     for n in returns}
            return ranks.pop() if returns and len(ranks) == 1 else None
        return None

    def _unpacked(self, fn, name: str, env: dict, depth: int) -> int | None:
        """`q, k, v = qkv.unbind(0)` (one dim fewer) or `q, k, v = x.split(n, dim=2)` / `.chunk` (same)."""
        for n in fn.nodes:
            if n.op != "store" or len(n.args) != 2 or not isinstance(n.args[1], Var):
                continue
            targets = [t.strip() for t in n.args[0].code.split(",")] if isinstance(n.args[0], Opaque) else []
            if name.split(":")[0] not in targets or fn.def_stmt.get(name) is None \
                    or fn.def_stmt[name].cst is not n.stmt.cst:
                continue
            source = fn.defs.get(n.args[1].name)
            if source is None or not source.args:
                return None
            r = self.of(fn, source.args[0], env, depth + 1)
            if r is None:
                return None
            return r - 1 if source.op == ".unbind" else r if source.op in (".split", ".chunk") else None
        return None


def _phi_preds(fn, name):
    phi = fn.phis.get(name)
    return [v for v in (phi.before, phi.inner) if v] if phi is not None else None


def _plain_slices(index: str) -> bool:
    """`:bsz, :end` keeps every dimension; an integer index or None would change the count."""
    return all(":" in p for p in index.split(","))


def _cst_rank(expr, resolver) -> int | None:
    """Rank of an `__init__` expression: `torch.zeros((B, T, H, D))`, `torch.tril(...).view(1, 1, n, n)`."""
    if not isinstance(expr, cst.Call):
        return None
    func = expr.func
    name = resolver.qualname(func) or ""
    if isinstance(func, cst.Attribute) and func.attr.value in ("view", "reshape") and not name.startswith("torch."):
        args = [a for a in expr.args if a.keyword is None]
        if args and not any(a.star for a in args):
            if len(args) == 1 and isinstance(args[0].value, (cst.Tuple, cst.List)):
                return len(args[0].value.elements)
            return len(args)
        return None
    if name.startswith("torch.") and name.rsplit(".", 1)[-1] in _CONSTRUCTORS:
        args = [a for a in expr.args if a.keyword is None and not a.star]
        if name.endswith("full"):
            args = args[:1]
        if len(args) == 1 and isinstance(args[0].value, (cst.Tuple, cst.List)):
            return len(args[0].value.elements)
        return len(args) or None
    if name in ("torch.tril", "torch.triu") and expr.args:
        return _cst_rank(expr.args[0].value, resolver)
    return None


# -- sizes the source states ------------------------------------------------------------------------

_SIZE_OPS = {cst.Multiply: "*", cst.Add: "+", cst.Subtract: "-", cst.FloorDivide: "//"}


def size_tree(fn, node) -> Expr | None:
    """A size expression (`bsz * self.num_heads`, `tgt_len`, `-1`) as a normalized tree, names read
    by their version; None for anything else (calls, subscripts, starred shapes)."""
    def tree(n):
        if isinstance(n, cst.Name):
            version = fn.name_version.get(id(n))
            return Expr("leaf", value=("var", version) if version else ("ref", n.value))
        if isinstance(n, cst.Attribute):
            base = tree(n.value)
            return None if base is None else Expr(".", [base], value=n.attr.value)
        if isinstance(n, cst.Integer):
            return const(int(n.value, 0))
        if isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Minus):
            inner = tree(n.expression)
            return None if inner is None else Expr("neg", [inner])
        if isinstance(n, cst.BinaryOperation) and type(n.operator) in _SIZE_OPS:
            left, right = tree(n.left), tree(n.right)
            return None if left is None or right is None else Expr(_SIZE_OPS[type(n.operator)], [left, right])
        return None
    e = tree(node)
    return normalize(e) if e is not None else None


def view_sizes(fn, call) -> list | None:
    """The sizes `x.view(a, b, c)` / `x.reshape((a, b, c))` names (a libcst Call), or None."""
    if not isinstance(call, cst.Call) or any(a.keyword is not None or a.star for a in call.args):
        return None
    args = [a.value for a in call.args]
    if len(args) == 1 and isinstance(args[0], (cst.Tuple, cst.List)):
        args = [el.value for el in args[0].elements]
    sizes = [size_tree(fn, a) for a in args]
    return None if any(x is None for x in sizes) else sizes


def asserted(fn, value: str, positions, before: int) -> list | None:
    """The sizes of `value` as a check before line `before` states them: `if value.size() != (...):
    raise ...` (or `.shape`), in the block that defines `value`, so it runs whenever value exists."""
    made = fn.def_stmt.get(value)
    if made is None:
        return None
    suite = _suite_of(fn.cst, made.line_node)
    for stmt in getattr(suite, "body", ()):
        if not is_check(stmt) or positions[stmt].start.line >= before:
            continue
        test = stmt.test
        if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1
                and isinstance(test.comparisons[0].operator, cst.NotEqual)
                and isinstance(test.comparisons[0].comparator, (cst.Tuple, cst.List))):
            continue
        left = test.left
        if isinstance(left, cst.Call) and not left.args and isinstance(left.func, cst.Attribute) \
                and left.func.attr.value == "size":
            left = left.func.value
        elif isinstance(left, cst.Attribute) and left.attr.value == "shape":
            left = left.value
        else:
            continue
        if isinstance(left, cst.Name) and fn.name_version.get(id(left)) == value:
            sizes = [size_tree(fn, el.value) for el in test.comparisons[0].comparator.elements]
            if all(x is not None for x in sizes):
                return sizes
    return None


def _suite_of(fn_cst, line_node):
    for n in _cst_walk(fn_cst):
        if isinstance(n, cst.IndentedBlock) and any(s is line_node for s in n.body):
            return n
    return None


def view_round_trip(fn, there, back, scores: str | None, positions, viewed=None) -> str | None:
    """Why `(s.view(*there) + m).view(*back)` (libcst Calls `there` and `back`; `scores` is s's value,
    `viewed` the sizes s was itself viewed to, if it was) is not just s with a mask added after
    splitting its first dimension, or None when it is: `back` names the sizes a check states for s,
    and `there` splits the first of them and keeps the last two."""
    a, b = view_sizes(fn, there), view_sizes(fn, back)
    text = _code(there)
    if a is None or b is None or len(b) != 3 or len(a) < 4 or [x.key for x in a[-2:]] != [x.key for x in b[-2:]] \
            or normalize(Expr("*", a[:-2])).key != b[0].key:
        return (f"the scores are reshaped (`{text}`, then `{_code(back)}`) in a way other than splitting their "
                f"first dimension and merging it back")
    if viewed is not None and [x.key for x in viewed] == [x.key for x in b]:
        return None                  # viewed back already (a mask added through a view before)
    shape = asserted(fn, scores, positions, positions[there].start.line) if scores else None
    if shape is None or [x.key for x in shape] != [x.key for x in b]:
        return (f"the scores are viewed as `{text}` to add a mask, and no check before it shows that they "
                f"have the sizes of `{_code(back)}`")
    return None


def _code(node) -> str:
    return " ".join(cst.Module(body=[]).code_for_node(node).split())
