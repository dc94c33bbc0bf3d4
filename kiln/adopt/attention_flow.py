"""sdpa locations found by data flow, each with the one reason it is not rewritten.

The expression-tree rule (`attention.py`) rewrites attention it can take apart; this finds the rest
by following values across statements and branches: a softmax over the last dim whose input comes
from a q @ k^T product (`@`, `matmul`, `bmm`, `baddbmm`, `einsum`) through scaling, masks and biases,
`masked_fill` / `torch.where`, clamps, casts, views, helper calls and `if`/`else` merges, and whose
output reaches a product with v through dropout, casts, a head mask and views, being otherwise only
returned (directly or packed in an output tuple) or dropped.  Probabilities read by anything else
(talking heads, statistics) are not attention.

Every step that keeps the rewrite out is recorded with its line; the reason reported is the first
of them in source order, in plain words (one reason per location).
"""
from __future__ import annotations

import re

import libcst as cst

from kiln.adopt.analysis import Function
from kiln.adopt.dsl import Const, Node, Opaque, Tuple, Var
from kiln.adopt.expr import Expr
from kiln.adopt.shapes import view_round_trip, view_sizes
from kiln.adopt.structural import Context, _reads, _returns, code_of, flat

# q @ k^T in its other spellings; the softmax input is traced back to one of these
_SCORE_PRODUCTS = {"@", "torch.bmm", ".bmm", "torch.baddbmm", ".baddbmm", "torch.einsum"}
# between the product and the softmax: scale, masks and biases, clamps, casts, view round trips
_SCORE_STEPS = {"+", "-", "*", "/", "to", "=", ".view", ".reshape", ".contiguous", ".masked_fill",
                "torch.masked_fill", "torch.where", "torch.max", "torch.maximum", "torch.clamp", ".clamp",
                ".type_as"}
# between the softmax and the product with v: dropout, casts, a head mask, views
_PROB_STEPS = {"to", "=", "dropout", "torch.nn.Dropout", "*", ".view", ".reshape", ".contiguous", ".type_as",
               ".masked_fill", "torch.where", ".permute", "transpose"}
# what may be done to probabilities that are only returned: rearranged, averaged over the heads
_RETURN_STEPS = {"=", ".contiguous", ".view", ".reshape", "transpose", ".permute", "mean", "to"}
# steps the rewrite does not cover, as the words of a reason
_BLOCKERS = {"torch.max": "the scores are clamped", "torch.maximum": "the scores are clamped",
             "torch.clamp": "the scores are clamped", ".clamp": "the scores are clamped",
             ".view": "the scores are reshaped between the product and the softmax",
             ".reshape": "the scores are reshaped between the product and the softmax",
             "torch.baddbmm": "the scores come from baddbmm (a bias added inside the product)",
             ".baddbmm": "the scores come from baddbmm (a bias added inside the product)",
             "torch.einsum": "the scores come from einsum"}
_NEG_INF = {'float("-inf")', "float('-inf')", '-float("inf")', "-float('inf')", "-math.inf", "-torch.inf",
            "-numpy.inf", "-np.inf", "float('-Inf')", 'float("-Inf")'}


def sdpa_locations(ctx: Context) -> list[tuple[int, int, str]]:
    """(first line, last line, reason) of each hand-written attention found by data flow; the
    caller keeps those no tree match covers."""
    from kiln.adopt.attention_split import kept_explicit
    fn = ctx.fn
    found = []
    for node in fn.nodes:
        last = _is_last_dim_softmax(ctx, node)
        if not last or node.out is None or node.stmt is None or kept_explicit(fn, node.stmt.line_node):
            continue
        blockers: list = []
        start = _trace_scores(ctx, node.args[0], blockers, set())
        if last == "dim=2" and (start is None or start.op not in ("torch.bmm", ".bmm")):
            continue                     # dim=2 is the last dim only of a 3-D (bmm) product
        end = _trace_probs(fn, node.out.name, blockers, set())
        if start is None or end is None or end is False:
            continue
        # The first blocker no rewrite gets past (a soft one, such as a head mask under `if`, could be
        # kept on an explicit path: attention_split.py) is the reason; else the first soft one.
        reasons = sorted(blockers, key=lambda b: (not b[2], b[0]))
        why = (f"{reasons[0][1]} (line {reasons[0][0]})" if reasons else
               "the attention is written in a form the rewrite does not take apart")
        if not reasons or not reasons[0][2]:
            # only blockers an explicit path could keep: the split was tried, and says what stopped it
            why = next((r for line, r in sorted(ctx.split_reasons.items()) if node.line <= line <= end.line), why)
        lifted = [r for line, r in sorted(getattr(ctx, "lift_reasons", {}).items()) if node.line <= line <= end.line]
        found.append((min(start.line, node.line), max(end.line, node.line), lifted[0] if lifted else why))
    return found


