"""sdpa for attention whose scores change under `if`s that must stay, with finite lowest-value masks.

GPT-2's `_attn` scales its scores under `if self.scale_attn_weights:` and `if
self.scale_attn_by_inverse_layer_idx:`, masks them under `if not self.is_cross_attention:` with
`torch.where(causal_mask, attn_weights, mask_value)` (`mask_value` = torch.finfo(dtype).min, not
-inf) and adds an optional padding mask.  Neither taking those `if`s as not entered (the split of
attention_split.py) nor folding them into one expression helps: the mask is built from values
made inside the `if`.  Here every statement of the run from q @ k^T to the product with v is kept
in place except those that change the scores, and each of those becomes the same change of the
arguments of scaled_dot_product_attention (the `if`s around them stay as they are):

    s = q @ k^T [* c]                 ->  scale = c (1.0)          [mask = None]
    s = s * c,  s = s / c             ->  scale = scale * c, scale = scale / c   (c a number, or
                                          a 0-d `torch.full([], c, ...)` / `torch.tensor(c)`: c)
    s = s + m                         ->  mask = m  (mask + m, or `m if mask is None else mask + m`)
    s = torch.where(k, s, f)          ->  mask = torch.where(k, 0.0 (mask), f)
    s = s.masked_fill(c, f)           ->  mask = torch.where(c, f, 0.0 (mask))
    s = s.to(s.dtype)                 ->  (nothing)

with f = -inf or torch.finfo(D).min of the scores' dtype D.  SDPA computes s0 * scale + mask, which is
the original: a mask taken where kept, and where masked f, or f plus what is added after, because in
float32 w + finfo.min == finfo.min for |w| < 2**103 (half a unit in the last place of finfo.min)
and finfo.min plus anything below -2**103 is -inf (docs/adopt-dsl.md has the derivation).  A scale
after a mask is refused (the mask would have to be scaled too).  Statements kept on the fast path
may read the scores' dtype or device before any mask is added: that is q's.  The probabilities are
then dropped like in the split (softmax, casts to v's dtype, dropout; a head mask under `if` goes
to the explicit path's test), and the explicit attention stays under the tests that need it,
including a new parameter of the method when it returns the probabilities on every call
(attention_probs.py).
"""
from __future__ import annotations

import libcst as cst

from kiln.adopt.attention import PRODUCTS, Parts, _number, _untranspose, take_apart
from kiln.adopt.attention_flow import min_fill, neg_inf
from kiln.adopt.attention_probs import probs_parameter
from kiln.adopt.attention_split import MARK, _TakenAsFalse, _atomic, _body_of, _indent, _later_reads, _sdpa_code, \
    _short
from kiln.adopt.detect import StatementRewrite
from kiln.adopt.dsl import Var
from kiln.adopt.expr import Expr, TreeBuilder
from kiln.adopt.shapes import Ranks
from kiln.adopt.structural import Context, _cst_walk, code_of, is_check

_STEPS = ("*", "/", "+", "to", "torch.where", ".masked_fill", "torch.masked_fill", "=")
_PROB_OPS = ("to", "call", "dropout", "torch.nn.Dropout", "=")


def _opaque(name: str) -> Expr:
    return Expr("leaf", value=("opaque", name, ()))


