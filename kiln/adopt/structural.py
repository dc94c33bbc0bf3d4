"""Rules written in Python: patterns the DSL cannot state (control flow, `__init__` facts, helpers).

A structural rule looks at one normalized expression tree (the same trees the DSL rules match) and
the function around it, and answers with a `Found`: the bound sub-expressions, the replacement lines
(DSL nodes, rendered by the same synthesis as DSL rules), or a reason to report the location without
rewriting it.  `sdpa` lives here because hand-written attention comes in many combinations (scale on
the scores or on q, a mask added under `if mask is not None:`, a float32 softmax cast back, an
`nn.Softmax` or `nn.Dropout` module ...) it lives in `attention.py` (rewrites) and `attention_flow.py`
(locations found by data flow); the detections of issue 6 (swiglu, rope, linear_gelu,
dropout_add_layernorm, fused_qkv, linear_cross_entropy) live in `detect.py`.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import libcst as cst

from kiln.adopt.analysis import Function, Phi
from kiln.adopt.dsl import Attr, Item, Node, Opaque, Tuple, Var
from kiln.adopt.expr import Expr, TreeBuilder


@dataclass
class Found:
    """A location.  `replace` is None for a report-only match, whose `reason` says why."""
    env: dict                                # $name -> bound tree
    replace: list | None = None              # DSL replacement lines
    reason: str | None = None
    raw: Expr | None = None                  # the matched tree, when not the node's own tree
    phis: list = field(default_factory=list)  # `if` statements folded into the match (deleted with it)


@dataclass
class StructuralRule:
    name: str
    doc: str
    find: object          # (Context, Node, raw Expr, normalized Expr) -> Found | None
    overlaps: bool = False   # also look at expressions another match already covers (report-only rules)
    locate: object = None    # (Context) -> [(first line, last line, reason)]: data-flow finds, reported
    statements: object = None   # (Context, spell) -> [StatementRewrite]: rewrites of whole statements


class Context:
    """What a structural rule may look at besides the tree: the function, its trees, `__init__`."""

    def __init__(self, fn: Function, builder: TreeBuilder, normalize, functions=(), configs=None):
        self.fn, self.builder, self.normalize = fn, builder, normalize
        self.configs = configs          # ConfigDefaults of the file (config field defaults), or None
        self.functions = {f.name: f for f in functions if f.cls is None}    # module-level helpers
        self.methods = {f.name: f for f in functions if f.cls is not None and f.cls == fn.cls}   # the class's own
        self._phi_builder = None
        self.split_reasons: dict = {}   # sdpa: line of a product with v -> why no split applies there

    def phi_builder(self) -> "GuardBuilder":
        if self._phi_builder is None:
            self._phi_builder = GuardBuilder(self.fn)
        return self._phi_builder

    def init_exprs(self, module: Expr) -> list:
        """For a `self.attr` operand: the expressions __init__ assigns to `self.attr` (maybe several)."""
        if module is None or module.op != "." or not module.args or module.args[0].op != "leaf" \
                or module.args[0].value != ("var", self.fn.params[0] if self.fn.params else None):
            return []
        return self.fn.init.get(module.value, [])

    def qualname(self, expr) -> str:
        return self.fn.resolver.qualname(expr) or ""


class GuardBuilder(TreeBuilder):
    """Trees that also see through `if m is not None: s = s + m` (no else).

    After that `if`, `s` is `s_before + m` or `s_before`; the tree is `s_before + guard(m)`, where
    `guard` prints as `m if m is not None else None`.  Only sdpa reads these trees: its mask
    argument accepts None, so the replacement is right on both paths.  `phis` collects the `if`
    statements folded into a tree (deleted with the match)."""

    def __init__(self, fn: Function):
        super().__init__(fn.nodes, inline=self._inline)
        self.fn = fn
        self.forced: set = set()
        self.phis: dict = {}         # phi value -> Phi, for those folded
        self.checks_ok = False       # fold `if m is not None:` with size checks in it (the split keeps them)

    def _inline(self, name: str) -> bool:
        return self.fn.inlinable(name) or name in self.forced

    def value(self, name: str) -> Expr:
        phi = self.fn.phis.get(name)
        if phi is not None and name not in self.cache:
            guarded = self._guarded(phi)
            if guarded is not None:
                before, mask, test, views = guarded
                self.forced.add(before)
                scores = self.value(before)
                if views is not None:       # `s = s.view(a) + m; s = s.view(b)`: the mask added to a view
                    inner, outer = views
                    scores = self._view(inner, scores)
                e = Expr("+", [scores, Expr("guard", [self.operand(mask)], value=test)])
                if views is not None:
                    e = self._view(outer, e)
                e.set_origin(e.src, name)
                self.cache[name] = e
                self.phis[name] = phi
                return e
        return super().value(name)

    def _view(self, node, base: Expr) -> Expr:
        e = Expr(node.op, [base] + [self.operand(a) for a in node.args[1:]], [(k, self.operand(v)) for k, v in node.kwargs])
        e.set_origin(node.cst, None)
        return e

    def _guarded(self, phi: Phi):
        """(value before, mask operand, (tested name, its version), views) for a foldable `if`, else
        None; `views` is (the view of the scores, the view back) when the mask is added to a view of
        the scores (`s = s.view(b, h, t, k) + m; s = s.view(b * h, t, k)`), else None."""
        fn = self.fn
        test = phi.if_cst.test
        # read once, after the `if` (or inside a following foldable `if` that forced it here)
        reader = fn.reader_block.get(phi.value)
        if not (phi.before and fn.uses[phi.value] == 1 and (reader is phi.block or phi.value in self.forced)
                and isinstance(test, cst.Comparison) and len(test.comparisons) == 1
                and isinstance(test.left, cst.Name) and isinstance(test.comparisons[0].operator, cst.IsNot)
                and isinstance(test.comparisons[0].comparator, cst.Name)
                and test.comparisons[0].comparator.value == "None"
                and test.left.value in phi.env):
            return None
        body = phi.if_cst.body
        if not isinstance(body, cst.IndentedBlock) or not all(
                isinstance(s, cst.SimpleStatementLine) and all(
                    isinstance(x, cst.Assign) and all(isinstance(t.target, cst.Name) for t in x.targets)
                    # `s += m` on fresh scores nothing else reads is `s = s + m` (analysis: `updated`)
                    or isinstance(x, cst.AugAssign) and isinstance(x.target, cst.Name)
                    and isinstance(x.operator, cst.AddAssign) and phi.before in fn.updated
                    for x in s.body)
                # a size check of the mask stays with it (only a builder that keeps checks folds these)
                or self.checks_ok and is_check(s) and phi.before not in _versions_read(fn, s)
                for s in body.body):
            return None
        # every other name the `if` assigns is a temporary of the mask, unused after it
        for other in fn.phis.values():
            if other.if_cst is phi.if_cst and other is not phi and fn.uses[other.value]:
                return None
        add, views = fn.defs.get(phi.inner), None
        if add is not None and add.op in (".view", ".reshape") and add.args and isinstance(add.args[0], Var) \
                and fn.inlinable(add.args[0].name):
            views = add
            add = fn.defs.get(add.args[0].name)
        if add is None or add.op != "+" or add.stmt is None or add.stmt.block is not phi.body:
            return None
        own = {add.out.python_name} | ({views.out.python_name} if views is not None else set())
        if sum(1 for n in phi.body.items if isinstance(n, Node) and n.out is not None
               and n.out.python_name in own) != 1 + (views is not None) \
                or fn.uses[phi.before] - self.check_reads[phi.before] != 1 \
                or fn.uses[phi.inner]:      # the sum is read only after the `if`, through the phi
            return None
        for n in phi.body.items:     # anything else the `if` computes only feeds the mask
            if isinstance(n, Node) and n.out is not None and not n.out.is_temp and n.out.name != phi.inner \
                    and not fn.inlinable(n.out.name):
                return None
        a, b = add.args
        if views is not None:       # one term is a view of the scores, read only here
            inner = [x for x in (a, b) if isinstance(x, Var) and fn.inlinable(x.name) and fn.defs.get(x.name)
                     is not None and fn.defs[x.name].op == views.op and fn.defs[x.name].args[:1] == (Var(phi.before),)]
            if len(inner) != 1:
                return None
            mask, views = (b if inner[0] == a else a), (fn.defs[inner[0].name], views)
        else:
            mask = b if a == Var(phi.before) else a if b == Var(phi.before) else None
        if mask is None or phi.inner in fn.mutated or phi.before in fn.mutated:
            return None
        name = test.left.value
        return phi.before, mask, (name, phi.env[name]), views

    @property
    def check_reads(self) -> Counter:
        """Reads by size checks, which a builder that keeps checks does not count as uses."""
        return check_reads(self.fn) if self.checks_ok else Counter()


def is_check(stmt) -> bool:
    """`if <test>: raise ...` without else: a check that stops the run and computes nothing."""
    return isinstance(stmt, cst.If) and stmt.orelse is None and isinstance(stmt.body, cst.IndentedBlock) \
        and all(isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, cst.Raise) for x in s.body)
                for s in stmt.body.body)


def _versions_read(fn: Function, node) -> set:
    return {fn.name_version[id(n)] for n in _cst_walk(node) if isinstance(n, cst.Name) and id(n) in fn.name_version}


def check_reads(fn: Function) -> Counter:
    """value -> how many of its reads are in size checks (`if s.size() != (...): raise ...`)."""
    counts = getattr(fn, "_check_reads", None)
    if counts is None:
        counts = Counter()
        for n in _cst_walk(fn.cst.body):
            if is_check(n):
                counts.update(fn.name_version[id(x)] for x in _cst_walk(n)
                              if isinstance(x, cst.Name) and id(x) in fn.name_version)
        fn._check_reads = counts
    return counts


def _cst_walk(node):
    yield node
    for child in node.children:
        yield from _cst_walk(child)


# ----------------------------------------------------------------------------------------------
# helpers shared by the Python rules

def _returns(fn: Function) -> list[Node]:
    out, stack = [], [fn.body]
    while stack:
        block = stack.pop()
        for item in block.items:
            if isinstance(item, Node):
                if item.op == "return":
                    out.append(item)
            else:
                stack.append(item)
    return out


def _reads(node: Node, name: str) -> bool:
    def visit(op) -> bool:
        if isinstance(op, Var):
            return op.name == name
        if isinstance(op, (Attr, Item)):
            return visit(op.base) or (isinstance(op, Item) and name in op.reads)
        if isinstance(op, Tuple):
            return any(visit(i) for i in op.items)
        if isinstance(op, Opaque):
            return name in op.reads
        return False

    return any(visit(a) for a in list(node.args) + [v for _, v in node.kwargs])


def code_of(node) -> str:
    """The source text of a libcst node."""
    return cst.Module(body=[]).code_for_node(node)


def flat(text: str) -> str:
    """`text` without whitespace, for comparing source fragments."""
    return re.sub(r"\s+", "", text)
