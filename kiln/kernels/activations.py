"""Activation kernels: SwiGLU, the fused gate/up projection + SwiGLU, and Linear + GELU.

Memory is where these win. Eager autograd of `silu(gate) * up` keeps gate, up *and* silu(gate); these
kernels keep only what the backward cannot cheaply recompute (gate and up; the input of the fused
projection plus its one (tokens, 2*intermediate) product), and recompute silu in the backward.
`linear_gelu` keeps only its input: the backward recomputes the pre-activation with one matmul
instead of storing a (tokens, out_features) tensor per layer. Everything is done in place where the
buffer is the kernel's own, because on a CPU a fresh buffer costs page faults, not just bytes.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.kernels import native
from kiln.kernels._common import gpu_impl, rows

aten = torch.ops.aten


# ---- SwiGLU -----------------------------------------------------------------------------------
def _check_pair(gate: Tensor, up: Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")


def _matrix(t: Tensor) -> Tensor | None:
    """t as (rows, cols) with a dense last dimension and one row stride (a view), or None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _swiglu_native(gate: Tensor, up: Tensor, grad: Tensor | None = None, out: tuple = ()):
    """native.c's single pass: the forward (grad None) into a new contiguous tensor, or the backward into
    `out` (grad_gate, grad_up; new ones when not given). None where it does not apply."""
    lib = native.usable(gate, up, grad)
    cols = gate.shape[-1] if gate.dim() else 0
    if lib is None or gate.numel() == 0 or cols == 0:
        return None
    if grad is None:
        out = (torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype)),)
    elif not out:
        out = (torch.empty(gate.shape, dtype=gate.dtype), torch.empty(up.shape, dtype=up.dtype))
    mats = [_matrix(t) for t in (gate, up, *((grad,) if grad is not None else ()), *out)]
    if any(m is None for m in mats):
        return None
    n = mats[0].shape[0]
    args = []
    for m in mats:
        args += [m.data_ptr(), native.code(m), m.stride(0)]
    fn = lib.kiln_swiglu if grad is None else lib.kiln_swiglu_backward
    if grad is not None:                       # the C order: grad, gate, up, grad_gate, grad_up
        args = args[6:9] + args[:6] + args[9:]
    native.check(fn(*args, n, cols, native.threads()), "swiglu")
    return out[0] if grad is None else out


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    done = _swiglu_native(gate, up)
    if done is not None:
        return done
    out = F.silu(gate).contiguous()
    return out.mul_(up) if out.dtype == torch.promote_types(out.dtype, up.dtype) else out * up


