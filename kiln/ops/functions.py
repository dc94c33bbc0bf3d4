"""User `torch.autograd.Function`s as one opaque op whose gradient is the user's own backward.

Capture (`kiln/capture/functions.py`) turns each `SomeFunction.apply(...)` call into one call of the
custom op `kiln::autograd_function(Tensor[] tensors, int key) -> Tensor[]`: `tensors` are every tensor
among the arguments, `key` indexes `CALLS`, which holds what a graph cannot: the Function class, the
non-tensor arguments and where the tensors go back, which inputs required grad in eager, the output
structure. torch.export never looks inside (the op's fake implementation runs the Function's forward on
fake tensors once, with tracing off, and records the outputs).

The VJP rule turns the node into the autograd pair of `kiln/autodiff/fallback.py`: the forward node runs
`SomeFunction.apply` under PyTorch's autograd on leaves for the inputs that required grad in eager, the
backward node asks autograd for their gradients, so the user's `backward` runs (with its `ctx`,
`saved_tensors`, `needs_input_grad`, `mark_non_differentiable`, `None` gradients) and nothing
differentiates the forward. A node whose inputs need no gradient keeps the op, whose real
implementation runs the Function under no_grad.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from kiln.errors import UnsupportedError
from kiln.ops.common import ZERO
from kiln.ops.registry import Cast, Kind, defop

# The unpatched `Function.apply` (capture replaces it for a while; the runs here never go through capture).
ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]

_local = threading.local()          # .depth: how many Function forwards this thread is running for Kiln


def running_forward() -> bool:
    """Whether this thread is inside a Function's forward run by Kiln (capture leaves such calls alone)."""
    return getattr(_local, "depth", 0) > 0


