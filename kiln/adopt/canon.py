"""Canonical op names: the many spellings of one tensor op map to one DSL op.

`torch.tanh(x)`, `x.tanh()` and `torch.nn.functional.tanh(x)` are all `tanh(x)`; `torch.mul`,
`x.mul` and `*` are all `*`.  Arguments are normalized too: the first tensor stays positional,
the rest become keywords by the op's signature (`x.mean(-1, True)` -> `mean(x, dim=-1,
keepdim=True)`), so a rule written once matches every spelling.  Both the analysis (source) and
the rule loader (patterns) go through `canonical_call`, so they agree by construction.
"""
from __future__ import annotations

from kiln.adopt.dsl import Attr, Const

# canonical op -> parameter names after the first (positional) input
SIGNATURES: dict[str, tuple[str, ...]] = {
    "tanh": (), "sigmoid": (), "erf": (), "sqrt": (), "rsqrt": (), "exp": (), "log": (),
    "relu": (), "square": (), "abs": (), "reciprocal": (),
    "mean": ("dim", "keepdim", "dtype"),
    "softmax": ("dim", "dtype"),
    "*": ("other",), "+": ("other",), "-": ("other",), "/": ("other",), "@": ("other",),
    "**": ("exponent",), "neg": (),
    "transpose": ("dim0", "dim1"),
    "dropout": ("p", "training", "inplace"),
}

# Functions (by qualified name) and Tensor methods (by `Tensor.<name>`) -> canonical op.
_ALIASES = {
    "tanh": ["torch.tanh", "Tensor.tanh", "torch.nn.functional.tanh"],
    "sigmoid": ["torch.sigmoid", "Tensor.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit"],
    "erf": ["torch.erf", "Tensor.erf", "torch.special.erf"],
    "sqrt": ["torch.sqrt", "Tensor.sqrt", "math.sqrt"],
    "rsqrt": ["torch.rsqrt", "Tensor.rsqrt"],
    "exp": ["torch.exp", "Tensor.exp", "math.exp"],
    "log": ["torch.log", "Tensor.log", "math.log"],
    "relu": ["torch.relu", "Tensor.relu", "torch.nn.functional.relu"],
    "abs": ["torch.abs", "Tensor.abs"],
    "reciprocal": ["torch.reciprocal", "Tensor.reciprocal"],
    "square": ["torch.square", "Tensor.square"],
    "mean": ["torch.mean", "Tensor.mean"],
    "softmax": ["torch.softmax", "Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax"],
    "*": ["torch.mul", "Tensor.mul", "torch.multiply", "Tensor.multiply"],
    "+": ["torch.add", "Tensor.add"],
    "-": ["torch.sub", "Tensor.sub", "torch.subtract", "Tensor.subtract"],
    "/": ["torch.div", "Tensor.div", "torch.divide", "Tensor.divide", "torch.true_divide", "Tensor.true_divide"],
    "@": ["torch.matmul", "Tensor.matmul"],
    "**": ["torch.pow", "Tensor.pow", "math.pow"],
    "neg": ["torch.neg", "Tensor.neg", "torch.negative", "Tensor.negative"],
    "to": ["Tensor.to"],
    "dropout": ["torch.nn.functional.dropout", "torch.dropout"],
    "transpose": ["torch.transpose", "Tensor.transpose", "torch.swapaxes", "Tensor.swapaxes",
                  "torch.swapdims", "Tensor.swapdims"],
}
CANONICAL: dict[str, str] = {alias: op for op, aliases in _ALIASES.items() for alias in aliases}

# Keywords that make an otherwise canonical call mean something else: leave those calls alone.
_CHANGES_MEANING = {"+": {"alpha"}, "-": {"alpha"}, "/": {"rounding_mode"}, "*": {"out"}}

