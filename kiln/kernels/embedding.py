"""An embedding's weight gradient added to another gradient of the same weight, in one pass.

A language model whose input embedding and output projection share one matrix (BERT's and GPT-2's tied word
embeddings) gets two gradients for it: the output projection's (the fused loss kernel's, dense) and the
embedding's, which ATen writes as a zeroed vocabulary-sized matrix with the tokens' gradient rows added into it,
before an add of the two reads both again. `embedding_backward_acc` is that sum in one pass (native.c's
`kiln_embedding_backward_acc`): each row the tokens name is summed in token order from zero, as ATen's CPU kernel
sums it, then added to the other gradient's row, so the result is the same bits as the two ATen ops.
kiln/passes/accumulate.py folds `add(embedding_dense_backward(...), t)` into it (`OpDef.accumulating`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels import native

aten = torch.ops.aten


def embedding_backward_acc(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                           scale_grad_by_freq: bool, acc: Tensor) -> tuple[Tensor]:
    """(`aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq) + acc`,) with
    grad and acc first widened to their promoted dtype (a bf16 weight copy's gradient read as the add of its fp32
    cast reads it): the same bits, as a 1-tuple (the compiled step's call convention for Kiln's own ops). One
    native pass for float32/bfloat16 CPU tensors promoting to float32, without `scale_grad_by_freq`; elsewhere
    the ATen ops."""
    dt = torch.promote_types(grad.dtype, acc.dtype)
    dim = grad.shape[-1] if grad.dim() else 0
    lib = native.usable(grad, acc)
    if (lib is None or scale_grad_by_freq or dt != torch.float32 or tuple(acc.shape) != (num_weights, dim)
            or indices.dtype not in (torch.int64, torch.int32) or indices.device.type != "cpu"
            or indices.numel() * dim != grad.numel()):
        e = aten.embedding_dense_backward(grad.to(dt), indices, num_weights, padding_idx, scale_grad_by_freq)
        return (e + acc.to(dt),)
    g, a = grad.contiguous(), acc.contiguous()
    ids = indices.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((num_weights, dim), dtype=torch.float32)
    status = lib.kiln_embedding_backward_acc(g.data_ptr(), native.code(g), ids.data_ptr(), ids.numel(), dim,
                                             num_weights, padding_idx, a.data_ptr(), native.code(a), out.data_ptr(),
                                             native.threads())
    if status == 2:
        bad = ids[(ids < 0) | (ids >= num_weights)][0].item()
        raise IndexError(f"embedding backward: index {bad} is out of range for {num_weights} rows")
    native.check(status, "embedding backward")
    return (out,)
