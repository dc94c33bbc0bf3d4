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


def inner_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.t() (+ bias) as oneDNN's inner product on the CPU, w read as it is (a view or not). oneDNN creates no
    primitive for an empty sum (x's last dimension 0): callers take ATen's op there."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous (rows, last dim) matrix; copies only when the layout requires it."""
    return t.reshape(-1, t.shape[-1])


def direct(op: torch._ops.OpOverload) -> Callable | None:
    """Kiln's custom op `op` (a `kiln::` OpOverload) as a plain call of its Python body, for Kiln's generated
    step, which runs without autograd and needs none of the dispatcher's work; or None where torch keeps more
    than that body for the op (a kernel for one device type, a torch_dispatch rule, a vmap rule).

    Through the dispatcher a call of these ops takes its autograd wrapper, a redispatch, dynamo's disable frame
    and the backend wrapper around the body: about 15 us a call on the EPYC (rms_norm of a tiny input: 43.8
    against 27.6 us), 36 calls a Llama bench step. What the dispatcher checked here is checked the same way: no output may alias
    an input or another output (torch's custom-op rule; the generated step frees and overwrites values by
    that assumption), else RuntimeError naming the op."""
    try:
        from torch._library.custom_ops import OPDEFS
        opdef = OPDEFS[op._schema.name]
        body = opdef._init_fn
        if set(opdef._backend_fns) - {None} or opdef._torch_dispatch_fns or opdef._vmap_fn is not None:
            return None
    except (ImportError, KeyError, AttributeError):     # another torch: the op through the dispatcher
        return None
    name = op._schema.name

    def call(*args, **kwargs):
        out = body(*args, **kwargs)
        _check_fresh(name, out, args, kwargs.values())
        return out

    call.__name__ = call.__qualname__ = getattr(body, "__name__", name.split("::")[-1])
    return call


def _storages(values) -> list[int]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            storage = v.untyped_storage()
            if storage.nbytes():
                found.append(storage.data_ptr())
        elif isinstance(v, (list, tuple)):
            found += _storages(v)
    return found


def _check_fresh(name: str, out, args, kwargs) -> None:
    """Raise where an output of custom op `name` shares memory with an input or with another output."""
    ins = set(_storages(args)) | set(_storages(kwargs))
    outs = _storages(out if isinstance(out, (list, tuple)) else (out,))
    if len(set(outs)) != len(outs) or ins.intersection(outs):
        raise RuntimeError(f"{name}: an output aliases an input or another output; Kiln's custom ops must return "
                           "fresh tensors (a bug in the kernel: please report it)")
