"""The `attention` dialect: attention's forward and backward by measurement, per shape, on CPU.

ATen's CPU flash-attention kernels are one of several ways to compute attention, and which is fastest depends
on the dtype, the shape and the CPU (the Xeon of docs/bf16-history.md, bf16, B8 H8 T256 d64: flash takes 7.6 ms
forward and 16.2 backward, the products below 3.3 and 5.7; at 1024 tokens flash is the fastest). This dialect,
ranked just before `sdpa`, offers measured alternatives; the step's tuner times each against ATen's kernel on
the node's shapes once per machine and keeps it only where it is faster (`kiln.dialects.measure`), in this
order (the first kept wins):
- forward, `math_forward`: the output and its log-sum-exp on matrix products and a native softmax pass
  (kiln/kernels/attention.py), in the flash kernel's layouts;
- backward, `math_backward`: the gradients from the forward's log-sum-exp on matrix products and two native
  row passes (in bf16 on AVX-512 BF16, one native pass on its pair dot products; where Kiln's products run on
  AMX tiles and no causal mask is there to skip, the head-group loop on them: docs/kernels.md);
- backward, `flash_fp32`: the same flash backward on fp32 copies of half-type inputs, gradients rounded once
  (where the first loses: long sequences).
Forward and backward are chosen apart: either forward's output and log-sum-exp feed either backward.
KILN_DIALECTS=-attention (or `dialects=` without it) leaves the flash kernels as they are.
"""
from __future__ import annotations

import torch

from kiln.dialects.registry import dialect, kernel
from kiln.dialects.sdpa import flash_backward
from kiln.dialects.upcast import upcast_kernel
from kiln.kernels.attention import (backward_from_probs, backward_packed, flash_backward_math, flash_forward_math,
                                    forward_keeping_probs)

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

ATTENTION = dialect("attention", priority=11, devices=("cpu",),
                    doc="attention's forward and backward chosen per shape by measurement: on matrix products and "
                        "native row passes (or the flash backward on fp32 copies), where faster than the flash "
                        "kernels here")


def _backward_ok(n) -> bool:
    """No dropout and a 4-d query (the flash backward's contract)."""
    q, p = n.args[1], n.args[6] if len(n.args) > 6 else 0.0
    return q.meta is not None and len(q.meta.shape) == 4 and not p


def _forward_ok(n) -> bool:
    """No dropout and a 4-d query (the flash forward's contract)."""
    q, p = n.args[0], n.args[3] if len(n.args) > 3 else 0.0
    return q.meta is not None and len(q.meta.shape) == 4 and not p


def _half(n) -> bool:
    return _backward_ok(n) and n.args[1].meta.dtype in (torch.bfloat16, torch.float16)


kernel(ATTENTION, BACKWARD, upcast_kernel(flash_backward), checker=_half, name="flash_fp32",
       measured=True)
kernel(ATTENTION, FORWARD, flash_forward_math, checker=_forward_ok, name="math_forward", measured=True)
kernel(ATTENTION, BACKWARD, flash_backward_math, checker=_backward_ok, priority=1, name="math_backward",
       measured=True)
# the pair that keeps the forward's probabilities for the backward (kiln/passes/keep_probs.py places it)
kernel(ATTENTION, forward_keeping_probs, forward_keeping_probs, name="keep_probs")
kernel(ATTENTION, backward_from_probs, backward_from_probs, name="from_probs")
# ... with its gradients written into the joined q/k/v projection's concatenation (kiln/passes/keep_probs.py)
kernel(ATTENTION, backward_packed, backward_packed, name="packed")