@dataclass(frozen=True)
class _Meta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Meta":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass(eq=False)
class Call:
    """One captured `cls.apply(*args, **kwargs)`. `leaves`/`spec` are pytree's flattening of (args, kwargs)
    with the tensors replaced by None (`slots[i]` is the leaf index of tensor i); `requires[i]`: tensor i
    is a positional argument that required grad in eager (only those get a gradient, as in eager)."""

    cls: type
    leaves: list
    spec: Any
    slots: tuple[int, ...]
    requires: tuple[bool, ...] | None         # None until the call's ctx said (setup_context-style)
    where: str                                   # module path of the call ("" at the top)
    positional: list = field(default_factory=list)   # per leaf: which positional argument it is (-1: none)
    no_gradient: frozenset = frozenset()         # tensors the backward gave None in the capture-time probe
    outputs: list | None = None                  # per output: an int (tensor index) or ("const", value)
    single: bool = True                          # forward returned one value, not a tuple
    in_metas: tuple = ()
    out_metas: tuple = ()
    key: int = field(default=-1)

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def __repr__(self) -> str:                    # how the generated step and explain show it
        return f"{self.cls.__qualname__}.apply"

    def arguments(self, tensors) -> tuple[list, dict]:
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return list(args), kwargs

    def apply(self, tensors):
        """The Function's own apply on these tensors (in the current grad mode)."""
        args, kwargs = self.arguments(tensors)
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return ORIGINAL_APPLY.__func__(self.cls, *args, **kwargs)
        finally:
            _local.depth -= 1

    def __call__(self, tensors) -> list[torch.Tensor]:
        """Run at step time: the tensor outputs, in order (autograd records the call if grad is on)."""
        out = self.apply(tensors)
        if self.outputs is None:                 # run outside export: nothing recorded yet
            self._record(out, tensors)
        outs = self._tensors(out)
        if len(outs) != len(self.out_metas):
            raise self.refuse(f"it returned {len(outs)} tensors at run time but {len(self.out_metas)} when "
                              "captured", "keep the output structure independent of tensor values")
        if any(isinstance(o, FakeTensor) for o in outs):
            raise self.refuse("its forward computed with a tensor of the capture (one a closure or a non-tensor "
                              "argument holds)", "pass every tensor the forward reads as an argument of apply")
        return outs

    def _tensors(self, out) -> list:
        items = (out,) if self.single else tuple(out)
        return [o for o in items if isinstance(o, torch.Tensor)]

    def structure(self, tensor_outputs: list):
        """What `apply` returns during capture, rebuilt around the op's tensor outputs."""
        items = [tensor_outputs[o] if isinstance(o, int) else o[1] for o in self.outputs]
        return items[0] if self.single else tuple(items)

    # ---- capture: the op's fake implementation ------------------------------------------------
    def fake(self, tensors) -> list[torch.Tensor]:
        if self.outputs is None:
            self._probe(tensors)
        elif tuple(_Meta.of(t) for t in tensors) != self.in_metas and not _same_but_device(tensors, self.in_metas):
            return _fresh(self._run_again(tensors))      # e.g. amp changed an input dtype: infer again
        meta_device = next((t.device for t in tensors if t.device.type == "meta"), None)
        return [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=meta_device or m.device)
                for m in self.out_metas]

    def _probe(self, tensors) -> None:
        """Run the forward once on the fake inputs (leaves requiring grad where eager's did) and record the
        output structure and which inputs the backward gives no gradient; refuse what Kiln cannot honour.
        It runs in a thread of its own: there, unlike inside export's dispatch of this op, autograd is on
        and nothing is traced (the fake mode is entered again, so tensors made inside stay fake)."""
        requires = self.requires or tuple(t.requires_grad for t in tensors)
        mode = torch._guards.detect_fake_mode(tensors)

        def probe():
            leaves = [t.detach().requires_grad_(r) for t, r in zip(tensors, requires)]
            with mode or contextlib.nullcontext(), _quiet_shapes(mode):
                try:
                    with torch.enable_grad():
                        inputs = [t.clone() for t in leaves]       # not leaves: an in-place forward shows, not fails
                        versions = [t._version for t in inputs]
                        out = self.apply(inputs)
                except UnsupportedError:
                    raise
                except Exception as e:
                    raise self.refuse(f"its forward could not run on fake tensors ({type(e).__name__}: "
                                      f"{_first_line(e)})", "the forward must depend on tensor shapes only (no "
                                      ".item(), .tolist(), .numpy() or Python branches on tensor values)") from e
                if [t._version for t in inputs] != versions:
                    raise self.refuse("its forward modifies an input in place (mark_dirty)",
                                      "return a new tensor instead of modifying the input")
                self._record(out, tensors)
                self.no_gradient = _probe_backward(out, leaves)
        _in_own_thread(probe)

    def _record(self, out, tensors) -> None:
        single = not isinstance(out, tuple)
        outputs, metas = [], []
        for o in ((out,) if single else out):
            if isinstance(o, torch.Tensor):
                if not all(isinstance(d, int) for d in (*o.shape, *o.stride())):
                    raise self.refuse("the shape of an output depends on tensor values",
                                      "make the output shapes depend on input shapes only")
                outputs.append(len(metas))
                metas.append(_Meta.of(o))
            elif any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(o)):
                raise self.refuse(f"its forward returns tensors inside a {type(o).__name__}",
                                  "return the tensors as a flat tuple")
            else:
                outputs.append(("const", o))
        self.single, self.outputs, self.out_metas = single, outputs, tuple(metas)
        self.in_metas = tuple(_Meta.of(t) for t in tensors)

    def _run_again(self, tensors) -> list[torch.Tensor]:
        with torch.no_grad():
            outs = self._tensors(self.apply(tensors))
        if len(outs) != len(self.out_metas):
            raise self.refuse("its forward returns a different number of tensors for other input dtypes",
                              "keep the output structure fixed")
        return outs

    def refuse(self, problem: str, todo: str) -> UnsupportedError:
        return UnsupportedError(f"torch.autograd.Function {self.name} (in {self.where or '<top>'}): {problem}; "
                                f"Kiln runs a Function's own backward and does not differentiate its forward, so "
                                f"it refuses rather than guess. To fix: {todo}")


