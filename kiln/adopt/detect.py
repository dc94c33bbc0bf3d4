"""The kiln-kernel rules of issue 6: find the pattern, rewrite to `kiln.kernels.*` where that is exact.

| rule | pattern | outcome |
|---|---|---|
| swiglu | `down(act(gate(x)) * up(x))`, act SiLU | act known SiLU (F.silu, nn.SiLU): `down(kiln.kernels.swiglu(gate(x), up(x)))`; act from `ACT2FN[config...]`: reported |
| linear_gelu | a GELU (F.gelu, nn.GELU, a config lookup) straight on a linear layer's output | `kiln.kernels.linear_gelu_of(x, fc, approximate=...)` / `linear_act(x, fc, act)`: through the module |
| rope | `x * cos + rotate_half(x) * sin`, the helper checked to be the half-rotation | reported |
| dropout_add_layernorm | `LayerNorm(Dropout(h) + residual)` | reported |
| fused_qkv | three nn.Linear of equal in_features on one input | reported |
| linear_cross_entropy | `logits = lm_head(h)`, then a cross-entropy of those logits | reported |
| cross_entropy | `loss_fct(logits, labels)` with `loss_fct = nn.CrossEntropyLoss(...)`, `F.cross_entropy(...)` | `kiln.kernels.cross_entropy_of(loss_fct, logits, labels)` (checked at run time) / `kiln.kernels.cross_entropy(...)` |

A reported location has `applied: false` and the reason the rewrite is not made.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import libcst as cst

from kiln.adopt.configs import GELU_NAMES, SILU_NAMES
from kiln.adopt.dsl import Const, Item, Node, Opaque, Tuple, Var
from kiln.adopt.expr import Expr
from kiln.adopt.rules import PYTHON_RULES
from kiln.adopt.structural import Context, Found, StructuralRule, code_of, flat

LINEAR = "torch.nn.Linear"


def activation(ctx: Context, e) -> tuple[str | None, str | None]:
    """What an activation call computes: ("silu" | "gelu", approximate) when the source says so;
    ("config", key) for an ACT2FN / get_activation lookup, known only at run time, with `key` the
    lookup's default (a literal key, or the config field's default read by ConfigDefaults) or None
    when that cannot be told; else (None, None)."""
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
    module = kw.get("__module__")
    ctors = ctx.init_exprs(module)
    if not ctors and module is not None and isinstance(getattr(e.src, "func", None), (cst.Subscript, cst.Call)):
        ctors = [e.src.func]                      # ACT2FN[self.config.pooler_hidden_act](x): looked up in place
    if not ctors:
        name = _imported_activation(e.op)
        return ("config", name) if name else (None, None)
    lookups = [c for c in ctors if isinstance(c, cst.Subscript) and ctx.qualname(c.value).endswith("ACT2FN") or
               isinstance(c, cst.Call) and ctx.qualname(c.func).endswith("get_activation")]
    if lookups:
        keys = {_lookup_key(ctx, c) for c in lookups}
        return "config", keys.pop() if len(keys) == 1 else None
    if len(ctors) != 1 or not isinstance(ctors[0], cst.Call):
        return None, None
    ctor = ctors[0]
    name = ctx.qualname(ctor.func)
    if name == "torch.nn.SiLU":
        return "silu", None
    if name == "torch.nn.GELU":
        args = [(a.keyword.value if a.keyword else "approximate", code_of(a.value)) for a in ctor.args]
        if not args:
            return "gelu", "none"
        if len(args) == 1 and args[0][0] == "approximate" and args[0][1].strip("'\"") in ("none", "tanh") \
                and args[0][1][0] in "'\"":
            return "gelu", args[0][1].strip("'\"")
    return None, None


def _imported_activation(op: str) -> str | None:
    """The ACT2FN key of an activation transformers' `activations` module makes at import, called by
    its name (`from ...activations import gelu`: `gelu = get_activation("gelu")`); else None."""
    module, _, name = op.rpartition(".")
    return name if module.endswith("activations") and name in GELU_NAMES | SILU_NAMES else None


def _act_operand(e) -> Expr:
    """What calls the activation `e`: its module (`self.act`, `ACT2FN[...]`), or the imported name."""
    module = dict(e.kw).get("__module__")
    return module if module is not None else Expr("leaf", value=("ref", e.op))


def _config_known(ctx: Context) -> bool:
    """Was the configuration module read? Then a lookup whose default it does not give (T5's
    `dense_act_fn`, derived in __init__) is not known to be any activation: not a location. Without
    it (a file on its own) a lookup may be anything, and the guarded rewrite is right either way."""
    return ctx.configs is not None and bool(ctx.configs.classes)


def _lookup_key(ctx: Context, lookup) -> str | None:
    """The ACT2FN key a lookup uses by default: `ACT2FN["gelu"]` -> "gelu"; `ACT2FN[config.hidden_act]`
    -> the `hidden_act` default of the imported configuration class; None when unknown."""
    if isinstance(lookup, cst.Subscript):
        if len(lookup.slice) != 1 or not isinstance(lookup.slice[0].slice, cst.Index):
            return None
        key = lookup.slice[0].slice.value
    else:
        if len(lookup.args) != 1:
            return None
        key = lookup.args[0].value
    if isinstance(key, cst.SimpleString):
        value = key.evaluated_value
        return value if isinstance(value, str) else None
    if isinstance(key, cst.Attribute) and ctx.configs is not None:
        value = ctx.configs.default(key.attr.value)
        return value if isinstance(value, str) else None
    return None


def _linear_module(e):
    return dict(e.kw).get("__module__") if e.op == LINEAR and len(e.args) == 1 else None


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
        kind, key = activation(ctx, act)
        env = {"$gate": gate, "$up": up, "$down": down}
        if kind == "config" and (key in SILU_NAMES or key is None and not _config_known(ctx)):
            # SiLU by the config's default: checked again on every call by kiln.kernels.act_mul
            env["$act"] = _act_operand(act)
            return Found(env, [Node("kiln.kernels.act_mul", (Var("$act"), Var("$gate"), Var("$up")), out=Var("$h")),
                               Node(LINEAR, (Var("$h"),), module=Var("$down"))])
        if kind != "silu":
            continue
        widths = {_ctor_arg(ctx, _linear_module(t), 1, "out_features") for t in (gate, up)}
        if len(widths) != 1 or None in widths:       # the kernel takes equal shapes, no broadcasting
            return Found(env, None, "cannot tell from __init__ that gate and up have the same out_features")
        lines = [Node("kiln.kernels.swiglu", (Var("$gate"), Var("$up")), out=Var("$h")),
                 Node(LINEAR, (Var("$h"),), module=Var("$down"))]
        return Found(env, lines)
    return None


# -- linear_gelu ---------------------------------------------------------------------------------

def _is_conv1d(e) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer storing its weight transposed, (in, out)."""
    return e.op.endswith("pytorch_utils.Conv1D") and len(e.args) == 1 and "__module__" in dict(e.kw)