def _is_last_dim_softmax(ctx: Context, node: Node):
    """True for a softmax over dim -1; "dim=2" for one over dim 2 (the last dim if the scores are 3-D)."""
    if not node.args:
        return False
    if node.op == "softmax":
        dim = getattr(node.kw.get("dim"), "value", None)
        return True if dim == -1 else "dim=2" if dim == 2 else False
    if node.op == "call" and isinstance(node.module, Var):       # nn.Softmax(dim=-1)(x)
        ctor = ctx.fn.defs.get(node.module.name)
        return ctor is not None and ctor.op == "torch.nn.Softmax" and not ctor.args \
            and getattr(ctor.kw.get("dim"), "value", None) == -1
    if node.op == "torch.nn.Softmax" and node.module is not None:
        ctors = ctx.init_exprs(ctx.builder.operand(node.module))
        return len(ctors) == 1 and isinstance(ctors[0], cst.Call) and len(ctors[0].args) == 1 \
            and flat(code_of(ctors[0].args[0].value)) == "-1"
    return False


def _swaps_last_two(node: Node) -> bool:
    """`p.permute(0, 2, 1)`, `p.permute(0, 1, 3, 2)`, `p.transpose(-2, -1)`: p^T, nothing else."""
    if node.op == "transpose":
        dims = {getattr(node.kw.get("dim0"), "value", None), getattr(node.kw.get("dim1"), "value", None)}
        return dims == {-2, -1}
    order = [getattr(a, "value", None) for a in node.args[1:]]
    n = len(order)
    return n >= 2 and order == list(range(n - 2)) + [n - 1, n - 2]


def _packed(code: str, value: str) -> bool:
    """Is every mention of `value`'s name in `code` a bare tuple element (`(out, probs) if ... else`)?"""
    name = re.escape(value.split(":")[0])
    spans = list(re.finditer(rf"(?<![\w.]){name}(?!\w)", code))
    return bool(spans) and all(re.match(r"\s*[,)]", code[m.end():]) and re.search(r"[(,]\s*$", code[:m.start()])
                               for m in spans)


def _only_in_tuples(node: Node, value: str) -> bool:
    """Does `node` read `value` only as an element of a tuple (`outputs + (probs,)`)?"""
    direct = [a for a in list(node.args) + [v for _, v in node.kwargs] if not isinstance(a, Tuple)]
    return not any(_reads(Node("=", (a,)), value) for a in direct)


def _tensor_vars(node: Node) -> list[str]:
    return [a.name for a in list(node.args) + [v for _, v in node.kwargs] if isinstance(a, Var)]


def _if_line(fn: Function, value: str) -> tuple[int, str]:
    phi = fn.phis.get(value)
    test = code_of(phi.if_cst.test) if phi is not None else "..."
    line = fn.defs[phi.inner].line if phi is not None and phi.inner in fn.defs else 0
    return line, test


def _trace_scores(ctx: Context, operand, blockers: list, seen: set, depth: int = 0):
    """The q @ k^T node the softmax input comes from (on some path), or None."""
    fn = ctx.fn
    if not isinstance(operand, Var) or depth > 40 or operand.name in seen:
        return None
    value = operand.name
    seen.add(value)
    if value in fn.phis:
        phi = fn.phis[value]
        preds = [phi.inner] + ([phi.before] if phi.before else [])
        hits = [_trace_scores(ctx, Var(p), blockers, seen, depth + 1) for p in preds]
        hit = next((h for h in hits if h is not None), None)
        if hit is not None and ctx.phi_builder()._guarded(phi) is None:   # not `if m is not None: s = s + m`
            line, test = _if_line(fn, value)
            blockers.append((line, f"the scores are changed under `if {test}:`, which is not an optional "
                                   f"additive mask", False))
        return hit
    if value in fn.merges:
        hits = [_trace_scores(ctx, Var(p), blockers, seen, depth + 1) for p in sorted(fn.merges[value])]
        hit = next((h for h in hits if h is not None), None)
        if hit is not None:
            lines = [fn.defs[p].line for p in fn.merges[value] if p in fn.defs]
            blockers.append((min(lines) if lines else 0, "the scores are computed differently on the "
                                                         "branches of an `if`/`else`", True))
        return hit
    node = fn.defs.get(value)
    if node is None:
        return None
    hit = _trace_step(ctx, node, blockers, seen, depth)
    if hit is not None and value in fn.mutated:
        blockers.append((min(fn.mutated[value]), f"the scores `{value.split(':')[0]}` are modified in place", True))
    return hit


