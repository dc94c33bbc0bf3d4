"""sdpa where the explicit attention is still needed on some calls: keep it, under a test.

transformers 4.x attention returns its probabilities when the caller asks (`output_attentions`),
multiplies them by a head mask when one is given, and adds relative-position scores for some
configurations:

    attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
    if self.position_embedding_type == "relative_key" or ...:
        ...
        attention_scores = attention_scores + relative_position_scores
    attention_scores = attention_scores / math.sqrt(self.attention_head_size)
    if attention_mask is not None:
        attention_scores = attention_scores + attention_mask
    attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))
    if head_mask is not None:
        attention_probs = attention_probs * head_mask
    context_layer = torch.matmul(attention_probs, value_layer)
    ...
    outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)

becomes `if <any of those tests>: <the statements as written> else: context_layer =
F.scaled_dot_product_attention(...); attention_probs = None`.  The first branch is the original
code; the second is the attention as it computes when every test is false (each such `if` taken as
not entered), taken apart like any other (`attention.take_apart`).  It applies when the statements
from the scores to the product with v are one run of one block (not a loop body); the tests are
plain (names, attributes, comparisons, `not` / `and` / `or`, constants) over values set before that
run; and what the run defines is read afterwards only as the output or under one of the tests.
"""
from __future__ import annotations

import libcst as cst

from kiln.adopt.attention import PRODUCTS, AttentionBuilder, _lines, take_apart
from kiln.adopt.detect import StatementRewrite
from kiln.adopt.dsl import Const
from kiln.adopt.expr import Expr
from kiln.adopt.shapes import Ranks
from kiln.adopt.structural import Context, _cst_walk, _versions_read, code_of, is_check

_PLAIN = (cst.Name, cst.Attribute, cst.Comparison, cst.BooleanOperation, cst.UnaryOperation, cst.SimpleString,
          cst.Integer, cst.Float, cst.Tuple, cst.List, cst.Element, cst.ComparisonTarget, cst.LeftParen,
          cst.RightParen, cst.Not, cst.And, cst.Or, cst.Is, cst.IsNot, cst.Equal, cst.NotEqual, cst.In, cst.NotIn,
          cst.LessThan, cst.GreaterThan, cst.LessThanEqual, cst.GreaterThanEqual, cst.Comma, cst.Dot,
          cst.BaseParenthesizableWhitespace, cst.Newline, cst.EmptyLine, cst.Comment, cst.TrailingWhitespace)


class _TakenAsFalse(AttentionBuilder):
    """Trees of the attention when the `if`s of `skip` (phi values) are not entered and the `if`/`else`s
    of `taken` (merged value -> its version at the end of the `else`) take their `else`.  Size checks
    inside `if mask is not None:` are allowed: the split keeps them on both paths."""

    def __init__(self, ctx: Context, block, skip: set, taken: dict):
        super().__init__(ctx, block, shared=True)
        self.skip, self.taken = skip, taken
        self.checks_ok = True

    def value(self, name: str) -> Expr:
        if name in self.skip or name in self.taken:
            if name not in self.cache:
                self.cache[name] = self.value(self.taken[name] if name in self.taken else self.fn.phis[name].before)
            return self.cache[name]
        return super().value(name)


# The comment on the `if` of a split: it says why the explicit attention is still there, and a second
# run leaves what is under it alone (idempotence).
MARK = "kiln adopt: the attention as written, where it is still needed"


def kept_explicit(fn, line_node) -> bool:
    """Is this statement inside the explicit branch of an earlier split (an `if` carrying MARK)?"""
    kept = getattr(fn, "_kept_ids", None)
    if kept is None:
        kept = set()
        stack = [fn.cst]
        while stack:
            n = stack.pop()
            if isinstance(n, cst.If) and n.body.header.comment is not None and MARK in n.body.header.comment.value:
                inner = [n.body]
                while inner:
                    m = inner.pop()
                    kept.add(id(m))
                    inner.extend(m.children)
            stack.extend(n.children)
        fn._kept_ids = kept
    return id(line_node) in kept


