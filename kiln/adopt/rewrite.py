"""`rewrite_source`: analysis -> matching -> synthesis for one file's text."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

import libcst as cst

from kiln.adopt import rules as rules_mod
from kiln.adopt.analysis import Block, Function, analyze
from kiln.adopt.configs import ConfigDefaults
from kiln.adopt.dsl import Node, operand_names
from kiln.adopt.expr import Expr, TreeBuilder, normalize
from kiln.adopt.match import match
from kiln.adopt.structural import Context, StructuralRule
from kiln.adopt.synth import Edits, Imports, Refusal, apply, paren, py_literal, render
from kiln.errors import KilnError


class AdoptError(KilnError):
    """A file that cannot be rewritten at all (it does not parse); names file and line."""


@dataclass
class Match:
    """One location: a rule matched in (class, method) over lines first_line..last_line (1-based)."""
    rule: str
    cls: str | None
    method: str
    first_line: int
    last_line: int
    applied: bool
    reason: str | None = None
    file: str = "<string>"
    requires: list = field(default_factory=list)   # what the rewritten code needs (torch >= 2.4 ...)

    def to_json(self) -> dict:
        return {"file": self.file, "rule": self.rule, "class": self.cls, "method": self.method,
                "first_line": self.first_line, "last_line": self.last_line, "applied": self.applied,
                "reason": self.reason, "requires": self.requires}


def resolve_rules(rules) -> list[rules_mod.CompiledRule]:
    """None -> all built-in rules; otherwise a list of built-in names and/or compiled rules."""
    if rules is None:
        return rules_mod.load_builtin()
    out = []
    for r in rules:
        out += rules_mod.load_builtin([r]) if isinstance(r, str) else [r]
    return out


def parse_source(text: str, filename: str):
    """Analyze `text`; a file that does not parse raises AdoptError naming file:line:column."""
    try:   # Python's own parser first: its messages and positions are the ones users know
        compile(text, filename, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        raise AdoptError(f"{filename}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}") from None
    except ValueError as exc:        # e.g. null bytes
        raise AdoptError(f"{filename}: not Python source: {exc}") from None
    try:
        return analyze(text)
    except cst.ParserSyntaxError as exc:
        raise AdoptError(f"{filename}:{exc.raw_line}:{exc.raw_column + 1}: libcst cannot parse this "
                         f"(newer syntax?): {exc.message}") from None


def rewrite_source(text: str, rules=None, filename: str = "<string>") -> tuple[str, list[Match]]:
    """Rewrite hand-written patterns in `text`; returns (new text, matches).

    `rules`: None for every built-in rule, or a list of built-in rule names / compiled rules
    (`kiln.adopt.rules.load_file(path)`).  Matches that were found but not rewritten have
    `applied=False` and a `reason`.  Everything outside the rewritten expressions is kept byte for
    byte; running the result through again changes nothing."""
    compiled = resolve_rules(rules)
    analysis = parse_source(text, filename)
    imports = Imports(analysis.module)
    edits = Edits()
    matches: list[Match] = []
    configs = ConfigDefaults(filename, analysis.module)
    for fn in analysis.functions:
        matches += _rewrite_function(fn, compiled, analysis, imports, edits, filename, configs)
    new_text = apply(analysis.module, edits, imports)
    try:
        compile(new_text, filename, "exec")
    except SyntaxError as exc:          # a bug in a rule or in synthesis: never write such a file
        raise AdoptError(f"{filename}: the rewritten source does not parse ({exc}); nothing written") from None
    return new_text, matches


def _blocks(block: Block):
    yield block
    for item in block.items:
        if isinstance(item, Block):
            yield from _blocks(item)


def _rewrite_function(fn: Function, compiled, analysis, imports, edits, filename, configs=None) -> list[Match]:
    builder = TreeBuilder(fn.nodes, inline=fn.inlinable)
    memo: dict = {}
    dsl_rules = [r for r in compiled if not isinstance(r, StructuralRule)]
    # rules that may rewrite first: a report-only rule that overlaps (linear_cross_entropy) must not take a node
    # a rewriting rule (cross_entropy) would rewrite, whatever order the rules were given in; it reports beside
    structural = sorted((r for r in compiled if isinstance(r, StructuralRule)), key=lambda r: r.overlaps)
    ctx = Context(fn, builder, lambda e: normalize(e, memo), analysis.functions, configs)
    ctx.analysis, ctx.imports = analysis, imports      # for rules that print source (attention_split)
    consumed: set[int] = set()          # id(cst) of expressions already folded into a match
    found = []
    for rule in structural:             # rewrites of whole statements (pairs of RoPE lines) come first
        if rule.statements is None:
            continue
        needed: set = set()
        for plan in rule.statements(ctx, lambda q: imports.spell(q, fn.local_names, needed)):
            for original, code in plan.replace.values():
                new = cst.parse_statement(code)      # a whole statement, or one small statement of a line
                if plan.leading is not None:
                    new = new.with_changes(leading_lines=plan.leading)
                edits.replace[id(original)] = new.body[0] if isinstance(original, cst.BaseSmallStatement) else new
                edits.keep_alive.append(original)
            for original, new in plan.nodes.values():      # a new parameter, the calls that pass it
                edits.replace[id(original)] = new
                edits.keep_alive.append(original)
            (edits.drop if plan.drop else edits.delete).update(id(s) for s in plan.delete)
            edits.keep_alive += plan.delete
            for original, _ in plan.replace.values():
                consumed |= {id(n) for n in _walk(original)}
            for s in plan.delete:
                consumed |= {id(n) for n in _walk(s)}
            found.append(Match(rule.name, fn.cls, fn.name, plan.first_line, plan.last_line, True, file=filename,
                               requires=requirements(" ".join(code for _, code in plan.replace.values()))))
        imports.needed |= needed
    for block in _blocks(fn.body):
        nodes = [n for n in block.items if isinstance(n, Node)]
        # Outer expressions come after their operands: trying them first keeps matches maximal.
        for node in reversed(nodes):
            if node.cst is None or node.op in ("=", "return", "store"):
                continue
            covered = id(node.cst) in consumed
            if covered and not any(r.overlaps for r in structural):
                continue
            raw = builder.node(node)
            tree = normalize(raw, memo)
            hit = None if covered else _first_match(dsl_rules, tree)
            phis, reason = [], None
            if hit is not None:
                rule, variant, env = hit
                replace = variant.replace
            else:
                hit = _first_structural([r for r in structural if r.overlaps or not covered], ctx, node, raw, tree)
                if hit is None:
                    continue
                rule, result = hit
                env, replace, reason, phis = result.env, result.replace, result.reason, result.phis
                raw = result.raw or raw
            if replace is not None:
                consumed |= {id(e.src) for e in raw.walk() if e.src is not None}
            plan = _Plan(fn, node, raw, env, analysis, imports, phis)
            first, last = plan.lines()
            m = Match(rule.name, fn.cls, fn.name, first, last, False, reason, file=filename)
            if replace is not None:
                try:
                    m.requires = requirements(plan.apply(replace, edits))
                    m.applied = True
                except Refusal as exc:
                    m.reason = str(exc)
            found.append(m)
            # report-only rules that overlap (linear_cross_entropy) report this node too, beside a rewrite of it
            for other in structural:
                if other.overlaps and other is not rule:
                    extra = other.find(ctx, node, builder.node(node), tree)
                    if extra is not None and extra.replace is None:
                        found.append(Match(other.name, fn.cls, fn.name, first, last, False, extra.reason,
                                           file=filename))
    for rule in structural:          # locations found by data flow, where no tree match covers them
        for first, last, reason in rule.locate(ctx) if rule.locate is not None else ():
            if not any(m.rule == rule.name and m.first_line <= last and first <= m.last_line for m in found):
                found.append(Match(rule.name, fn.cls, fn.name, first, last, False, reason, file=filename))
    return sorted(found, key=lambda m: m.first_line)


def _first_structural(rules, ctx, node, raw, tree):
    for rule in rules:
        result = rule.find(ctx, node, raw, tree)
        if result is not None:
            return rule, result
    return None


def _first_match(compiled, tree: Expr):
    for rule in compiled:
        for cv in rule.variants:
            for env in match(cv.tree, tree, rule.rule.var_types):
                return rule, cv.variant, env
    return None


class _Plan:
    """What one match changes: the root expression and the `name = expr` lines folded into it."""

    def __init__(self, fn: Function, node: Node, raw: Expr, env: dict, analysis, imports: Imports, phis=()):
        self.fn, self.node, self.raw, self.env = fn, node, raw, env
        self.analysis, self.imports = analysis, imports
        self.stmt = node.stmt
        self.phis = list(phis)                # `if` statements folded into the match: deleted whole
        self.needed: set[str] = set()        # imports this edit needs; merged only if it applies
        bound_vars = set().union(*(e.vars for e in env.values())) if env else set()
        bodies = [p.body for p in self.phis]
        inside = {v for v in raw.vars if v in fn.defs and fn.defs[v].stmt is not None
                  and any(fn.defs[v].stmt.block is b for b in bodies)}
        self.folded = [v for v in raw.vars if v not in fn.phis and (v not in bound_vars or v in inside)]
        self.folded_stmts = [fn.defs[v].stmt for v in self.folded if v not in inside]
        self.node_by_cst = {id(n.cst): n for n in fn.nodes if n.cst is not None}

    def lines(self) -> tuple[int, int]:
        pos = self.analysis.positions[self.node.cst]
        first = min([pos.start.line] + [s.line for s in self.folded_stmts]
                    + [self.analysis.positions[p.if_cst].start.line for p in self.phis])
        return first, pos.end.line

    def apply(self, replace: list, edits: Edits):
        for s in self.folded_stmts:
            if not isinstance(s.line_node, cst.SimpleStatementLine) or s.block is not self.stmt.block:
                raise Refusal(f"the statement at line {s.line} would have to be removed, and it sits in "
                              f"another block or shares its line")
        for p in self.phis:
            if p.block is not self.stmt.block:
                raise Refusal(f"the `if` at line {self.analysis.positions[p.if_cst].start.line} would have to be "
                              f"removed, and it sits in another block")
        # The folded statements are evaluated at the replacement instead: a value changed in place
        # from the first of them on would be read changed (earlier changes are harmless).
        first = min([s.line for s in self.folded_stmts] + [self.stmt.line])
        mutated = sorted(v for v in self.raw.reads if any(line >= first for line in self.fn.mutated.get(v, ())))
        if mutated:
            raise Refusal(f"`{mutated[0].split(':')[0]}` is modified in place while it is used here")
        stored = sorted(e.value for e in self.raw.walk() if e.op == "." and e.args and e.args[0].op == "leaf"
                        and e.args[0].value == ("var", self.fn.params[0] if self.fn.params else None)
                        and any(first <= line < self.stmt.line for line in self.fn.attr_stores.get(e.value, ())))
        if stored:
            raise Refusal(f"`self.{stored[0]}` is written in place between the lines this rewrite joins")
        used = {n for line in replace for n in _names(line)}
        texts = {name: self.source_of(e, name) for name, e in self.env.items() if name in used}
        code = render(replace, texts, self.spell)
        top = getattr(self.stmt.cst, "value", None) is self.node.cst
        edits.replace_expr(self.node.cst, code, top)
        self.imports.needed |= self.needed
        edits.delete |= {id(s.cst) for s in self.folded_stmts} | {id(p.if_cst) for p in self.phis}
        edits.keep_alive += [s.cst for s in self.folded_stmts] + [p.if_cst for p in self.phis]
        return code

    def spell(self, qualname: str) -> str:
        return self.imports.spell(qualname, self.fn.local_names, self.needed)

    # -- printing what a variable is bound to, at the place of the root expression --------------
    def visible(self, name: str) -> str | None:
        """The value `name` holds at the root expression once the folded statements are gone."""
        value = self.stmt.env.get(name)
        while value is not None and any(self.fn.def_stmt.get(value) is s for s in self.folded_stmts):
            value = self.fn.def_stmt[value].env.get(name)
        return value

    def check(self, name: str, value: str, var: str):
        if self.visible(name) != value:
            line = self.fn.defs[value].line if value in self.fn.defs else "?"
            raise Refusal(f"the replacement reads `{name}` as assigned at line {line}, but `{name}` is assigned "
                          f"again before the line the replacement goes to")

    def source_of(self, e: Expr, var: str) -> str:
        if e.var and e.var not in self.folded:
            self.check(e.var.split(":")[0], e.var, var)
            return e.var.split(":")[0]
        if e.op == "leaf":
            kind = e.value[0]
            if kind == "var":
                self.check(e.value[1].split(":")[0], e.value[1], var)
                return e.value[1].split(":")[0]
            if kind == "ref":
                return self.spell(e.value[1])
            for value in e.value[2]:
                self.check(value.split(":")[0], value, var)
            return e.value[1]
        if e.op == "const":
            return py_literal(e.value)
        if e.op == "guard":       # a mask added only under `if name is not None:`
            name, value = e.value
            self.check(name, value, var)
            inner = self.source_of(e.args[0], var)
            return name if inner == name else f"{paren(inner)} if {name} is not None else None"
        if e.src is not None:
            owner = self.node_by_cst.get(id(e.src))
            if not e.pure and owner is not None and owner.stmt is not self.stmt:
                raise Refusal(f"`{_short(self.analysis.module.code_for_node(e.src))}` (line {owner.stmt.line}) "
                              f"would run at line {self.stmt.line} instead, and calls may not be moved")
            for n in _cst_names(e.src):
                value = self.fn.name_version.get(id(n))
                if value is not None:
                    self.check(n.value, value, var)
            # Without its own parentheses: the replacement adds them where precedence needs them.
            return self.analysis.module.code_for_node(e.src.with_changes(lpar=[], rpar=[]))
        if e.op == "." and e.args:
            return f"{paren(self.source_of(e.args[0], var))}.{e.value}"
        if e.op == "[]" and e.args:          # `mask[None, None, ...]` read as an operand
            for value in e.value[1]:
                self.check(value.split(":")[0], value, var)
            return f"{paren(self.source_of(e.args[0], var))}[{e.value[0]}]"
        if e.op in ("operator.invert", "operator.and_"):     # boolean masks: `~m`, `a & b`
            parts = [paren(self.source_of(a, var)) for a in e.args]
            return f"~{parts[0]}" if e.op == "operator.invert" else " & ".join(parts)
        # Made by normalization (`/ math.sqrt(d)` became `* rsqrt(d)`): print the normal form.
        # `** -0.5` rather than torch.rsqrt: it works on Python numbers and tensors alike.
        powers = {"rsqrt": "-0.5", "sqrt": "0.5"}
        if e.op in powers and len(e.args) == 1 and not e.kw:
            return f"{paren(self.source_of(e.args[0], var))} ** {powers[e.op]}"
        if e.op == "**" and len(e.args) == 2:
            return f"{paren(self.source_of(e.args[0], var))} ** {paren(self.source_of(e.args[1], var))}"
        if e.op in ("*", "+"):
            return f" {e.op} ".join(paren(self.source_of(a, var)) for a in e.args)
        raise Refusal(f"the rewrite cannot write its {var.lstrip('$')} argument back as source")


def _short(code: str, width: int = 40) -> str:
    code = " ".join(code.split())
    return code if len(code) <= width else code[:width - 3] + "..."


# What a rewritten expression needs beyond the PyTorch the file already used (reported per match).
REQUIREMENTS = {"rms_norm(": "torch >= 2.4 (torch.nn.functional.rms_norm)",
                "scaled_dot_product_attention(": "torch >= 2.1 (scaled_dot_product_attention with scale=)",
                "kiln_kernels.": "kiln for the fused kernel (without kiln the file runs its plain-PyTorch fallback)"}


def requirements(code: str) -> list[str]:
    return [need for marker, need in REQUIREMENTS.items() if marker in code]


def _names(node: Node) -> list[str]:
    return operand_names(node)


def _walk(node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def _cst_names(node):
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Name):
            yield n
        stack.extend(n.children)