def _trace_step(ctx: Context, node: Node, blockers: list, seen: set, depth: int):
    fn = ctx.fn
    if node.op in _SCORE_PRODUCTS and len(_tensor_vars(node)) + sum(
            not isinstance(a, (Var, Const)) for a in node.args) >= 2:
        if node.op in _BLOCKERS:
            blockers.append((node.line, _BLOCKERS[node.op], True))
        return node
    trip = _round_trip(ctx, node)
    if trip is not None:             # `(s.view(b, h, t, k) + m).view(b * h, t, k)`: s plus a mask
        inner, why = trip
        seen.add(("round trip", inner))      # its first view is no blocker of its own
        hit = _trace_scores(ctx, node.args[0], blockers, seen, depth + 1)
        if hit is not None and why:
            blockers.append((node.line, why, True))
        return hit
    passed = _passed_through(ctx, node)
    if passed is not None:           # `s = self.apply_sparse_mask(s, ...)`, a hook that returns s as it is
        hit = _trace_scores(ctx, passed, blockers, seen, depth + 1)
        if hit is not None:
            blockers.append((node.line, f"the scores go through `self.{node.module.name}(...)`, which returns them "
                                        f"unchanged here but a subclass may override", True))
        return hit
    helper = ctx.functions.get(node.op)
    helper = helper if helper is not None and _mask_like(helper) else None
    if node.op not in _SCORE_STEPS and helper is None:
        return None
    for v in _tensor_vars(node):
        hit = _trace_scores(ctx, Var(v), blockers, seen, depth + 1)
        if hit is not None:
            if helper is not None:       # a mask or bias added by a helper the rewrite cannot see into
                blockers.append((node.line, f"the scores go through `{node.op}(...)`, whose effect on them "
                                            f"the rewrite cannot see", True))
            elif node.op in _BLOCKERS and not (node.out is not None and ("round trip", node.out.name) in seen):
                blockers.append((node.line, _BLOCKERS[node.op], True))
            fill = _fill(node, v)
            if fill is not None:
                e = ctx.normalize(ctx.builder.operand(fill))
                if not neg_inf(e) and not min_fill(e, _a_dtype):     # finfo.min: attention_lift.py
                    blockers.append((node.line, finite_fill(e), True))
            return hit
    return None


def _fill(node: Node, scores: str):
    """The value `masked_fill(s, cond, value)` / `torch.where(cond, s, value)` puts where s is masked."""
    if node.op in (".masked_fill", "torch.masked_fill") and len(node.args) == 3 and node.args[0] == Var(scores):
        return node.args[2]
    if node.op == "torch.where" and len(node.args) == 3:
        return node.args[2] if node.args[1] == Var(scores) else node.args[1] if node.args[2] == Var(scores) else None
    return None


def _round_trip(ctx: Context, node: Node):
    """(the first view's value, None or why not) when `node` is the view back of `(s.view(...) + m).view(...)`
    (with clamps or fills in between: those are blockers of their own)."""
    fn = ctx.fn
    if node.op not in (".view", ".reshape") or not node.args or not isinstance(node.args[0], Var) \
            or not hasattr(ctx, "analysis"):
        return None
    step, views = fn.defs.get(node.args[0].name), []
    for _ in range(4):              # back from the view to the `+` of the mask, through clamps and fills
        if step is None or step.op not in _SCORE_STEPS or step.op in (".view", ".reshape"):
            return None
        views = [fn.defs.get(a.name) for a in step.args if isinstance(a, Var)]
        views = [v for v in views if v is not None and v.op == node.op and v.args and isinstance(v.args[0], Var)]
        if step.op == "+" and len(views) == 1:
            break
        step = next((fn.defs.get(a.name) for a in step.args[:1] if isinstance(a, Var)), None)
    if len(views) != 1 or views[0].out is None:
        return None
    scores = views[0].args[0].name
    phi = fn.phis.get(scores)      # the mask before went through a view and back too: both paths must hold
    paths = [(p, view_sizes(fn, fn.defs[p].cst) if p in fn.defs and fn.defs[p].op == node.op else None)
             for p in ((phi.before, phi.inner) if phi is not None else (scores,))]
    whys = [view_round_trip(fn, views[0].cst, node.cst, p, ctx.analysis.positions, viewed) for p, viewed in paths]
    return views[0].out.name, next((w for w in whys if w), None)


