"""The op registry: one `OpDef` per op, holding every fact the compiler needs about it.

An OpDef is the single place where Kiln describes an op: which ATen overloads it covers, its VJP
(gradient) rule, its mixed-precision cast class, its kind (read by fusion and rematerialization), its
side effects and a cost estimate. Op families live in sibling modules (`pointwise.py`, `nn.py`, ...),
one block per op; `tests/ops/test_registry.py` checks that every registered op is complete.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch._ops import OpOverload

from kiln.once import Once
from kiln.ir.symbolic import hint

log = logging.getLogger("kiln")


class Kind(enum.Enum):
    VIEW = "view"              # aliases its input, no compute
    POINTWISE = "pointwise"    # elementwise, incl. broadcasting and casts
    REDUCTION = "reduction"
    MATMUL = "matmul"          # mm/bmm/linear/conv: the flops
    NORM = "norm"              # layer/batch/rms norm (reduction + pointwise)
    ATTENTION = "attention"
    INDEX = "index"            # gather/scatter/embedding/cat/slicing that copies
    RANDOM = "random"          # draws from the RNG: never CSE'd, never recomputed blindly
    CREATION = "creation"      # zeros/ones/arange/full: no tensor inputs
    LOSS = "loss"
    OPTIMIZER = "optimizer"    # in-place parameter/state updates
    COLLECTIVE = "collective"  # torch.distributed communication between ranks (kiln/ops/collectives.py)
    OPAQUE = "opaque"          # fallbacks and anything Kiln cannot see into


class Cast(enum.Enum):
    """Mixed-precision cast class (TensorFlow/RAF AMP lists)."""

    LOWER = "lower"            # always run in low precision (matmul, conv, attention)
    FP32 = "fp32"              # never run in low precision (softmax, losses, norm statistics, exp, ...)
    FOLLOW = "follow"          # run in the dtype of the inputs (views, elementwise, activations)


Vjp = Callable[..., Sequence[Any]]


def _default_cost(node) -> float:
    """Element-count estimate: bytes moved dominate everything but matmuls. Costs are heuristics: symbolic
    sizes count at their hint (the compiled batch's size, no guard)."""
    return float(sum(hint(v.meta.numel) for v in node.outputs if v.meta is not None))


@dataclass
class OpDef:
    name: str
    targets: tuple[Any, ...]                     # ATen OpOverloads (or Kiln op keys) it covers
    vjp: Vjp | None                              # gradient rule; None: no rule (-> logged fallback)
    kind: Kind
    cast: Cast
    differentiable: bool = True                  # False: outputs never carry gradient (comparisons)
    side_effects: bool = False                   # True: never removed, never merged, never reordered
    cost: Callable[[Any], float] = _default_cost
    # bytes of temporaries the kernel makes and frees inside itself (a chunk of logits), at the compiled
    # batch's sizes: the memory model counts them at the node (kiln/passes/memory.py)
    workspace: Callable[[Any], int] | None = None
    infer: Callable[..., list] | None = None     # shape inference for non-ATen ops (args, kwargs) -> metas
    # its kernel reads mixed float dtypes and computes in the promoted one itself, as ATen's elementwise
    # arithmetic does: amp inserts no widening cast before it (a separate pass over the narrower input)
    promotes: bool = False
    # every float input may come in a narrower float dtype holding the same values, the result unchanged (the
    # kernel widens what it reads: the optimizer's gradients, the non-finite guard): a widening cast read
    # only by such ops is dropped (kiln/passes/casts.py)
    reads_narrow: bool = False
    # outputs whose dtype the kernel's `out_dtype` argument sets (computed wide, rounded once): a narrowing
    # cast of them is folded into the kernel (kiln/passes/casts.py)
    out_dtype: tuple[int, ...] = ()
    # (i, j): output i, also rounded to the dtype the kernel's `low_dtype` argument names, is output j (empty
    # otherwise): a narrowing cast of output i that is also read as it is folds into the kernel
    also_low: tuple[int, int] | None = None
    # (i, j): output i plus a tensor t of its shape equals the op with t as its argument j (given as None):
    # an add of output i folds into the kernel (kiln/passes/accumulate.py)
    accumulates: tuple[int, int] | None = None
    # an op taking this op's arguments and then a tensor t of output 0's shape, whose output 0 is this op's output 0
    # plus t, the same bits in float32 (where the op has no argument to take t: embedding_dense_backward's twin
    # for a tied embedding); folded like `accumulates` where an enabled dialect runs it (kiln/passes/accumulate.py)
    accumulating: "OpDef | None" = None
    # an op computing this op's outputs and, after them, output 0's sum over every dimension but the last (a
    # bias's gradient, which the graph sums in a second pass): the sum folds into it (kiln/passes/accumulate.py)
    column_sums: "OpDef | None" = None
    # the output whose sum `column_sums` computes (0 unless said: layer_norm_backward sums its low-precision copy)
    sums_output: int = 0
    # the op computes each row of some leading dims of its outputs from the same row of the arguments at
    # given positions alone (other arguments apply to every row: weights): given the node, (those positions,
    # how many leading dims at most are rows), or None where this use mixes rows. Pointwise ops need no
    # declaration (their shapes say it). The chunk pass (kiln/passes/chunk.py) runs such ops on row slices
    rows: Callable[[Any], tuple[tuple[int, ...], int] | None] | None = None
    # the position of the argument that is the output's shape (view, reshape): a row slice rewrites it
    shape_arg: int | None = None
    # (node, k) -> the node's arguments with its kernel's temporaries about k times smaller (the loss kernels'
    # chunks of logits): what the chunk pass asks of it under a budget rematerialization alone misses
    smaller: Callable[[Any, int], tuple] | None = None
    doc: str = ""

    @property
    def has_rule(self) -> bool:
        return self.vjp is not None or not self.differentiable

    def __repr__(self) -> str:
        return f"OpDef({self.name})"


_BY_TARGET: dict[Any, OpDef] = {}
_UNDECLARED: set = set()          # targets `lookup` made an OpDef for on the spot (no module declared them)
_BY_NAME: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in _BY_NAME:
        raise ValueError(f"op {op.name!r} registered twice")
    _BY_NAME[op.name] = op
    for t in op.targets:
        if t in _BY_TARGET:
            raise ValueError(f"{t} is covered by both {_BY_TARGET[t].name} and {op.name}")
        _BY_TARGET[t] = op
    return op


def defop(targets, vjp: Vjp | None, kind: Kind, cast: Cast = Cast.FOLLOW, *, name: str | None = None,
          **facts) -> OpDef:
    """Register one op. `targets` is an OpOverload or a tuple of them; the name defaults to the first."""
    if not isinstance(targets, (tuple, list)):
        targets = (targets,)
    if name is None:
        name = _target_name(targets[0])
    return register(OpDef(name, tuple(targets), vjp, kind, cast, **facts))


def nondiff(targets, kind: Kind = Kind.POINTWISE, **facts) -> list[OpDef]:
    """Register ops whose outputs never carry a gradient (comparisons, integer math, creation)."""
    if not isinstance(targets, (tuple, list)):
        targets = (targets,)
    return [defop(t, None, kind, Cast.FOLLOW, differentiable=False, **facts) for t in targets]


def _target_name(t: Any) -> str:
    if isinstance(t, OpOverload):
        ns = t.namespace
        packet, overload = t._schema.name.split("::")[1], t._overloadname
        return f"{ns}.{packet}" + ("" if overload == "default" else f".{overload}")
    return str(t)


def find(target: Any) -> OpDef | None:
    """The registered OpDef for `target`, or None (nothing recorded either way, unlike `lookup`)."""
    _ensure_loaded()
    return _BY_TARGET.get(target)


def lookup(target: Any) -> OpDef:
    """The OpDef for an ATen overload. Ops nobody registered get an OpDef with no VJP rule, so
    autodiff falls back to PyTorch autograd for them (logged, and shown by explain)."""
    _ensure_loaded()
    op = _BY_TARGET.get(target)
    if op is not None:
        return op
    if isinstance(target, OpOverload) and target._schema.is_mutable:
        from kiln.errors import UnsupportedError
        raise UnsupportedError(f"{_target_name(target)} mutates its input in the captured forward; "
                               "Kiln trains functional graphs only")
    op = OpDef(_target_name(target), (target,), None, Kind.OPAQUE, Cast.FOLLOW,
               doc="not in Kiln's registry: gradient by the autograd fallback")
    _BY_TARGET[target] = op
    _UNDECLARED.add(target)
    return op


def registered(target: Any) -> bool:
    """Whether some module of kiln.ops declared `target` (with a rule, or as non-differentiable)."""
    _ensure_loaded()
    return target in _BY_TARGET and target not in _UNDECLARED


def by_name(name: str) -> OpDef:
    _ensure_loaded()
    return _BY_NAME[name]


def all_ops() -> list[OpDef]:
    _ensure_loaded()
    return list(_BY_NAME.values())


def _load() -> None:
    """Import the modules that register (once: `_ensure_loaded`)."""
    from kiln.ops import pointwise, views, reductions, nn, indexing, spectral  # noqa: F401  (register)
    from kiln.ops import kernels  # noqa: F401  (kiln.kernels custom ops)
    from kiln.ops import functions  # noqa: F401  (user torch.autograd.Functions)
    from kiln import optim  # noqa: F401  (optimizer update ops)
    from kiln.ops import collectives  # noqa: F401  (data-parallel communication)
    from kiln.autodiff import fallback  # noqa: F401


_ensure_loaded = Once(_load)


aten = torch.ops.aten