class _Lift:
    def __init__(self, ctx: Context, node):
        self.ctx, self.fn, self.node = ctx, ctx.fn, node
        self.scores: set = set()        # versions of the scores (phis included)
        self.probs: set = set()
        self.steps: dict = {}           # id(statement line) -> the node changing the scores there
        self.ifs: dict = {}             # id(if) -> the `if` around score changes (kept, its changes lifted)
        self.head_ifs: list = []        # `if head_mask is not None: p = p * head_mask`
        self.prob_lines: set = set()
        self.start = None

    def is_score(self, v: str, depth: int = 0) -> bool:
        fn = self.fn
        if depth > 30 or v is None:
            return False
        phi = fn.phis.get(v)
        if phi is not None:
            return self.is_score(phi.before, depth + 1) or self.is_score(phi.inner, depth + 1)
        d = fn.defs.get(v)
        if d is None:
            return False
        if d.op in PRODUCTS:
            return True
        return d.op in _STEPS and any(isinstance(a, Var) and self.is_score(a.name, depth + 1) for a in d.args)

    def chains(self, body) -> bool:
        """Walk back from the product with v: the probabilities, then the scores, to q @ k^T."""
        fn = self.fn
        p = self.node.args[0].name
        for _ in range(16):
            phi = fn.phis.get(p)
            if phi is not None:
                inner = fn.defs.get(phi.inner)
                if phi.if_cst not in body or not phi.before or inner is None or inner.op != "*" \
                        or Var(phi.before) not in inner.args or phi.if_cst.orelse is not None \
                        or len(phi.if_cst.body.body) != 1:
                    return False
                self.head_ifs.insert(0, phi.if_cst)
                self.probs |= {p, phi.inner}
                p = phi.before
                continue
            d = fn.defs.get(p)
            if d is None or d.stmt is None or d.stmt.line_node not in body or d.stmt.target != p or not d.args \
                    or not isinstance(d.args[0], Var):
                return False
            self.probs.add(p)
            self.prob_lines.add(id(d.stmt.line_node))
            if d.op == "softmax":
                break
            if d.op not in _PROB_OPS:
                return False
            p = d.args[0].name
        else:
            return False
        s = self.logits = d.args[0].name
        for _ in range(24):
            phi = fn.phis.get(s)
            if phi is not None:
                if phi.if_cst not in body or not phi.before or phi.if_cst.orelse is not None \
                        or not isinstance(phi.if_cst.body, cst.IndentedBlock):
                    return False
                self.scores.add(s)
                v = phi.inner
                while v != phi.before:
                    d = fn.defs.get(v)
                    if d is None or d.stmt is None or d.stmt.line_node not in phi.if_cst.body.body \
                            or d.stmt.target != v:
                        return False
                    self.scores.add(v)
                    self.steps[id(d.stmt.line_node)] = d
                    v = self.previous(d)
                    if v is None:
                        return False
                self.ifs[id(phi.if_cst)] = phi.if_cst
                s = phi.before
                continue
            d = fn.defs.get(s)
            if d is None or d.stmt is None or d.stmt.line_node not in body or d.stmt.target != s:
                return False
            self.scores.add(s)
            prev = self.previous(d)
            if prev is None:
                self.start = d
                return any(x.op in PRODUCTS for x in self.tree(d).walk())
            self.steps[id(d.stmt.line_node)] = d
            s = prev
        return False

    def tree(self, d) -> Expr:
        fn = self.fn
        builder = TreeBuilder(fn.nodes, inline=lambda n: n.startswith("%") or fn.inlinable(n) and not self.is_score(n))
        return self.ctx.normalize(builder.node(d))

    def previous(self, d):
        """The version of the scores a step reads (None for the product)."""
        found = [x.value[1] for x in self.tree(d).walk() if x.op == "leaf" and x.value[0] == "var"
                 and self.is_score(x.value[1])]
        return found[0] if len(set(found)) == 1 and d.op not in PRODUCTS else None


