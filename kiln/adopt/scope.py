"""What a module's names mean: imports, assignments in `__init__`, names a piece of code binds.

`Resolver` gives module-level names their qualified meaning (`F` -> `torch.nn.functional`), and
keeps the file's own `softmax` apart from torch's (`Resolver.qualname`);
`_self_types` reads what `__init__` assigns to `self.x` (the constructor's qualified name, and the
expressions, which rules read: `nn.Softmax(dim=-1)`, `ACT2FN[config.hidden_act]`, a registered
buffer); `_assigned_names` lists the names statements bind.  Used by `analysis.py`.
"""
from __future__ import annotations

import builtins

import libcst as cst

from kiln.adopt import canon

# What a name the file binds itself is called when it could be taken for one the analysis knows:
# `__file__.softmax` is the file's own `softmax`, never torch's.
HERE = "__file__"

# Bare names with a meaning of their own in the analysis and the rules: canonical ops (`softmax`,
# `sigmoid`, `erf` ...), the modules qualified names start with (`torch.`, `math.`, `Tensor.`), and
# Python's builtins (`len`, `float`, `abs`), which the analysis names by their bare name.
_KNOWN = [*canon.SIGNATURES, "to", "torch", "kiln", *(q.split(".")[0] for q in [*canon.CANONICAL, *canon.PURE_CALLS])]
RESERVED = frozenset(n for n in _KNOWN if n.isidentifier())


def _inherited_init(cls: cst.ClassDef, classes: dict, depth: int = 0):
    """The `__init__` a class runs: its own, else that of its single base class when that base is
    defined in the same file (`LlamaFlashAttention2(LlamaAttention)` builds q/k/v in the base's)."""
    own = next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
    if own is not None or depth > 8:
        return own
    bases = [b.value for b in cls.bases if b.keyword is None]
    if len(bases) == 1 and isinstance(bases[0], cst.Name) and bases[0].value in classes \
            and classes[bases[0].value] is not cls:
        return _inherited_init(classes[bases[0].value], classes, depth + 1)
    return None


class Resolver:
    """Qualified names of module-level names: `F` -> `torch.nn.functional` after
    `import torch.nn.functional as F`, `nn.Linear` -> `torch.nn.Linear` after `from torch import nn`.

    libcst's QualifiedNameProvider answers the same question but costs seconds per large file
    (it builds every scope); within a method only module-level bindings matter here, since the
    analysis treats every name the function assigns as a local value.  A name bound to two
    different things at module level (say, in both branches of an `if`) resolves to nothing.

    A name is torch's only through an import.  Where its bare name means something to the analysis
    (`RESERVED`), a name the file defines itself (`def softmax(x, dim): ...`, `softmax = ...`), binds
    to two things, or leaves unbound without it being a builtin (a `from lib import *` may bring
    anything) resolves to `__file__.<name>`, which no rule or detector knows."""

    def __init__(self, module: cst.Module):
        self.bindings: dict[str, str | None] = {}
        self.imported: set[str] = set()        # names some import binds
        self._scan(module.body)

    def _bind(self, name: str, target: str):
        old = self.bindings.get(name, target)
        self.bindings[name] = target if old == target else None

    def _scan(self, body):
        for stmt in body:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                self._bind(stmt.name.value, stmt.name.value)
            elif isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                for small in stmt.body:
                    self._small(small)
            elif isinstance(stmt, (cst.If, cst.Try, cst.With, cst.For, cst.While)):
                for part in [stmt] + [getattr(stmt, a, None) for a in ("orelse", "finalbody")] \
                        + list(getattr(stmt, "handlers", ())):
                    while isinstance(part, (cst.If, cst.Else, cst.Try, cst.With, cst.For, cst.While,
                                            cst.ExceptHandler, cst.Finally)):
                        self._scan(part.body.body if isinstance(part.body, cst.IndentedBlock) else [part.body])
                        part = part.orelse if isinstance(part, cst.If) else None

    def _small(self, small):
        if isinstance(small, cst.Import):
            for alias in small.names:
                full = _code(alias.name)
                local = _code(alias.asname.name) if alias.asname is not None else full.split(".")[0]
                self._bind(local, full if alias.asname is not None else local)
                self.imported.add(local)
        elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
            base = "." * len(small.relative) + (_code(small.module) if small.module is not None else "")
            for alias in small.names:
                name = _code(alias.name)
                local = _code(alias.asname.name) if alias.asname is not None else name
                self._bind(local, f"{base}.{name}" if not base.endswith(".") else base + name)
                self.imported.add(local)
        elif isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
            for name in _assigned_names([small]):
                self._bind(name, name)

    def foreign(self, name: str) -> bool:
        """Is the module-level `name` not known to be an import or a builtin: defined by the file
        itself, bound to different things, or bound by nothing that is not a builtin?"""
        if name not in self.bindings:
            return not hasattr(builtins, name)
        return self.bindings[name] is None or name not in self.imported

    def qualname(self, node) -> str | None:
        if isinstance(node, cst.Name):
            name = node.value
            if name in RESERVED and self.foreign(name):
                return f"{HERE}.{name}"     # the file's own `softmax`: not torch's
            return self.bindings.get(name, name)    # unbound: a builtin, by its name
        if isinstance(node, cst.Attribute):
            base = self.qualname(node.value)
            return None if base is None else f"{base}.{node.attr.value}"
        return None


