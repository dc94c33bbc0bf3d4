"""Emitting nodes: the one way every stage (capture, lowering, autodiff, optimizer) adds ops.

`b(aten.mm.default, x, w)` appends a node, infers its output shapes/dtypes by running the op on meta
tensors, and returns its output Value (or a tuple of Values for multi-output ops).

Layouts. The strides in a meta are a *prediction*: meta kernels do not always give the strides the
device kernel returns (CPU batch norm returns a contiguous output where its meta keeps the input's
layout; an autograd fallback's gradients have whatever layout autograd made), and a pass that swaps a
value for one of another layout may leave later metas behind. Kiln never lets correctness rest on a
prediction: the strides of a value are *exact* only for the step's own tensors (parameters, buffers,
constants, optimizer state; not the user's inputs, whose strides the program is not keyed on) and views of
exact values (`layout_known`). `aten.view` needs a layout that allows it, so a view
of any other value is emitted as `aten.reshape`, which is the same view when the real layout allows it and
a copy when it does not. Strides are still predicted for the rest (fused regions compile for them and
check them on their first call).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._pytree import tree_leaves

from kiln.ir import symbolic
from kiln.ir.graph import Graph, Node, Phase, Role, TensorMeta, Value, tree_map_values, tree_values
from kiln.ops import registry

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default)        # need a layout that allows them
EXACT_ROLES = frozenset({Role.PARAM, Role.FROZEN, Role.BUFFER, Role.CONSTANT, Role.STATE})


def layout_known(v: Value) -> bool:
    """Whether v's strides are exact rather than predicted: a step tensor other than a user input, or a
    view of one (views compute their strides from their input's the same way on every device). A clone
    does not count: `remove_noops` drops the clones it predicts to be no-ops."""
    while v.producer is not None:
        n = v.producer
        ins = n.inputs
        if n.op.kind is not registry.Kind.VIEW or len(ins) != 1:
            return False
        v = ins[0]
    return v.role in EXACT_ROLES


def viewable(v: Value) -> bool:
    """Whether `aten.view` of v to any shape of its numel is certain to work: an exact contiguous layout."""
    return layout_known(v) and v.meta.as_meta_tensor().is_contiguous()


def infer_metas(target: Any, args: tuple, kwargs: dict) -> list[TensorMeta | None]:
    """Output metas of `target(*args, **kwargs)` where args hold Values: the op runs on meta tensors, or,
    when a size is symbolic, on fake tensors of the program's ShapeEnv (kiln/ir/symbolic.py)."""
    if not isinstance(target, OpOverload):
        return registry.lookup(target).infer(args, kwargs)
    devices = [v.meta.device for v in tree_values((args, kwargs)) if v.meta is not None]
    env = symbolic.shape_env([v.meta.shape for v in tree_values((args, kwargs)) if v.meta is not None] +
                             [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.SymInt)])
    if env is not None:
        return _infer_symbolic(env, target, args, kwargs, devices)
    margs, mkwargs = tree_map_values(lambda v: v.meta.as_meta_tensor(), (args, kwargs))
    if "device" in mkwargs and mkwargs["device"] is not None:
        device = torch.device(mkwargs["device"])
        mkwargs = dict(mkwargs, device="meta")
    else:
        device = devices[0] if devices else torch.device("cpu")
    out = target(*margs, **mkwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [TensorMeta(tuple(o.shape), o.dtype, tuple(o.stride()), device) if isinstance(o, torch.Tensor)
            else None for o in outs]


def _infer_symbolic(env, target, args: tuple, kwargs: dict, devices: list) -> list[TensorMeta | None]:
    """Metas of an op with symbolic sizes: run on fake tensors (of the inputs' real devices) in the ShapeEnv's
    fake mode, so output sizes are expressions of the same symbols. Fake tensors are costly to make (their
    sizes are symbolic arithmetic): one per distinct meta is kept on the ShapeEnv, and so is each distinct
    inference (the repeated layers of a model ask the same ones)."""
    memo = env.__dict__.setdefault("_kiln_metas", {})
    try:
        key = (target, _key((args, kwargs)))
        hit = memo.get(key)
    except TypeError:                       # an unhashable constant: not memoized
        key, hit = None, None
    if hit is not None:
        return list(hit)
    fakes = env.__dict__.setdefault("_kiln_fakes", {})
    fresh = target._schema.is_mutable       # an in-place op may change its fake input: never a shared one

    def fake(v):
        m = v.meta
        t = None if fresh else fakes.get(m)
        if t is None:
            t = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
            if not fresh:
                fakes[m] = t
        return t
    with symbolic.fake_mode(env):
        fargs, fkwargs = tree_map_values(fake, (args, kwargs))
        impl = _symbolic_impl(target)
        try:
            out = impl(*fargs, **fkwargs)
        except Exception:                   # noqa: BLE001 - a Python meta that cannot take these: the op itself
            if impl is target:
                raise
            out = target(*fargs, **fkwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    metas = [TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outs]
    if key is not None:
        memo[key] = tuple(metas)
    return metas


@functools.cache
def _symbolic_impl(target):
    """What to run `target` as on fake tensors with symbolic sizes. An op without a C++ meta kernel runs its
    C++ kernel on fake tensors, which may read sizes as plain ints (`constant_pad_nd` does): that would
    specialize a dynamic size. Its Python meta registration or decomposition reads them as SymInts."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "Meta"):
        return target
    from torch._decomp import decomposition_table, meta_table
    return meta_table.get(target) or decomposition_table.get(target) or target


def _key(x: Any):
    """A hashable description of an argument structure for memoized inference (Values by their metas)."""
    if isinstance(x, Value):
        return ("%", x.meta)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(i) for i in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _key(v)) for k, v in x.items()))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(symbolic.expr(x)))
    if isinstance(x, float):
        return ("f", x, str(x))
    hash(x)
    return (type(x).__name__, x)


class Builder:
    """Appends nodes to `dest` (a graph's node list by default) with a fixed phase and scope."""

    def __init__(self, graph: Graph, phase: Phase, scope: str = "", dest: list[Node] | None = None):
        self.graph = graph
        self.phase = phase
        self.scope = scope
        self.dest = graph.nodes if dest is None else dest

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        return self.emit(target, args, kwargs, name=None)

    def emit(self, target: Any, args: tuple, kwargs: dict, name: str | None = None,
             metas: list | None = None) -> Any:
        if isinstance(target, registry.OpDef):
            op, target = target, target.targets[0]
        if target in VIEWS and not layout_known(args[0]):
            target = aten.reshape.default     # a predicted layout may not allow the view (module docstring)
        op = registry.lookup(target)
        if metas is None:
            metas = infer_metas(target, args, kwargs)
        hint = name or op.name.split(".")[1]
        outs = [Value(self.graph.fresh_name(hint), m) for m in metas]
        node = Node(op, target, tuple(args), dict(kwargs), outs, self.phase, self.scope)
        for v in outs:
            v.producer = node
        self.dest.append(node)
        if len(outs) == 1 and not _is_multi(target):
            return outs[0]
        return tuple(outs)


def _is_multi(target: Any) -> bool:
    if isinstance(target, OpOverload):
        rets = target._schema.returns
        return len(rets) != 1 or str(rets[0].type).startswith("List")
    return True
