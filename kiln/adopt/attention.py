"""sdpa: hand-written scaled dot-product attention -> `F.scaled_dot_product_attention`.

Attention in the wild is written many ways; all of them are read into one expression tree (values
folded across the statements of one block, `if mask is not None: s = s + mask` seen as an optional
mask, simple mask helpers such as `maybe_add_mask(s, m)` inlined) and taken apart here:

    probs @ v                      @, torch.matmul, torch.bmm
    probs: dropout / casts around  softmax(logits, dim=-1[, dtype=float32])
    logits: casts (.float()), additive masks, masked_fill(cond, -inf) / where(cond, s, -inf)
            around  scores * scale
    scores: q @ k^T  with k^T any transpose of the last two dims (transpose(-2, -1), .mT,
            permute(0, 1, 3, 2), transpose(2, 3) of a 4-D k, transpose(1, 2) under bmm)
    scale:  numbers on the scores, on q or on k; tensor factors stay on q (or k)

The replacement passes the masks as `attn_mask` (additive ones as they are, boolean ones as the
positions to keep), dropout as `dropout_p=p if training else 0.0` and the numeric scale as
`scale=`.  Statements whose values only fed the attention are removed; when one of them (the
scores, the probabilities) is still read elsewhere the location is refused with that reason.
Attention this tree does not cover is located by data flow in `attention_flow.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from kiln.adopt.dsl import Const, Node, Opaque, Var
from kiln.adopt.expr import Expr, TreeBuilder, const
from kiln.adopt.attention_flow import expr_text, finite_fill, neg_inf, sdpa_locations
from kiln.adopt.canon import SIGNATURES
from kiln.adopt.dsl import Attr, Item, Tuple
from kiln.adopt.rules import PYTHON_RULES
from kiln.adopt.shapes import Ranks, asserted, view_round_trip, view_sizes
from kiln.adopt.structural import (Context, Found, GuardBuilder, StructuralRule, _cst_walk, _reads, _returns,
                                   code_of)

SDPA = "torch.nn.functional.scaled_dot_product_attention"
PRODUCTS = ("@", "torch.bmm", ".bmm")
_VIEWS = (".view", ".reshape")
_NUMBER_CALLS = {".size", ".dim", ".numel", "len", "int", "float", "math.sqrt", "math.log", "math.exp", "math.pow"}


class AttentionBuilder(GuardBuilder):
    """Trees for sdpa: a GuardBuilder that also inlines module-level mask helpers
    (`return s if m is None else s + m`).  With `shared=True` it also folds values of the block that
    are read more than once: never to rewrite (their statements would have to stay), but to take the
    attention apart and say which of its values something else reads (`_still_read`)."""

    def __init__(self, ctx: Context, block, shared: bool = False):
        super().__init__(ctx.fn)
        self.ctx, self.block, self.shared = ctx, block, shared

    def _inline(self, name: str) -> bool:
        if name in self.forced or self.fn.inlinable(name):
            return True
        node = self.fn.defs.get(name)
        if not self.shared or node is None or name in self.fn.mutated:
            return False
        stmt = node.stmt
        return stmt is not None and stmt.target == name and stmt.block is self.block

    def node(self, node) -> Expr:
        helper = self.ctx.functions.get(node.op) if node.module is None and not node.kwargs else None
        if helper is not None:
            inlined = self._mask_helper(helper, node)
            if inlined is not None:
                return inlined
        return super().node(node)

    def _mask_helper(self, helper, node):
        """`maybe_add_mask(s, m)` whose body is `return s if m is None else s + m` (or the `is not None`
        spelling, or `return s + m`): the tree `s + m`, with m optional when tested against None."""
        params, args = helper.params, list(node.args)
        body = [s for s in helper.cst.body.body if not (isinstance(s, cst.SimpleStatementLine)
                                                         and isinstance(s.body[0], cst.Expr))]
        if len(args) != len(params) or len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) \
                or not isinstance(body[0].body[0], cst.Return) or body[0].body[0].value is None:
            return None
        value = body[0].body[0].value
        bound = dict(zip(params, args))
        sum_ = value
        optional = None
        if isinstance(value, cst.IfExp) and isinstance(value.test, cst.Comparison) \
                and len(value.test.comparisons) == 1 and isinstance(value.test.left, cst.Name) \
                and code_of(value.test.comparisons[0].comparator) == "None":
            optional = value.test.left.value
            is_none = isinstance(value.test.comparisons[0].operator, cst.Is)
            plain, sum_ = (value.body, value.orelse) if is_none else (value.orelse, value.body)
            if not isinstance(plain, cst.Name) or plain.value not in bound:
                return None
        if not (isinstance(sum_, cst.BinaryOperation) and isinstance(sum_.operator, cst.Add)
                and isinstance(sum_.left, cst.Name) and isinstance(sum_.right, cst.Name)
                and sum_.left.value in bound and sum_.right.value in bound):
            return None
        left, right = bound[sum_.left.value], bound[sum_.right.value]
        terms = []
        for name, operand in ((sum_.left.value, left), (sum_.right.value, right)):
            e = self.operand(operand)
            if name == optional:
                if not isinstance(operand, Var):
                    return None
                e = Expr("guard", [e], value=(operand.python_name, operand.name))
            terms.append(e)
        e = Expr("+", terms)
        e.set_origin(node.cst, None)
        return e


@dataclass
class Parts:
    """Hand-written attention taken apart (trees of the normalized match)."""
    q: Expr
    k: Expr
    v: Expr
    scale: list = field(default_factory=list)     # numeric factors: the `scale=` argument
    masks: list = field(default_factory=list)     # additive terms of the logits
    keep: list = field(default_factory=list)      # boolean masks: True where a key takes part
    dropout: dict = field(default_factory=dict)   # {"$dp", "$train"} or {"$drop"}
    core: list = field(default_factory=list)      # the trees from the product with v down to q @ k^T
    batch: list = field(default_factory=list)     # sizes dim 0 splits into where masks are added to a view


def _int(e: Expr):
    return int(e.value) if e is not None and e.is_num() and float(e.value).is_integer() else None


def _is_float32(e: Expr) -> bool:
    return e is not None and e.key == ("leaf", ("ref", "torch.float32"), (), ())


def _contains_product(e: Expr) -> bool:
    return any(x.op in PRODUCTS for x in e.walk())


def _on_score_path(e: Expr) -> bool:
    """Is `e` the scores, possibly scaled, masked or cast (not a mask computed from them)?"""
    if e.op in PRODUCTS:
        return True
    if e.op in ("*", "+", "to", ".masked_fill", "torch.masked_fill", "torch.where") + _VIEWS:
        return any(_on_score_path(a) for a in e.args[:1] if e.op in _VIEWS) or \
            e.op not in _VIEWS and any(_on_score_path(a) for a in e.args)
    return False


def take_apart(ctx: Context, tree: Expr, ranks: Ranks, fills=None):
    """(Parts, None) for attention that can be rewritten, (Parts or None, reason) for attention that
    cannot, None for anything that is not hand-written attention.  `fills(e)` says which finite
    fills a caller that builds the masks itself takes (attention_lift.py); the others stop here."""
    ok = fills or (lambda e: False)
    if tree.op not in PRODUCTS or len(tree.args) != 2:
        return None
    probs, v = tree.args
    parts = Parts(None, None, v, core=[tree, probs])
    casts, upcast = [], False
    while True:
        kw = dict(probs.kw)
        if probs.op == "dropout" and set(kw) <= {"p", "training"}:
            parts.dropout = {"$dp": kw.get("p", const(0.5)), "$train": kw.get("training")}
        elif probs.op == "torch.nn.Dropout" and len(probs.args) == 1:
            parts.dropout = {"$drop": kw["__module__"]}
        elif probs.op == "to" and (len(probs.args) == 2 and not kw or len(probs.args) == 1 and set(kw) == {"dtype"}):
            casts.append(probs.args[1] if len(probs.args) == 2 else kw["dtype"])
        else:
            break
        probs = probs.args[0]
        parts.core.append(probs)
    if probs.op != "softmax" or not probs.args:
        return None
    kw = dict(probs.kw)
    dim = _int(kw.get("dim"))
    if set(kw) - {"dim", "dtype"} or not (dim == -1 or dim == 2 and tree.op != "@"):
        return None
    if "dtype" in kw:
        if not _is_float32(kw["dtype"]):
            return None
        upcast = True
    logits, reason = probs.args[0], None
    while True:
        parts.core.append(logits)
        if logits.op == "to" and len(logits.args) == 2 and _is_float32(logits.args[1]):
            upcast, logits = True, logits.args[0]
        elif logits.op in (".masked_fill", "torch.masked_fill") and len(logits.args) == 3:
            scores, cond, fill = logits.args
            if not neg_inf(fill) and not ok(fill):
                reason = reason or finite_fill(fill)
            parts.keep.append(_invert(cond))
            logits = scores
        elif logits.op == "torch.where" and len(logits.args) == 3 and not logits.kw:
            cond, a, b = logits.args
            if _contains_product(a) and not _contains_product(b):
                parts.keep.append(cond)
                reason = reason or (None if neg_inf(b) or ok(b) else finite_fill(b))
                logits = a
            elif _contains_product(b) and not _contains_product(a):
                parts.keep.append(_invert(cond))
                reason = reason or (None if neg_inf(a) or ok(a) else finite_fill(a))
                logits = b
            else:
                return None
        elif logits.op == "+":
            scored = [t for t in logits.args if _on_score_path(t)]
            if len(scored) != 1:
                return None
            parts.masks += [t for t in logits.args if t is not scored[0]]
            logits = scored[0]
        elif logits.op in _VIEWS and logits.args:
            peeled = _round_trip(ctx, logits)
            if peeled is None:
                return None
            if (parts.masks or parts.keep) and not parts.batch:
                reason = reason or "a mask is added to the scores both as they are and through a view of them"
            logits, masks, batch, why = peeled
            if parts.batch and [b.key for b in batch] != [b.key for b in parts.batch]:
                why = why or "the scores are viewed with different shapes to add their masks"
            parts.masks += masks
            parts.batch = batch
            reason = reason or why
        else:
            break
    factors = list(logits.args) if logits.op == "*" else [logits]
    products = [f for f in factors if f.op in PRODUCTS]
    if len(products) != 1 or len(products[0].args) != 2:
        return None
    product = products[0]
    parts.core.append(product)
    q, kt = product.args
    k, why = _untranspose(ctx, kt, product, ranks, _checked_rank(ctx, [logits, product]))
    if k is None:
        return None
    if product.op != "@":      # torch.bmm: 3-D operands only; the original fails on anything else
        wrong = next((r for r in (_rank(ctx, q, ranks), _rank(ctx, k, ranks)) if r not in (None, 3)), None)
        if wrong is not None:
            return parts, f"torch.bmm takes 3-D tensors, but the source makes q or k {wrong}-D: the original fails here"
    q_factors, q_scale = _split_scale(ctx, q)
    k_factors, k_scale = _split_scale(ctx, k)
    parts.q = q_factors[0] if len(q_factors) == 1 else Expr("*", q_factors)
    parts.k = k_factors[0] if len(k_factors) == 1 else Expr("*", k_factors)
    parts.scale = q_scale + k_scale
    for f in factors:
        if f is product:
            continue
        kind = _number(ctx, f)
        if kind in ("number", None):
            parts.scale.append(f)
        elif kind == "scalar":          # a 0-d tensor: (q * s) @ k^T is (q @ k^T) * s
            parts.q = Expr("*", [parts.q, f])
        else:
            reason = reason or (f"the scores are multiplied by `{expr_text(f)}`, which is not known to be a number "
                                f"(scaled_dot_product_attention takes a numeric scale)")
    if any(m.op == "const" for m in parts.masks):
        return None
    reason = reason or why
    guards = [m for m in parts.masks if m.op == "guard"]
    if guards and len(parts.masks) > 1 and not (len(guards) == 2 == len(parts.masks) and not parts.keep):
        reason = reason or "the mask is added under `if ... is not None` together with other masks"
    inputs = {e.key for e in [q, k, v, parts.q, parts.k] + (list(q.args) if q.op == "*" else []) +
              (list(k.args) if k.op == "*" else [])}
    for c in casts:
        if _is_float32(c) and not upcast:
            reason = reason or "the probabilities are cast to float32, which changes the result's dtype"
        elif not (c.op == "." and c.value == "dtype" and c.args[0].key in inputs
                  and (c.args[0].pure or c.args[0].var in {q.var, k.var, v.var} - {None})):   # v.dtype
            reason = reason or "the probabilities are cast to a dtype that is not the dtype of q, k or v"
    if upcast and not casts:
        reason = reason or ("the softmax is taken in float32 and never cast back: the result's dtype "
                            "would change")
    return parts, reason


def _round_trip(ctx: Context, e: Expr):
    """`(s.view(b, h, t, k) + m).view(b * h, t, k)`, a mask added to a view of 3-D scores `s`:
    (s, [m], [b, h], None) when a check shows that `s` has the sizes of the view back, so that
    the first view only splits dim 0 (then q, k and v can be split the same way); (s, [m], [b, h],
    reason) when the source does not show that; None when `e` is not such a round trip."""
    inner = e.args[0]
    terms = list(inner.args) if inner.op == "+" else [inner]
    viewed = [t for t in terms if t.op in _VIEWS and t.args and _on_score_path(t.args[0])]
    if len(viewed) != 1 or e.src is None or viewed[0].src is None:
        return None
    view, masks = viewed[0], [t for t in terms if t is not viewed[0]]
    s, lead = view.args[0], list(view.args[1:-2])
    if len(view.args) == 2 and view.args[1].op == "tuple":
        lead = list(view.args[1].args[:-2])
    made = s.var or (s.value[1] if s.op == "leaf" and s.value[0] == "var" else None)
    before = view_sizes(ctx.fn, s.src) if s.op in _VIEWS and s.src is not None else None
    return s, masks, lead, view_round_trip(ctx.fn, view.src, e.src, made, ctx.analysis.positions, before)


def _invert(cond: Expr) -> Expr:
    """The keep-mask of `masked_fill(cond, -inf)`: `a != b` for `a == b`, `m` for `~m`, else `~cond`."""
    if cond.op in ("operator.invert", ".logical_not") and len(cond.args) == 1:
        return cond.args[0]
    if cond.op == "leaf" and cond.value[0] == "opaque":
        try:
            node = cst.parse_expression(cond.value[1])
        except cst.ParserSyntaxError:
            node = None
        if isinstance(node, cst.Comparison) and len(node.comparisons) == 1 \
                and isinstance(node.comparisons[0].operator, (cst.Equal, cst.NotEqual)):
            flip = cst.NotEqual() if isinstance(node.comparisons[0].operator, cst.Equal) else cst.Equal()
            comp = node.comparisons[0]
            new = node.with_changes(comparisons=[comp.with_changes(operator=flip.with_changes(
                whitespace_before=comp.operator.whitespace_before, whitespace_after=comp.operator.whitespace_after))])
            return Expr("leaf", value=("opaque", code_of(new), cond.value[2]), reads=cond.reads)
    return Expr("operator.invert", [cond])


def _checked_rank(ctx: Context, scores: list):
    """The number of dimensions a size check states for the scores (the product, or the product times
    numbers), or None."""
    for e in scores:
        made = e.var or (e.value[1] if e.op == "leaf" and e.value[0] == "var" else None)
        sizes = asserted(ctx.fn, made, ctx.analysis.positions, 10**9) if made and hasattr(ctx, "analysis") else None
        if sizes is not None:
            return len(sizes)
    return None


def _untranspose(ctx: Context, kt: Expr, product: Expr, ranks: Ranks, scores_rank=None):
    """(k, None) when `kt` is k with its last two dims swapped; (k, reason) when it is only if k has a
    rank the source does not show; (None, None) when it is not a transpose at all.  Scores checked to
    be n-D show it for `q @ k.transpose(n - 2, n - 1)`: k must have n dims for that transpose, and
    the product has no more than k."""
    if kt.op == "." and kt.value == "mT" and kt.args:
        return kt.args[0], None
    if kt.op == ".permute" and len(kt.args) > 2:
        order = [_int(a) for a in kt.args[1:]]
        n = len(order)
        if order == list(range(n - 2)) + [n - 1, n - 2]:
            return kt.args[0], None
        return None, None
    if kt.op != "transpose":
        return None, None
    dims = dict(kt.kw)
    d0, d1 = _int(dims.get("dim0")), _int(dims.get("dim1"))
    if d0 is None or d1 is None:
        return None, None
    k = kt.args[0]
    if {d0, d1} == {-2, -1}:
        return k, None
    if d0 < 0 or d1 != d0 + 1:
        return None, None
    if product.op != "@" and (d0, d1) == (1, 2):         # bmm takes 3-D tensors: dims 1, 2 are the last two
        return k, None
    known = _rank(ctx, k, ranks)
    if known == d1 + 1 or known is None and product.op == "@" and scores_rank == d1 + 1:
        return k, None
    if known is None:
        return k, (f"k.transpose({d0}, {d1}) is k^T only when k is {d1 + 1}-D, and the source does not show "
                   f"k's number of dimensions")
    return None, None


def _rank(ctx: Context, e: Expr, ranks: Ranks):
    if e.op == "leaf" and e.value[0] == "var":
        return ranks.of(ctx.fn, Var(e.value[1]))
    if e.var:
        return ranks.of(ctx.fn, Var(e.var))
    node = next((n for n in ctx.fn.nodes if n.cst is e.src), None) if e.src is not None else None
    return ranks.node(ctx.fn, node) if node is not None else None


def _split_scale(ctx: Context, e: Expr):
    """(tensor factors, numeric factors) of a product forming q or k."""
    if e.op != "*":
        return [e], []
    numbers = [f for f in e.args if _number(ctx, f) == "number" or f.op == "const"]
    tensors = [f for f in e.args if f not in numbers]
    if not tensors:
        return [e], []
    return tensors, numbers


def _number(ctx: Context, e: Expr, depth: int = 0):
    """"number" when `e` is a Python number (it can be `scale=`); "scalar" for a 0-d tensor
    (`torch.full([], ...)`); "tensor" for what the source shows is a tensor (a torch call, an
    `nn.Parameter` built in `__init__`); None when the source does not say (a parameter, a config
    field: taken as the number it is in practice for a scale on the scores)."""
    if depth > 12:
        return None
    if e.op == "const":
        return "number" if isinstance(e.value, float) else None
    if e.op in _NUMBER_CALLS or e.op == "[]" and e.args and e.args[0].op == "." and e.args[0].value == "shape":
        return "number"
    if e.op in ("sqrt", "rsqrt", "**", "*", "+"):
        kinds = {_number(ctx, a, depth + 1) for a in e.args}
        return "number" if kinds == {"number"} else "tensor" if "tensor" in kinds else None
    if e.op == "torch.full" and e.args and e.args[0].op == "tuple" and not e.args[0].args \
            or e.op == "leaf" and e.value[0] == "opaque" and e.value[1].replace(" ", "").startswith("torch.full([]"):
        return "scalar"
    if e.op == "." and e.args and e.args[0].op == "leaf" and ctx.fn.params[:1] == [e.args[0].value[1]] \
            and ctx.fn.cls is not None:
        kinds = set()
        for x in ctx.fn.init.get(e.value, []):   # `self.scale = head_dim ** -0.5`: math, int, float only
            calls = [c for c in _cst_walk(x) if isinstance(c, cst.Call)]
            torchy = any(not (ctx.qualname(c.func) or "").startswith(("math.", "int", "float")) for c in calls)
            kinds.add("tensor" if torchy else "number")
        return kinds.pop() if len(kinds) == 1 else None
    if e.op == "leaf" and e.value[0] == "var":
        node = ctx.fn.defs.get(e.value[1])
        if node is None or e.value[1] in ctx.fn.mutated:
            return None
        full = TreeBuilder(ctx.fn.nodes, inline=lambda name: name not in ctx.fn.mutated)
        return _number(ctx, ctx.normalize(full.node(node)), depth + 1)
    if e.op.startswith(("torch.", ".")):
        return "tensor"
    if e.op in SIGNATURES and e.args:       # exp, tanh ...: a number of numbers, a tensor of tensors
        kinds = {_number(ctx, a, depth + 1) for a in e.args}
        return "number" if kinds == {"number"} else "tensor" if "tensor" in kinds else None
    return None


def _lines(parts: Parts) -> tuple[list[Node], dict]:
    """The replacement line and the bindings it uses."""
    env = {"$q": parts.q, "$k": parts.k, "$v": parts.v}
    kwargs = []
    if parts.masks:
        env["$mask"] = parts.masks[0] if len(parts.masks) == 1 else Expr("+", parts.masks)
    if parts.keep:
        env["$keep"] = parts.keep[0] if len(parts.keep) == 1 else Expr("operator.and_", parts.keep)
    guard = parts.masks[0] if len(parts.masks) == 1 and parts.masks[0].op == "guard" else None
    if len(parts.masks) == 2 and all(m.op == "guard" for m in parts.masks):   # two optional masks: their sum
        for i, g in enumerate(reversed(parts.masks), 1):
            env[f"$m{i}"], env[f"$t{i}"] = g.args[0], Expr("leaf", value=("var", g.value[1]), reads={g.value[1]})
        kwargs.append(("attn_mask", Opaque("$m1 if $t2 is None else $m2 if $t1 is None else $m1 + $m2")))
    elif guard is not None and parts.keep:   # an optional mask and a keep-mask: both when there is one
        env["$mask"], env["$test"] = guard.args[0], Expr("leaf", value=("var", guard.value[1]), reads={guard.value[1]})
        kwargs.append(("attn_mask", Opaque('torch.where($keep, $mask, float("-inf")) if $test is not None else $keep')))
    elif parts.masks and parts.keep:     # masked_fill(-inf) then + mask: the mask where kept, -inf elsewhere
        kwargs.append(("attn_mask", Opaque('torch.where($keep, $mask, float("-inf"))')))
    elif parts.masks or parts.keep:
        kwargs.append(("attn_mask", Var("$mask" if parts.masks else "$keep")))
    env.update({k: v for k, v in parts.dropout.items() if v is not None})
    if "$drop" in parts.dropout:
        kwargs.append(("dropout_p", Opaque("$drop.p if $drop.training else 0.0")))
    elif "$dp" in parts.dropout:
        kwargs.append(("dropout_p", Opaque("$dp if $train else 0.0") if parts.dropout["$train"] is not None
                       else Var("$dp")))
    scale = parts.scale
    env["$scale"] = scale[0] if len(scale) == 1 else Expr("*", scale) if scale else const(1.0)
    kwargs.append(("scale", Var("$scale")))
    if not parts.batch:
        return [Node(SDPA, (Var("$q"), Var("$k"), Var("$v")), tuple(kwargs))], env
    # 3-D q, k, v whose scores take their masks through a view (b * h, t, k) -> (b, h, t, k): split
    # dim 0 the same way, attend in that shape, and merge the dims back
    sizes = Tuple(tuple(Var(f"$b{i}") for i in range(len(parts.batch))))
    env.update({f"$b{i}": b for i, b in enumerate(parts.batch)})
    split = [Node(".unflatten", (Var(f"${x}"), Const(0), sizes), out=Var(f"%{x}")) for x in "qkv"]
    attend = Node(SDPA, (Var("%q"), Var("%k"), Var("%v")), tuple(kwargs), out=Var("%o"))
    return split + [attend, Node(".flatten", (Var("%o"), Const(0), Const(len(parts.batch) - 1)))], env


def find_sdpa(ctx: Context, node: Node, raw: Expr, tree: Expr):
    from kiln.adopt.attention_split import kept_explicit
    if node.op not in PRODUCTS or node.stmt is None or kept_explicit(ctx.fn, node.stmt.line_node):
        return None
    ranks = Ranks(ctx.functions)
    builder = AttentionBuilder(ctx, node.stmt.block)
    raw2 = builder.node(node)
    found = take_apart(ctx, ctx.normalize(raw2), ranks)
    if found is None:      # not foldable as written: values read elsewhere too? Then say which.
        shared = AttentionBuilder(ctx, node.stmt.block, shared=True)
        raw3 = shared.node(node)
        found = take_apart(ctx, ctx.normalize(raw3), ranks)
        if found is None:
            return None
        parts, reason = found
        env = _lines(parts)[1]
        phis = [shared.phis[v] for v in raw3.vars if v in shared.phis]
        reason = reason or _still_read(ctx, node, raw3, env, phis, parts) or \
            "the attention is spread over statements that cannot be removed"
        return Found(env, None, reason, raw=raw3)
    parts, reason = found
    lines, env = _lines(parts)
    phis = [builder.phis[v] for v in raw2.vars if v in builder.phis]
    if reason is None:
        result = node.out.name if node.out is not None else None
        target = node.stmt.target
        if any(v is not None and (v in ctx.fn.mutated or v in ctx.fn.updated) for v in (result, target)):
            reason = ("the attention output is modified in place afterwards (`+=`), which "
                      "scaled_dot_product_attention's backward does not allow")
    if reason is not None:
        return Found(env, None, reason, raw=raw2)
    return Found(env, lines, raw=raw2, phis=phis)


def _still_read(ctx: Context, node: Node, raw: Expr, env: dict, phis: list, parts: Parts) -> str | None:
    """The first value of the attention (scores, probabilities) that something besides the attention
    reads: then the explicit computation has to stay, and the rewrite would not remove it."""
    fn = ctx.fn
    core = [e.var for e in parts.core if e.var]
    bound = set().union(*(e.vars for e in env.values() if isinstance(e, Expr))) - set(core)
    folded = [v for v in raw.vars if v not in fn.phis and v not in bound]
    stmts = {id(fn.defs[v].stmt) for v in folded if fn.defs.get(v) is not None and fn.defs[v].stmt is not None}
    stmts.add(id(node.stmt))
    bodies = [p.body for p in phis]
    inside = [n for n in fn.nodes if n.stmt is not None and (id(n.stmt) in stmts or n.stmt.block in bodies)]
    for v in sorted(set(core), key=lambda v: fn.defs[v].line if v in fn.defs else 0):
        if v.startswith("%") or v not in folded:
            continue
        reads = sum(_count(n, v) for n in inside)
        if fn.uses[v] > reads:
            return f"the attention {_role(parts, v)} `{v.split(':')[0]}` are also {_other_use(fn, v, inside)}"
    return None


def _role(parts: Parts, value: str) -> str:
    """"probabilities" for the softmax and what follows it, "scores" for what comes before."""
    for step in parts.core:
        if step.var == value:
            return "probabilities"
        if step.op == "softmax":
            return "scores"
    return "scores"


def _count(node: Node, name: str) -> int:
    def visit(op) -> int:
        if isinstance(op, Var):
            return int(op.name == name)
        if isinstance(op, Attr):
            return visit(op.base)
        if isinstance(op, Item):
            return visit(op.base) + op.reads.count(name)
        if isinstance(op, Tuple):
            return sum(visit(i) for i in op.items)
        if isinstance(op, Opaque):
            return op.reads.count(name)
        return 0
    return sum(visit(a) for a in list(node.args) + [v for _, v in node.kwargs] +
               ([node.module] if node.module is not None else []))


def _other_use(fn, value: str, inside: list) -> str:
    line = _returned(fn, value)
    if line is not None:
        return f"returned (line {line})"
    readers = [n for n in fn.nodes if n not in inside and _reads(n, value)]
    if readers:
        return f"read at line {min(n.line for n in readers)}"
    return "read elsewhere (in a condition or a nested function)"


def _returned(fn, value: str, depth: int = 0):
    """The line of a `return` that gives back `value`, directly or through copies and tuples."""
    for n in _returns(fn):
        if _reads(n, value):
            return n.line
    if depth < 4:
        later = [n.out.name for n in fn.nodes if n.out is not None and n.op in ("=", ".detach", "to") and _reads(n, value)]
        later += [m for m, preds in fn.merges.items() if value in preds]
        later += [phi.value for phi in fn.phis.values() if value in (phi.before, phi.inner)]
        for v in later:
            line = _returned(fn, v, depth + 1)
            if line is not None:
                return line
    return None


def _splits(ctx: Context, spell):
    from kiln.adopt.attention_split import explicit_splits
    return explicit_splits(ctx, spell)


SDPA_RULE = StructuralRule("sdpa", PYTHON_RULES["sdpa"], find_sdpa, locate=sdpa_locations, statements=_splits)