def _find_linear_gelu(ctx: Context, node: Node, raw, tree):
    """GELU straight on a linear layer's output -> a kiln.kernels call that still goes through the
    module: fused when it is a plain nn.Linear without hooks, `act(fc(x))` as written otherwise."""
    if len(tree.args) != 1 or (_linear_module(tree.args[0]) is None and not _is_conv1d(tree.args[0])):
        return None
    linear = tree.args[0]
    env = {"$x": linear.args[0], "$fc": dict(linear.kw)["__module__"]}
    kw = dict(tree.kw)
    if tree.op == "torch.nn.functional.gelu" and set(kw) <= {"approximate"}:
        # F.gelu(fc(x), approximate=...): a literal, or whatever decides it at run time (a config field)
        if "approximate" in kw:
            env["$approx"] = kw["approximate"]
            return Found(env, [Node("kiln.kernels.linear_gelu_of", (Var("$x"), Var("$fc")),
                                    (("approximate", Var("$approx")),))])
        return Found(env, [Node("kiln.kernels.linear_gelu_of", (Var("$x"), Var("$fc")))])
    kind, approx = activation(ctx, tree)
    module_gelu = kind == "gelu" and "__module__" in kw
    if module_gelu or kind == "config" and (approx in GELU_NAMES or approx is None and not _config_known(ctx)):
        # an activation module (nn.GELU, or one a config picks, checked on every call): keep calling it
        env["$act"] = _act_operand(tree)
        return Found(env, [Node("kiln.kernels.linear_act", (Var("$x"), Var("$fc"), Var("$act")))])
    return None


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

    def half(value, index_text, position):
        d = fn.defs.get(value.name)
        while d is not None and d.op == "=" and isinstance(d.args[0], Var):
            d = fn.defs.get(d.args[0].name)
        if d is not None and d.op == "=":
            item = d.args[0]
        else:
            source, index = _unpacked(fn, value.name) or (None, None)
            if isinstance(source, Var):                 # x1, x2 = x.chunk(2, dim=-1)
                return index == position and _chunk_of(fn, source, p)
            item = source.items[index] if isinstance(source, Tuple) and index < len(source.items) else None
        return isinstance(item, Item) and item.base == Var(p) and flat(item.index) == index_text

    return (half(neg.args[0], f"...,{p}.shape[-1]//2:", 1) and half(pair.items[1], f"...,:{p}.shape[-1]//2", 0))