def _in_own_thread(fn) -> None:
    """fn() on a fresh thread (fresh dispatch state, grad mode on, no tracing modes), waited for."""
    failure = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            failure.append(e)
    t = threading.Thread(target=run, name="kiln-function-probe")
    t.start()
    t.join()
    if failure:
        raise failure[0]


def _quiet_shapes(mode):
    """A probe's data-dependent values (`.any()`, `.item()` on fake tensors) are its own: they must not
    become pending symbols of export's shape environment."""
    env = getattr(mode, "shape_env", None)
    return env.ignore_fresh_unbacked_symbols() if env is not None else contextlib.nullcontext()


def _probe_backward(out, leaves) -> frozenset:
    """Which inputs the backward gives None (no gradient, as in eager: a parameter whose every path gives
    None is not updated), found by running it once on the fake tensors. A backward that cannot run on
    them (it reads tensor values) tells nothing: every input is taken to have a gradient (zeros if None)."""
    outs = [o for o in ((out,) if not isinstance(out, tuple) else out)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [i for i, t in enumerate(leaves) if t.requires_grad]
    if not outs or not inputs:
        return frozenset()
    try:
        grads = torch.autograd.grad(outs, [leaves[i] for i in inputs], [torch.ones_like(o) for o in outs],
                                    allow_unused=True)
    except Exception:  # noqa: BLE001  (a backward that reads values: nothing learnt)
        return frozenset()
    return frozenset(i for i, g in zip(inputs, grads) if g is None)


def _same_but_device(tensors, metas) -> bool:
    """Shape inference on meta tensors: the same facts as captured except the device."""
    return len(tensors) == len(metas) and all(
        (tuple(t.shape), tuple(t.stride()), t.dtype) == (m.shape, m.stride, m.dtype) for t, m in zip(tensors, metas))


def _fresh(outs) -> list[torch.Tensor]:
    return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device) for o in outs]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


CALLS: dict[int, Call] = {}
_keys = itertools.count()
_lock = threading.Lock()


def record(call: Call) -> int:
    """Keep `call` for the op's implementations and the compiled steps; returns its key."""
    with _lock:
        call.key = next(_keys)
        CALLS[call.key] = call
    return call.key


@torch.library.custom_op("kiln::autograd_function", mutates_args=())
def autograd_function(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """A captured Function call run without gradient (a step where none of its inputs needs one)."""
    with torch.no_grad():
        outs = CALLS[key](tensors)
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return [o.clone() if o.untyped_storage().data_ptr() in storages else o for o in outs]   # ops never alias


@autograd_function.register_fake
def _autograd_function_fake(tensors, key):
    return CALLS[key].fake(tensors)


# ---- the op ----------------------------------------------------------------------------------
def vjp_autograd_function(b, n, *grads):
    """The user's backward through PyTorch's autograd: the fallback pair, run on `Call` (not the op)."""
    from kiln.autodiff import fallback           # the pair lives with the fallback (autodiff)
    tensors, key = n.args[0], n.args[1]
    call = CALLS[key]
    requiring = [(i, v) for i, (v, r) in enumerate(zip(tensors, call.requires or ())) if r and v.is_float]
    wanted = {v for _, v in requiring}                           # leaves: ctx.needs_input_grad as in eager
    given = {v for i, v in requiring if i not in call.no_gradient}
    result = {v: ZERO for v in tensors if v not in given}        # eager gives them no gradient either
    if not given:
        return result
    n.target, n.args, n.kwargs = call, (list(tensors),), {}
    emit = fallback.convert(b, n, wanted, f"torch.autograd.Function {call.name} runs its own backward",
                            chosen=True)
    result.update((v, g) for v, g in emit(b, n, *grads).items() if v in given)
    return result


# OPAQUE: never merged by CSE (a Function may draw random numbers); FP32 under amp, as captured
defop(torch.ops.kiln.autograd_function.default, vjp_autograd_function, Kind.OPAQUE, Cast.FP32,
      doc="a user torch.autograd.Function: its forward and its own backward run under PyTorch's autograd")
