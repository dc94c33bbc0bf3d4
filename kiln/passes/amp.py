"""Automatic mixed precision over the forward graph, before autodiff (so the backward follows).

Each op's cast class comes from its OpDef (overridable per op name or module path; ops the model runs
under `torch.autocast(enabled=False)` are FP32, `Node.full_precision`):
- LOWER  (matmul, linear, conv, attention): floating inputs are cast to the low dtype;
- FP32   (softmax, losses, norms, exp/log/pow, reductions): low-precision inputs are cast to fp32;
- FOLLOW (views, elementwise, activations): inputs of mixed float dtypes are promoted to the widest
  (as ATen would), nothing else; ops whose kernels promote by themselves (`OpDef.promotes`: ATen's
  Tensor-Tensor arithmetic, the rope kernel) read them as they are.
Every value is cast at most once per dtype (so each parameter is cast to bf16 once per step and the
backward reuses that copy), and a cast of a cast goes back to the source instead of chaining.
Because autodiff runs afterwards on the mixed graph, each gradient is computed in the dtype of its
forward value, and the gradient of a parameter is cast back to fp32 by the `_to_copy` rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._ops import OpOverload

from kiln.errors import KilnError
from kiln.ir.builder import Builder, infer_metas
from kiln.ir.graph import Graph, Value, tree_map_values
from kiln.ops.registry import Cast, by_name

aten = torch.ops.aten

LOW_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass
class AmpPolicy:
    dtype: torch.dtype
    # fp16 loss scaler: (growth_factor, backoff_factor, growth_interval), as torch.amp.GradScaler
    scaler: tuple[float, float, int] = (2.0, 0.5, 2000)
    op_overrides: dict[str, Cast] = field(default_factory=dict)       # "aten.softmax" -> Cast
    module_overrides: dict[str, Cast] = field(default_factory=dict)   # "model.layers.0.mlp" -> Cast

    @classmethod
    def make(cls, amp: str, overrides: dict | None = None) -> "AmpPolicy":
        if amp not in LOW_DTYPES:
            raise KilnError(f"amp must be 'bf16', 'fp16' or None, got {amp!r}")
        ops, mods = {}, {}
        for key, value in (overrides or {}).items():
            try:
                cast = value if isinstance(value, Cast) else Cast(str(value).lower())
            except ValueError:
                raise KilnError(f"amp_overrides[{key!r}] = {value!r}: use 'lower', 'fp32' or 'follow'") from None
            if key.startswith(("aten.", "kiln.")):
                try:
                    by_name(key)
                except KeyError:
                    raise KilnError(f"amp_overrides: no op named {key!r} in Kiln's registry") from None
                ops[key] = cast
            else:
                mods[key] = cast
        return cls(LOW_DTYPES[amp], op_overrides=ops, module_overrides=mods)

    def cast_class(self, node) -> Cast:
        if node.full_precision:
            return Cast.FP32            # the model's own `torch.autocast(enabled=False)` block
        if node.op.name in self.op_overrides:
            return self.op_overrides[node.op.name]
        cls = node.op.cast
        best = ""
        for path, cast in self.module_overrides.items():       # the most specific module path wins
            if (node.scope == path or node.scope.startswith(path + ".")) and len(path) > len(best):
                best, cls = path, cast
        return cls


def autocast(graph: Graph, policy: AmpPolicy) -> int:
    """Insert casts into the forward graph per `policy`. Returns how many casts were inserted."""
    low = policy.dtype
    casts: dict[tuple[int, torch.dtype], Value] = {}
    new_nodes = []
    inserted = 0

    def cast(b: Builder, v: Value, dtype: torch.dtype) -> Value:
        nonlocal inserted
        if v.meta.dtype == dtype:
            return v
        src = v.producer.args[0] if v.producer is not None and v.producer.target is aten._to_copy.default \
            and set(v.producer.kwargs) <= {"dtype"} else None
        if isinstance(src, Value) and src.meta.dtype == dtype:
            return src                                     # cast(cast(x, a), x.dtype) -> x
        key = (v.uid, dtype)
        if key not in casts:
            moved = _moved(b, v, dtype, cast)
            if moved is None:
                moved = b(aten._to_copy.default, v, dtype=dtype)
                inserted += 1
            casts[key] = moved
        return casts[key]

    for n in graph.nodes:
        floats = [v for v in n.inputs if v.is_float]
        b = Builder(graph, n.phase, n.scope, dest=new_nodes)
        cls = policy.cast_class(n)
        if cls is Cast.LOWER:
            want = {v: low for v in floats if v.meta.dtype == torch.float32}
        elif cls is Cast.FP32:
            want = {v: torch.float32 for v in floats if v.meta.dtype in (torch.bfloat16, torch.float16)}
        elif n.op.promotes:
            want = {}                  # the kernel promotes mixed inputs itself: no pass over the narrower one
        else:
            want = _promotion(floats)
        if want:
            swap = {v: cast(b, v, dt) for v, dt in want.items()}
            n.args, n.kwargs = tree_map_values(lambda v: swap.get(v, v), (n.args, n.kwargs))
        _refresh(n)                    # input dtypes upstream may have changed
        _saturate_scalars(n, low)
        new_nodes.append(n)
    graph.nodes = new_nodes
    return inserted


# Ops that only move data, with which rounding commutes: a narrowing cast of their result is the op on cast
# inputs. The cast then reaches what they move: BERT's decoder bias joins its weight by unsqueeze, pad and cat
# (one product for both: kiln_kernels._with_bias), and the cast of the joined matrix was an activation cast
# every step, and its gradient's widening another; cast beneath, they are casts of parameters (once a step)
# and of their gradients (read by the optimizer as they are).
_MOVES = (aten.cat.default, aten.constant_pad_nd.default, aten.unsqueeze.default)


def _moved(b: Builder, v: Value, dtype: torch.dtype, cast) -> Value | None:
    """The op making `v`, rebuilt on its inputs `cast` to `dtype`, where it only moves data and `dtype` is
    narrower (a pad value must be exact in `dtype`); else None."""
    p = v.producer
    if p is None or p.target not in _MOVES or dtype.itemsize >= v.meta.dtype.itemsize or p.kwargs:
        return None
    if p.target is aten.constant_pad_nd.default:
        value = p.args[2] if len(p.args) > 2 else 0.0
        if not isinstance(value, (int, float)) or float(torch.tensor(value, dtype=dtype)) != value:
            return None
    if not all(x.meta.dtype == v.meta.dtype for x in p.inputs if x.is_float):
        return None
    args = tree_map_values(lambda x: cast(b, x, dtype) if x.is_float else x, p.args)
    return b(p.target, *args)


def _promotion(floats: list[Value]) -> dict[Value, torch.dtype]:
    """FOLLOW ops: mixed float dtypes are promoted to the widest, with 0-dim tensors not deciding
    (ATen's rule), so ops without built-in promotion see one dtype."""
    dtypes = {v.meta.dtype for v in floats}
    if len(dtypes) < 2:
        return {}
    deciders = [v for v in floats if len(v.meta.shape) > 0] or floats
    target = deciders[0].meta.dtype
    for v in deciders[1:]:
        target = torch.promote_types(target, v.meta.dtype)
    return {v: target for v in floats if v.meta.dtype != target}


# ops whose float constant is a value written into the result (never an operand of arithmetic)
_FILLS = {aten.masked_fill.Scalar, aten.fill.Scalar, aten.clamp.default, aten.clamp_min.default,
          aten.clamp_max.default, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
          aten.index_fill.int_Scalar, aten.full_like.default, aten.new_full.default, aten.scatter.value}


def _saturate_scalars(n, low: torch.dtype) -> None:
    """A fill value the fp32 program holds finitely but `low` cannot (`torch.finfo(torch.float32).min`
    captured as a mask value, `-1e9` under fp16) becomes `low`'s largest finite value of its sign, which is
    what the model computes under autocast (`finfo(scores.dtype).min`); ATen would otherwise refuse to
    convert it (`masked_fill`, `fill_`, `clamp`) or write an infinity. Only for fill ops (`_FILLS`) that
    compute in `low` after the casts: in arithmetic (`x / 1e6` under fp16) the constant is an operand ATen
    keeps in fp32, and stays. Infinities and NaN stay as they are."""
    if n.target not in _FILLS or not any(v.meta.dtype == low for v in (*n.inputs, *n.outputs) if v.is_float):
        return
    top, f32 = torch.finfo(low).max, torch.finfo(torch.float32).max

    def fix(x):
        return (top if x > 0 else -top) if type(x) is float and top < abs(x) <= f32 else x
    args = [fix(a) for a in n.args]
    kwargs = {k: fix(v) for k, v in n.kwargs.items()}
    if args != list(n.args) or kwargs != n.kwargs:
        n.args, n.kwargs = tuple(args), kwargs


def _refresh(n) -> None:
    """Re-infer output metas after input dtypes changed (only ATen ops; Kiln ops keep theirs)."""
    if not isinstance(n.target, OpOverload):
        return
    for v, m in zip(n.outputs, infer_metas(n.target, n.args, n.kwargs)):
        if m is not None and v.meta != m:
            v.meta = m


_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_has_native(dtype: torch.dtype) -> bool | None:
    """Whether this CPU multiplies `dtype` matrices natively (None if it cannot be told).
    Without it, oneDNN emulates low-precision matmul and it is much slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else any(flag in flags for flag in _NATIVE_FLAGS[dtype])