def _chunk_of(fn, value: Var, param: str) -> bool:
    """Is `value` the two halves of `param`'s last dim: `param.chunk(2, dim=-1)` / `torch.chunk(param, 2, -1)`?"""
    d = fn.defs.get(value.name)
    if d is None or d.op not in (".chunk", "torch.chunk") or len(d.args) not in (2, 3) or d.args[0] != Var(param):
        return False
    dim = d.kw.get("dim", d.args[2] if len(d.args) == 3 else None)
    return d.args[1] == Const(2) and dim == Const(-1)


def _unpacked(fn, value: str):
    """(source, position) of the tuple assignment that defines the value `x1:1`: `x1, x2 = a, b` gives
    (the Tuple (a, b), 0), `x1, x2 = t` gives (t, 0); None when no such assignment defines it."""
    name = value.split(":")[0]
    stmt = fn.def_stmt.get(value)
    for n in fn.nodes:
        if n.op == "store" and len(n.args) == 2 and isinstance(n.args[0], Opaque) \
                and isinstance(n.args[1], (Tuple, Var)) and stmt is not None and stmt.cst is n.stmt.cst:
            targets = [t.strip() for t in n.args[0].code.split(",")]
            if name in targets:
                return n.args[1], targets.index(name)
    return None


def _rope_parts(ctx: Context, tree):
    """(x, cos, sin) of `x * cos + rotate_half(x) * sin` (any order), or None."""
    if tree.op != "+" or len(tree.args) != 2 or not all(t.op == "*" and len(t.args) == 2 for t in tree.args):
        return None
    for plain, rotated in (tree.args, reversed(tree.args)):
        for rot, sin in (rotated.args, reversed(rotated.args)):
            x = _rotated_half(ctx, rot)
            if x is None:
                continue
            if not x.pure or sin.op == "const":
                continue
            cos = [f for f in plain.args if f.key != x.key]
            if len(cos) == 1 and len(plain.args) == 2:
                return x, cos[0], sin
    return None