def lift(ctx: Context, node, spell):
    """A StatementRewrite, a reason, or None (not attention this covers)."""
    fn = ctx.fn
    body = _body_of(fn.cst, node.stmt.line_node)
    if body is None or node.stmt.block.keyword in ("for", "while") or not node.args \
            or not isinstance(node.args[0], Var):
        return None
    lift_ = _Lift(ctx, node)
    if not lift_.chains(body):
        return None
    out = [node.out.name if node.out is not None else None, node.stmt.target]
    if any(v is not None and (v in fn.mutated or v in fn.updated) for v in out):
        return ("the attention output is modified in place afterwards (`+=`), which "
                "scaled_dot_product_attention's backward does not allow")
    start = lift_.start
    first, last = body.index(start.stmt.line_node), body.index(node.stmt.line_node)
    region = body[first:last + 1]
    if any(i not in region for i in lift_.ifs.values()) or any(i not in region for i in lift_.head_ifs):
        return None
    # q @ k^T, the softmax, casts and dropout checked by the tree rule, on the softmax of the product
    # itself (the changes of the scores in between are lifted one by one below)
    taken = {lift_.logits: start.stmt.target} if lift_.logits != start.stmt.target else {}
    skip = {v for v in lift_.probs if v in fn.phis}
    builder = _TakenAsFalse(ctx, node.stmt.block, skip, taken)
    builder.forced |= (lift_.probs - set(fn.phis)) | {start.stmt.target}
    raw = builder.node(node)
    found = take_apart(ctx, ctx.normalize(raw), Ranks(ctx.functions), fills=lambda e: True)
    if found is None:
        return None
    parts, reason = found
    if reason is not None:
        return reason
    product = next(x for x in lift_.tree(start).walk() if x.op in PRODUCTS)
    q = product.args[0]
    k, why = _untranspose(ctx, product.args[1], product, Ranks(ctx.functions))
    if k is None or why:
        return why
    if len({_cast(fn, x) for x in (q, k, parts.v)}) > 1:
        return ("q, k and v are not cast alike before the attention (q and k to float32, say): "
                "scaled_dot_product_attention takes them in one dtype")
    if not all(_plain(x) for x in (q, k, parts.v)):
        return None
    names = {x: x.value[1].split(":")[0] for x in (q, k, parts.v)}
    lo, hi = start.stmt.line, node.stmt.line
    for x, n in names.items():      # read by the call at the end of the run instead of at the product
        if any(lo <= line <= hi for line in fn.mutated.get(x.value[1], ())):
            return f"`{n}` is modified in place while it is used here"
    env0 = start.stmt.env
    if any(env0.get(n) != x.value[1] or node.stmt.env.get(n) != x.value[1] for x, n in names.items()):
        return None                     # q, k or v reassigned among the attention's statements
    return _build(ctx, lift_, node, region, parts, q, k, raw, names[q], spell)


def _plain(e: Expr) -> bool:
    return e.op == "leaf" and e.value[0] == "var"


def _cast(fn, e: Expr):
    """What q, k or v is cast to where it is made (`query.to(torch.float32)`), or None."""
    if _plain(e):
        d = fn.defs.get(e.value[1])
        if d is None or d.op not in ("to", ".float", ".half", ".bfloat16") or len(d.args) > 2 \
                or "device" in repr(d.args[1:]):
            return None
        return d.op, repr(d.args[1:])
    if e.op == "to" and len(e.args) == 2 and not (e.args[1].op == "." and e.args[1].value == "device"):
        return "to", repr(e.args[1].key)
    return None


