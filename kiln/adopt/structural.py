"""Rules written in Python: patterns the DSL cannot state (control flow, `__init__` facts, helpers).

A structural rule looks at one normalized expression tree (the same trees the DSL rules match) and
the function around it, and answers with a `Found`: the bound sub-expressions, the replacement lines
(DSL nodes, rendered by the same synthesis as DSL rules), or a reason to report the location without
rewriting it.  `sdpa` lives here because hand-written attention comes in many combinations (scale on
the scores or on q, a mask added under `if mask is not None:`, a float32 softmax cast back, an
`nn.Softmax` or `nn.Dropout` module ...); the detections of issue 6 (swiglu, rope, linear_gelu,
dropout_add_layernorm, fused_qkv, linear_cross_entropy) live in `detect.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from kiln.adopt.analysis import Function, Phi
from kiln.adopt.dsl import Attr, Const, Item, Node, Opaque, Tuple, Var
from kiln.adopt.expr import Expr, TreeBuilder, const


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
        self._phi_builder = None

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

    def _inline(self, name: str) -> bool:
        return self.fn.inlinable(name) or name in self.forced

    def value(self, name: str) -> Expr:
        phi = self.fn.phis.get(name)
        if phi is not None and name not in self.cache:
            guarded = self._guarded(phi)
            if guarded is not None:
                before, mask, test = guarded
                self.forced.add(before)
                e = Expr("+", [self.value(before), Expr("guard", [self.operand(mask)], value=test)])
                e.set_origin(None, name)
                self.cache[name] = e
                self.phis[name] = phi
                return e
        return super().value(name)

    def _guarded(self, phi: Phi):
        """(value before, mask operand, (tested name, its version)) for a foldable `if`, else None."""
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
                    for x in s.body)
                for s in body.body):
            return None
        # every other name the `if` assigns is a temporary of the mask, unused after it
        for other in fn.phis.values():
            if other.if_cst is phi.if_cst and other is not phi and fn.uses[other.value]:
                return None
        add = fn.defs.get(phi.inner)
        if add is None or add.op != "+" or add.stmt is None or add.stmt.block is not phi.body:
            return None
        if sum(1 for n in phi.body.items if isinstance(n, Node) and n.out is not None
               and n.out.python_name == add.out.python_name) != 1 or fn.uses[phi.before] != 1 \
                or fn.uses[phi.inner]:      # the sum is read only after the `if`, through the phi
            return None
        for n in phi.body.items:     # anything else the `if` computes only feeds the mask
            if isinstance(n, Node) and n.out is not None and not n.out.is_temp and n.out.name != phi.inner \
                    and not fn.inlinable(n.out.name):
                return None
        a, b = add.args
        mask = b if a == Var(phi.before) else a if b == Var(phi.before) else None
        if mask is None or phi.inner in fn.mutated or phi.before in fn.mutated:
            return None
        name = test.left.value
        return phi.before, mask, (name, phi.env[name])


# ----------------------------------------------------------------------------------------------
# sdpa

SDPA = "torch.nn.functional.scaled_dot_product_attention"
_TRANSPOSE_REASON = ("k.transpose({0}, {1}) is k^T only when k is 4-D, which the source does not say "
                     "(write transpose(-2, -1) to allow the rewrite)")


def _int(e: Expr):
    return int(e.value) if e is not None and e.is_num() and float(e.value).is_integer() else None


def _is_scale_like(e: Expr) -> bool:
    """Factors that read as a scale rather than the query: numbers, self.x attributes, roots and powers."""
    if e.op == "const" or e.op in ("sqrt", "rsqrt", "**"):
        return True
    return e.op == "." and e.args and e.args[0].op in ("leaf", ".")


def sdpa_parts(tree: Expr):
    """Take hand-written attention apart: (bound trees, None) or (partial bindings, refusal), or None."""
    if tree.op != "@" or len(tree.args) != 2:
        return None
    probs, v = tree.args
    found = {"$v": v}
    if probs.op == "dropout" and set(dict(probs.kw)) <= {"p", "training"}:
        kw = dict(probs.kw)
        found["$dp"] = kw.get("p", const(0.5))
        found["$train"] = kw.get("training")
        probs = probs.args[0]
    elif probs.op == "torch.nn.Dropout" and len(probs.args) == 1:
        found["$drop"] = dict(probs.kw)["__module__"]
        probs = probs.args[0]
    cast = None
    if probs.op == "to" and len(probs.args) == 2 and not probs.kw:
        cast, probs = probs.args[1], probs.args[0]
    if probs.op != "softmax":
        return None
    kw = dict(probs.kw)
    if _int(kw.get("dim")) != -1 or set(kw) - {"dim", "dtype"}:
        return None
    logits = probs.args[0]
    terms = list(logits.args) if logits.op == "+" else [logits]
    scores = [t for t in terms if t.op == "@" or (t.op == "*" and sum(f.op == "@" for f in t.args) == 1)]
    if len(scores) != 1:
        return None
    masks = [t for t in terms if t is not scores[0]]
    if any(m.op == "const" for m in masks):
        return None
    if masks:
        found["$mask"] = masks[0] if len(masks) == 1 else Expr("+", masks)
    factors = list(scores[0].args) if scores[0].op == "*" else [scores[0]]
    matmul = next(f for f in factors if f.op == "@")
    scale = [f for f in factors if f is not matmul]
    q, kt = matmul.args
    if kt.op != "transpose":
        return None
    dims = dict(kt.kw)
    d0, d1 = _int(dims.get("dim0")), _int(dims.get("dim1"))
    if (d0, d1) not in ((-2, -1), (2, 3)):
        return None
    found["$q"], found["$k"] = q, kt.args[0]
    if (d0, d1) == (2, 3):
        return found, _TRANSPOSE_REASON.format(2, 3)
    if q.op == "*":
        tensors = [f for f in q.args if not _is_scale_like(f)]
        if len(tensors) != 1:
            return found, "cannot tell the query from the scale in the product that forms q"
        scale += [f for f in q.args if f is not tensors[0]]
        found["$q"] = q = tensors[0]
    if any(m.op == "guard" for m in masks) and len(masks) > 1:
        return found, "the mask is added under `if ... is not None` together with other terms"
    found["$scale"] = scale[0] if len(scale) == 1 else Expr("*", scale) if scale else const(1.0)
    dtype = kw.get("dtype")
    if dtype is not None and dtype.key != ("leaf", ("ref", "torch.float32"), (), ()):
        return found, "softmax with a dtype other than torch.float32"
    if cast is not None:
        # softmax(..., dtype=torch.float32).to(q.dtype), or a cast to v's dtype: the kernel keeps the
        # softmax in float32 too and returns the dtype of q, k and v (which it requires to be one):
        # equal in float32, within half-precision rounding otherwise.
        inputs = (q.key, matmul.args[0].key, found["$k"].key, v.key)
        if not (cast.op == "." and cast.value == "dtype" and cast.args[0].key in inputs and cast.args[0].pure):
            return found, "the probabilities are cast to a dtype that is not the dtype of q, k or v"
    elif dtype is not None:
        return found, "softmax(..., dtype=torch.float32) is never cast back: the result's dtype would change"
    return found, None


def _sdpa_lines(found: dict) -> list[Node]:
    kwargs = []
    if "$mask" in found:
        kwargs.append(("attn_mask", Var("$mask")))
    if "$drop" in found:
        kwargs.append(("dropout_p", Opaque("$drop.p if $drop.training else 0.0")))
    elif "$dp" in found:
        kwargs.append(("dropout_p", Opaque("$dp if $train else 0.0") if found["$train"] is not None else Var("$dp")))
    kwargs.append(("scale", Var("$scale")))
    return [Node(SDPA, (Var("$q"), Var("$k"), Var("$v")), tuple(kwargs))]


def _find_sdpa(ctx: Context, node: Node, raw: Expr, tree: Expr):
    if tree.op != "@":
        return None
    builder = ctx.phi_builder()
    raw2 = builder.node(node)
    tree2 = ctx.normalize(raw2)
    parts = sdpa_parts(tree2)
    if parts is None:
        return _kept_explicit(ctx, node, tree2)
    found, reason = parts
    env = {k: v for k, v in found.items() if v is not None}
    if reason is not None:
        return Found(env, None, reason, raw=raw2)
    phis = [builder.phis[v] for v in raw2.vars if v in builder.phis]
    result = node.out.name if node.out is not None else None
    target = node.stmt.target if node.stmt is not None else None
    if any(v is not None and v in ctx.fn.mutated for v in (result, target)):
        # `out += ...` after it: fine for matmul's output, but SDPA's backward reads its own output
        return Found(env, None, "the attention output is modified in place afterwards (`+=`), which "
                                "scaled_dot_product_attention's backward does not allow", raw=raw2)
    return Found(env, _sdpa_lines(found), raw=raw2, phis=phis)


def _kept_explicit(ctx: Context, node: Node, tree: Expr):
    """Attention whose probabilities are returned, or multiplied by a head mask under an `if`:
    a location, reported with the reason the explicit path stays."""
    probs = tree.args[0]
    if probs.op != "leaf" or probs.value[0] != "var":
        return None
    fn = ctx.fn
    name, reasons = probs.value[1], []
    phi = fn.phis.get(name)
    if phi is not None and phi.before is not None:
        inner = fn.defs.get(phi.inner)
        if inner is None or inner.op != "*" or Var(phi.before) not in inner.args:
            return None
        reasons.append("a head mask multiplies the attention probabilities under `if`")
        if fn.uses[phi.before] != 1:
            return None
        name = phi.before
    if fn.uses[name] > 1:
        if not _only_returned(fn, name, node):
            return None          # used for something else (talking heads ...): not attention
        reasons.append("the attention probabilities are returned (output_attentions)")
    if not reasons:
        return None
    builder = ctx.phi_builder()
    builder.forced.add(name)
    raw = Expr("@", [builder.value(name), builder.operand(node.args[1])])
    parts = sdpa_parts(ctx.normalize(raw))
    if parts is None:
        return None
    found, also = parts
    why = "; ".join(reasons) + ": the explicit path is kept" + (f" (also: {also})" if also else "")
    return Found({k: v for k, v in found.items() if v is not None}, None, why, raw=raw)


def _only_returned(fn: Function, name: str, final, depth: int = 0) -> bool:
    """Is every read of `name` besides `final` a `return` of it (alone, in a tuple, or through a
    variable such as `outputs = (out, probs) if output_attentions else (out,)` that is returned)?"""
    readers = [n for n in fn.nodes + _returns(fn) if n is not final and _reads(n, name)]
    return bool(readers) and all(
        n.op == "return" or (n.op == "=" and n.out is not None and depth < 2
                             and _only_returned(fn, n.out.name, None, depth + 1))
        for n in readers)


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





# ----------------------------------------------------------------------------------------------
# sdpa locations the rewrite does not cover

# q @ k^T in its other spellings; the softmax input is traced back to one of these
_SCORE_PRODUCTS = {"@", "torch.bmm", ".bmm", "torch.baddbmm", ".baddbmm", "torch.einsum"}
# between the product and the softmax: scale, masks and biases, clamps, casts, view round trips
_SCORE_STEPS = {"+", "-", "*", "/", "to", "=", ".view", ".reshape", ".contiguous", ".masked_fill",
                "torch.masked_fill", "torch.where", "torch.max", "torch.maximum", "torch.clamp", ".clamp",
                ".type_as"}
# between the softmax and the product with v: dropout, casts, a head mask, views
_PROB_STEPS = {"to", "=", "dropout", "torch.nn.Dropout", "*", ".view", ".reshape", ".contiguous", ".type_as",
               ".masked_fill", "torch.where", ".permute", "transpose"}
_FEATURES = {".masked_fill": "masked_fill masking", "torch.masked_fill": "masked_fill masking",
             "torch.where": "torch.where masking", "torch.max": "a clamp of the scores",
             "torch.maximum": "a clamp of the scores", "torch.clamp": "a clamp of the scores",
             ".clamp": "a clamp of the scores", ".view": "view round trips", ".reshape": "view round trips",
             "torch.baddbmm": "scores from baddbmm", ".baddbmm": "scores from baddbmm",
             "torch.einsum": "einsum products", "torch.bmm": "3-D bmm products", ".bmm": "3-D bmm products"}


def sdpa_locations(ctx: Context) -> list[tuple[int, int, str]]:
    """Hand-written attention found by data flow rather than by one expression tree: softmax over the
    last dim whose input comes from q @ k^T through scaling/masking steps (also across `if`/`else`,
    in-place adds and reassignments) and whose output reaches a product with v through dropout, casts
    and a head mask, the probabilities otherwise only returned or dropped. These are reported
    (first line, last line, reason) where the tree rule found nothing to rewrite."""
    fn = ctx.fn
    found = []
    for node in fn.nodes:
        last = _is_last_dim_softmax(ctx, node)
        if not last or node.out is None:
            continue
        feats: set = set()
        start = _trace_scores(fn, node.args[0], feats, set())
        if last == "dim=2" and (start is None or start.op not in ("torch.bmm", ".bmm")):
            continue                     # dim=2 is the last dim only of a 3-D (bmm) product
        end = _trace_probs(fn, node.out.name, feats, set())
        if start is None or end is None or end is False:
            continue
        why = ", ".join(sorted(feats)) or "the steps are spread over statements the tree rule cannot fold"
        found.append((min(start.line, node.line), max(end.line, node.line),
                      f"hand-written attention with {why}: reported, not rewritten"))
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


def code_of(node) -> str:
    """The source text of a libcst node."""
    return cst.Module(body=[]).code_for_node(node)


def flat(text: str) -> str:
    """`text` without whitespace, for comparing source fragments."""
    return re.sub(r"\s+", "", text)


def _tensor_vars(node: Node) -> list[str]:
    out = []
    for a in list(node.args) + [v for _, v in node.kwargs]:
        if isinstance(a, Var):
            out.append(a.name)
    return out


def _trace_scores(fn: Function, operand, feats: set, seen: set, depth: int = 0):
    """The q @ k^T node the softmax input comes from (on some path), or None."""
    if not isinstance(operand, Var) or depth > 40 or operand.name in seen:
        return None
    value = operand.name
    seen.add(value)
    if value in fn.phis:
        phi = fn.phis[value]
        preds = [phi.inner] + ([phi.before] if phi.before else [])
        hits = [_trace_scores(fn, Var(p), feats, seen, depth + 1) for p in preds]
        hit = next((h for h in hits if h is not None), None)
        if hit is not None:
            feats.add("steps under `if`")
        return hit
    if value in fn.merges:
        hits = [_trace_scores(fn, Var(p), feats, seen, depth + 1) for p in sorted(fn.merges[value])]
        hit = next((h for h in hits if h is not None), None)
        if hit is not None:
            feats.add("scores computed differently on `if`/`else` paths")
        return hit
    node = fn.defs.get(value)
    if node is None:
        return None
    if node.op in _SCORE_PRODUCTS and len(_tensor_vars(node)) + sum(
            not isinstance(a, (Var, Const)) for a in node.args) >= 2:
        if node.op in _FEATURES:
            feats.add(_FEATURES[node.op])
        return node
    if node.op not in _SCORE_STEPS:
        return None
    for v in _tensor_vars(node):
        hit = _trace_scores(fn, Var(v), feats, seen, depth + 1)
        if hit is not None:
            if node.op in _FEATURES:
                feats.add(_FEATURES[node.op])
            return hit
    return None


def _trace_probs(fn: Function, value: str, feats: set, seen: set, depth: int = 0, transposed: bool = False):
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
        elif node.op in ("return", "store") or _only_in_tuples(node, value) \
                or node.op == "=" and isinstance(node.args[0], Opaque) and _packed(node.args[0].code, value):
            continue                      # returned, or packed into the outputs
        elif node.op in _PROB_STEPS and node.out is not None and (node.op != "=" or isinstance(node.args[0], Var)) \
                and (node.op not in (".permute", "transpose") or _swaps_last_two(node)):
            if node.op in _FEATURES:
                feats.add(_FEATURES[node.op])
            flip = transposed != (node.op in (".permute", "transpose"))
            hit = _trace_probs(fn, node.out.name, feats, seen, depth + 1, flip)
            if hit is False:
                return False
            end = end or hit
        else:
            return False
    for phi in fn.phis.values():          # `if head_mask is not None: p = p * head_mask`, `p = None`
        if value in (phi.before, phi.inner):
            hit = _trace_probs(fn, phi.value, feats, seen, depth + 1, transposed)
            if hit is False:
                return False
            end = end or hit
    for merged, preds in fn.merges.items():
        if value in preds:
            hit = _trace_probs(fn, merged, feats, seen, depth + 1, transposed)
            if hit is False:
                return False
            end = end or hit
    return end


SDPA_RULE = StructuralRule(
    "sdpa",
    "softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1) @ v -> F.scaled_dot_product_attention",
    _find_sdpa, locate=sdpa_locations)
