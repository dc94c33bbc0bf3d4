"""User `torch.autograd.Function`s during capture: each call becomes one node whose gradient is its backward.

torch.export (non-strict) runs a Function's `forward` and records the ops inside it, so the Function's
`backward` would be lost and Kiln would differentiate the forward: a straight-through estimator
(round forward, identity backward) would give zero gradient. While export traces, the `forward` of
every Function class is wrapped: called for a `SomeFunction.apply(...)` of the model, it records one
`kiln::autograd_function` op (kiln/ops/functions.py) instead of running the forward's ops, and that
op's VJP rule runs the Function's own backward. The wrap is on `forward` because `apply` is often bound
early (`quantize = STE.apply` at import); `Function.apply` is wrapped too, for classes defined later.

Left to PyTorch: Functions defined in torch's private modules (`torch._library`: the autograd glue of
custom ops, functorch's machinery, nested tensors, `torch.nn.modules._functions`), legacy Functions
(non-static forward), calls while functorch transforms are active, calls from inside a forward
Kiln itself runs, and other threads. `torch.utils.checkpoint`'s reentrant `CheckpointFunction` is
inlined: its backward recomputes the function and differentiates it, which is what Kiln does with the
function's ops, so the function is traced as it is, in the caller's grad mode (when no input requires
grad, eager gives the checkpointed parameters no gradient, and so does Kiln).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.autograd.function import _is_setup_context_defined

from kiln.ops import functions as ops

Function = torch.autograd.Function
_local = threading.local()   # .modules: the module stack of the capture running in this thread (else None)
_lock = threading.Lock()
_active = 0                  # captures running (any thread): the wrappers are installed while > 0
_saved: dict[type, dict] = {}   # class -> {attribute: what its __dict__ held (None: nothing)}


@contextlib.contextmanager
def honour_autograd_functions():
    """While export traces the forward, turn each custom autograd.Function call into one node."""
    global _active
    outer = getattr(_local, "modules", None)
    _local.modules, _local.pending = [], None
    hooks = (torch.nn.modules.module.register_module_forward_pre_hook(_enter),
             torch.nn.modules.module.register_module_forward_hook(_leave))
    with _lock:
        if _active == 0:
            Function.apply = classmethod(_apply)
            for cls in _subclasses(Function):
                _wrap(cls)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                _unwrap_all()
        for h in hooks:
            h.remove()
        _local.modules, _local.names = outer, (None,)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _eligible(cls) -> bool:
    parts = cls.__module__.split(".")
    private = parts[0] == "torch" and any(p.startswith("_") for p in parts)     # torch's own machinery
    return (not private and cls is not torch.utils.checkpoint.CheckpointFunction
            and isinstance(inspect.getattr_static(cls, "forward", None), staticmethod))   # not legacy


def _wrap(cls) -> None:
    """Install the recording forward (and setup_context) on `cls`; undone by `_unwrap_all`."""
    if cls in _saved or not _eligible(cls):
        return
    new_style = _is_setup_context_defined(cls.setup_context)
    saved = _saved[cls] = {}
    for attr, make in (("forward", _recording_forward),) + ((("setup_context", _recording_setup),) if new_style else ()):
        saved[attr] = cls.__dict__.get(attr)
        setattr(cls, attr, staticmethod(make(cls, getattr(cls, attr), new_style)))


def _unwrap_all() -> None:
    Function.apply = ops.ORIGINAL_APPLY
    for cls, saved in _saved.items():
        for attr, old in saved.items():
            if old is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, old)
    _saved.clear()


def _capturing() -> bool:
    return (getattr(_local, "modules", None) is not None and not ops.running_forward()
            and not torch._C._are_functorch_transforms_active())


def _recording_forward(cls, forward, new_style: bool):
    @functools.wraps(forward)                  # Function.apply binds default arguments by this signature
    def recording_forward(*args, **kwargs):
        if not _capturing():
            return forward(*args, **kwargs)
        if new_style:               # setup_context(ctx, ...) comes next and says which inputs need grad
            return _record(cls, args, kwargs, None)
        ctx, args = args[0], args[1:]
        return _record(cls, args, kwargs, _needs_input_grad(ctx))
    return recording_forward


def _recording_setup(cls, setup_context, new_style: bool):
    @functools.wraps(setup_context)
    def recording_setup_context(ctx, inputs, output):
        call = getattr(_local, "pending", None)
        if not _capturing() or call is None or call.cls is not cls:
            return setup_context(ctx, inputs, output)
        _local.pending = None
        call.requires = _per_tensor(call, _needs_input_grad(ctx))
    return recording_setup_context


def _needs_input_grad(ctx) -> tuple:
    """ctx.needs_input_grad as the backward will see it; all False where the call records no graph (grad
    mode off at the call: apply then gives the node no edges, but needs_input_grad still follows
    requires_grad)."""
    return tuple(ctx.needs_input_grad) if ctx.next_functions else (False,) * len(ctx.needs_input_grad)


def _apply(cls, *args, **kwargs):
    if getattr(_local, "modules", None) is not None and not ops.running_forward():
        if cls is torch.utils.checkpoint.CheckpointFunction:
            return _inline_checkpoint(*args)
        with _lock:
            _wrap(cls)               # a class defined after the capture started
    return ops.ORIGINAL_APPLY.__func__(cls, *args, **kwargs)


def _record(cls, args, kwargs, needs_input_grad):
    """One `kiln::autograd_function` call in place of the forward's ops; returns the forward's outputs."""
    leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)))
    slots = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    tensors = [leaves[i] for i in slots]
    call = ops.Call(cls, [None if isinstance(x, torch.Tensor) else x for x in leaves], spec, slots, None, _where())
    call.positional = _positional(args, kwargs)
    if needs_input_grad is None:
        _local.pending = call
    else:
        call.requires = _per_tensor(call, needs_input_grad)
    outs = torch.ops.kiln.autograd_function(tensors, ops.record(call))
    return call.structure(list(outs))


def _positional(args, kwargs) -> list:
    """Per pytree leaf of (args, kwargs): the index of the positional argument it is, or -1 (autograd
    differentiates the tensors that are arguments themselves, not tensors inside them)."""
    marks = ([i if isinstance(a, torch.Tensor) else pytree.tree_map(lambda _: -1, a) for i, a in enumerate(args)],
             pytree.tree_map(lambda _: -1, dict(kwargs)))
    return pytree.tree_leaves(marks)


def _per_tensor(call, needs_input_grad: tuple) -> tuple[bool, ...]:
    pos = [call.positional[i] for i in call.slots]
    return tuple(0 <= p < len(needs_input_grad) and bool(needs_input_grad[p]) for p in pos)


def _inline_checkpoint(run_function, preserve_rng_state, *args):
    """The checkpointed function's own ops, differentiated by Kiln as the reentrant backward would. With no
    input requiring grad, eager records nothing (the function's parameters get no gradient): then the call
    is one opaque node without gradient, like any Function whose inputs need none."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return run_function(*args)
    cls = torch.utils.checkpoint.CheckpointFunction
    return _record(cls, (run_function, preserve_rng_state, *args), {}, (False,) * (len(args) + 2))


# ---- where a call is, for error messages ------------------------------------------------------
def _enter(module, args):
    stack = getattr(_local, "modules", None)
    if stack is not None:
        stack.append(module)


def _leave(module, args, out):     # a forward hook must return None, or it replaces the output
    stack = getattr(_local, "modules", None)
    if stack:
        stack.pop()


def _where() -> str:
    """The path of the innermost running module, relative to the user's model (as export names scopes)."""
    stack = getattr(_local, "modules", None) or []
    if len(stack) < 2:
        return ""
    if getattr(_local, "names", (None,))[0] is not stack[0]:      # once per capture
        _local.names = (stack[0], {id(m): name for name, m in stack[0].named_modules()})
    path = _local.names[1].get(id(stack[-1]), type(stack[-1]).__name__)
    for wrapper in ("_export_root", "model"):            # torch.export's wrapper, then Kiln's LossModule
        path = path.removeprefix(wrapper + ".") if path != wrapper else ""
    return path