def _rotated_half(ctx: Context, rot):
    """x when `rot` is the half rotation of x: a `rotate_half(x)` helper checked by is_rotate_half, or
    the same written inline, `torch.cat((-x[..., h // 2:], x[..., :h // 2]), dim=-1)` with h the size
    of x's last dim (`x.shape[-1]`, `x.size(-1)`, or a name holding it)."""
    if len(rot.args) == 1 and not rot.kw and is_rotate_half(ctx.functions.get(rot.op)):
        return rot.args[0]
    kw = dict(rot.kw)
    if rot.op != "torch.cat" or len(rot.args) != 1 or rot.args[0].op != "tuple" or len(rot.args[0].args) != 2 \
            or set(kw) != {"dim"} or not (kw["dim"].is_num() and kw["dim"].value == -1.0):
        return None
    neg, lower = rot.args[0].args
    if not (neg.op == "*" and len(neg.args) == 2 and neg.args[0].is_num() and neg.args[0].value == -1.0):
        return None
    upper = neg.args[1]
    if upper.op != "[]" or lower.op != "[]" or upper.args[0].key != lower.args[0].key:
        return None
    x = lower.args[0]
    if x.op != "leaf" or x.value[0] != "var":
        return None
    name = x.value[1].split(":")[0]
    sizes = {f"{name}.shape[-1]", f"{name}.size(-1)"}
    halves = {f"{h}//2" for h in sizes}
    for value in set(upper.value[1]) | set(lower.value[1]):   # `h = x.size(-1)` or `half = h // 2` read by the index
        d = ctx.fn.defs.get(value)
        text = flat(code_of(d.stmt.cst.value)) if d is not None and d.stmt is not None \
            and getattr(d.stmt.cst, "value", None) is not None else None
        if text in sizes:
            halves.add(f"{value.split(':')[0]}//2")
        elif text in halves or text in {f"{h}//2" for h in sizes}:
            halves.add(value.split(":")[0])
    return x if (flat(upper.value[0]), flat(lower.value[0])) in {(f"...,{h}:", f"...,:{h}") for h in halves} else None


ROPE_ALONE = ("kiln.kernels.rope rotates q and k in one call; this rotation has no partner with the same "
              "cos/sin in a neighbouring `name = ...` statement (or sits inside a larger expression)")


def _find_rope(ctx: Context, node: Node, raw, tree):
    return Found({}, None, ROPE_ALONE) if _rope_parts(ctx, tree) is not None else None


@dataclass
class StatementRewrite:
    """A rewrite of whole statements: `replace` (statement -> new code) and `delete`."""
    first_line: int
    last_line: int
    replace: dict
    delete: list
    needs: set          # qualified names the new code spells (imports)
    drop: bool = False  # the deleted statements moved into the new code: drop them, comments and all
    leading: list | None = None   # comment lines to put before the new statement (a whole-statement rewrite)
    nodes: dict = field(default_factory=dict)   # id(node) -> (node, new node): edits elsewhere (a signature, a call)


def _plain_name(e) -> str | None:
    return e.value[1] if e.op == "leaf" and e.value[0] == "var" else None


def rope_pairs(ctx: Context, spell) -> list[StatementRewrite]:
    """`q_embed = q * cos + rotate_half(q) * sin` and `k_embed = k * cos + ...` in adjacent statements,
    same cos and sin, plain names -> `q_embed, k_embed = kiln.kernels.rope(q, k, cos, sin)`."""
    fn = ctx.fn
    hits = []
    for node in fn.nodes:
        stmt = node.stmt
        if stmt is None or stmt.target is None or getattr(stmt.cst, "value", None) is not node.cst \
                or not isinstance(stmt.cst, cst.Assign) or len(stmt.cst.targets) != 1:
            continue
        parts = _rope_parts(ctx, ctx.normalize(ctx.builder.node(node)))
        names = [_plain_name(p) for p in parts] if parts else []
        if parts and all(names) and not any(n in fn.mutated for n in names):
            hits.append((node, stmt, names))
    out, used = [], set()
    for (n1, s1, (x1, c1, s1n)), (n2, s2, (x2, c2, s2n)) in zip(hits, hits[1:]):
        if id(s1) in used or (c1, s1n) != (c2, s2n) or x1 == x2 or s1.block is not s2.block:
            continue
        block = [i for i in s1.block.items if isinstance(i, Node) and i.stmt is not None]
        stmts = []
        for i in block:
            if i.stmt not in stmts:
                stmts.append(i.stmt)
        if s1 not in stmts or s2 not in stmts or stmts.index(s2) != stmts.index(s1) + 1:
            continue
        if s1.line_node is s2.line_node:
            continue                              # `a = ...; b = ...` on one line: leave it
        t1, t2 = s1.target, s2.target
        py = lambda v: v.split(":")[0]  # noqa: E731
        # operands are read at the first statement: the second must not see a value the first changes
        if py(t1) in {py(x2), py(c2), py(s2n)} or len({py(t1), py(t2)}) != 2 \
                or any(s1.env.get(py(v)) != v for v in (x1, x2, c1, s1n)):
            continue
        code = f"{py(t1)}, {py(t2)} = {spell('kiln.kernels.rope')}({py(x1)}, {py(x2)}, {py(c1)}, {py(s1n)})"
        used |= {id(s1), id(s2)}
        out.append(StatementRewrite(n1.line, n2.line, {id(s1.cst): (s1.cst, code)}, [s2.cst], {"kiln.kernels"}))
    return out


