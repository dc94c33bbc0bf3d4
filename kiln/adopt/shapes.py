"""How many dimensions a tensor has, when the source says so.

`k.transpose(2, 3)` is `k^T` only for a 4-D `k`; `torch.bmm` takes 3-D tensors.  The number of
dimensions is read from what made the value: `.view(B, T, nh, hs)` / `.reshape` / `.permute` with
that many arguments, a constructor in `__init__` (`torch.zeros((B, T, H, D))` for a cache buffer,
`torch.tril(...).view(1, 1, n, n)`), slices of such a value (`cache[:bsz, :end]`), shape-keeping
ops (transpose, casts, `contiguous`, arithmetic with numbers), `a, b, c = x.unbind(0)`, and the
`return`s of a module-level helper (`repeat_kv(x, n)`: `return x` or `return y.reshape(b, s, h, d)`).
Anything else is unknown (None): the caller then does not rely on the number.
"""
from __future__ import annotations

import libcst as cst

from kiln.adopt.dsl import Attr, Const, Item, Node, Opaque, Tuple, Var
from kiln.adopt.structural import _returns

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