def explicit_splits(ctx: Context, spell) -> list[StatementRewrite]:
    out = []
    for node in ctx.fn.nodes:
        if node.op in PRODUCTS and node.stmt is not None and len(node.args) == 2 and node.stmt.target \
                and not kept_explicit(ctx.fn, node.stmt.line_node):
            plan = _split(ctx, node, spell)
            if not isinstance(plan, StatementRewrite) and (plan is not None or not _tree_applies(ctx, node)):
                from kiln.adopt.attention_lift import lift
                lifted = lift(ctx, node, spell)
                plan = lifted if lifted is not None else plan
                if isinstance(lifted, str):     # it saw the whole attention: its reason comes first
                    ctx.lift_reasons = {**getattr(ctx, "lift_reasons", {}), node.line: lifted}
            if isinstance(plan, str):       # why not: attention_flow reports it where nothing else blocks
                ctx.split_reasons[node.line] = plan
            elif plan is not None and not any(p.first_line <= plan.last_line and plan.first_line <= p.last_line
                                            for p in out):
                out.append(plan)
    return out


def _split(ctx: Context, node, spell):
    fn = ctx.fn
    block = node.stmt.block
    body = _body_of(fn.cst, node.stmt.line_node)
    if body is None or block.keyword in ("for", "while"):
        return None
    skip: set = set()
    taken: dict = {}
    ranks = Ranks(ctx.functions)
    for _ in range(8):          # take as not entered each `if` that changes the scores or probabilities
        builder = _TakenAsFalse(ctx, block, skip, taken)
        raw = builder.node(node)
        found = take_apart(ctx, ctx.normalize(raw), ranks)
        if found is not None:
            break
        leaves = set(_leaf_vars(raw))
        more = {v for v in leaves if v in fn.phis and v not in skip and fn.phis[v].before
                and fn.phis[v].if_cst in body and _on_chain(builder, fn.phis[v].before)}
        other = {v: fn.branches[v][2] for v in leaves if v in fn.branches and v not in taken
                 and fn.branches[v][0] in body and _constant_else(fn.branches[v][0], v)
                 and fn.branches[v][2] and _on_chain(builder, fn.branches[v][2])}
        if not more and not other:
            return None
        skip |= more
        taken.update(other)
    else:
        return None
    parts, reason = found
    if reason is not None:
        return reason
    # the run starts at the scores: q, k, v, masks and scale are operands, made before it or not
    bound = set().union(*(e.vars for e in [parts.q, parts.k, parts.v, *parts.masks, *parts.keep, *parts.scale,
                                          *[d for d in parts.dropout.values() if d is not None],
                                          *[a for x in raw.walk() if x.op in (".view", ".reshape") for a in x.args[1:]]]))
    stmts = [fn.defs[v].stmt for v in raw.vars - bound if v in fn.defs and fn.defs[v].stmt is not None]
    branch_ifs = [fn.branches[v][0] for v in taken]
    guards = [p.if_cst for p in builder.phis.values()]
    tops = [s.line_node for s in stmts if s.line_node in body] + [fn.phis[v].if_cst for v in skip] \
        + guards + branch_ifs + [node.stmt.line_node]
    last = body.index(node.stmt.line_node)
    first = min(body.index(t) for t in tops if t in body)
    region = body[first:last + 1]
    positions = ctx.analysis.positions
    lo, hi = positions[region[0]].start.line, positions[region[-1]].end.line
    inside = {v for v, n in fn.defs.items() if lo <= n.line <= hi} | \
        {v for v, p in fn.phis.items() if lo <= positions[p.if_cst].start.line <= hi} | \
        {v for v, preds in fn.merges.items() if preds & set(fn.defs) and
         any(lo <= fn.defs[p].line <= hi for p in preds if p in fn.defs)}
    start_env = min((n.stmt for n in fn.nodes if n.stmt is not None and n.stmt.line >= lo),
                    key=lambda s: s.line).env
    ifs = sorted([fn.phis[v].if_cst for v in skip] + branch_ifs, key=lambda i: positions[i].start.line)
    tests = list(dict.fromkeys(code_of(i.test) for i in ifs))
    for i in ifs:
        if not _plain(i.test, fn, inside, start_env):
            return (f"the test `{code_of(i.test)}` (line {positions[i].start.line}) would have to choose the explicit "
                    f"path before the attention, and it is not a plain test of values set before it")
    # on the fast path, in order: the size checks of the operands (those of the scores go with the
    # scores), statements that compute operands from values made before the attention (shapes), the
    # attention, and the constants of the `else`s taken; statements whose values nothing reads are dropped
    kept, kept_values, fast_env = [], set(), dict(start_env)
    for stmt in region:
        made = {v for v, st in fn.def_stmt.items() if st is not None and st.line_node is stmt}
        keep = None
        if stmt in tops:
            if stmt in guards and any(is_check(c) for c in stmt.body.body):
                keep = stmt.with_changes(body=stmt.body.with_changes(body=[c for c in stmt.body.body if is_check(c)]))
        elif is_check(stmt):
            keep = None if _versions_read(fn, stmt) & inside else stmt
        elif made and not any(fn.uses[v] for v in made) and _pure(fn, stmt):
            continue
        elif made and isinstance(stmt, cst.SimpleStatementLine) and not _versions_read(fn, stmt) & inside \
                and _pure(fn, stmt) and all(isinstance(x, cst.Assign) for x in stmt.body):
            keep = stmt
        else:
            return (f"`{_short(code_of(stmt.with_changes(leading_lines=[])))}` (line {positions[stmt].start.line}) "
                    f"runs among the attention's statements and is not part of it")
        if keep is not None:
            if not _visible(keep, fn, fast_env):
                return f"`{_short(code_of(keep))}` reads values set among the attention's statements"
            kept.append(keep.with_changes(leading_lines=[]))
            if keep is stmt and not is_check(stmt):
                kept_values |= made
                fast_env.update({v.split(":")[0]: v for v in made})
    inside -= kept_values
    constants = {v for v, (i, _, _) in fn.branches.items() if i in branch_ifs and v.split(":")[0] in
                 {t.target.value for a in i.orelse.body.body for x in a.body for t in x.targets}}
    later = _later_reads(fn, ctx.analysis, hi, inside, node.stmt.target, start_env, constants)
    if isinstance(later, str):
        return later
    needed_tests, none_names = later
    tests += [t for t in needed_tests if t not in tests]
    if not tests:
        return None               # nothing needs the explicit path: the plain rewrite applies
    call = _sdpa_code(ctx, node, raw, parts, inside, fast_env, spell)
    if call.startswith("!"):
        return call[1:]
    module = ctx.analysis.module
    indent = module.default_indent
    head = region[0].with_changes(leading_lines=[])      # its comments stay before the `if`
    explicit = "".join(module.code_for_node(s) for s in [head, *region[1:]])
    line = node.stmt.line_node.deep_replace(node.cst, cst.parse_expression(call)).with_changes(leading_lines=[])
    fast = "".join(module.code_for_node(c) for c in kept) + module.code_for_node(line)
    fast += "".join(module.code_for_node(a.with_changes(leading_lines=[]))
                    for i in dict.fromkeys(branch_ifs) for a in i.orelse.body.body)
    fast += "".join(f"{n} = None\n" for n in sorted(none_names))
    cond = " or ".join(t if len(tests) == 1 or _atomic(t) else f"({t})" for t in tests)
    code = f"if {cond}:  # {MARK}\n{_indent(explicit, indent)}else:\n{_indent(fast, indent)}"
    try:
        cst.parse_statement(code)
    except cst.ParserSyntaxError:
        return None
    return StatementRewrite(lo, positions[node.stmt.line_node].end.line, {id(region[0]): (region[0], code)},
                            list(region[1:]), set(), drop=True, leading=list(region[0].leading_lines))