@torch.library.custom_op("kiln::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up."""
    impl = gpu_impl("swiglu", gate)
    if impl is not None:
        return impl(gate, up)
    _check_pair(gate, up)
    return _swiglu(gate, up)


@swiglu_op.register_fake
def _(gate, up):
    _check_pair(gate, up)
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("kiln::swiglu_backward", mutates_args=())
def swiglu_backward_op(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_gate, grad_up) of silu(gate) * up; silu(gate) is recomputed, not stored."""
    impl = gpu_impl("swiglu_backward", gate)
    if impl is not None:
        return impl(grad, gate, up)
    done = _swiglu_native(gate, up, grad) if grad.shape == gate.shape else None
    if done is not None:
        return done
    grad_gate = torch.mul(grad, up).to(gate.dtype).contiguous()
    aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
    grad_up = F.silu(gate).to(up.dtype).contiguous()
    grad_up.mul_(grad)
    return grad_gate, grad_up


@swiglu_backward_op.register_fake
def _(grad, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return torch.ops.kiln.swiglu_backward(grad, gate, up)


swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


# ---- gate/up projection + SwiGLU --------------------------------------------------------------
def _check_proj(x: Tensor, gate_weight: Tensor, up_weight: Tensor) -> None:
    if gate_weight.dim() != 2 or gate_weight.shape != up_weight.shape or gate_weight.shape[1] != x.shape[-1]:
        raise ValueError(f"swiglu_linear: x {tuple(x.shape)}, gate_weight {tuple(gate_weight.shape)} and "
                         f"up_weight {tuple(up_weight.shape)} do not fit (weights are (intermediate, hidden))")


@torch.library.custom_op("kiln::swiglu_linear", mutates_args=())
def swiglu_linear_op(x: Tensor, gate_weight: Tensor, up_weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, gate_up): out = silu(x @ gate_weight.T) * (x @ up_weight.T); gate_up is the one
    (..., 2 * intermediate) product [gate | up] the backward needs."""
    impl = gpu_impl("swiglu_linear", x)
    if impl is not None:
        return impl(x, gate_weight, up_weight)
    _check_proj(x, gate_weight, up_weight)
    inter = gate_weight.shape[0]
    # one GEMM over the stacked weights instead of two: the (2I x H) copy is tokens-times cheaper than the product
    gate_up = torch.mm(rows(x), torch.cat([gate_weight, up_weight]).t())
    out = _swiglu(gate_up[:, :inter], gate_up[:, inter:])
    lead = tuple(x.shape[:-1])
    return out.reshape(lead + (inter,)), gate_up.reshape(lead + (2 * inter,))


@swiglu_linear_op.register_fake
def _(x, gate_weight, up_weight):
    _check_proj(x, gate_weight, up_weight)
    lead, inter = tuple(x.shape[:-1]), gate_weight.shape[0]
    dtype = torch.promote_types(x.dtype, gate_weight.dtype)
    return x.new_empty(lead + (inter,), dtype=dtype), x.new_empty(lead + (2 * inter,), dtype=dtype)


@torch.library.custom_op("kiln::swiglu_linear_backward", mutates_args=())
def swiglu_linear_backward_op(grad: Tensor, x: Tensor, gate_weight: Tensor, up_weight: Tensor,
                              gate_up: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_gate_weight, grad_up_weight) of swiglu_linear, from the saved gate_up product."""
    impl = gpu_impl("swiglu_linear_backward", x)
    if impl is not None:
        return impl(grad, x, gate_weight, up_weight, gate_up)
    inter = gate_weight.shape[0]
    gu, g, x2 = rows(gate_up), rows(grad), rows(x)
    gate, up = gu[:, :inter], gu[:, inter:]
    d = torch.empty_like(gu)                           # [d gate | d up], written in place below
    d_gate, d_up = d[:, :inter], d[:, inter:]
    if _swiglu_native(gate, up, g, (d_gate, d_up)) is None:
        torch.mul(g, up, out=d_gate)
        aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        aten.silu.out(gate, out=d_up).mul_(g)
    # two accumulating GEMMs instead of one over re-stacked weights: no (2I x H) copy
    grad_x = torch.mm(d_gate, gate_weight).addmm_(d_up, up_weight).reshape(x.shape)
    grad_gw = torch.mm(d_gate.t(), x2)
    grad_uw = torch.mm(d_up.t(), x2)
    return grad_x, grad_gw, grad_uw


@swiglu_linear_backward_op.register_fake
def _(grad, x, gate_weight, up_weight, gate_up):
    return x.new_empty(x.shape), gate_weight.new_empty(gate_weight.shape), up_weight.new_empty(up_weight.shape)


def _swiglu_linear_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)     # else autograd allocates zeros for gate_up's (absent) gradient
    ctx.save_for_backward(*inputs, output[1])


def _swiglu_linear_backward(ctx, grad, _grad_gate_up):
    return torch.ops.kiln.swiglu_linear_backward(grad, *ctx.saved_tensors)


swiglu_linear_op.register_autograd(_swiglu_linear_backward, setup_context=_swiglu_linear_setup)


# ---- GELU ----------------------------------------------------------------------------------------------
# bf16 GELU by table (native_lut.c): every bf16 value's GELU as ATen computes it (the lookup gives ATen's bits),
# and its derivative in float64 rounded to fp32 once. Built on first use, per approximation, in this process
# (ATen's results depend on the ISA it runs with, which a process does not change).
_LUT_LOCK = threading.Lock()
_LUTS: dict[str, tuple[Tensor, Tensor]] = {}


def _gelu_tables(approximate: str) -> tuple[Tensor, Tensor]:
    """(forward: int32 entries holding ATen's bf16 GELU of each bf16 bit pattern; derivative: fp32 entries)."""
    tables = _LUTS.get(approximate)
    if tables is None:
        with _LUT_LOCK:
            every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            forward = aten.gelu(every, approximate=approximate).view(torch.int16).to(torch.int32) & 0xFFFF
            slope = aten.gelu_backward(torch.ones(1 << 16, dtype=torch.float64), every.double(),
                                       approximate=approximate).float()
            tables = _LUTS.setdefault(approximate, (forward.contiguous(), slope.contiguous()))
    return tables


def _lut(*tensors: Tensor, approximate: str):
    """The native library where GELU by table takes these tensors (dense CPU bfloat16), else None."""
    if approximate not in ("none", "tanh") or any(t.dtype != torch.bfloat16 or not t.is_contiguous()
                                                  for t in tensors):
        return None
    return native.usable(*tensors)


def _gelu_native(*tensors: Tensor, approximate: str):
    """The native library where its GELU loops take these tensors (the tanh approximation; CPU float32 or
    bfloat16, dense), else None."""
    if approximate != "tanh" or any(not t.is_contiguous() for t in tensors):
        return None
    return native.usable(*tensors)


def gelu(x: Tensor, approximate: str = "none", out: Optional[Tensor] = None) -> Tensor:
    """`aten.gelu(x, approximate=)`, into `out` (x itself for in place) if given. bf16 (either form) by table:
    ATen's own result for each value, looked up (native.c `kiln_lut_bf16`; 4M values on the EPYC: 0.6 against
    ATen's 1.1 ms exact, 4.4 tanh). fp32 tanh as one native pass (`kiln_gelu_tanh`: x * sigmoid(2u), the same
    function as 0.5 x (1 + tanh(u)), with one exp and no tanh); fp32 exact: ATen's own."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    lib = _lut(x, out, approximate=approximate)
    if lib is not None:
        native.check(lib.kiln_lut_bf16(x.data_ptr(), out.data_ptr(), _gelu_tables(approximate)[0].data_ptr(),
                                       x.numel(), native.threads()), "GELU")
        return out
    lib = _gelu_native(x, out, approximate=approximate)
    if lib is None:
        return aten.gelu.out(x, approximate=approximate, out=out)
    native.check(lib.kiln_gelu_tanh(x.data_ptr(), native.code(x), out.data_ptr(), native.code(out), x.numel(),
                                    native.threads()), "GELU")
    return out


def gelu_backward(grad: Tensor, x: Tensor, approximate: str = "none", out: Optional[Tensor] = None) -> Tensor:
    """`aten.gelu_backward(grad, x, approximate=)` into `out` (grad or x itself for in place) if given. bf16:
    grad times the derivative by table (`kiln_lut_scale_bf16`, the derivative exact to fp32, the product
    rounded once); fp32 tanh as one native pass (`kiln_gelu_tanh_backward`); else ATen's."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    lib = _lut(grad, x, out, approximate=approximate) if grad.shape == x.shape else None
    if lib is not None:
        native.check(lib.kiln_lut_scale_bf16(grad.data_ptr(), x.data_ptr(), out.data_ptr(),
                                             _gelu_tables(approximate)[1].data_ptr(), x.numel(), native.threads()),
                     "GELU backward")
        return out
    lib = _gelu_native(grad, x, out, approximate=approximate) if grad.shape == x.shape else None
    if lib is None:
        return aten.gelu_backward.grad_input(grad, x, approximate=approximate, grad_input=out)
    native.check(lib.kiln_gelu_tanh_backward(grad.data_ptr(), native.code(grad), x.data_ptr(), native.code(x),
                                             out.data_ptr(), native.code(out), x.numel(), native.threads()),
                 "GELU backward")
    return out


def gelu_backward_sums(grad: Tensor, x: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    """(`aten.gelu_backward(grad, x, approximate=)`, its sum over every dimension but the last, in its dtype): the
    gradient reaching a GELU's input and that of the bias added before it, which Hugging Face's MLPs (BERT's exact
    GELU, GPT-2's tanh) compute as a second pass reading the first's result. One native pass
    (`kiln_gelu_backward_sums`) for dense bfloat16 or float32 tensors of one shape on the CPU: each value rounded
    once, the column sums of the rounded values in fp32; bf16 reads the derivative by table (exact to fp32),
    fp32 computes it (the exact form from one exp per value; ATen's takes two). 2048 x 2048 bf16 on the EPYC:
    see docs/kernels.md. Elsewhere ATen's two ops."""
    lib = native.usable(grad, x)
    if lib is None or approximate not in ("none", "tanh") or grad.shape != x.shape or grad.dtype != x.dtype \
            or x.dim() < 1 or not (grad.is_contiguous() and x.is_contiguous()) or x.shape[-1] > 1 << 20:
        out = aten.gelu_backward(grad, x, approximate=approximate)
        return out, out.sum(tuple(range(out.dim() - 1))) if out.dim() > 1 else out.clone()
    cols = x.shape[-1]
    out = torch.empty_like(x)
    sums = torch.empty(cols, dtype=torch.float32)
    table = _gelu_tables(approximate)[1].data_ptr() if x.dtype == torch.bfloat16 else None
    native.check(lib.kiln_gelu_backward_sums(grad.data_ptr(), native.code(grad), x.data_ptr(), native.code(x),
                                             out.data_ptr(), native.code(out), x.numel() // max(cols, 1), cols,
                                             int(approximate == "tanh"), sums.data_ptr(), table, native.threads()),
                 "GELU backward with sums")
    return out, sums.to(x.dtype)


# ---- Linear + GELU ----------------------------------------------------------------------------
def _check_approximate(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def _pre_activation(x2: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())


@torch.library.custom_op("kiln::linear_gelu", mutates_args=())
def linear_gelu_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], approximate: str) -> Tensor:
    """gelu(x @ weight.T + bias): the activation runs in place on the matmul's output buffer."""
    impl = gpu_impl("linear_gelu", x)
    if impl is not None:
        return impl(x, weight, bias, approximate)
    _check_approximate(approximate)
    z = _pre_activation(rows(x), weight, bias)
    gelu(z, approximate, out=z)
    return z.reshape(tuple(x.shape[:-1]) + (weight.shape[0],))


@linear_gelu_op.register_fake
def _(x, weight, bias, approximate):
    _check_approximate(approximate)
    return x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("kiln::linear_gelu_backward", mutates_args=())
def linear_gelu_backward_op(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                            approximate: str) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias) of linear_gelu; the pre-activation is recomputed (one matmul)
    so the forward stores nothing but its input. grad_bias is empty when bias is None."""
    impl = gpu_impl("linear_gelu_backward", x)
    if impl is not None:
        return impl(grad, x, weight, bias, approximate)
    x2 = rows(x)
    z = _pre_activation(x2, weight, bias)
    gz = gelu_backward(rows(grad).contiguous(), z, approximate, out=z)     # in place over z
    grad_x = torch.mm(gz, weight).reshape(x.shape)
    grad_w = torch.mm(gz.t(), x2)
    grad_b = gz.sum(0) if bias is not None else x.new_empty((0,))
    return grad_x, grad_w, grad_b


@linear_gelu_backward_op.register_fake
def _(grad, x, weight, bias, approximate):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty((0,)))


def _linear_gelu_setup(ctx, inputs, output):
    x, weight, bias, approximate = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.approximate = approximate


def _linear_gelu_backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    gx, gw, gb = torch.ops.kiln.linear_gelu_backward(grad, x, weight, bias, ctx.approximate)
    return gx, gw, gb if bias is not None else None, None


linear_gelu_op.register_autograd(_linear_gelu_backward, setup_context=_linear_gelu_setup)
