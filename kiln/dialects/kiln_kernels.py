"""The `kiln` dialect: Kiln's fused kernel library (`kiln.kernels`, custom ops `torch.ops.kiln.*`).

Each op's kernel is the custom op itself: on CPU its ATen implementation, on CUDA the
implementation registered in `kiln.kernels.GPU_IMPLS` (the ATen one until then). No lowering: a
model opts in by calling `kiln.kernels.*`, and capture keeps those calls as single nodes.
With the dialect disabled (`kiln.dialects("aten")`), the nodes still run the same custom op, as
the generic kernel every OpOverload has, since Kiln cannot take an opaque custom op apart.
"""
from __future__ import annotations

from kiln.dialects.registry import dialect, kernel
from kiln.kernels import OPS

KILN = dialect("kiln", priority=5, devices=("cpu", "cuda"),
               doc="Kiln's fused kernels: norms, SwiGLU, Linear+GELU, RoPE, chunked Linear+cross-entropy")

for _name, _op in OPS.items():
    kernel(KILN, _op, _op, name=_name)