def _tree_applies(ctx: Context, node) -> bool:
    """Does the plain rewrite (attention.find_sdpa) rewrite this attention?"""
    from kiln.adopt.attention import find_sdpa
    found = find_sdpa(ctx, node, None, None)
    return found is not None and found.replace is not None


def _constant_else(if_cst, value: str) -> bool:
    """`if test: ... else: a = None` (the `else` only assigns constants, and not to `value`'s name)."""
    orelse = if_cst.orelse
    if not isinstance(orelse, cst.Else) or not isinstance(orelse.body, cst.IndentedBlock):
        return False
    for s in orelse.body.body:
        if not isinstance(s, cst.SimpleStatementLine) or not all(
                isinstance(x, cst.Assign) and len(x.targets) == 1 and isinstance(x.targets[0].target, cst.Name)
                and x.targets[0].target.value != value.split(":")[0]
                and isinstance(x.value, (cst.Name, cst.Integer, cst.Float, cst.SimpleString))
                and (not isinstance(x.value, cst.Name) or x.value.value in ("None", "True", "False"))
                for x in s.body):
            return False
    return True


def _pure(fn, stmt) -> bool:
    """Does the statement only compute (no module calls, nothing changed in place, no stores)?"""
    nodes = [n for n in fn.nodes if n.stmt is not None and n.stmt.line_node is stmt]
    names_only = all(isinstance(x, cst.Assign) and all(_names_only(t.target) for t in x.targets)
                     for x in getattr(stmt, "body", ()))
    return all(n.module is None and n.op != "call" and (n.op != "store" or names_only)
               and not (n.op.startswith(".") and n.op.endswith("_") and not n.op.endswith("__"))
               for n in nodes) and not any(fn.def_stmt.get(v) is not None and fn.def_stmt[v].line_node is stmt
                                           for v in fn.mutated)


