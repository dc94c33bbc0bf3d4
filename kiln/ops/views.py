"""Shape ops: views, reshapes, transposes, slicing, splitting and joining. One block per op."""
from __future__ import annotations

import torch

from kiln.ops.common import ZERO, arg, reshape, shape, sum_to
from kiln.ops.registry import Kind, defop

aten = torch.ops.aten
V = Kind.VIEW


def _back_to_input_shape(b, n, g):
    return (reshape(b, g, shape(n.args[0])),)


defop((aten.view.default, aten._unsafe_view.default, aten.reshape.default), _back_to_input_shape, V, shape_arg=1)
defop((aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints),
      _back_to_input_shape, V)
defop(aten.unsqueeze.default, lambda b, n, g: (b(aten.squeeze.dim, g, n.args[1]),), V)
defop(aten.expand.default, lambda b, n, g: (sum_to(b, g, shape(n.args[0])),), V)
defop(aten.transpose.int, lambda b, n, g: (b(aten.transpose.int, g, n.args[1], n.args[2]),), V)
defop(aten.t.default, lambda b, n, g: (b(aten.t.default, g),), V)


def vjp_permute(b, n, g):
    dims = [d % len(n.args[1]) for d in n.args[1]]
    inverse = [dims.index(i) for i in range(len(dims))]
    return (b(aten.permute.default, g, inverse),)


defop(aten.permute.default, vjp_permute, V)
defop(aten.slice.Tensor, lambda b, n, g: (b(aten.slice_backward.default, g, shape(n.args[0]), arg(n, 1, "dim", 0),
                                            arg(n, 2, "start", None) or 0, _end(arg(n, 3, "end", None)),
                                            arg(n, 4, "step", 1)),), V)
defop(aten.select.int, lambda b, n, g: (b(aten.select_backward.default, g, shape(n.args[0]), n.args[1], n.args[2]),), V)
def vjp_narrow(b, n, g):
    x, dim, start, length = n.args
    start = start + shape(x)[dim] if start < 0 else start     # negative start counts from the end
    return (b(aten.slice_backward.default, g, shape(x), dim, start, start + length, 1),)


defop(aten.narrow.default, vjp_narrow, V)


def _end(end):
    return 2 ** 63 - 1 if end is None else end


def vjp_split(b, n, *gs):
    """Gradient of split/unbind: concatenate the pieces' gradients (zeros where a piece is unused)."""
    x, dim = n.args[0], (arg(n, 2, "dim", 0) if n.target is not aten.unbind.int else arg(n, 1, "dim", 0))
    pieces = []
    for g, out in zip(gs, n.outputs):
        if g is None:
            g = b(aten.zeros.default, shape(out), dtype=out.meta.dtype, device=out.meta.device)
        if n.target is aten.unbind.int:
            g = b(aten.unsqueeze.default, g, dim)
        pieces.append(g)
    return (b(aten.cat.default, pieces, dim),)


defop((aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int), vjp_split, V)


def vjp_cat(b, n, g):
    tensors, dim = n.args[0], arg(n, 1, "dim", 0)
    dim = dim % len(shape(n.out))
    grads, start = [], 0
    for t in tensors:
        if shape(t) == [0]:      # torch.cat skips legacy empty 1-D tensors (whatever dim is)
            grads.append(ZERO)
            continue
        size = shape(t)[dim]
        grads.append(b(aten.slice.Tensor, g, dim, start, start + size))
        start += size
    return (grads,)


defop(aten.cat.default, vjp_cat, Kind.INDEX)


def vjp_stack(b, n, g):
    dim = arg(n, 1, "dim", 0)
    return ([b(aten.select.int, g, dim, i) for i in range(len(n.args[0]))],)


defop(aten.stack.default, vjp_stack, Kind.INDEX)


def vjp_constant_pad(b, n, g):
    # padding by p is undone by padding by -p (negative padding crops)
    return (b(aten.constant_pad_nd.default, g, [-p for p in n.args[1]]), None)


defop(aten.constant_pad_nd.default, vjp_constant_pad, Kind.INDEX)


def vjp_repeat(b, n, g):
    x, reps = n.args
    xs = shape(x)
    lead = len(reps) - len(xs)
    xs_full = [1] * lead + xs
    # view each repeated dim as (rep, size) and sum over the rep axis
    split_shape = []
    for r, s in zip(reps, xs_full):
        split_shape += [r, s]
    g = reshape(b, g, split_shape)
    g = b(aten.sum.dim_IntList, g, list(range(0, 2 * len(reps), 2)), False)
    return (reshape(b, g, xs), None)


defop(aten.repeat.default, vjp_repeat, Kind.INDEX)
