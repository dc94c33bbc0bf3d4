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
from kiln.adopt.expr import Expr
from kiln.adopt.shapes import Ranks
from kiln.adopt.structural import Context, code_of

_PLAIN = (cst.Name, cst.Attribute, cst.Comparison, cst.BooleanOperation, cst.UnaryOperation, cst.SimpleString,
          cst.Integer, cst.Float, cst.Tuple, cst.List, cst.Element, cst.ComparisonTarget, cst.LeftParen,
          cst.RightParen, cst.Not, cst.And, cst.Or, cst.Is, cst.IsNot, cst.Equal, cst.NotEqual, cst.In, cst.NotIn,
          cst.LessThan, cst.GreaterThan, cst.LessThanEqual, cst.GreaterThanEqual, cst.Comma, cst.Dot,
          cst.BaseParenthesizableWhitespace, cst.Newline, cst.EmptyLine, cst.Comment, cst.TrailingWhitespace)


class _TakenAsFalse(AttentionBuilder):
    """Trees of the attention when the `if`s of `skip` (phi values) are not entered."""

    def __init__(self, ctx: Context, block, skip: set):
        super().__init__(ctx, block, shared=True)
        self.skip = skip

    def value(self, name: str) -> Expr:
        if name in self.skip:
            if name not in self.cache:
                self.cache[name] = self.value(self.fn.phis[name].before)
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
            if plan is not None and not any(p.first_line <= plan.last_line and plan.first_line <= p.last_line
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
    ranks = Ranks(ctx.functions)
    for _ in range(6):          # take as not entered each `if` that changes the scores or probabilities
        builder = _TakenAsFalse(ctx, block, skip)
        raw = builder.node(node)
        found = take_apart(ctx, ctx.normalize(raw), ranks)
        if found is not None:
            break
        more = {v for v in _leaf_vars(raw) if v in fn.phis and v not in skip and fn.phis[v].before
                and fn.phis[v].if_cst in body and _on_chain(builder, fn.phis[v].before)}
        if not more:
            return None
        skip |= more
    else:
        return None
    parts, reason = found
    if reason is not None:
        return None
    # the run starts at the scores: q, k, v, masks and scale are operands, made before it or not
    bound = set().union(*(e.vars for e in [parts.q, parts.k, parts.v, *parts.masks, *parts.keep, *parts.scale,
                                          *[d for d in parts.dropout.values() if d is not None]]))
    stmts = [fn.defs[v].stmt for v in raw.vars - bound if v in fn.defs and fn.defs[v].stmt is not None]
    tops = [s.line_node for s in stmts if s.line_node in body] + [fn.phis[v].if_cst for v in skip] \
        + [p.if_cst for p in builder.phis.values()] + [node.stmt.line_node]
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
    tests = [code_of(fn.phis[v].if_cst.test) for v in sorted(skip, key=lambda v: positions[fn.phis[v].if_cst].start.line)]
    if not all(_plain(fn.phis[v].if_cst.test, fn, inside, start_env) for v in skip):
        return None
    later = _later_reads(fn, ctx.analysis, hi, inside, node.stmt.target, start_env)
    if later is None:
        return None
    needed_tests, none_names = later
    tests += [t for t in needed_tests if t not in tests]
    if not tests:
        return None               # nothing needs the explicit path: the plain rewrite applies
    call = _sdpa_code(ctx, node, raw, parts, inside, start_env, spell)
    if call is None:
        return None
    module = ctx.analysis.module
    indent = module.default_indent
    head = region[0].with_changes(leading_lines=[])      # its comments stay before the `if`
    explicit = "".join(module.code_for_node(s) for s in [head, *region[1:]])
    line = node.stmt.line_node.deep_replace(node.cst, cst.parse_expression(call)).with_changes(leading_lines=[])
    fast = module.code_for_node(line) + "".join(f"{n} = None\n" for n in sorted(none_names))
    cond = " or ".join(t if len(tests) == 1 or _atomic(t) else f"({t})" for t in tests)
    code = f"if {cond}:  # {MARK}\n{_indent(explicit, indent)}else:\n{_indent(fast, indent)}"
    try:
        cst.parse_statement(code)
    except cst.ParserSyntaxError:
        return None
    return StatementRewrite(lo, positions[node.stmt.line_node].end.line, {id(region[0]): (region[0], code)},
                            list(region[1:]), set(), drop=True, leading=list(region[0].leading_lines))


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


def _on_chain(builder, value: str) -> bool:
    """Does this value come from a q @ k^T product or a softmax (the scores or the probabilities)?"""
    return any(x.op in PRODUCTS or x.op == "softmax" for x in builder.value(value).walk())


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


def _later_reads(fn, analysis, after: int, inside: set, output: str, env: dict):
    """(tests, names) when every read after line `after` of a value the run defines is the output or
    sits under a plain test (the branch that needs the explicit path); None otherwise."""
    tests, names = [], set()
    ok = True

    def visit(n, conds, parent=None):
        nonlocal ok
        if not ok:
            return
        if isinstance(n, cst.Name) and analysis.positions[n].start.line > after:
            version = fn.name_version.get(id(n))
            if version in inside and version != output:
                test = next((c for c in reversed(conds) if c is not None), None)
                # given back as it is (`(out, probs)`, `return probs`), and only under a test
                if test is None or not isinstance(parent, (cst.Element, cst.Return, cst.Assign, cst.AugAssign)):
                    ok = False
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
    return (tests, names) if ok else None


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
    except (Refusal, KeyError):
        return None