def _names_only(target) -> bool:
    """`a` or `a, (b, c)`: names, not attributes or items (a store into those changes something)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return all(_names_only(el.value) for el in target.elements)
    return isinstance(target, cst.Name)


def _visible(stmt, fn, env: dict) -> bool:
    """Does every local name `stmt` reads hold, at the start of the run, the value it reads here?"""
    return all(env.get(n.value) == fn.name_version[id(n)] for n in _cst_walk(stmt)
               if isinstance(n, cst.Name) and id(n) in fn.name_version and n.value in fn.local_names)


def _body_of(fn_cst, line_node):
    """The statement list (of an indented block in `fn_cst`) that holds `line_node`."""
    stack = [fn_cst]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.IndentedBlock) and any(s is line_node for s in n.body):
            return list(n.body)
        stack.extend(n.children)
    return None


def _leaf_vars(e: Expr):
    for x in e.walk():
        if x.op == "leaf" and x.value[0] == "var":
            yield x.value[1]


def _on_chain(builder, value: str, depth: int = 0) -> bool:
    """Does this value come from a q @ k^T product or a softmax (the scores or the probabilities),
    directly or through the `if`s before it?"""
    fn = builder.fn
    if depth > 8:
        return False
    if any(x.op in PRODUCTS or x.op == "softmax" for x in builder.value(value).walk()):
        return True
    phi = fn.phis.get(value)
    preds = [phi.before, phi.inner] if phi is not None else sorted(fn.merges.get(value, ()))
    return any(p and _on_chain(builder, p, depth + 1) for p in preds)


def _short(code: str, width: int = 60) -> str:
    code = " ".join(code.split())
    return code if len(code) <= width else code[:width - 3] + "..."


def _atomic(test: str) -> bool:
    return " or " not in test and " and " not in test


def _indent(code: str, indent: str) -> str:
    return "".join(indent + line if line.strip() else line for line in code.splitlines(True))


def _plain(test, fn, inside: set, env: dict) -> bool:
    """A test with no calls, over names that hold at the start of the run what they hold here."""
    stack = [test]
    while stack:
        n = stack.pop()
        if not isinstance(n, _PLAIN):
            return False
        if isinstance(n, cst.Name) and n.value not in ("None", "True", "False"):
            version = fn.name_version.get(id(n))
            if n.value in fn.local_names and (version is None or version in inside or env.get(n.value) != version):
                return False
        if isinstance(n, cst.Attribute):
            stack.append(n.value)
            continue
        stack.extend(n.children)
    return True


def _later_reads(fn, analysis, after: int, inside: set, output: str, env: dict, constants: set = frozenset(),
                 skip: frozenset = frozenset()):
    """(tests, names) when every read after line `after` of a value the run defines is the output, a
    constant an `else` taken assigns, or sits under a plain test (the branch that needs the explicit
    path); otherwise why not.  A value that later `if`s may carry on (`if not output_attentions:
    probs = None`) counts as read where those later versions are read: under `output_attentions`
    there, which is when it is not None."""
    tests, names = [], set()
    ok: bool | str = True
    carried = _carried(fn, inside - {output} - constants)

    def visit(n, conds, parent=None):
        nonlocal ok
        if ok is not True or id(n) in skip:      # `skip`: a `return` a new parameter takes care of
            return
        if isinstance(n, cst.Name) and analysis.positions[n].start.line > after:
            version = fn.name_version.get(id(n))
            if version in carried and version not in inside:
                test = _none_unless(fn, version)
                if test is not None and _plain(fn.phis[version].if_cst.test, fn, inside, env):
                    if test not in tests:
                        tests.append(test)
                    return
            if (version in inside or version in carried) and version != output and version not in constants:
                test = next((c for c in reversed(conds) if c is not None), None)
                # given back as it is (`(out, probs)`, `return probs`), and only under a test
                if test is None or not isinstance(parent, (cst.Element, cst.Return, cst.Assign, cst.AugAssign)):
                    ok = (f"`{n.value}`, set among the attention's statements, is read at line "
                          f"{analysis.positions[n].start.line} where no test could keep the explicit path")
                    return
                names.add(n.value)
                if code_of(test) not in tests:
                    tests.append(code_of(test))
            return
        if isinstance(n, cst.IfExp):
            visit(n.test, conds)
            visit(n.body, conds + [n.test if _plain(n.test, fn, inside, env) else None])
            visit(n.orelse, conds + [None])
            return
        if isinstance(n, cst.If):
            visit(n.test, conds)
            visit(n.body, conds + [n.test if _plain(n.test, fn, inside, env) else None])
            if n.orelse is not None:
                visit(n.orelse, conds + [None])
            return
        for child in n.children:
            visit(child, conds, n)
    visit(fn.cst.body, [])
    return (tests, names) if ok is True else ok


def _carried(fn, values: set) -> set:
    """`values` and the versions after later `if`s and `if`/`else`s that may hold one of them."""
    out, grew = set(values), True
    while grew:
        grew = False
        for v, phi in fn.phis.items():
            if v not in out and (phi.before in out or phi.inner in out):
                out.add(v)
                grew = True
        for v, preds in fn.merges.items():
            if v not in out and preds & out:
                out.add(v)
                grew = True
    return out


def _none_unless(fn, version: str) -> str | None:
    """T for a value after `if not T: x = None` (None unless T), else None."""
    phi = fn.phis.get(version)
    inner = fn.defs.get(phi.inner) if phi is not None else None
    test = phi.if_cst.test if phi is not None else None
    if inner is None or inner.op != "=" or inner.args != (Const(None),) \
            or not (isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not)):
        return None
    return code_of(test.expression)


def _sdpa_code(ctx: Context, node, raw, parts, inside: set, env: dict, spell):
    """The scaled_dot_product_attention call, its operands printed as they are at the start of the run."""
    from kiln.adopt.rewrite import _Plan
    from kiln.adopt.synth import Refusal, render

    lines, bindings = _lines(parts)
    plan = _Plan(ctx.fn, node, raw, bindings, ctx.analysis, ctx.imports)
    plan.folded = sorted(inside)
    plan.visible = env.get
    plan.spell = spell
    try:
        texts = {name: plan.source_of(e, name) for name, e in bindings.items() if isinstance(e, Expr)}
        return render(lines, texts, spell)
    except Refusal as exc:
        return f"!{exc}"
    except KeyError as exc:
        return f"!the scaled_dot_product_attention call cannot be written ({exc} is not known where it goes)"