# -- dropout_add_layernorm -----------------------------------------------------------------------

DROPOUT_ADD_LN_REASON = ("kiln.kernels.dropout_add_layer_norm draws its own dropout mask and returns the "
                         "new residual too; this rewrite is not enabled")
_LAYER_NORMS = ("torch.nn.LayerNorm", "torch.nn.functional.layer_norm")
_DROPOUTS = ("torch.nn.Dropout", "dropout")


def _find_dropout_add_layernorm(ctx: Context, node: Node, raw, tree):
    if tree.op != "torch.nn.LayerNorm" or len(tree.args) != 1:
        return None
    s = tree.args[0]
    if s.op != "+" or len(s.args) != 2:
        return None
    if not any(t.op in _DROPOUTS for t in s.args):
        return None
    return Found({}, None, DROPOUT_ADD_LN_REASON)


def _copied_from(fn, operand):
    """The node computing `operand`, looking through plain `a = b` copies."""
    node = fn.defs.get(operand.name) if isinstance(operand, Var) else None
    while node is not None and node.op == "=" and isinstance(node.args[0], Var):
        node = fn.defs.get(node.args[0].name)
    return node


def dropout_add_layernorm_locations(ctx: Context) -> list[tuple[int, int, str]]:
    """LayerNorm(Dropout(h) + residual) where the sum is also read elsewhere (kept as the next
    residual, so no single expression tree holds the pattern)."""
    fn, out = ctx.fn, []
    for node in fn.nodes:
        if node.op not in _LAYER_NORMS or not node.args:
            continue
        add = _copied_from(fn, node.args[0])
        if add is None or add.op != "+" or len(add.args) != 2:
            continue
        drop = next((d for d in (_copied_from(fn, a) for a in add.args) if d is not None and d.op in _DROPOUTS), None)
        if drop is not None:
            out.append((min(drop.line, add.line), node.line, DROPOUT_ADD_LN_REASON))
    return out


# -- fused_qkv -----------------------------------------------------------------------------------

def _ctor_arg(ctx: Context, module, position: int, keyword: str) -> str | None:
    """The source text of an argument of the constructor __init__ assigns to `module`, or None."""
    ctors = ctx.init_exprs(module)
    if len(ctors) != 1 or not isinstance(ctors[0], cst.Call):
        return None
    for i, a in enumerate(ctors[0].args):
        if (a.keyword is None and not a.star and i == position) or (a.keyword is not None and a.keyword.value == keyword):
            return flat(code_of(a.value))
    return None


