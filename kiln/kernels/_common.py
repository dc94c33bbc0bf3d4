"""What every kernel module shares: the GPU slot, the accumulation dtype and the autograd glue.

Every kernel is a `torch.library.custom_op` in the `kiln` namespace. Its Python body is the CPU
implementation (ATen calls only, so it also runs on any other device), except where a GPU
implementation has been registered in `GPU_IMPLS` for the op's name: then a CUDA input goes there.
"""
from __future__ import annotations

from typing import Callable

import torch

# name ("rms_norm", "rms_norm_backward", ...) -> a callable with the custom op's exact signature and
# return value. Empty today: CUDA tensors run the ATen implementation, which is correct but unfused.
# A Triton/CUDA kernel plugs in with `GPU_IMPLS["rms_norm"] = my_kernel`; nothing else changes,
# because export, compile and Kiln only ever see the custom op.
GPU_IMPLS: dict[str, Callable] = {}


def gpu_impl(name: str, t: torch.Tensor) -> Callable | None:
    """The registered GPU implementation of op `name` if `t` lives on a CUDA device, else None."""
    return GPU_IMPLS.get(name) if t.is_cuda else None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are accumulated in fp32 for half types and in the input dtype otherwise
    (fp64 stays fp64, so gradcheck in double precision is exact)."""
    return torch.promote_types(dtype, torch.float32)


def empty_like_absent(ref: torch.Tensor) -> torch.Tensor:
    """The value a kernel returns for an output that does not exist in this call (the gradient of a
    weight that was None, the mask of a dropout that did not run): custom ops have fixed schemas,
    and an empty tensor costs nothing."""
    return ref.new_empty((0,))


def rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous (rows, last dim) matrix; copies only when the layout requires it."""
    return t.reshape(-1, t.shape[-1])