def _build(ctx: Context, lift_: _Lift, node, region, parts: Parts, q, k, raw, q_name: str, spell):
    fn, module = ctx.fn, ctx.analysis.module
    positions = ctx.analysis.positions
    taken_names = fn.local_names | set(fn.params)
    scale = next((n for n in ("attn_scale", "sdpa_scale") if n not in taken_names), None)
    mask = next((n for n in ("attn_mask", "sdpa_mask") if n not in taken_names), None)
    if scale is None or mask is None:
        return None
    state = {"mask": None, "masked": False, "added": False, "why": None}
    dtype_ok: set = set()            # score versions whose dtype is q's (no mask added before them)
    chain = lift_.scores | lift_.probs

    def operand(expr) -> str | None:
        """Source of an operand of a change of the scores: it reads them only for their dtype or device."""
        expr = kept(expr)
        if expr is None:
            return None
        return code_of(expr.with_changes(lpar=[], rpar=[])) if hasattr(expr, "lpar") else code_of(expr)

    def is_prev(expr, prev) -> bool:
        while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "to" \
                and len(expr.args) == 1 and _reads_dtype_of(expr.args[0].value, fn, prev):   # s.to(s.dtype)
            expr = expr.func.value
        return isinstance(expr, cst.Name) and fn.name_version.get(id(expr)) == prev

    def current() -> str:
        return {None: "0.0", "some": mask}.get(state["mask"], f"0.0 if {mask} is None else {mask}")

    def fill_ok(e: Expr) -> bool:
        return neg_inf(e) or min_fill(e, lambda dt: dt.op == "." and dt.value == "dtype" and len(dt.args) == 1 and (
            _plain(dt.args[0]) and (dt.args[0].value[1] in dtype_ok or dt.args[0].key == q.key)))

    def lifted(d, inside_if: bool) -> list[str] | None:
        stmt = d.stmt.cst
        value = stmt.value if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 else None
        prev = lift_.previous(d)
        line = positions[d.stmt.line_node].start.line
        out, factor, op = [], None, None
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Multiply, cst.Divide)):
            if is_prev(value.left, prev):
                factor, op = value.right, "/" if isinstance(value.operator, cst.Divide) else "*"
            elif isinstance(value.operator, cst.Multiply) and is_prev(value.right, prev):
                factor, op = value.left, "*"
        if factor is not None:
            number = _number_of(ctx, lift_.tree(d), prev)
            text = operand(_unwrap_full(ctx, factor))
            if text is None:
                return None
            if not number:
                state["why"] = state["why"] or (
                    f"the scores are scaled by `{_short(text)}` (line {line}), which is not known to be a number "
                    f"(scaled_dot_product_attention takes a numeric scale)")
                return None
            if state["masked"]:
                state["why"] = state["why"] or (f"the scores are scaled at line {line}, after a mask is applied: "
                                                f"the mask would have to be scaled too")
            out.append(f"{scale} = {scale} {op} {_paren(text)}")
        elif isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
            other = value.right if is_prev(value.left, prev) else value.left if is_prev(value.right, prev) else None
            text = operand(other) if other is not None else None
            if text is None:
                return None
            out.append({None: f"{mask} = {text}", "some": f"{mask} = {mask} + {_paren(text)}"}.get(
                state["mask"], f"{mask} = {_paren(text)} if {mask} is None else {mask} + {_paren(text)}"))
            state["mask"] = "some" if state["mask"] == "some" or not inside_if else "maybe"
            state["masked"] = state["added"] = True
        elif isinstance(value, cst.Call):
            tree = lift_.tree(d)
            args = [a.value for a in value.args]
            if any(a.keyword is not None or a.star for a in value.args):
                return None
            name = ctx.qualname(value.func)
            if name == "torch.where" and len(args) == 3 and tree.op == "torch.where":
                if is_prev(args[1], prev) and fill_ok(tree.args[2]):
                    cond, fill, keep = operand(args[0]), operand(args[2]), True
                elif is_prev(args[2], prev) and fill_ok(tree.args[1]):
                    cond, fill, keep = operand(args[0]), operand(args[1]), False
                else:
                    fills = [a for a in tree.args[1:] if not (a.op == "leaf" and a.value[1:2] == (prev,))]
                    return _fill_reason(state, fills[-1] if fills else tree, line)
            elif tree.op in (".masked_fill", "torch.masked_fill") and len(tree.args) == 3:
                if isinstance(value.func, cst.Attribute) and value.func.attr.value == "masked_fill" and len(args) == 2 \
                        and is_prev(value.func.value, prev):
                    cond, fill = args
                elif name == "torch.masked_fill" and len(args) == 3 and is_prev(args[0], prev):
                    cond, fill = args[1:]
                else:
                    return None
                if not fill_ok(tree.args[2]):
                    return _fill_reason(state, tree.args[2], line)
                cond, fill, keep = operand(cond), operand(fill), False
            elif tree.op == "to" and is_prev(value, prev):
                return []
            else:
                return None
            if cond is None or fill is None:
                return None
            where = spell("torch.where")
            new = f"{where}({cond}, {current()}, {fill})" if keep else f"{where}({cond}, {fill}, {current()})"
            out.append(f"{mask} = {new}")
            state["mask"] = "some" if state["mask"] == "some" or not inside_if else "maybe"
            state["masked"] = True
        else:
            return None
        if not state["added"]:
            dtype_ok.add(d.stmt.target)
        return out

    def kept(stmt):
        """A statement of the run that is not the attention: as it is, the scores' dtype and device
        read as q's; None when it reads the scores or probabilities otherwise."""
        reads = [n for n in _cst_walk(stmt) if isinstance(n, cst.Name) and fn.name_version.get(id(n)) in chain]
        swap = {}
        for parent in _cst_walk(stmt):
            if isinstance(parent, cst.Attribute) and isinstance(parent.value, cst.Name) \
                    and parent.attr.value in ("dtype", "device") and fn.name_version.get(id(parent.value)) in dtype_ok:
                swap[id(parent.value)] = parent.value
        if any(id(n) not in swap for n in reads):
            return None
        return stmt.visit(_Rename(set(swap), q_name)) if swap else stmt

    # the start: q @ k^T, maybe times numbers
    start = lift_.start
    value = start.stmt.cst.value if isinstance(start.stmt.cst, cst.Assign) else None
    init = "1.0"
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Multiply, cst.Divide)):
        tree = lift_.tree(start)
        sides = [s for s in (value.left, value.right) if not _has_product(s)]
        if len(sides) != 1 or (isinstance(value.operator, cst.Divide) and sides[0] is not value.right) \
                or not _number_of(ctx, tree, None):
            return None
        text = operand(_unwrap_full(ctx, sides[0]))
        if text is None:
            return None
        init = f"1.0 / {_paren(text)}" if isinstance(value.operator, cst.Divide) else text
    elif not (isinstance(value, cst.Call) or isinstance(value, cst.BinaryOperation)
              and isinstance(value.operator, cst.MatrixMultiply)):
        return None
    dtype_ok.add(start.stmt.target)
    fast = [f"{scale} = {init}\n", f"{mask} = None\n"]
    for stmt in region[1:-1]:
        if id(stmt) in lift_.steps:
            lines = lifted(lift_.steps[id(stmt)], False)
            if lines is None:
                return state["why"]
            fast += [f"{x}\n" for x in lines]
        elif id(stmt) in lift_.ifs:
            inner = []
            for s in stmt.body.body:
                if id(s) in lift_.steps:
                    lines = lifted(lift_.steps[id(s)], True)
                    if lines is None:
                        return state["why"]
                    inner += [cst.parse_statement(x) for x in lines]
                else:
                    k_ = kept(s)
                    if k_ is None or not isinstance(s, cst.SimpleStatementLine) and not is_check(s):
                        return None
                    inner.append(k_)
            if not inner:
                inner = [cst.parse_statement("pass")]
            if any(fn.name_version.get(id(n)) in lift_.scores for n in _cst_walk(stmt.test) if isinstance(n, cst.Name)):
                return None
            fast.append(module.code_for_node(stmt.with_changes(body=stmt.body.with_changes(body=inner))))
            if not state["added"]:
                dtype_ok.update(v for v, p in fn.phis.items() if p.if_cst is stmt and v in lift_.scores)
        elif id(stmt) in lift_.prob_lines or stmt in lift_.head_ifs:
            continue
        else:
            k_ = kept(stmt)
            if k_ is None:
                line = positions[stmt].start.line
                return (f"`{_short(code_of(stmt.with_changes(leading_lines=[])))}` (line {line}) reads the attention "
                        f"scores or probabilities and is not part of the attention")
            fast.append(module.code_for_node(k_))
    if state["why"]:
        return state["why"]
    if not state["masked"]:
        fast.remove(f"{mask} = None\n")
    # what the run defines and is read after it
    inside = set(lift_.scores | lift_.probs)
    inside |= {v for v, p in fn.phis.items() if p.before in inside or p.inner in inside}
    output = node.stmt.target
    hi = positions[region[-1]].end.line

    def later(g, after, values, out, env, skip):
        return _later_reads(g, ctx.analysis, after, values, out, env, skip=skip)

    reads = later(fn, hi, inside, output, lift_.start.stmt.env, frozenset())
    nodes, extra = {}, []
    if isinstance(reads, str):
        plan = probs_parameter(ctx, inside, later)
        if plan is None:
            return reads
        if isinstance(plan, str):
            return plan
        name, ret, nodes = plan
        reads = later(fn, hi, inside, output, lift_.start.stmt.env, frozenset({id(ret)}))
        if isinstance(reads, str):
            return reads
        extra = [name]
        returned = next(el.value.value for el in ret.value.elements
                        if isinstance(el.value, cst.Name) and fn.name_version.get(id(el.value)) in inside)
        reads = (reads[0], reads[1] | {returned})
    tests = [code_of(i.test) for i in lift_.head_ifs]
    tests += [t for t in reads[0] + extra if t not in tests]
    if not tests:
        return None
    masks = [_opaque(mask)] if state["masked"] else []
    sdpa = Parts(q, k, parts.v, scale=[_opaque(scale)], masks=masks, dropout=parts.dropout)
    call = _sdpa_code(ctx, node, raw, sdpa, inside, dict(node.stmt.env), spell)
    if call.startswith("!"):
        return call[1:]
    line = node.stmt.line_node.deep_replace(node.cst, cst.parse_expression(call)).with_changes(leading_lines=[])
    fast.append(module.code_for_node(line))
    fast += [f"{n} = None\n" for n in sorted(reads[1])]
    head = region[0].with_changes(leading_lines=[])
    explicit = "".join(module.code_for_node(s) for s in [head, *region[1:]])
    cond = " or ".join(t if len(tests) == 1 or _atomic(t) else f"({t})" for t in tests)
    indent = module.default_indent
    code = f"if {cond}:  # {MARK}\n{_indent(explicit, indent)}else:\n{_indent(''.join(fast), indent)}"
    try:
        cst.parse_statement(code)
    except cst.ParserSyntaxError:
        return None
    lo = positions[region[0]].start.line
    return StatementRewrite(lo, positions[node.stmt.line_node].end.line, {id(region[0]): (region[0], code)},
                            list(region[1:]), set(), drop=True, leading=list(region[0].leading_lines), nodes=nodes)