def _held(fn, name: str, path: frozenset = frozenset(), depth: int = 0) -> set[tuple[str, frozenset]]:
    """(value, path) pairs: the values `name` may hold and the branches taken to get there, as
    {(id of the `if`, branch)}.  Followed: plain copies (`a = b`), conditional expressions, the `if`
    without else (`if q is None: q = h`) and if/else merges.  A name unbound before an `if` holds
    only what the `if` assigned (DETR's `hidden_states_original`, set only when position embeddings
    are added)."""
    out = {(name, path)}
    if depth > 8:
        return out
    node = fn.defs.get(name)
    steps = []
    if node is not None and node.op == "=" and isinstance(node.args[0], Var):
        steps.append((node.args[0].name, None))
    elif node is not None and node.op == "=" and isinstance(node.cst, cst.IfExp):   # `kv if cross else h`
        steps += [(fn.name_version.get(id(b)), None) for b in (node.cst.body, node.cst.orelse) if isinstance(b, cst.Name)]
    phi = fn.phis.get(name)
    if phi is not None:
        steps += [(phi.before, (id(phi.if_cst), "not taken")), (phi.inner, (id(phi.if_cst), "taken"))]
    branches = fn.branches.get(name)
    if branches is not None:
        steps += [(branches[1], (id(branches[0]), "taken")), (branches[2], (id(branches[0]), "not taken"))]
    else:
        steps += [(v, None) for v in fn.merges.get(name, ())]
    for value, branch in steps:
        if value and (branch is None or (branch[0], _other(branch[1])) not in path):
            out |= _held(fn, value, path | {branch} if branch else path, depth + 1)
    return out


def _other(branch: str) -> str:
    return "taken" if branch == "not taken" else "not taken"


def _together(paths) -> bool:
    """Can these branch choices all hold on one run (no `if` both taken and not taken)?"""
    chosen = {}
    return all(chosen.setdefault(key, branch) == branch for path in paths for key, branch in path)


def _find_fused_qkv(ctx: Context, node: Node, raw, tree):
    """Three nn.Linear modules applied to one value, on at least one path through the method.  Their
    in_features need not be shown equal in __init__: a Linear applied to a tensor has that tensor's
    last dim as its in_features, so three applied to the same value have equal ones."""
    if node.op != LINEAR or len(node.args) != 1 or not isinstance(node.args[0], Var):
        return None
    linears = [(n, _held(ctx.fn, n.args[0].name)) for n in ctx.fn.nodes if n.op == LINEAR
               and n.module is not None and len(n.args) == 1 and isinstance(n.args[0], Var)]
    for value in sorted({v for v, _ in _held(ctx.fn, node.args[0].name)}):
        same = [(n, [p for v, p in held if v == value]) for n, held in linears]
        same = [(n, paths) for n, paths in same if paths]
        if len({n.module for n, _ in same}) != 3 or min(same, key=lambda s: s[0].line)[0] is not node:
            continue
        if any(_together(combo) for combo in itertools.product(*(paths for _, paths in same))):
            return Found({}, None, "fusing the three projections changes the module's parameters (one stacked "
                                   "weight; checkpoints need converting)")
    return None


# -- linear_cross_entropy ------------------------------------------------------------------------

_PASS = {".view", ".reshape", "to", ".contiguous", ".flatten", "="}
CROSS_ENTROPY = ("torch.nn.functional.cross_entropy", "torch.nn.CrossEntropyLoss")


def _is_lm_head(ctx: Context, node: Node) -> bool:
    """An nn.Linear producing vocabulary logits: named `lm_head`, or built with a vocab-size width."""
    if node.op != LINEAR or node.module is None:
        return False
    if getattr(node.module, "name", "") == "lm_head":
        return True
    width = _ctor_arg(ctx, ctx.builder.operand(node.module), 1, "out_features")
    return width is not None and ("vocab" in width.lower() or width in _embedding_sizes(ctx))


def _embedding_sizes(ctx: Context) -> set[str]:
    """The vocabulary sizes of the token embeddings `__init__` builds (`nn.Embedding(V, d)`): a
    Linear projecting back to that many outputs is the language-model head."""
    sizes = set()
    stack = [e for exprs in ctx.fn.init.values() for e in exprs]
    while stack:
        e = stack.pop()
        if isinstance(e, cst.Call) and ctx.qualname(e.func) == "torch.nn.Embedding" and e.args \
                and e.args[0].keyword is None:
            sizes.add(flat(code_of(e.args[0].value)))
        stack.extend(e.children)
    return sizes


