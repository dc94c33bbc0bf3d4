"""FFTs and the complex <-> real ops around them. One block per op.

Gradients of complex values follow PyTorch's convention: for a real loss L and z = x + iy, the gradient
of z is dL/dx + i dL/dy. So an op's VJP is the adjoint (conjugate transpose) of its linear map, a real
input takes the real part of that, and a holomorphic f gets g * conj(f'(z)).

An FFT of normalization mode m (0: none, 1: 1/sqrt(n), 2: 1/n) is scale * F, with F the unnormalized
DFT in one direction; its adjoint is scale * F in the other direction, which is the same ATen call with
`forward` flipped. The one-sided transforms (rfft / irfft) add a truncation (adjoint: zero padding) and
a Hermitian extension (adjoint: the one-sided forward transform with the mirrored bins doubled).
"""
from __future__ import annotations

import math

import torch

from kiln.ops.common import arg, cast, shape
from kiln.ops.registry import Cast, Kind, defop
from kiln.ir.symbolic import hint

aten = torch.ops.aten
V, P, F32 = Kind.VIEW, Kind.POINTWISE, Cast.FP32


def is_complex(v) -> bool:
    """Whether v is a complex Value or Python complex number."""
    if isinstance(v, complex):
        return True
    meta = getattr(v, "meta", None)
    return meta is not None and meta.dtype.is_complex


def conj(b, v):
    """conj(v) for a complex Value or number; v itself for real ones (so real graphs are unchanged)."""
    if isinstance(v, complex):
        return v.conjugate()
    return b(aten.conj_physical.default, v) if is_complex(v) else v


def real_part(b, g, like):
    """A gradient for the input `like`: the real part of g when `like` is real and g complex."""
    return b(aten.real.default, g) if is_complex(g) and not is_complex(like) else g


# ---- complex <-> real views and constructors ------------------------------------------------------
# view_as_real(z): (..., 2) real; gradient = real channel + i * imaginary channel
defop(aten.view_as_real.default, lambda b, n, g: (
    b(aten.complex.default, b(aten.select.int, g, -1, 0), b(aten.select.int, g, -1, 1)),), V)
# view_as_complex(x): x is (..., 2) real; gradient = the (re, im) pairs of g. Complex tensors exist in
# fp32/fp64 (ATen has no bf16 complex, little complex32): under amp their real inputs are taken to fp32
# (a model's own `.float()` before them was a no-op in the fp32 capture, so it is not in the graph)
defop(aten.view_as_complex.default, lambda b, n, g: (
    b(aten.view_as_real.default, b(aten.resolve_conj.default, g)),), V, F32)
defop(aten.complex.default, lambda b, n, g: (b(aten.real.default, g), b(aten.imag.default, g)), P, F32)
# real(z) = x: gradient g + 0i (real(x) of a real x is x itself)
defop(aten.real.default, lambda b, n, g: (cast(b, g, n.args[0].meta.dtype),), V)


def vjp_imag(b, n, g):
    # imag(z) = y: gradient 0 + i g
    return (b(aten.complex.default, b(aten.zeros_like.default, g), g),)


defop(aten.imag.default, vjp_imag, V)
# conjugation and negation: lazily, as bits on a view (_conj, _neg_view), or materialized; the
# gradients are always materialized (a view_as_real of a conjugate view would fail)
defop(aten._conj.default, lambda b, n, g: (conj(b, g),), V)
defop(aten.conj_physical.default, lambda b, n, g: (conj(b, g),), P)
defop(aten._neg_view.default, lambda b, n, g: (b(aten.neg.default, g),), V)
# resolving the bits copies (when set), the value stays the same
defop((aten.resolve_conj.default, aten.resolve_neg.default), lambda b, n, g: (g,), P, name="aten.resolve_conj")


# ---- FFTs --------------------------------------------------------------------------------------
def _mode(norm, inverse: bool) -> int:
    """ATen's normalization enum for the `norm=` string of torch.fft (0 none, 1 1/sqrt(n), 2 1/n)."""
    if norm == "ortho":
        return 1
    if norm == "forward":
        return 0 if inverse else 2
    if norm in (None, "backward"):
        return 2 if inverse else 0
    raise NotImplementedError(f"unknown FFT norm {norm!r}")


def _pad_to(b, g, dim: int, size: int):
    """Zero-pad g at the end of `dim` to `size` (the adjoint of keeping the first entries)."""
    missing = size - shape(g)[dim]
    if missing == 0:
        return g
    return b(aten.constant_pad_nd.default, g, [0, 0] * (len(shape(g)) - 1 - dim) + [0, missing], 0.0)


def _c2c_adjoint(b, g, x, dims, mode, forward: bool):
    """Adjoint of _fft_c2c(., dims, mode, forward), for the input x (real x: the real part)."""
    return real_part(b, b(aten._fft_c2c.default, g, dims, mode, not forward), x)


def _r2c_adjoint(b, g, x, dims, mode, onesided: bool):
    """Adjoint of _fft_r2c(x, dims, mode, onesided): the dropped half of the spectrum gets zeros."""
    if onesided:
        g = _pad_to(b, g, dims[-1], shape(x)[dims[-1]])
    return b(aten.real.default, b(aten._fft_c2c.default, g, dims, mode, False))