class _Rename(cst.CSTTransformer):
    """`s.dtype` -> `q.dtype` for the Names `ids` (the scores, before any mask is added)."""

    def __init__(self, ids: set, name: str):
        super().__init__()
        self.ids, self.name = ids, name

    def on_leave(self, original, updated):
        updated = super().on_leave(original, updated)
        return updated.with_changes(value=self.name) if id(original) in self.ids else updated


def _reads_dtype_of(expr, fn, version) -> bool:
    return isinstance(expr, cst.Attribute) and expr.attr.value == "dtype" and isinstance(expr.value, cst.Name) \
        and fn.name_version.get(id(expr.value)) == version


def _has_product(expr) -> bool:
    return any(isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.MatrixMultiply) or
               isinstance(n, cst.Call) and code_of(n.func).split(".")[-1] in ("matmul", "bmm") for n in _cst_walk(expr))


def _unwrap_full(ctx: Context, expr):
    """`torch.full([], c, ...)` / `torch.tensor(c, ...)`: c (the number a 0-d tensor holds), else `expr`."""
    if isinstance(expr, cst.Call):
        name = ctx.qualname(expr.func)
        args = [a for a in expr.args if a.keyword is None]
        if name == "torch.full" and len(args) == 2 and isinstance(args[0].value, (cst.List, cst.Tuple)) \
                and not args[0].value.elements:
            return args[1].value
        if name == "torch.tensor" and len(args) == 1:
            return args[0].value
    return expr


