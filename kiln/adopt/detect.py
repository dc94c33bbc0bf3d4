"""The kiln-kernel rules of issue 6: find the pattern, rewrite to `kiln.kernels.*` where that is exact.

| rule | pattern | outcome |
|---|---|---|
| swiglu | `down(act(gate(x)) * up(x))`, act SiLU | act known SiLU (F.silu, nn.SiLU): `down(kiln.kernels.swiglu(gate(x), up(x)))`; act from `ACT2FN[config...]`: reported |
| linear_gelu | a GELU (F.gelu, nn.GELU) straight on an nn.Linear's output | `kiln.kernels.linear_gelu(x, fc.weight, fc.bias, approximate=...)`; a config activation: reported |
| rope | `x * cos + rotate_half(x) * sin`, the helper checked to be the half-rotation | reported |
| dropout_add_layernorm | `LayerNorm(Dropout(h) + residual)` | reported |
| fused_qkv | three nn.Linear of equal in_features on one input | reported |
| linear_cross_entropy | `logits = lm_head(h)`, then a cross-entropy of those logits | reported |

A reported location has `applied: false` and the reason the rewrite is not made.
"""
from __future__ import annotations

import re

import libcst as cst

from kiln.adopt.dsl import Attr, Const, Item, Node, Tuple, Var
from kiln.adopt.structural import Context, Found, StructuralRule

LINEAR = "torch.nn.Linear"


def _code(node) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _flat(text: str) -> str:
    return re.sub(r"\s+", "", text)


def activation(ctx: Context, e) -> tuple[str | None, str | None]:
    """What an activation call computes: ("silu" | "gelu", approximate) when the source says so,
    ("config", None) for an ACT2FN / get_activation lookup (known only at run time), else (None, None)."""
    kw = dict(e.kw)
    if e.op == "torch.nn.functional.silu" and set(kw) <= {"inplace"}:
        return "silu", None
    if e.op == "torch.nn.functional.gelu" and set(kw) <= {"approximate"}:
        approx = kw.get("approximate")
        if approx is None:
            return "gelu", "none"
        if approx.op == "const" and approx.value in ("none", "tanh"):
            return "gelu", approx.value
        return None, None
    ctors = ctx.init_exprs(kw.get("__module__"))
    if not ctors:
        return None, None
    if any(isinstance(c, cst.Subscript) and ctx.qualname(c.value).endswith("ACT2FN") or
           isinstance(c, cst.Call) and ctx.qualname(c.func).endswith("get_activation") for c in ctors):
        return "config", None
    if len(ctors) != 1 or not isinstance(ctors[0], cst.Call):
        return None, None
    ctor = ctors[0]
    name = ctx.qualname(ctor.func)
    if name == "torch.nn.SiLU":
        return "silu", None
    if name == "torch.nn.GELU":
        args = [(a.keyword.value if a.keyword else "approximate", _code(a.value)) for a in ctor.args]
        if not args:
            return "gelu", "none"
        if len(args) == 1 and args[0][0] == "approximate" and args[0][1].strip("'\"") in ("none", "tanh") \
                and args[0][1][0] in "'\"":
            return "gelu", args[0][1].strip("'\"")
    return None, None


def _linear_module(e):
    return dict(e.kw).get("__module__") if e.op == LINEAR and len(e.args) == 1 else None


CONFIG_ACT = "the activation is looked up from the config (ACT2FN) at run time, so it is not known to be {}"


# -- swiglu --------------------------------------------------------------------------------------

