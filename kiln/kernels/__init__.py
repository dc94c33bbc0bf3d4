"""kiln.kernels: fused training kernels as PyTorch custom ops (namespace `kiln`).

Each function here calls one `torch.ops.kiln.<name>` custom op. The ops have fake (meta)
implementations, so `torch.export` and `torch.compile` keep them as single nodes; an autograd
formula whose backward is its own fused op (`kiln::<name>_backward`) that saves only what it needs;
a CPU implementation written with ATen calls; and a GPU slot (`GPU_IMPLS`, empty today). Kiln's
compiler knows each op (`kiln/ops/kernels.py`, `kiln/dialects/kiln_kernels.py`), so a model calling
these functions compiles with the kernels kept fused, forward and backward. See docs/kernels.md.

Only the first output(s) of each op are returned here; the others (statistics, masks) are the
op's saved-for-backward values and are not differentiable.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as _module

from kiln.kernels._common import GPU_IMPLS
from kiln.kernels import activations, cross_entropy, logit_loss, norms, rope as _rope  # noqa: F401  (registers the ops)
from kiln.kernels.ctc import ctc_loss

__all__ = ["rms_norm", "dropout_add_layer_norm", "linear_gelu", "swiglu", "swiglu_linear", "rope",
           "linear_cross_entropy", "cross_entropy", "cross_entropy_of", "ctc_loss", "activation_kind", "linear_act", "linear_gelu_of", "act_mul", "GPU_IMPLS",
           "OPS"]

_k = torch.ops.kiln

# every custom op of the library, forward and backward (the compiler registers each of them)
OPS = {name: getattr(_k, name).default for name in (
    "rms_norm", "add_rms_norm", "rms_norm_backward",
    "dropout_add_layer_norm", "dropout_add_layer_norm_backward", "layer_norm_backward",
    "layer_norm_backward_sums",
    "swiglu", "swiglu_backward", "swiglu_linear", "swiglu_linear_backward",
    "linear_gelu", "linear_gelu_backward",
    "rope", "rope_backward",
    "linear_cross_entropy", "linear_cross_entropy_backward",
    "linear_cross_entropy_grads", "linear_cross_entropy_grads_backward",
    "softmax_cross_entropy", "softmax_cross_entropy_backward",
    "ctc_loss", "ctc_loss_backward")}


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Optional[Tensor] = None):
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    `out = s / sqrt(mean(s**2, -1) + eps) * weight` with `s = x` (or `s = x + residual`), statistics in
    fp32 for half types. Output dtype: `promote(s.dtype, weight.dtype)`.

    Returns:
        `out` if `residual` is None (op `kiln::rms_norm`), else the tuple `(out, s)` where `s = x + residual`
        is the new residual stream (op `kiln::add_rms_norm`). `x` and `residual` must have the same shape.
    """
    if residual is None:
        return _k.rms_norm(x, weight, eps)[0]
    out, s, _ = _k.add_rms_norm(x, residual, weight, eps)
    return out, s


def dropout_add_layer_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                           p: float = 0.0, eps: float = 1e-5, training: bool = True) -> tuple[Tensor, Tensor]:
    """`s = dropout(x, p, training) + residual; out = layer_norm(s, (x.shape[-1],), weight, bias, eps)`.

    Returns the tuple `(out, s)`: the normalized output and the new residual sum. The keep-mask is drawn
    once in the forward from the default generator (`torch.manual_seed` reproduces it; the draws differ
    from `F.dropout`'s: 16 random bits per element, so p is rounded to a multiple of 1/65536 and the
    scale is 1/(1 - rounded p)) and stored as bool; the backward uses that mask.
    `x` and `residual` must have the same shape.
    """
    out, s, _mean, _rstd, _mask = _k.dropout_add_layer_norm(x, residual, weight, bias, float(p), float(eps),
                                                            bool(training))
    return out, s