# Cast methods -> the dtype they cast to (`x.float()` is `to(x, torch.float32)`).
CAST_METHODS = {"float": "torch.float32", "half": "torch.float16", "bfloat16": "torch.bfloat16",
                "double": "torch.float64"}

# torch.nn.functional.softmax(input, dim, _stacklevel, dtype): positional order differs.
_POSITIONAL = {"torch.nn.functional.softmax": ("dim", "_stacklevel", "dtype"), "torch.dropout": ("p", "training")}
# keyword spellings of one parameter (torch.dropout's `train` is F.dropout's `training`)
_KEYWORDS = {"torch.dropout": {"train": "training"}}

# Calls without side effects or randomness besides the canonical ops: moving or merging them is safe.
PURE_CALLS = {".size", ".dim", ".numel", "len", "int", "float", "math.sqrt", "math.log", "math.exp",
              # views, casts and tensor-building functions: no side effects, no randomness
              ".view", ".reshape", ".permute", ".contiguous", ".unsqueeze", ".squeeze", ".expand", ".flatten",
              ".bool", ".type_as", ".masked_fill", ".detach", "torch.where", "torch.tril", "torch.triu",
              "torch.ones", "torch.zeros", "torch.full", "torch.arange", "torch.finfo",
              "torch.nn.functional.normalize"}
PURE_OPS = (frozenset(SIGNATURES) - {"dropout"}) | {"to"} | PURE_CALLS     # dropout draws random numbers


def _order_transpose(named: list) -> list:
    """transpose(x, -1, -2) is transpose(x, -2, -1): order constant dims so both compare equal."""
    dims = dict(named)
    d0, d1 = dims.get("dim0"), dims.get("dim1")
    if isinstance(d0, Const) and isinstance(d1, Const) and isinstance(d0.value, int) \
            and isinstance(d1.value, int) and d0.value > d1.value:
        dims["dim0"], dims["dim1"] = d1, d0
    return list(dims.items())


def canonical_call(qualname: str, args: list, kwargs: list[tuple[str, object]], dtype_ref):
    """Map a call to (op, args, kwargs), or None when `qualname` is not a canonical op.

    `qualname` is a function's qualified name or `Tensor.<method>` with the receiver as args[0].
    `dtype_ref(name)` builds the operand for a dtype such as `torch.float32`.
    """
    method = qualname[len("Tensor."):] if qualname.startswith("Tensor.") else None
    if method in CAST_METHODS and not args[1:] and not kwargs:
        return "to", [args[0], dtype_ref(CAST_METHODS[method])], []
    if method == "type" and len(args) == 2 and not kwargs:     # x.type(dtype); x.type() is a string
        return "to", list(args), []
    if method == "type_as" and len(args) == 2 and not kwargs:  # x.type_as(y) is x.to(y.dtype)
        return "to", [args[0], Attr(args[1], "dtype")], []
    op = CANONICAL.get(qualname)
    if op is None or not args:
        return None
    if op == "to":
        return op, list(args), list(kwargs)
    if any(k in _CHANGES_MEANING.get(op, ()) for k, _ in kwargs):
        return None
    names = _POSITIONAL.get(qualname, SIGNATURES[op])
    if len(args) - 1 > len(names):
        return None
    if op in ("*", "+", "-", "/", "@", "**"):
        rest = dict(kwargs)
        other = args[1] if len(args) > 1 else rest.pop(names[0], None)
        if other is None or rest:
            return None
        return op, [args[0], other], []
    if op == "square":
        return ("**", [args[0], Const(2)], []) if not kwargs and len(args) == 1 else None
    renamed = _KEYWORDS.get(qualname, {})
    named = list(zip(names, args[1:])) + [(renamed.get(k, k), v) for k, v in kwargs if k not in ("input", "_stacklevel")]
    named = [(k, v) for k, v in named if k != "_stacklevel"]
    if len({k for k, _ in named}) != len(named):
        return None
    if op == "transpose":
        named = _order_transpose(named)
    return op, [args[0]], named