def _find_swiglu(ctx: Context, node: Node, raw, tree):
    down = _linear_module(tree)
    if down is None or tree.args[0].op != "*" or len(tree.args[0].args) != 2:
        return None
    for act, up in (tree.args[0].args, reversed(tree.args[0].args)):
        if len(act.args) != 1 or _linear_module(up) is None or _linear_module(act.args[0]) is None:
            continue
        gate = act.args[0]
        x, x2 = gate.args[0], up.args[0]
        if x.key != x2.key or not x.pure or gate.key == up.key:
            continue
        kind, _ = activation(ctx, act)
        if kind == "config":
            return Found({}, None, CONFIG_ACT.format("SiLU"))
        if kind != "silu":
            continue
        env = {"$gate": gate, "$up": up, "$down": down}
        widths = {_ctor_arg(ctx, _linear_module(t), 1, "out_features") for t in (gate, up)}
        if len(widths) != 1 or None in widths:       # the kernel takes equal shapes, no broadcasting
            return Found(env, None, "cannot tell from __init__ that gate and up have the same out_features")
        lines = [Node("kiln.kernels.swiglu", (Var("$gate"), Var("$up")), out=Var("$h")),
                 Node(LINEAR, (Var("$h"),), module=Var("$down"))]
        return Found(env, lines)
    return None


# -- linear_gelu ---------------------------------------------------------------------------------

def _find_linear_gelu(ctx: Context, node: Node, raw, tree):
    if len(tree.args) != 1 or _linear_module(tree.args[0]) is None:
        return None
    kind, approx = activation(ctx, tree)
    if kind == "config":
        return Found({}, None, CONFIG_ACT.format("GELU"))
    if kind != "gelu":
        return None
    linear = tree.args[0]
    env = {"$x": linear.args[0], "$fc": _linear_module(linear)}
    lines = [Node("kiln.kernels.linear_gelu", (Var("$x"), Attr(Var("$fc"), "weight"), Attr(Var("$fc"), "bias")),
                  (("approximate", Const(approx)),))]
    return Found(env, lines)


# -- rope ----------------------------------------------------------------------------------------

def is_rotate_half(fn) -> bool:
    """Is `fn` the half rotation: cat((-x[..., d//2:], x[..., :d//2]), dim=-1) with d = x.shape[-1]?"""
    if fn is None or len(fn.params) != 1:
        return False
    p = fn.params[0]
    returns = [n for n in fn.body.items if isinstance(n, Node) and n.op == "return"]
    if len(returns) != 1 or not returns[0].args or not isinstance(returns[0].args[0], Var):
        return False
    cat = fn.defs.get(returns[0].args[0].name)
    if cat is None or cat.op != "torch.cat" or len(cat.args) != 1 or cat.kw.get("dim", Const(0)) != Const(-1):
        return False
    pair = cat.args[0]
    if not isinstance(pair, Tuple) or len(pair.items) != 2 or not all(isinstance(i, Var) for i in pair.items):
        return False
    neg = fn.defs.get(pair.items[0].name)
    if neg is None or neg.op != "neg" or not isinstance(neg.args[0], Var):
        return False

    def half(value, index_text):
        d = fn.defs.get(value.name)
        while d is not None and d.op == "=" and isinstance(d.args[0], Var):
            d = fn.defs.get(d.args[0].name)
        item = d.args[0] if d is not None and d.op == "=" else None
        return isinstance(item, Item) and item.base == Var(p) and _flat(item.index) == index_text

    return (half(neg.args[0], f"...,{p}.shape[-1]//2:") and half(pair.items[1], f"...,:{p}.shape[-1]//2"))


def _find_rope(ctx: Context, node: Node, raw, tree):
    if tree.op != "+" or len(tree.args) != 2 or not all(t.op == "*" and len(t.args) == 2 for t in tree.args):
        return None
    for plain, rotated in (tree.args, reversed(tree.args)):
        for rot, sin in (rotated.args, reversed(rotated.args)):
            if len(rot.args) != 1 or rot.kw or not is_rotate_half(ctx.functions.get(rot.op)):
                continue
            x = rot.args[0]
            if x.pure and any(f.key == x.key for f in plain.args) and sin.op != "const":
                return Found({}, None, "kiln.kernels.rope rotates q and k in one call; rewriting each "
                                       "`t * cos + rotate_half(t) * sin` separately is not enabled")
    return None


# -- dropout_add_layernorm -----------------------------------------------------------------------

def _find_dropout_add_layernorm(ctx: Context, node: Node, raw, tree):
    if tree.op != "torch.nn.LayerNorm" or len(tree.args) != 1:
        return None
    s = tree.args[0]
    if s.op != "+" or len(s.args) != 2:
        return None
    if not any(t.op in ("torch.nn.Dropout", "dropout") for t in s.args):
        return None
    return Found({}, None, "kiln.kernels.dropout_add_layer_norm draws its own dropout mask and returns the "
                           "new residual too; this rewrite is not enabled")


