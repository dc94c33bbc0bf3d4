"""The visible fallback for ops without a VJP rule: `torch.func.vjp` as one opaque node pair.

The forward node runs the op under `torch.func.vjp` and also returns the VJP closure; the backward
node applies that closure. Because the closure is made from the very forward call whose outputs the
graph uses, the gradient is right even for ops that draw random numbers.
"""
from __future__ import annotations

import logging

import torch

from kiln.ir.graph import Value, tree_map_values
from kiln.ops.registry import Cast, Kind, OpDef, register

log = logging.getLogger("kiln")


class _Slot:
    """Marks where the i-th differentiable tensor goes back into the op's argument structure."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"_Slot({self.i})"


def _fill(template, tensors):
    if isinstance(template, _Slot):
        return tensors[template.i]
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(t, tensors) for t in template)
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    return template


def fallback_forward(op, template, *diff_inputs):
    """Run `op` on the inputs and return (*outputs, vjp_closure)."""
    def f(*primals):
        args, kwargs = _fill(template, primals)
        out = op(*args, **kwargs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    outs, vjp_fn = torch.func.vjp(f, *diff_inputs)
    return (*outs, vjp_fn)


def fallback_backward(vjp_fn, outputs_like, *grads):
    """Apply the saved closure; outputs without a gradient get zeros."""
    cotangents = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs_like))
    return tuple(vjp_fn(cotangents))


def _no_infer(args, kwargs):  # pragma: no cover - metas are always given explicitly
    raise AssertionError("fallback nodes are built with explicit metas")


FALLBACK_FORWARD = register(OpDef("kiln.fallback_forward", (fallback_forward,), None, Kind.OPAQUE, Cast.FP32,
                                  differentiable=False, infer=_no_infer,
                                  doc="forward of an op without a VJP rule, under torch.func.vjp"))
FALLBACK_BACKWARD = register(OpDef("kiln.fallback_backward", (fallback_backward,), None, Kind.OPAQUE,
                                   Cast.FP32, differentiable=False, infer=_no_infer,
                                   doc="applies the VJP closure saved by kiln.fallback_forward"))


def convert(b, node, requires: set[Value], reason: str):
    """Turn `node` into a fallback forward node in place; return a rule that emits its backward."""
    diff = [v for v in node.inputs if v in requires]
    index = {v: i for i, v in enumerate(diff)}
    template = tree_map_values(lambda v: _Slot(index[v]) if v in index else v, (node.args, node.kwargs))
    original = node.target
    log.warning("kiln: no gradient rule for %s (in %s): %s; using the torch.func.vjp fallback "
                "(one opaque node, shown by explain)", node.op.name, node.scope or "<top>", reason)
    closure = Value(b.graph.fresh_name("vjp_fn"), None, node)
    node.op, node.target = FALLBACK_FORWARD, fallback_forward
    node.args, node.kwargs = (original, template, *diff), {}
    node.outputs = node.outputs + [closure]
    tensor_outputs = node.outputs[:-1]

    def emit_backward(b, n, *grads):
        metas = [v.meta for v in diff]
        gs = b.emit(FALLBACK_BACKWARD, (closure, list(tensor_outputs), *grads[:len(tensor_outputs)]), {},
                    name="fallback_grad", metas=metas)
        return dict(zip(diff, gs))

    return emit_backward
