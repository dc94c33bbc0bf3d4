"""Reverse-mode differentiation of the forward graph, one VJP rule per op.

Walks the forward nodes last to first, calls each op's rule with the gradients of its outputs, and
accumulates input gradients. The rules emit ordinary graph nodes (mostly ATen backward kernels), so
the backward is part of the same graph as the forward and every pass sees both.
"""
from __future__ import annotations

import torch

from kiln.autodiff import fallback
from kiln.errors import UnsupportedError
from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Phase, Value, tree_values
from kiln.ops.common import ZERO, cast, sum_to
from kiln.ir.symbolic import same

aten = torch.ops.aten


def requires_grad(graph: Graph, wrt: list[Value]) -> set[Value]:
    """Values whose gradient can be non-zero: floating-point and complex values computed from `wrt` by
    differentiable ops (a complex intermediate, as in FFT mixing or complex RoPE, carries the gradient)."""
    req = set(wrt)
    for n in graph.nodes:
        if n.op.differentiable and any(v in req for v in n.inputs):
            req.update(o for o in n.outputs if o.meta is not None and (o.is_float or o.meta.dtype.is_complex))
    return req


def differentiate(graph: Graph, loss: Value, wrt: list[Value], seed: Value | None = None) -> dict[Value, Value]:
    """Append the backward of `loss` w.r.t. `wrt` to `graph`; return {wrt value: gradient value}.
    `seed` is d(objective)/d(loss): 1 by default, the loss scale under fp16 loss scaling."""
    forward = list(graph.nodes)
    req = requires_grad(graph, wrt)
    if loss not in req:
        raise UnsupportedError("the loss does not depend on any trainable parameter "
                               "(is everything frozen, or is the loss computed without the model?)")
    b = Builder(graph, Phase.BACKWARD, scope="loss")
    if seed is None:
        seed = b(aten.full.default, [], 1.0, dtype=loss.meta.dtype, device=loss.meta.device)
    grads: dict[Value, Value] = {loss: cast(b, seed, loss.meta.dtype)}

    def accumulate(v: Value, g) -> None:
        if g is None or g is ZERO or v not in req:
            return
        if not same(g.meta.shape, v.meta.shape):
            g = sum_to(b, g, v.meta.shape)            # the input was broadcast
        if g.meta.dtype.is_complex and not v.meta.dtype.is_complex:
            g = b(aten.real.default, g)               # a real input of a complex op: the real part
        g = cast(b, g, v.meta.dtype)                  # the op promoted the input's dtype
        grads[v] = g if v not in grads else b(aten.add.Tensor, grads[v], g)

    for n in reversed(forward):
        gs = [grads.get(o) for o in n.outputs]
        if all(g is None for g in gs) or not any(v in req for v in n.inputs):
            continue
        b.scope = n.scope
        rule = n.op.vjp
        reason = "op not in the registry" if rule is None else ""
        if rule is not None:
            try:
                result = rule(b, n, *gs)
            except NotImplementedError as e:       # a rule may decline a case it does not cover
                rule, reason = None, str(e)
        if rule is None:
            result = fallback.convert(b, n, req, reason)(b, n, *gs)
        _collect(n, result, req, accumulate)
    return {v: grads[v] for v in wrt if v in grads}


def _collect(n, result, req, accumulate) -> None:
    """Match a rule's result to the node's inputs and check that no gradient went missing."""
    if isinstance(result, dict):                  # fallback: {input value: gradient}
        pairs = list(result.items())
    else:
        pairs = []
        for a, g in zip(n.args, result):
            if isinstance(a, (list, tuple)) and isinstance(g, (list, tuple)):
                pairs += [(ai, gi) for ai, gi in zip(a, g) if isinstance(ai, Value)]
            elif isinstance(a, Value):
                pairs.append((a, g))
    given = set()
    for v, g in pairs:
        if g is not None:
            given.add(v)
            accumulate(v, g)
    missing = [v for v in tree_values((n.args, n.kwargs)) if v in req and v not in given]
    if missing:
        raise UnsupportedError(f"the gradient rule of {n.op.name} (in {n.scope or '<top>'}) gives no gradient "
                               f"for input(s) {missing}, which need one; refusing to train with a wrong gradient")