# -- fused_qkv -----------------------------------------------------------------------------------

def _ctor_arg(ctx: Context, module, position: int, keyword: str) -> str | None:
    """The source text of an argument of the constructor __init__ assigns to `module`, or None."""
    ctors = ctx.init_exprs(module)
    if len(ctors) != 1 or not isinstance(ctors[0], cst.Call):
        return None
    for i, a in enumerate(ctors[0].args):
        if (a.keyword is None and not a.star and i == position) or (a.keyword is not None and a.keyword.value == keyword):
            return _flat(_code(a.value))
    return None


def _find_fused_qkv(ctx: Context, node: Node, raw, tree):
    if node.op != LINEAR or len(node.args) != 1 or not isinstance(node.args[0], Var):
        return None
    same = [n for n in ctx.fn.nodes if n.op == LINEAR and n.args == node.args and n.module is not None]
    modules = {n.module for n in same}
    if len(modules) != 3 or min(same, key=lambda n: n.line) is not node:
        return None
    feats = {_ctor_arg(ctx, ctx.builder.operand(n.module), 0, "in_features") for n in same}
    if len(feats) != 1 or None in feats:
        return None
    return Found({}, None, "fusing the three projections changes the module's parameters (one stacked "
                           "weight; checkpoints need converting): not rewritten")


# -- linear_cross_entropy ------------------------------------------------------------------------

_PASS = {".view", ".reshape", "to", ".contiguous", ".flatten", "="}
CROSS_ENTROPY = ("torch.nn.functional.cross_entropy", "torch.nn.CrossEntropyLoss")


def _source_linear(fn, operand, depth=0):
    """Follow `operand` back through views, casts and slices to an `lm_head` nn.Linear call, or None."""
    while depth < 20:
        depth += 1
        if isinstance(operand, Item):
            operand = operand.base
            continue
        if not isinstance(operand, Var):
            return None
        node = fn.defs.get(operand.name)
        if node is None:
            phi = fn.phis.get(operand.name)
            operand = Var(phi.before) if phi is not None and phi.before else None
            continue
        if node.op == LINEAR and node.module is not None and getattr(node.module, "name", "") == "lm_head":
            return node
        if node.op not in _PASS or not node.args:
            return None
        operand = node.args[0]
    return None


def _find_linear_cross_entropy(ctx: Context, node: Node, raw, tree):
    fn = ctx.fn
    op = node.op
    if op == "call" and isinstance(node.module, Var):          # loss_fct = CrossEntropyLoss(); loss_fct(...)
        d = fn.defs.get(node.module.name)
        op = d.op if d is not None and not d.args else op
    if op not in CROSS_ENTROPY or not node.args:
        return None
    if _source_linear(fn, node.args[0]) is None:
        return None
    return Found({}, None, "kiln.kernels.linear_cross_entropy (logits never materialized) is not applied: "
                           "the logits are computed and returned by the surrounding code")


DETECTIONS = [
    StructuralRule("swiglu", "down(silu(gate(x)) * up(x)) -> down(kiln.kernels.swiglu(gate(x), up(x)))", _find_swiglu),
    StructuralRule("linear_gelu", "gelu(fc(x)) -> kiln.kernels.linear_gelu(x, fc.weight, fc.bias)", _find_linear_gelu),
    StructuralRule("rope", "x * cos + rotate_half(x) * sin (report only)", _find_rope),
    StructuralRule("dropout_add_layernorm", "LayerNorm(Dropout(h) + residual) (report only)",
                   _find_dropout_add_layernorm),
    StructuralRule("fused_qkv", "three nn.Linear of one input and equal in_features (report only)",
                   _find_fused_qkv, overlaps=True),
    StructuralRule("linear_cross_entropy", "cross-entropy of lm_head(h) logits (report only)",
                   _find_linear_cross_entropy, overlaps=True),
]