def _trace_probs(fn: Function, value: str, blockers: list, seen: set, depth: int = 0, transposed: bool = False):
    """The product with v the probabilities reach; None when there is none, False when the
    probabilities are used for something else (not attention then)."""
    if depth > 40 or value in seen:
        return None
    seen.add(value)
    end = None
    for node in fn.nodes + _returns(fn):
        if not _reads(node, value):
            continue
        if node.op in _SCORE_PRODUCTS and (node.args[:1] == (Var(value),) or node.op == "torch.einsum"
                                           or transposed and node.args[1:2] == (Var(value),)):
            end = node                    # probs @ v, or v @ probs^T
        elif _gives_back(node, value):
            # on every call: outside any `if`, and not in the true branch of a conditional expression
            always = node.stmt is not None and node.stmt.block is fn.body and not any(
                isinstance(a, Opaque) and " if " in a.code for a in node.args)
            blockers.append((node.line, "the attention probabilities are returned" +
                             (" on every call" if always else ""), always))
        elif node.op in _PROB_STEPS and node.out is not None and (node.op != "=" or isinstance(node.args[0], Var)) \
                and (node.op not in (".permute", "transpose") or _swaps_last_two(node)):
            if node.op in (".view", ".reshape"):
                blockers.append((node.line, "the probabilities are reshaped before the product with v", True))
            flip = transposed != (node.op in (".permute", "transpose"))
            hit = _trace_probs(fn, node.out.name, blockers, seen, depth + 1, flip)
            if hit is False:
                return False
            end = end or hit
        elif _rearranges(node) and _only_returned(fn, node.out.name, set()):
            blockers.append((node.line, "the attention probabilities are returned (rearranged or averaged "
                                        "over the heads)", True))
        else:
            return False
    for phi in fn.phis.values():          # `if head_mask is not None: p = p * head_mask`, `p = None`
        if value in (phi.before, phi.inner):
            inner = fn.defs.get(phi.inner)
            if value == phi.before and inner is not None and inner.op == "*":
                blockers.append((inner.line, f"a head mask multiplies the attention probabilities under "
                                             f"`if {code_of(phi.if_cst.test)}:`", False))
            hit = _trace_probs(fn, phi.value, blockers, seen, depth + 1, transposed)
            if hit is False:
                return False
            end = end or hit
    for merged, preds in fn.merges.items():
        if value in preds:
            hit = _trace_probs(fn, merged, blockers, seen, depth + 1, transposed)
            if hit is False:
                return False
            end = end or hit
    return end


def _only_returned(fn: Function, value: str, seen: set) -> bool:
    """Is `value` only returned, through views, transposes and averages (fairseq's `need_weights`:
    `p.view(b, h, t, s).transpose(1, 0)`, then `.mean(dim=0)` unless each head's weights are asked for)?"""
    if value in seen or len(seen) > 40:
        return True
    seen.add(value)
    for node in fn.nodes + _returns(fn):
        if not _reads(node, value):
            continue
        if not (_gives_back(node, value) or _rearranges(node) and _only_returned(fn, node.out.name, seen)):
            return False
    later = [phi.value for phi in fn.phis.values() if value in (phi.before, phi.inner)]
    later += [merged for merged, preds in fn.merges.items() if value in preds]
    return all(_only_returned(fn, v, seen) for v in later)


def _gives_back(node: Node, value: str) -> bool:
    """Does `node` return `value`, store it, or pack it as an element of an output tuple?"""
    return node.op in ("return", "store") or _only_in_tuples(node, value) \
        or node.op == "=" and isinstance(node.args[0], Opaque) and _packed(node.args[0].code, value)


def _rearranges(node: Node) -> bool:
    """A view, transpose, cast, head average or plain copy of a value (`_RETURN_STEPS`)."""
    return node.op in _RETURN_STEPS and node.out is not None and (node.op != "=" or isinstance(node.args[0], Var))