def _c2r_adjoint(b, g, dims, mode):
    """Adjoint of _fft_c2r(z, dims, mode, n), g real with size n along dims[-1]: the one-sided forward
    transform, with the bins that stand for two (themselves and their mirror image) doubled."""
    gz = b(aten._fft_r2c.default, g, dims, mode, True)
    d, n = dims[-1], shape(g)[dims[-1]]
    half = shape(gz)[d]
    twice = n - half                                        # bins 1 .. n - half have a mirror image
    if twice <= 0:
        return gz
    parts = [b(aten.slice.Tensor, gz, d, 0, 1),
             b(aten.mul.Tensor, b(aten.slice.Tensor, gz, d, 1, 1 + twice), 2.0)]
    if 1 + twice < half:
        parts.append(b(aten.slice.Tensor, gz, d, 1 + twice, half))
    return b(aten.cat.default, parts, d)


defop(aten._fft_c2c.default, lambda b, n, g: (
    _c2c_adjoint(b, g, n.args[0], list(n.args[1]), n.args[2], n.args[3]), None, None, None), Kind.MATMUL, F32)
defop(aten._fft_r2c.default, lambda b, n, g: (
    _r2c_adjoint(b, g, n.args[0], list(n.args[1]), n.args[2], n.args[3]), None, None, None), Kind.MATMUL, F32)


def vjp_fft_c2r(b, n, g):
    z, dims, mode, _ = n.args
    if shape(z)[dims[-1]] != shape(g)[dims[-1]] // 2 + 1:
        raise NotImplementedError("a one-sided input of another size than last_dim_size // 2 + 1")
    return _c2r_adjoint(b, g, list(dims), mode), None, None, None


defop(aten._fft_c2r.default, vjp_fft_c2r, Kind.MATMUL, F32)


def _fft_args(n, default_dims):
    """(input, dims, sizes, norm) of a torch.fft op node; dims normalized, in the op's order."""
    x = n.args[0]
    ndim = len(shape(x))
    sizes, norm = arg(n, 1, "n" if default_dims == "one" else "s"), arg(n, 3, "norm")
    dims = arg(n, 2, "dim", {"one": -1, "two": [-2, -1]}.get(default_dims))
    if dims is None:
        dims = list(range(ndim)) if sizes is None else list(range(ndim - len(sizes), ndim))
    dims = [d % ndim for d in ([dims] if isinstance(dims, int) else dims)]
    if sizes is not None and not isinstance(sizes, (list, tuple)):
        sizes = [sizes]
    return x, dims, sizes, norm


def _unpadded(x, dims, sizes, last_half: bool = False) -> None:
    """Decline (to the autograd fallback) transforms whose signal sizes pad or trim the input."""
    if sizes is None:
        return
    have = [shape(x)[d] for d in dims]
    want = list(sizes)
    if last_half:
        want[-1] = want[-1] // 2 + 1
    if have != want:
        raise NotImplementedError("an FFT whose signal size pads or trims its input")


def _fft_rule(transform: str, inverse: bool, default_dims: str):
    """The VJP of a torch.fft op: `transform` c2c (fft, ifft, fft2, ...), r2c (rfft...), c2r (irfft...);
    `default_dims` "one" (dim=-1), "two" (dim=(-2, -1)) or "all" (every dim, or the last len(s))."""
    def rule(b, n, g):
        x, dims, sizes, norm = _fft_args(n, default_dims)
        mode = _mode(norm, inverse)
        _unpadded(x, dims, sizes, last_half=transform == "c2r")
        if transform == "c2c":
            gx = _c2c_adjoint(b, g, x, dims, mode, not inverse)
        elif transform == "r2c":
            gx = _r2c_adjoint(b, g, x, dims, mode, True)
        else:
            gx = _c2r_adjoint(b, g, dims, mode)
        return gx, None, None, None
    return rule


def _fft_cost(n) -> float:
    """About 5 n log2 n flops per transformed signal (complex radix-2)."""
    numel = max(max(hint(v.meta.numel) for v in (n.args[0], n.out)), 1)
    return 5.0 * numel * math.log2(max(numel, 2))


# torch.fft ops as captured: (transform, inverse?, default dims); s= / n= only where it neither pads nor trims
defop(aten.fft_fft.default, _fft_rule("c2c", False, "one"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_ifft.default, _fft_rule("c2c", True, "one"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_fft2.default, _fft_rule("c2c", False, "two"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_ifft2.default, _fft_rule("c2c", True, "two"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_fftn.default, _fft_rule("c2c", False, "all"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_ifftn.default, _fft_rule("c2c", True, "all"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_rfft.default, _fft_rule("r2c", False, "one"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_rfft2.default, _fft_rule("r2c", False, "two"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_rfftn.default, _fft_rule("r2c", False, "all"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_irfft.default, _fft_rule("c2r", True, "one"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_irfft2.default, _fft_rule("c2r", True, "two"), Kind.MATMUL, F32, cost=_fft_cost)
defop(aten.fft_irfftn.default, _fft_rule("c2r", True, "all"), Kind.MATMUL, F32, cost=_fft_cost)
