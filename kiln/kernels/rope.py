"""Rotary position embedding (Llama's rotate_half convention) for q and k in one kernel.

    out = t * cos + rotate_half(t) * sin,   rotate_half([t1, t2]) = [-t2, t1]   (halves of the last dim)

Eager code builds rotate_half with a `cat` of two slices (a full copy of q and of k) and then three
more full-size temporaries per tensor. Here each half is written by one in-place addcmul into the
output buffer, so the only allocation is the output. The map is linear in q and k, so the backward
needs only cos and sin: nothing of q or k is saved (unless cos/sin themselves require gradients).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch import Tensor

from kiln.kernels import native
from kiln.kernels._common import gpu_impl


def _check(t: Tensor, cos: Tensor, sin: Tensor, name: str) -> None:
    if t.shape[-1] % 2:
        raise ValueError(f"rope: the last dimension of {name} must be even, got {tuple(t.shape)}")
    for table in (cos, sin):
        if not _broadcasts_to(table.shape, t.shape):
            raise ValueError(f"rope: cos/sin {tuple(table.shape)} must broadcast to {name} {tuple(t.shape)} "
                             "(for (batch, seq, dim) tables and (batch, heads, seq, dim) q, pass unsqueeze_dim=1)")


def _broadcasts_to(shape, target) -> bool:
    """Whether `shape` broadcasts to `target` unchanged (`torch.broadcast_shapes`'s rule, without its symbolic-size
    machinery: 40 us a call, four calls a rope)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def _out_dtype(t: Tensor, cos: Tensor, sin: Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """`out_dtype` when given (a cast folded into the kernel: computed in the promoted dtype, rounded once),
    else t's, cos's and sin's promoted dtype."""
    return out_dtype if out_dtype is not None else torch.promote_types(torch.promote_types(t.dtype, cos.dtype),
                                                                        sin.dtype)


def _leading3(t: Tensor, sizes: tuple) -> list[int] | None:
    """t's strides over `sizes` (t's leading dimensions, at most 3), padded in front to 3; None: more than 3."""
    lead = len(sizes)
    if lead > 3:
        return None
    return [0] * (3 - lead) + list(t.stride()[:lead])


def _rotate_native(t: Tensor, cos: Tensor, sin: Tensor, sign: float, out_dtype: Optional[torch.dtype]) -> Tensor | None:
    """native.c's single pass over t's rows (any layout with a dense last dimension), or None."""
    d = t.shape[-1] if t.dim() else 0
    lib = native.usable(t, cos, sin)
    if (lib is None or not 0 < d <= native.ROW_MAX or t.numel() == 0 or cos.dtype != sin.dtype
            or t.stride(-1) != 1 or not native.supports(_out_dtype(t, cos, sin, out_dtype))):
        return None
    c, s = cos.expand(t.shape), sin.expand(t.shape)
    out = torch.empty_like(t, dtype=_out_dtype(t, cos, sin, out_dtype))   # t's layout (the fake gives the same)
    lead = t.shape[:-1]
    strides = [_leading3(x, lead) for x in (t, c, out)]
    if None in strides or c.stride() != s.stride() or c.stride(-1) != 1 or out.stride(-1) != 1:
        return None
    sizes = [1] * (3 - len(lead)) + list(lead)
    # rows in t's memory order (q and k as projections make them are (b, t, h, d) seen as (b, h, t, d): walked
    # head by head, each row 2 cache lines h * d elements past the last, the loop ran several times slower)
    order = sorted(range(3), key=lambda i: -strides[0][i] if sizes[i] > 1 else 0)
    arrays = [(ctypes.c_int64 * 3)(*(v[i] for i in order)) for v in (*strides, sizes)]
    native.check(lib.kiln_rope(t.data_ptr(), native.code(t), arrays[0], c.data_ptr(), s.data_ptr(), native.code(c),
                               arrays[1], out.data_ptr(), native.code(out), arrays[2], arrays[3], d,
                               int(sign < 0), native.threads()), "rope")
    return out


def _rotate(t: Tensor, cos: Tensor, sin: Tensor, sign: float, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """t * cos + sign * rotate_half(t) * sin with rotate_half's halves written in place;
    sign=-1 applies the transpose (the backward). In `out_dtype` when given."""
    done = _rotate_native(t, cos, sin, sign, out_dtype)
    if done is not None:
        return done
    if out_dtype is not None and out_dtype != _out_dtype(t, cos, sin):
        return _rotate(t, cos, sin, sign).to(out_dtype)
    h = t.shape[-1] // 2
    out = torch.empty_like(t, dtype=_out_dtype(t, cos, sin))
    torch.mul(t, cos, out=out)
    # forward: out1 -= t2 * sin1, out2 += t1 * sin2; backward (transpose): g1 += g2 * sin2, g2 -= g1 * sin1
    if sign > 0:
        out[..., :h].addcmul_(t[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(t[..., :h], sin[..., h:])
    else:
        out[..., :h].addcmul_(t[..., h:], sin[..., h:])
        out[..., h:].addcmul_(t[..., :h], sin[..., :h], value=-1)
    return out


@torch.library.custom_op("kiln::rope", mutates_args=())
def rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
            out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(q_rotated, k_rotated); cos and sin broadcast to q and to k; both in `out_dtype` when given."""
    impl = gpu_impl("rope", q)
    if impl is not None:
        qr, kr = impl(q, k, cos, sin)
        return qr.to(_out_dtype(qr, cos, sin, out_dtype)), kr.to(_out_dtype(kr, cos, sin, out_dtype))
    _check(q, cos, sin, "q")
    _check(k, cos, sin, "k")
    return _rotate(q, cos, sin, 1.0, out_dtype), _rotate(k, cos, sin, 1.0, out_dtype)


@rope_op.register_fake
def _(q, k, cos, sin, out_dtype=None):
    _check(q, cos, sin, "q")
    _check(k, cos, sin, "k")
    return (torch.empty_like(q, dtype=_out_dtype(q, cos, sin, out_dtype)),
            torch.empty_like(k, dtype=_out_dtype(k, cos, sin, out_dtype)))


@torch.library.custom_op("kiln::rope_backward", mutates_args=())
def rope_backward_op(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                     out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(grad_q, grad_k): the transpose of the rotation applied to the output gradients (in `out_dtype`)."""
    impl = gpu_impl("rope_backward", grad_q)
    if impl is not None:
        gq, gk = impl(grad_q, grad_k, cos, sin)
        return gq.to(_out_dtype(gq, cos, sin, out_dtype)), gk.to(_out_dtype(gk, cos, sin, out_dtype))
    return _rotate(grad_q, cos, sin, -1.0, out_dtype), _rotate(grad_k, cos, sin, -1.0, out_dtype)


@rope_backward_op.register_fake
def _(grad_q, grad_k, cos, sin, out_dtype=None):
    return (torch.empty_like(grad_q, dtype=_out_dtype(grad_q, cos, sin, out_dtype)),
            torch.empty_like(grad_k, dtype=_out_dtype(grad_k, cos, sin, out_dtype)))


def rotate_half(t: Tensor) -> Tensor:
    """[-t2, t1]: only used for the (rare) gradient of cos/sin, never on the q/k path."""
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


def _setup(ctx, inputs, output):
    q, k, cos, sin = inputs[:4]
    table_grads = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    # q and k are kept only when cos/sin need a gradient (a learned rotation table)
    ctx.save_for_backward(cos, sin, *((q, k) if table_grads else ()))
    ctx.table_grads = table_grads


def _backward(ctx, grad_q, grad_k):
    cos, sin, *qk = ctx.saved_tensors
    gq, gk = torch.ops.kiln.rope_backward(grad_q, grad_k, cos, sin)
    gcos = gsin = None
    if ctx.table_grads:
        q, k = qk
        gcos = (grad_q * q).sum_to_size(cos.shape) + (grad_k * k).sum_to_size(cos.shape)
        gsin = (grad_q * rotate_half(q)).sum_to_size(sin.shape) + (grad_k * rotate_half(k)).sum_to_size(sin.shape)
    return gq, gk, gcos, gsin, None


rope_op.register_autograd(_backward, setup_context=_setup)
