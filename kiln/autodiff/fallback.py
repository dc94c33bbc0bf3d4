"""The visible fallback for ops without a VJP rule: PyTorch's autograd as one opaque node pair.

The forward node runs the op with autograd recording and also returns what its backward needs; the
backward node asks autograd for the inputs' gradients. Because that graph is made by the very forward
call whose outputs the graph uses, the gradient is right even for ops that draw random numbers.
"""
from __future__ import annotations

import logging

import torch

from kiln.ir.graph import TensorMeta, Value, tree_map_values
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


class _Saved:
    """What the backward of a fallback pair needs: the forward's leaf inputs and its differentiable
    outputs, joined by PyTorch's autograd graph of that very call."""

    __slots__ = ("inputs", "outputs")

    def __init__(self, inputs, outputs):
        self.inputs, self.outputs = inputs, outputs


def _as_promised(t, stride):
    """`t` in the layout the graph's meta promised (a kernel may return another one than its meta)."""
    if not isinstance(t, torch.Tensor) or stride is None or tuple(t.stride()) == tuple(stride) or t.numel() <= 1:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def fallback_forward(op, template, differentiable, *diff_inputs, strides=None):
    """Run `op` under PyTorch's autograd on detached copies of the inputs; return (*outputs, saved).
    `differentiable[i]` says whether output i is floating-point or complex (integer outputs, such as
    topk's indices, carry no gradient). Autograd, unlike torch.func.vjp, runs every op's own backward,
    including custom ops and `torch.autograd.Function`s that have no functorch support."""
    leaves = tuple(x.detach().requires_grad_(True) for x in diff_inputs)
    with torch.enable_grad():
        args, kwargs = _fill(template, leaves)
        out = op(*args, **kwargs)
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    saved = _Saved(leaves, [o if d else None for o, d in zip(out, differentiable)])
    strides = strides or (None,) * len(out)
    return (*(_as_promised(o.detach(), st) if isinstance(o, torch.Tensor) else o for o, st in zip(out, strides)),
            saved)


def fallback_backward(saved, *grads):
    """Gradients of the saved inputs, given the gradients of the op's outputs (None: no gradient);
    inputs the outputs do not depend on get zeros."""
    pairs = [(o, g) for o, g in zip(saved.outputs, grads)
             if o is not None and g is not None and o.requires_grad]
    if not pairs:
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in saved.inputs)
    outs, gs = zip(*pairs)
    got = torch.autograd.grad(outs, saved.inputs, gs, allow_unused=True)
    return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g.contiguous()
                 for g, x in zip(got, saved.inputs))


def _no_infer(args, kwargs):  # pragma: no cover - metas are always given explicitly
    raise AssertionError("fallback nodes are built with explicit metas")


FALLBACK_FORWARD = register(OpDef("kiln.fallback_forward", (fallback_forward,), None, Kind.OPAQUE, Cast.FP32,
                                  differentiable=False, infer=_no_infer,
                                  doc="forward of an op without a VJP rule, recorded by PyTorch autograd"))
FALLBACK_BACKWARD = register(OpDef("kiln.fallback_backward", (fallback_backward,), None, Kind.OPAQUE,
                                   Cast.FP32, differentiable=False, infer=_no_infer,
                                   doc="gradients by autograd from what kiln.fallback_forward saved"))


def convert(b, node, requires: set[Value], reason: str, chosen: bool = False):
    """Turn `node` into a fallback forward node in place; return a rule that emits its backward.
    `chosen`: the pair is the intended gradient (a user's torch.autograd.Function runs its own backward),
    not a missing rule: logged at INFO instead of as a warning."""
    diff = [v for v in node.inputs if v in requires]
    index = {v: i for i, v in enumerate(diff)}
    template = tree_map_values(lambda v: _Slot(index[v]) if v in index else v, (node.args, node.kwargs))
    original = node.target
    if chosen:
        log.info("kiln: %s (in %s): one opaque node under PyTorch autograd", reason, node.scope or "<top>")
    else:
        log.warning("kiln: no gradient rule for %s (in %s): %s; using the autograd fallback "
                    "(one opaque node, shown by explain)", node.op.name, node.scope or "<top>", reason)
    closure = Value(b.graph.fresh_name("saved"), None, node)
    node.op, node.target = FALLBACK_FORWARD, fallback_forward
    differentiable = tuple(v.meta is not None and (v.meta.dtype.is_floating_point or v.meta.dtype.is_complex)
                           for v in node.outputs)
    strides = tuple(v.meta.stride if v.meta is not None else None for v in node.outputs)
    node.args, node.kwargs = (original, template, differentiable, *diff), {"strides": strides}
    outputs = list(node.outputs)
    node.outputs = outputs + [closure]

    def emit_backward(b, n, *grads):
        # autograd returns gradients in whatever layout its kernels chose: they are made contiguous, so
        # the layout the graph's metas promise (and later views rely on) is the real one
        metas = [v.meta.contiguous() for v in diff]
        gs = b.emit(FALLBACK_BACKWARD, (closure, *grads[:len(outputs)]), {}, name="fallback_grad", metas=metas)
        return dict(zip(diff, gs))

    return emit_backward