def _built(value, helpers: dict, self_name: str, depth: int = 0):
    """The constructor call an `__init__` value comes down to.  A call of a helper of the same file
    (a module-level function, or a method through `self.`) whose every return is the module it was
    given (fairseq's `quant_noise(nn.Linear(...), p, block)`, which only registers a hook) or one it
    builds (`self.build_fc(i, o)` returning `quant_noise(nn.Linear(i, o), ...)`) is that module's
    constructor; anything else is the value itself."""
    if not isinstance(value, cst.Call) or depth > 4:
        return value
    func, method = value.func, False
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == self_name:
        func, method = func.attr, True
    helper = helpers.get((method, func.value)) if isinstance(func, cst.Name) else None
    if helper is None or any(a.star for a in value.args):
        return value
    names = [p.name.value for p in helper.params.params][1 if method else 0:]
    given = {names[i]: a.value for i, a in enumerate(value.args) if a.keyword is None and i < len(names)}
    given.update({a.keyword.value: a.value for a in value.args if a.keyword is not None})
    built = []
    for ret in (n for n in _walk(helper.body) if isinstance(n, cst.Return)):
        r = ret.value
        r = given.get(r.value) if isinstance(r, cst.Name) and r.value in names else r
        built.append(_built(r, helpers, self_name, depth + 1))
    kinds = {_code(b.func) if isinstance(b, cst.Call) else None for b in built}
    return built[0] if built and len(kinds) == 1 and None not in kinds else value


def _self_types(init: cst.FunctionDef, resolver: Resolver, helpers: dict | None = None) -> tuple[dict[str, str], dict]:
    """`self.fc = nn.Linear(...)` in __init__ -> {"fc": "torch.nn.Linear"}; conflicting types drop out.
    `helpers` ({(is_method, name): FunctionDef}) are looked through (`_built`).

    Also returns {attribute: [expressions assigned to it]} (rules read constructor arguments from
    them: `nn.Softmax(dim=-1)`, `ACT2FN[config.hidden_act]`)."""
    params = init.params.params
    if not params:
        return {}, {}
    self_name = params[0].name.value
    found: dict[str, set] = {}
    exprs: dict[str, list] = {}
    for node in _walk(init.body):
        if isinstance(node, cst.Assign) and len(node.targets) == 1:
            target = node.targets[0].target
            if (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name)
                    and target.value.value == self_name):
                kind = None
                value = _built(node.value, helpers or {}, self_name)
                if isinstance(value, cst.Call):
                    kind = resolver.qualname(value.func)
                found.setdefault(target.attr.value, set()).add(kind)
                exprs.setdefault(target.attr.value, []).append(value)
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) \
                and node.func.attr.value == "register_buffer" and isinstance(node.func.value, cst.Name) \
                and node.func.value.value == self_name and len(node.args) >= 2 \
                and isinstance(node.args[0].value, cst.SimpleString):
            # self.register_buffer("bias", torch.tril(...)): what `self.bias` holds (rules read it)
            name = node.args[0].value.evaluated_value
            if isinstance(name, str):
                exprs.setdefault(name, []).append(node.args[1].value)
    types = {k: next(iter(v)) for k, v in found.items() if len(v) == 1 and None not in v}
    return types, exprs


def _walk(node):
    stack = list(node) if isinstance(node, (list, tuple)) else [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children))


_CODE_MODULE = cst.Module(body=[])


def _code(node) -> str:
    if isinstance(node, (list, tuple)):
        return ", ".join(_code(n) for n in node)
    return _CODE_MODULE.code_for_node(node)


class _AssignedNames(cst.CSTVisitor):
    """Names bound by a piece of code, not descending into nested scopes (defs, lambdas, comprehensions)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.outer: set[str] = set()     # `global g` / `nonlocal g`: stores to another scope

    def _target(self, t):
        if isinstance(t, cst.Name):
            self.names.add(t.value)
        elif isinstance(t, (cst.Tuple, cst.List)):
            for el in t.elements:
                self._target(el.value)
        elif isinstance(t, cst.StarredElement):
            self._target(t.value)

    def visit_AssignTarget(self, node):
        self._target(node.target)

    def visit_AnnAssign(self, node):
        self._target(node.target)

    def visit_AugAssign(self, node):
        self._target(node.target)

    def visit_For(self, node):
        self._target(node.target)

    def visit_WithItem(self, node):
        if node.asname is not None:
            self._target(node.asname.name)

    def visit_ExceptHandler(self, node):
        if node.name is not None:
            self._target(node.name.name)

    def visit_NamedExpr(self, node):
        self._target(node.target)

    def visit_Import(self, node):
        for alias in node.names:
            self.names.add(_code(alias.asname.name) if alias.asname else _code(alias.name).split(".")[0])

    def visit_ImportFrom(self, node):
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                self.names.add(_code(alias.asname.name) if alias.asname else _code(alias.name))

    def visit_Global(self, node):
        self.outer.update(n.name.value for n in node.names)

    visit_Nonlocal = visit_Global

    def visit_FunctionDef(self, node):
        self.names.add(node.name.value)
        return False

    def visit_ClassDef(self, node):
        self.names.add(node.name.value)
        return False

    def _skip(self, node):
        return False

    visit_Lambda = visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _skip
    # Dotted names and strings cannot bind anything (a walrus is not allowed in either).
    visit_Attribute = visit_SimpleString = visit_FormattedString = visit_ConcatenatedString = _skip


def _assigned_names(stmts) -> set[str]:
    """Names bound by these statements (not descending into nested scopes' bodies)."""
    visitor = _AssignedNames()
    for st in stmts:
        st.visit(visitor)
    return visitor.names - visitor.outer
