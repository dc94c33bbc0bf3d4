"""Unfused PyTorch references for kiln.kernels and the comparison harness the kernel tests share.

Every check runs the kernel and the reference on equal inputs (as separate leaves), then compares
outputs and the gradients of every floating input, for the same random output gradients. The
references are plain PyTorch (F.* and tensor ops), never Kiln.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

# fp32 against the fp32 reference: a few ulps of summation-order difference, nothing more
FP32 = dict(rtol=1e-5, atol=1e-5)
# fp64: the formulas themselves must agree (no reduced-precision excuse)
FP64 = dict(rtol=1e-10, atol=1e-10)
# bf16 kernel vs the fp32 reference on the same bf16-rounded inputs: bf16 keeps 8 bits of mantissa
# (relative step 2**-8 = 0.4%), and matmul reductions add up such steps, so a fixed tolerance is either
# loose or flaky. The criterion instead: the kernel's max error is at most twice eager bf16's (the same
# unfused reference run in bf16) plus 1% of the value's scale. A wrong formula is off by O(1).
BF16 = dict(slack=2.0, atol=1e-2)

def rms_norm(x, w, eps=1e-6, residual=None):
    s = x if residual is None else x + residual
    out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w
    return out if residual is None else (out, s)


def rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


def rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate, up):
    return F.silu(gate) * up


def swiglu_linear(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def linear_gelu(x, w, b=None, approximate="none"):
    return F.gelu(F.linear(x, w, b), approximate=approximate)


def linear_cross_entropy(h, w, y, ignore_index=-100, reduction="mean"):
    logits = F.linear(h, w)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))    # HF upcasts half logits
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), y.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)
    return loss.reshape(y.shape) if reduction == "none" else loss


# ---- layouts ----------------------------------------------------------------------------------
def strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dimension with stride 2 (a sliced view)."""
    big = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    big[..., ::2] = t
    return big[..., ::2]


def transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values, first two dimensions stored swapped (a transposed view)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


LAYOUTS = {"contiguous": lambda t: t, "strided": strided, "transposed": transposed}


# ---- the harness ------------------------------------------------------------------------------
def _leaves(inputs, nograd, dtype=None):
    out = []
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach() if dtype is None else t.detach().to(dtype)     # detach keeps the layout
            out.append(t.requires_grad_(i not in nograd))
        else:
            out.append(t)
    return out


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check(fused: Callable, ref: Callable, inputs: Sequence, tol: dict, nograd=(), ref_dtype=None,
          seed: int = 1) -> tuple:
    """Forward outputs and input gradients of `fused(*inputs)` equal `ref(*inputs)` within `tol`.
    With `ref_dtype`, the reference runs on copies upcast to that dtype and `tol` is BF16's criterion,
    judged against the reference run in the inputs' own (low) dtype. Returns the fused outputs."""
    a_in, b_in = _leaves(inputs, nograd), _leaves(inputs, nograd, ref_dtype)
    a, b = _run(fused, a_in, seed), _run(ref, b_in, seed)
    e = _run(ref, _leaves(inputs, nograd), seed) if ref_dtype is not None else None
    assert len(a[0]) == len(b[0]), (len(a[0]), len(b[0]))
    names = [f"output {i}" for i in range(len(a[0]))] + [f"grad of input {i}" for i in range(len(a[1]))]
    for k, (x, y) in enumerate(zip(a[0] + a[1], b[0] + b[1])):
        if y is None:
            assert x is None, f"{names[k]}: unexpected gradient"
            continue
        assert x is not None, f"{names[k]}: missing"
        assert x.shape == y.shape, f"{names[k]}: {tuple(x.shape)} vs {tuple(y.shape)}"
        if e is None:
            torch.testing.assert_close(x.to(y.dtype), y, **tol, msg=lambda m: f"{names[k]}: {m}")
        else:
            eager = (e[0] + e[1])[k]
            err, eager_err = _max_err(x, y), _max_err(eager, y)
            bound = tol["slack"] * eager_err + tol["atol"] * (1 + y.abs().max().item())
            assert err <= bound, f"{names[k]}: bf16 error {err:.4g} > {bound:.4g} (eager bf16: {eager_err:.4g})"
    return a[0]


def _max_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.to(y.dtype) - y).abs().max().item() if y.numel() else 0.0


def _run(fn: Callable, leaves: list, seed: int) -> tuple[list, list]:
    """(outputs, input gradients) for fixed random output gradients drawn from `seed`."""
    outs = _as_tuple(fn(*leaves))
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    diff = [(o, g.to(o.dtype)) for o, g in zip(outs, grads) if o.requires_grad]
    if diff:
        torch.autograd.backward([o for o, _ in diff], [g for _, g in diff])
    in_grads = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            assert x.grad is None or (x.grad.dtype == x.dtype and x.grad.shape == x.shape), "gradient dtype/shape"
            in_grads.append(x.grad)
    return [o.detach() for o in outs], in_grads


def saved_bytes(fn: Callable, inputs: Sequence) -> int:
    """Bytes autograd keeps for the backward beyond the inputs themselves (each storage once)."""
    ins = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in ins:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(seen.values())
