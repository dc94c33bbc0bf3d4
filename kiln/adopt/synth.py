"""Synthesis: render a rule's replacement and apply edits with libcst, touching nothing else.

Every edit is either "replace this expression" or "delete this `name = expr` statement" (a
statement whose whole value the match folded into the replaced expression).  Comments on deleted
lines move to the next statement.  Names are spelled through the file's own imports by `Imports`,
the one place that adds an import when none fits (`import torch` after the last top-level import).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import re

import libcst as cst

from kiln.adopt import fallbacks
from kiln.adopt.dsl import BINARY_OPS, Attr, Const, Item, Node, Opaque, Ref, Tuple, Var
from kiln.adopt.scope import HERE

_ATOMIC = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float, cst.SimpleString,
           cst.Tuple, cst.List)


_TEMPLATE_VAR = re.compile(r"\$[A-Za-z_][A-Za-z0-9_]*")


def paren(code: str) -> str:
    return code if is_atomic(code) else f"({code})"


class Refusal(Exception):
    """A match that cannot be rewritten safely; the message is the reason reported to the user."""


def is_atomic(code: str) -> bool:
    """Can `code` be used as an operand or a receiver without parentheses?"""
    try:
        node = cst.parse_expression(code)
    except cst.ParserSyntaxError:
        return False
    if node.lpar:
        return True
    if isinstance(node, (cst.Integer, cst.Float)) and code.lstrip().startswith("-"):
        return False
    return isinstance(node, _ATOMIC)


def py_literal(value) -> str:
    """A constant as source; strings in double quotes, the style of most model code."""
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return repr(value)


class Imports:
    """Module-level import bindings; spells qualified names the way the file already imports them."""

    def __init__(self, module: cst.Module):
        self.module = module
        self.bindings: dict[str, str] = {}          # local name -> qualified module/object
        self.needed: set[str] = set()               # top-level modules to `import`, and kiln kernels
        self.kernel_block = None                    # the `import kiln.kernels as kiln_kernels` block
        for stmt in module.body:
            if fallbacks.is_block(stmt):
                self.kernel_block = stmt
                continue
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.Import):
                    for alias in small.names:
                        full = _dotted(alias.name)
                        if alias.asname is not None:
                            self.bindings[alias.asname.name.value] = full
                        else:
                            top = full.split(".")[0]
                            self.bindings[top] = top
                elif isinstance(small, cst.ImportFrom) and (small.relative or small.module is not None) \
                        and not isinstance(small.names, cst.ImportStar):
                    # `from ...activations import ACT2FN`: ACT2FN is `...activations.ACT2FN`, as the analysis names it
                    base = "." * len(small.relative) + (_dotted(small.module) if small.module is not None else "")
                    for alias in small.names:
                        name = _dotted(alias.name)
                        local = alias.asname.name.value if alias.asname is not None else name
                        self.bindings[local] = base + name if base.endswith(".") else f"{base}.{name}"
        self.module_names = _module_level_names(module)

    def spell(self, qualname: str, local_names=frozenset(), needed: set | None = None) -> str:
        """`torch.nn.functional.gelu` -> `F.gelu` (if `F` is imported so), else `torch.nn...`.

        A module that must be imported for the spelling is added to `needed` (default: the set
        `add_needed` inserts); callers that may still give up pass their own set and merge it."""
        if qualname.startswith("kiln.kernels."):
            # `kiln_kernels.X`, imported by a block that falls back to plain PyTorch without kiln
            clash = fallbacks.ALIAS in local_names or (fallbacks.ALIAS in self.module_names and self.kernel_block is None)
            if clash or qualname.split(".")[2] not in fallbacks.EAGER:
                raise Refusal(f"cannot spell {qualname}: the name {fallbacks.ALIAS!r} means something else here")
            (self.needed if needed is None else needed).add(qualname)
            return f"{fallbacks.ALIAS}.{qualname.split('.', 2)[2]}"
        if qualname.startswith(HERE + "."):
            raise Refusal(f"cannot spell {qualname}: {qualname[len(HERE) + 1:]!r} is not imported here")
        best = None
        for local, target in self.bindings.items():
            if (qualname == target or qualname.startswith(target + ".")) and local not in local_names:
                if best is None or len(target) > len(best[1]):
                    best = (local, target)
        if best is not None:
            return best[0] + qualname[len(best[1]):]
        top = qualname.split(".")[0]
        if top in local_names or top in self.module_names:
            raise Refusal(f"cannot spell {qualname}: the name {top!r} means something else here")
        # `import torch` brings torch.nn.functional; kiln's kernels are imported by their module
        module = qualname.rsplit(".", 1)[0] if top == "kiln" else top
        (self.needed if needed is None else needed).add(module)
        return qualname

    def add_needed(self, module: cst.Module) -> cst.Module:
        """Insert `import X` for each needed module after the last import at the top of the file,
        then the kiln kernels' import block (replacing one of an earlier run)."""
        kernels = {n.split(".")[2] for n in self.needed if n.startswith("kiln.kernels.")}
        modules = {n for n in self.needed if not n.startswith("kiln.kernels.")}
        if kernels and "torch" not in self.bindings:
            modules.add("torch")             # the fallbacks spell torch.nn.functional...
        if self.kernel_block is not None:
            have = fallbacks.kernels_in(self.kernel_block)
            if kernels <= have:
                kernels = set()
            else:                           # replace the earlier block by one for all the kernels
                kernels |= have
                module = module.with_changes(body=[s for s in module.body if not fallbacks.is_block(s)])
        if not modules and not kernels:
            return module
        body = list(module.body)
        at = 0
        for i, stmt in enumerate(body):
            if isinstance(stmt, cst.SimpleStatementLine) and all(
                    isinstance(s, (cst.Import, cst.ImportFrom)) or _is_docstring(s) for s in stmt.body):
                at = i + 1
            else:
                break
        new = [cst.parse_statement(f"import {name}\n") for name in sorted(modules)]
        if kernels:
            new.append(fallbacks.block(kernels).with_changes(
                leading_lines=[cst.EmptyLine()] if at or new else []))
        return module.with_changes(body=body[:at] + new + body[at:])