def _number_of(ctx: Context, tree: Expr, prev) -> bool:
    """Are the factors of `tree` (a product with the scores `prev`, or q @ k^T) numbers: Python
    numbers, or 0-d tensors made of one, or values the source does not show to be tensors?"""
    if tree.op != "*":
        return False
    ok = True
    for f in tree.args:
        if f.op == "leaf" and f.value[0] == "var" and f.value[1] == prev or f.op in PRODUCTS:
            continue
        if f.op == "**" and len(f.args) == 2 and f.args[1].is_num() and f.args[1].value == -1.0:
            f = f.args[0]
        if f.op in ("torch.full", "torch.tensor") and f.args:
            f = f.args[-1]
        ok = ok and _number(ctx, f) in ("number", None)
    return ok


def _paren(text: str) -> str:
    try:
        e = cst.parse_expression(text)
    except cst.ParserSyntaxError:
        return f"({text})"
    atomic = isinstance(e, (cst.Name, cst.Attribute, cst.Call, cst.Integer, cst.Float, cst.Subscript)) or e.lpar
    return text if atomic else f"({text})"


def _fill_reason(state, fill: Expr, line: int):
    from kiln.adopt.attention_flow import finite_fill
    state["why"] = state["why"] or f"{finite_fill(fill)} (line {line})"
    return None
