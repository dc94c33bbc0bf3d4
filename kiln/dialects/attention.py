"""The `attention` dialect: attention's backward by measurement, per shape, on CPU.

ATen's CPU flash-attention backward is one of several ways to compute the same gradients, and which is
fastest depends on the dtype and the shape (the Xeon of docs/bf16.md, bf16, B8 H8 d64: the flash backward
takes 13.7 ms at 128 tokens where it takes 3.7 ms on fp32 copies; at 1024 tokens bf16 flash is the fastest).
This dialect, ranked just before `sdpa`, offers two measured alternatives for the backward node; the step's
tuner times each against ATen's kernel on the node's shapes once per machine and keeps it only where it is
faster (`kiln.dialects.measure`), in this order (the first kept wins):
- `math_backward`: the gradients from the forward's log-sum-exp on matrix products and two native row passes
  (kiln/kernels/attention.py); in the bench models' bf16 steps 13.5-14 ms a layer against flash's 16-18;
- `flash_fp32`: the same flash backward on fp32 copies of half-type inputs, gradients rounded once (where the
  first loses: long sequences).
KILN_DIALECTS=-attention (or `dialects=` without it) leaves the flash backward as it is.
"""
from __future__ import annotations

import torch

from kiln.dialects.registry import dialect, kernel
from kiln.dialects.sdpa import flash_backward
from kiln.dialects.upcast import upcast_kernel
from kiln.kernels.attention import flash_backward_math

aten = torch.ops.aten
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

ATTENTION = dialect("attention", priority=11, devices=("cpu",),
                    doc="attention's backward chosen per shape by measurement: flash on fp32 copies, or from the "
                        "log-sum-exp on matrix products, where faster than the flash backward here")


def _backward_ok(n) -> bool:
    """No dropout and a 4-d query (the flash backward's contract)."""
    q, p = n.args[1], n.args[6] if len(n.args) > 6 else 0.0
    return q.meta is not None and len(q.meta.shape) == 4 and not p


def _half(n) -> bool:
    return _backward_ok(n) and n.args[1].meta.dtype in (torch.bfloat16, torch.float16)


kernel(ATTENTION, BACKWARD, upcast_kernel(flash_backward), checker=_half, name="flash_fp32",
       measured=True)
kernel(ATTENTION, BACKWARD, flash_backward_math, checker=_backward_ok, priority=1, name="math_backward",
       measured=True)