def linear_gelu(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """`F.gelu(F.linear(x, weight, bias), approximate=approximate)`.

    The activation is applied in place on the matmul's output. The backward recomputes the
    pre-activation (one extra matmul) so nothing but `x` is stored for it.
    """
    return _k.linear_gelu(x, weight, bias, approximate)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up` (same shapes). Stores gate and up for the backward, not silu(gate)."""
    return _k.swiglu(gate, up)


def swiglu_linear(x: Tensor, gate_weight: Tensor, up_weight: Tensor) -> Tensor:
    """`F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight)`: Llama's MLP before `down_proj`.

    Both projections run as one matmul over the stacked weights; weights are (intermediate, hidden),
    no bias. The backward keeps x and the (..., 2 * intermediate) product, not silu(gate).
    """
    return _k.swiglu_linear(x, gate_weight, up_weight)[0]


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: Optional[int] = None
         ) -> tuple[Tensor, Tensor]:
    """Rotary embedding, Llama convention: `t * cos + rotate_half(t) * sin` for t in (q, k).

    `cos` and `sin` must broadcast to q and k; Hugging Face passes (batch, seq, dim) tables with
    (batch, heads, seq, dim) q/k and `unsqueeze_dim=1`, which this accepts the same way. The last
    dimension must be even. Returns `(q_rotated, k_rotated)`.
    """
    if unsqueeze_dim is not None:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _k.rope(q, k, cos, sin)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk_size: Optional[int] = None) -> Tensor:
    """`F.cross_entropy(F.linear(hidden, weight).float().flatten(0, -2), labels.flatten(), ...)`, chunked.

    hidden is (..., H), weight (vocab, H), labels hidden's leading shape. The logits are computed
    `chunk_size` tokens at a time (default: as many as fit 16M logits, at least 128), forward and
    backward, so the (tokens x vocab) logits tensor is never materialized. reduction: "mean" (over non-ignored tokens;
    nan if all are ignored, as PyTorch), "sum" or "none" (labels' shape, 0 at ignored tokens).
    The loss is float32 for half-precision inputs (the softmax statistics always are).
    """
    return _k.linear_cross_entropy(hidden, weight, labels, int(ignore_index), reduction, int(chunk_size or 0))[0]


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """`F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)` for (N, C) logits and
    (N,) int64 class labels, in fewer passes over the logits (op `kiln::softmax_cross_entropy`): the forward reads
    them once and keeps one fp32 log-sum-exp per row (not the log-softmax, a second logits-sized tensor),
    the backward reads them once and writes their gradient. Computed in fp32, returned in the logits' dtype.

    Other inputs (class dimension 1 with more dims, probabilities as targets, other label dtypes) run
    `F.cross_entropy` as given. `kiln adopt` writes this call for a default `nn.CrossEntropyLoss()` /
    `F.cross_entropy` over flattened logits."""
    if logits.dim() != 2 or labels.dim() != 1 or labels.dtype != torch.int64 or not logits.is_floating_point() \
            or labels.shape[0] != logits.shape[0]:
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    return _k.softmax_cross_entropy(logits, labels, int(ignore_index), reduction)[0]


def cross_entropy_of(loss: Callable[[Tensor, Tensor], Tensor], logits: Tensor, labels: Tensor) -> Tensor:
    """`loss(logits, labels)`, as the `cross_entropy` kernel when `loss` is `F.cross_entropy` or a plain
    `nn.CrossEntropyLoss` (no class weights, no label smoothing, no hooks: its `ignore_index` and `reduction`
    are used); anything else (a subclass, another loss) is called as written. The check runs on every call.
    `kiln adopt` writes this call for `loss_fct(logits, labels)` with `loss_fct = nn.CrossEntropyLoss(...)`."""
    if loss is F.cross_entropy:
        return cross_entropy(logits, labels)
    if type(loss) is torch.nn.CrossEntropyLoss and loss.weight is None and loss.label_smoothing == 0.0 \
            and not _observed(loss):
        return cross_entropy(logits, labels, loss.ignore_index, loss.reduction)
    return loss(logits, labels)


# -- activations chosen at run time (config lookups such as transformers' ACT2FN[config.hidden_act]) --

# transformers.activations classes by what they compute (all mathematically equal to the named form;
# FastGELU and NewGELU write the tanh approximation out, so they agree with it to rounding)
_HF_ACTIVATIONS = {"GELUActivation": ("gelu", "none"), "NewGELUActivation": ("gelu", "tanh"),
                   "FastGELUActivation": ("gelu", "tanh"), "GELUTanh": ("gelu", "tanh"),
                   "PytorchGELUTanh": ("gelu", "tanh"), "SiLUActivation": ("silu", None)}


def activation_kind(act) -> tuple[str, Optional[str]] | None:
    """What the activation `act` (a module or function) computes: ("gelu", "none" | "tanh"),
    ("silu", None), or None when it is anything else or cannot be told.

    Recognized: `F.gelu`, `F.silu`, `nn.GELU`, `nn.SiLU` and the GELU/SiLU classes of
    `transformers.activations` (by class, exactly: a subclass may compute something else)."""
    if act is F.gelu:
        return "gelu", "none"
    if act is F.silu:
        return "silu", None
    cls = type(act)
    if cls is torch.nn.GELU:
        return "gelu", act.approximate
    if cls is torch.nn.SiLU:
        return "silu", None
    if cls.__module__ == "transformers.activations":
        return _HF_ACTIVATIONS.get(cls.__name__)
    return None


def linear_act(x: Tensor, linear: torch.nn.Module, act: Callable[[Tensor], Tensor], recompute: bool = False
               ) -> Tensor:
    """`act(linear(x))`, with ATen's one-pass GELU when `act` is a GELU (also transformers'
    `NewGELUActivation` and the other classes that write the formula out in several ops).

    `recompute=False` (the default, for speed): `F.gelu(linear(x), approximate=...)`, through the module;
    the backward keeps the pre-activation, as PyTorch's own GELU does. `recompute=True` (for memory):
    one `linear_gelu` kernel when `linear` is a plain `nn.Linear` (or transformers' `Conv1D`, GPT-2's
    linear layer with a transposed weight) that nothing observes; its backward recomputes the
    pre-activation with one more matmul instead of keeping a (tokens, out_features) tensor per layer.

    The checks run on every call (a guard, not a rewrite-time guess): a config that picks another
    activation runs `act(linear(x))` exactly as written, and a module with hooks, a quantized or
    LoRA-wrapped layer (any other class) is always called as a module. `kiln adopt` writes this call
    for `act(fc(x))`."""
    kind = activation_kind(act)
    if kind is None or kind[0] != "gelu":
        return act(linear(x))
    return linear_gelu_of(x, linear, approximate=kind[1], recompute=recompute)


def linear_gelu_of(x: Tensor, linear: torch.nn.Module, approximate: str = "none", recompute: bool = False
                   ) -> Tensor:
    """`F.gelu(linear(x), approximate=approximate)`. With `recompute=True`, one `linear_gelu` kernel
    (the backward recomputes the matmul; see `linear_act`) when `linear` is a plain `nn.Linear` (or
    transformers' `Conv1D`) without hooks; otherwise, and by default, exactly that call, through the
    module (hooks fire, quantized or LoRA-wrapped layers run their own forward). `kiln adopt` writes
    this call for `F.gelu(fc(x), approximate=...)`, whatever decides `approximate`."""
    weight = _plain_linear_weight(linear) if recompute and approximate in ("none", "tanh") else None
    if weight is not None:
        return linear_gelu(x, weight, linear.bias, approximate=approximate)
    return F.gelu(linear(x), approximate=approximate)


def _plain_linear_weight(m) -> Optional[Tensor]:
    """The (out, in) weight of a layer whose forward is exactly `F.linear(x, weight, bias)` and that
    nothing observes (no forward hooks, its own or global), else None: the caller runs the module."""
    if _observed(m):
        return None
    if type(m) is torch.nn.Linear:
        return m.weight
    if _is_hf_conv1d(m):                # y = x @ weight + bias, weight stored (in, out)
        return m.weight.t()
    return None


def _observed(m: torch.nn.Module) -> bool:
    """Whether a forward hook (the module's own or a global one) would see a call of `m`."""
    return bool(m._forward_hooks or m._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks)


def _is_hf_conv1d(m) -> bool:
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils" \
        and getattr(m, "weight", None) is not None and m.weight.dim() == 2


def act_mul(act: Callable[[Tensor], Tensor], gate: Tensor, up: Tensor) -> Tensor:
    """`act(gate) * up`, as the `swiglu` kernel when `act` is SiLU and the shapes are equal.

    Like `linear_act`, the activation is checked on every call; anything else runs as written."""
    kind = activation_kind(act)
    if kind is not None and kind[0] == "silu" and gate.shape == up.shape:
        return swiglu(gate, up)
    return act(gate) * up