def _is_docstring(small) -> bool:
    return isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))


def _dotted(node) -> str:
    if isinstance(node, cst.Name):
        return node.value
    return f"{_dotted(node.value)}.{node.attr.value}"


def _module_level_names(module: cst.Module) -> set[str]:
    names = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.add(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign):
                    for t in small.targets:
                        if isinstance(t.target, cst.Name):
                            names.add(t.target.value)
    return names


# ----------------------------------------------------------------------------------------------
# Replacement text

def render(lines: list[Node], bound: dict[str, str], spell) -> str:
    """Python source for a replacement; `bound` maps `$x` to source text, `spell` names functions."""
    values = dict(bound)
    text = ""
    for node in lines:
        text = _render_node(node, values, spell)
        if node.out is not None:
            values[node.out.name] = text
    return text


def _render_node(node: Node, values, spell) -> str:
    def operand(op, atomic=False) -> str:
        text = _render_operand(op, values, spell)
        return f"({text})" if atomic and not is_atomic(text) else text

    args = list(node.args)
    if node.op == "=":
        return operand(args[0])
    if node.op in BINARY_OPS and len(args) == 2 and not node.kwargs:
        return f"{operand(args[0], True)} {node.op} {operand(args[1], True)}"
    if node.op == "neg":
        return f"-{operand(args[0], True)}"
    if node.op.startswith("."):
        callee, args = f"{operand(args[0], True)}{node.op}", args[1:]
    elif node.module is not None:
        callee = operand(node.module, True)
    else:
        callee = spell(node.op)
    parts = [operand(a) for a in args] + [f"{k}={operand(v)}" for k, v in node.kwargs]
    return f"{callee}({', '.join(parts)})"