def _passed_through(ctx: Context, node: Node):
    """The argument a call of one of the class's own methods returns unchanged on every path (fairseq's
    `apply_sparse_mask(self, attn_weights, ...): return attn_weights`), or None."""
    module = node.module
    if node.op != "call" or getattr(module, "base", None) != Var(ctx.fn.params[0] if ctx.fn.params else "") \
            or node.kwargs:
        return None
    method = ctx.methods.get(module.name)
    returns = _returns(method) if method is not None else []
    params = method.params[1:] if method is not None else []
    values = {r.args[0] if len(r.args) == 1 else None for r in returns}
    if len(values) != 1 or not isinstance(next(iter(values)), Var) or next(iter(values)).name not in params:
        return None
    index = params.index(next(iter(values)).name)
    return node.args[index] if index < len(node.args) else None


def _mask_like(helper: Function) -> bool:
    """Does the helper only add to or mask its first argument (`s + m`, `s.masked_fill(...)`,
    `torch.where(c, s, ...)`, on some path)? A transform such as tanh soft-capping is not a mask:
    attention whose scores always go through one is not a location."""
    first = helper.params[0] if helper.params else None
    for ret in _returns(helper):
        value = ret.args[0] if ret.args else None
        while isinstance(value, Var) and value.name in helper.defs:
            node = helper.defs[value.name]
            if node.op in ("+", "-", ".masked_fill", "torch.masked_fill", "torch.where") \
                    and any(isinstance(a, Var) and a.name.split(":")[0] == first for a in node.args):
                return True
            value = node.args[0] if node.op == "=" and node.args else None
        if isinstance(value, Opaque) and first in value.code and " if " in value.code and "+" in value.code:
            return True                  # `s if m is None else s + m`
    return False


def expr_text(e: Expr) -> str:
    if e.op in (".view", ".reshape") and e.src is not None:
        return code_of(e.src)
    if e.op == "const":
        return repr(e.value)
    if e.var:
        return e.var.split(":")[0]
    if e.src is not None:
        return code_of(e.src)
    if e.op == "." and len(e.args) == 1:             # `torch.finfo(x.dtype).min` folded from its parts
        return f"{expr_text(e.args[0])}.{e.value}"
    if e.op.startswith("torch.") and e.args and not e.kw:
        return f"{e.op}({', '.join(expr_text(a) for a in e.args)})"
    if e.op == "leaf":
        return str(e.value[1]).split(":")[0]
    return e.op


def neg_inf(e: Expr) -> bool:
    if e.op == "const":
        return e.value == float("-inf")
    if e.op == "leaf" and e.value[0] == "opaque":
        return "".join(e.value[1].split()) in {s.replace(" ", "") for s in _NEG_INF}
    if e.op == "*" and len(e.args) == 2 and e.args[0].is_num() and e.args[0].value == -1.0:   # -float("inf")
        inner = e.args[1]
        return inner.op == "float" and inner.args and inner.args[0].op == "const" and inner.args[0].value == "inf"
    return e.op == "float" and len(e.args) == 1 and e.args[0].op == "const" and e.args[0].value in ("-inf", "-Inf")


def _a_dtype(e: Expr) -> bool:
    return e.op == "." and e.value == "dtype"


def min_fill(e: Expr, scores_dtype) -> bool:
    """Is `e` the lowest finite value of the scores' dtype: `torch.finfo(D).min`, maybe held in a 0-d
    tensor (`torch.full([], ..., dtype=D)`, `torch.tensor(...)`) moved to a device, with
    `scores_dtype(D)` true?  In float32, w + finfo.min == finfo.min for every |w| < 2**103 (half a unit
    in the last place of finfo.min), so such a fill is an additive mask (docs/adopt-dsl.md)."""
    for _ in range(6):
        kw = dict(e.kw)
        if e.op == "to" and len(e.args) == 2 and not kw and e.args[1].op == "." and e.args[1].value == "device":
            e = e.args[0]
        elif e.op == "torch.full" and len(e.args) == 2 and e.args[0].op == "tuple" and not e.args[0].args \
                and set(kw) <= {"dtype", "device"} and ("dtype" not in kw or scores_dtype(kw["dtype"])):
            e = e.args[1]
        elif e.op == "torch.tensor" and len(e.args) == 1 and set(kw) <= {"dtype", "device"} \
                and ("dtype" not in kw or scores_dtype(kw["dtype"])):
            e = e.args[0]
        else:
            break
    return e.op == "." and e.value == "min" and len(e.args) == 1 and e.args[0].op == "torch.finfo" \
        and len(e.args[0].args) == 1 and not e.args[0].kw and scores_dtype(e.args[0].args[0])


def finite_fill(fill: Expr) -> str:
    return (f"the scores are masked with `{expr_text(fill)}` rather than -inf: a boolean attention mask would differ "
            f"in rows where every key is masked")