def _source_linear(ctx: Context, operand, depth=0):
    """Follow `operand` back through views, casts, slices and branches to an LM-head nn.Linear, or None."""
    fn = ctx.fn
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
            if phi is not None:
                operand = Var(phi.before) if phi.before else None
                continue
            for pred in sorted(fn.merges.get(operand.name, ())):     # logits computed on if/else paths
                hit = _source_linear(ctx, Var(pred), depth)
                if hit is not None:
                    return hit
            return None
        if _is_lm_head(ctx, node):
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
    if _source_linear(ctx, node.args[0]) is None:
        return None
    return Found({}, None, "kiln.kernels.linear_cross_entropy (logits never materialized) is not applied: "
                           "the logits are computed and returned by the surrounding code (the cross_entropy rule "
                           "makes the loss on them one pass each way)")


# -- cross_entropy -------------------------------------------------------------------------------

_CE_KWARGS = ("ignore_index", "reduction")


def _built_cross_entropy(ctx: Context, node: Node) -> bool:
    """`node` calls an object built by CrossEntropyLoss(...): a local (`loss_fct = CrossEntropyLoss(); loss_fct(a,
    b)`, however often it is called) or the constructor called at once (`CrossEntropyLoss()(a, b)`)."""
    if node.op != "call" or not isinstance(node.module, Var):
        return False
    d = ctx.fn.defs.get(node.module.name)
    return d is not None and d.op in CROSS_ENTROPY


def _find_cross_entropy(ctx: Context, node: Node, raw, tree):
    """A cross-entropy call -> kiln.kernels.cross_entropy_of(loss, logits, labels) for a CrossEntropyLoss
    object (its configuration is checked at run time: class weights, label smoothing, a subclass or a hook
    run the object as written), kiln.kernels.cross_entropy(...) for F.cross_entropy with at most
    ignore_index / reduction."""
    kw = dict(tree.kw) if tree.kw else {}
    if tree.op == "torch.nn.functional.cross_entropy":
        if len(tree.args) != 2 or not set(kw) <= set(_CE_KWARGS):
            extra = sorted(set(kw) - set(_CE_KWARGS)) or ["positional arguments after the labels"]
            return Found({}, None, f"F.cross_entropy with {', '.join(extra)} is kept (the kernel takes "
                                   "ignore_index and reduction only)")
        env = {"$x": tree.args[0], "$y": tree.args[1]}
        named = []
        for k in _CE_KWARGS:
            if k not in kw:
                continue
            v = kw[k]
            if k == "ignore_index" and v.op == "const" and float(v.value).is_integer():
                named.append((k, Const(int(v.value))))       # constants are held as floats: -100, not -100.0
            else:
                env[f"${k}"] = v
                named.append((k, Var(f"${k}")))
        return Found(env, [Node("kiln.kernels.cross_entropy", (Var("$x"), Var("$y")), tuple(named))])
    loss = kw.get("__module__")
    if loss is None or not (tree.op in CROSS_ENTROPY or _built_cross_entropy(ctx, node)):
        return None
    if len(tree.args) != 2 or set(kw) != {"__module__"}:
        return Found({}, None, "a CrossEntropyLoss called with other than (logits, labels) is kept")
    env = {"$loss": loss, "$x": tree.args[0], "$y": tree.args[1]}
    return Found(env, [Node("kiln.kernels.cross_entropy_of", (Var("$loss"), Var("$x"), Var("$y")))])


DETECTIONS = [
    StructuralRule("swiglu", PYTHON_RULES["swiglu"], _find_swiglu),
    StructuralRule("linear_gelu", PYTHON_RULES["linear_gelu"], _find_linear_gelu),
    StructuralRule("rope", PYTHON_RULES["rope"], _find_rope,
                   statements=rope_pairs),
    StructuralRule("dropout_add_layernorm", PYTHON_RULES["dropout_add_layernorm"],
                   _find_dropout_add_layernorm, locate=dropout_add_layernorm_locations),
    StructuralRule("fused_qkv", PYTHON_RULES["fused_qkv"],
                   _find_fused_qkv, overlaps=True),
    StructuralRule("linear_cross_entropy", PYTHON_RULES["linear_cross_entropy"],
                   _find_linear_cross_entropy, overlaps=True),
    StructuralRule("cross_entropy", PYTHON_RULES["cross_entropy"], _find_cross_entropy),
]