def _render_operand(op, values, spell) -> str:
    if isinstance(op, Var):
        return values[op.name]
    if isinstance(op, Const):
        return py_literal(op.value)
    if isinstance(op, Ref):
        return spell(op.name)
    if isinstance(op, Attr):
        base = _render_operand(op.base, values, spell)
        return f"{base if is_atomic(base) else f'({base})'}.{op.name}"
    if isinstance(op, Item):
        base = _render_operand(op.base, values, spell)
        return f"{base if is_atomic(base) else f'({base})'}[{op.index}]"
    if isinstance(op, Tuple):
        items = [_render_operand(i, values, spell) for i in op.items]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(op, Opaque):
        # A replacement may hold Python the DSL does not model, with `$x` filled in:
        # `$p if $training else 0.0`.
        return _TEMPLATE_VAR.sub(lambda m: paren(values[m.group(0)]), op.code)
    raise TypeError(op)


# ----------------------------------------------------------------------------------------------
# Applying edits

@dataclass
class Edits:
    replace: dict = field(default_factory=dict)   # id(original expression) -> new expression
    delete: set = field(default_factory=set)      # id(original small statement or compound statement)
    drop: set = field(default_factory=set)        # id(whole statements moved elsewhere: nothing of them stays)
    keep_alive: list = field(default_factory=list)

    def replace_expr(self, original: cst.BaseExpression, code: str, top: bool):
        new = cst.parse_expression(code)
        if original.lpar and not is_atomic(code):  # the source had parentheses and still needs them
            new = new.with_changes(lpar=original.lpar, rpar=original.rpar)
        elif not top and not is_atomic(code):
            new = new.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        self.replace[id(original)] = new
        self.keep_alive.append(original)


class _Apply(cst.CSTTransformer):
    def __init__(self, edits: Edits):
        super().__init__()
        self.edits = edits

    def on_leave(self, original, updated):
        updated = super().on_leave(original, updated)
        new = self.edits.replace.get(id(original))
        return new if new is not None else updated

    def leave_IndentedBlock(self, original, updated):
        return updated.with_changes(body=self._body(original.body, updated.body))

    def _body(self, original_body, updated_body):
        body, carried = [], []
        for orig, upd in zip(original_body, updated_body):
            if id(orig) in self.edits.drop:
                continue
            if id(orig) in self.edits.delete:       # a whole compound statement (an `if` folded into a match)
                carried += list(upd.leading_lines) + _comments(orig.body)
                continue
            if isinstance(orig, cst.SimpleStatementLine) and isinstance(upd, cst.SimpleStatementLine):
                kept = [u for o, u in zip(orig.body, upd.body) if id(o) not in self.edits.delete]
                if not kept:
                    # Keep the comments of a deleted line: they move to the next statement.
                    carried += list(upd.leading_lines)
                    if upd.trailing_whitespace.comment is not None:
                        carried.append(cst.EmptyLine(comment=upd.trailing_whitespace.comment))
                    continue
                if len(kept) != len(upd.body):
                    kept[-1] = kept[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
                    upd = upd.with_changes(body=kept)
            if carried:
                upd = upd.with_changes(leading_lines=[*carried, *upd.leading_lines])
                carried = []
            body.append(upd)
        return body


def _comments(node) -> list:
    """The comments inside a deleted compound statement, as lines to keep before the next statement."""
    out = []
    for n in _walk_cst(node):
        if isinstance(n, cst.EmptyLine) and n.comment is not None:
            out.append(n)
        elif isinstance(n, cst.TrailingWhitespace) and n.comment is not None:
            out.append(cst.EmptyLine(comment=n.comment))
    return out


def _walk_cst(node):
    yield node
    for child in node.children:
        yield from _walk_cst(child)


def apply(module: cst.Module, edits: Edits, imports: Imports) -> str:
    if not edits.replace and not edits.delete and not edits.drop:
        return module.code
    return imports.add_needed(module.visit(_Apply(edits))).code
