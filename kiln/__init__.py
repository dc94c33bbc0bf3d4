"""Kiln: compile a PyTorch model's whole training step (forward, backward, optimizer update).

    import kiln
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=3e-4, weight_decay=0.01))
    loss = step(input_ids=batch, labels=batch)
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Callable

from kiln.errors import CaptureError, InputError, KilnError, StepError, UnsupportedError

if TYPE_CHECKING:
    import torch

    from kiln import optim
    from kiln.distributed import DataParallel
    from kiln.runtime.step import CompiledStep

__all__ = ["compile", "explain", "dialects", "optim", "adopt", "DataParallel", "CompiledStep", "KilnError", "CaptureError",
           "UnsupportedError", "InputError", "StepError", "NonFiniteError"]
__version__ = "0.1.0"


def compile(model: "torch.nn.Module", *, optimizer: "optim.Optimizer | torch.optim.Optimizer", loss_fn: Callable | None = None,
            dialects: list[str] | None = None, amp: str | None = None, amp_overrides: dict | None = None,
            max_programs: int = 8, verify: bool = False, tuning: str | None = None,
            nonfinite: str = "raise", dynamic=None, fail_on_max_programs: bool = False,
            memory_budget=None, parallel: "DataParallel | None" = None, accumulate: int = 1,
            max_grad_norm: float | None = None) -> "CompiledStep":
    """Compile `model`'s training step.

    Args:
        model: any nn.Module. Without `loss_fn`, `model(*args, **kwargs)` must return the loss: a scalar
            tensor, a tuple/list led by it, or an object with `.loss` (Hugging Face ModelOutput).
        optimizer: `kiln.optim.AdamW(...)` or `kiln.optim.SGD(...)`, or a `torch.optim.AdamW`, `Adam` or `SGD`
            (with parameter groups; hyper-parameters read from its `param_groups` at every call, so lr
            schedulers work; its `state` tensors are the ones the step updates). The update runs inside
            the step.
        loss_fn: optional `loss_fn(model, *args, **kwargs) -> loss`.
        dialects: kernel providers in preference order (default: all, by priority); `aten` is always
            the fallback. See `kiln.dialects`.
        amp: None (fp32), "bf16", or "fp16" (with dynamic loss scaling). Parameters, gradients given to
            the optimizer and optimizer state stay fp32; ops run in the dtype their cast class says.
        amp_overrides: {op name or module path: "lower" | "fp32" | "follow"}, e.g.
            {"aten._softmax": "lower"} or {"model.layers.0.mlp": "fp32"}; the most specific path wins.
        max_programs: how many programs (one per input structure and shapes; a dynamic program serves many
            shapes) are kept. Beyond it the least recently used one is dropped, with one warning, and new
            programs are compiled for dynamic sizes; `fail_on_max_programs=True` raises `InputError` instead.
        dynamic: which sizes a program may vary. None (default): the first batch compiles for its exact
            sizes; once a batch of the same structure comes with other sizes, one program with every
            dimension dynamic (those the model fixes stay static) serves them all; with `parallel=` the
            first program is already dynamic (ranks see sizes of their own). True: dynamic from the first
            batch. False: one program per distinct shape. A dict names the dynamic dimensions, e.g.
            {"input_ids": {1: "seq"}, "labels": {1: "seq"}} (positional arguments by index); dimensions with
            one name are one size. `step.cache_info()` lists the programs, their symbolic sizes and guards.
        memory_budget: the peak memory a step may take: bytes (an int, or "6GiB", "512MiB") for the whole
            process's heap, so what the process holds besides the step's tensors (torch, the model's
            Python side, other tensors; measured when compiling and after the first step) leaves that much
            less for the step; or a fraction of the step's predicted peak without it (0.5). Kiln recomputes
            activations in the backward instead of keeping them, cheapest first, until the predicted peak
            fits; a budget it cannot meet raises a KilnError naming the smallest peak it can reach.
            `step.memory()` reports the peak, what is live there and what was recomputed (`measure=True`
            checks it against the allocator).
        verify: run the graph verifier after every pass (slower compiles; for debugging).
        tuning: when kernels that are only sometimes faster than ATen's (Inductor regions, oneDNN) are
            compiled and measured on CPU. "online" (default, or $KILN_TUNING): the first step runs at
            once on ATen's kernels while a background process compiles; each candidate is then timed
            against ATen on the step's own calls and kept only if faster. "ahead": all of it before the
            first step, so every step runs the same kernels (reproducible numerics from step one).
            Either way the results are cached per machine: later runs decide at compile time. Each
            step tunes on its own (`step.tuner`); `step.close()` (or `with kiln.compile(...) as step:`)
            stops its background compiler and settles what is still measured on ATen's kernels.
        nonfinite: what a step does when its loss or a gradient is NaN/inf (fp32/bf16; fp16's loss scaler
            skips such steps itself). "raise" (default): a `NonFiniteError` naming the loss or the first
            parameter, with parameters and optimizer state unchanged; "skip": the step is skipped with a
            warning and counted in `step.skipped_steps`; "ignore": no check (the update applies NaNs).
        parallel: `kiln.DataParallel(zero=0|1|2, bucket_mb=25)` to train on several processes (after
            `torch.distributed.init_process_group`): gradients averaged over the ranks by collectives inside
            the step, overlapping the backward; ZeRO-1/2 shard the optimizer state (and the gradients).
        accumulate: gradient accumulation over N micro-batches: each call adds its micro-batch's gradient
            of `loss / N` (as eager's `(loss / N).backward()`) to sums the step keeps, and every N-th call
            also clips (if the optimizer clips) and updates with the summed gradient, then zeroes the sums.
            Every call returns its micro-batch's unscaled loss; `step.accumulated` counts the micro-batches
            summed so far, `step.reset_accumulation()` drops them. A failed call leaves the sums unchanged.
        max_grad_norm: with a torch.optim optimizer, clip the gradients' global norm inside the step, as eager's
            `torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)` before `optimizer.step()` (on
            the summed gradient with `accumulate`). kiln.optim optimizers take it as their own argument.
            `math.inf` measures the norm without clipping. Either way `step.grad_norm` is the norm before
            clipping at the latest update (what `clip_grad_norm_` returns).

    Every step is all or nothing: the update (parameters, optimizer state, step counters, loss scale,
    buffers) is committed at once at the end, so an exception or a signal leaves all of it as it was
    or fully updated. Calls from several threads run one at a time.

    Returns a `CompiledStep`: `loss = step(...)` trains one step; `step.source()`, `step.explain()`,
    `step.state_dict()` / `step.load_state_dict()`.
    """
    from kiln.runtime.step import CompiledStep
    return CompiledStep(model, optimizer, loss_fn=loss_fn, dialects=dialects, max_programs=max_programs,
                        verify=verify, amp=amp, amp_overrides=amp_overrides, tuning=tuning,
                        nonfinite=nonfinite, dynamic=dynamic, fail_on_max_programs=fail_on_max_programs,
                        memory_budget=memory_budget, parallel=parallel, accumulate=accumulate,
                        max_grad_norm=max_grad_norm)


def explain(step: "CompiledStep", file=None, profile: bool = False) -> str:
    """Print (and return) a table of every op of the step's latest program: phase, dialect, output.

    `profile=True` adds each op's measured time and the split between matmul, attention, fused
    regions, casts and the optimizer: the latest batch is replayed 4 times on copies of the
    parameters and optimizer state (the model and the optimizer are not changed)."""
    return step.explain(file=file, profile=profile)


# Imported on first use, so that `import kiln` (and `kiln adopt`, which needs no torch) starts in
# well under a second: torch and the compiler load when one of these is first touched.
_LAZY = {"optim": ("kiln.optim", None), "dialects": ("kiln.dialects.registry", "dialects"),
         "CompiledStep": ("kiln.runtime.step", "CompiledStep"), "NonFiniteError": ("kiln.guards", "NonFiniteError"),
         "adopt": ("kiln.adopt", None), "DataParallel": ("kiln.distributed", "DataParallel")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


class _Kiln(types.ModuleType):
    """`kiln.dialects` is the selection function (`with kiln.dialects("aten"): ...`), as it was when
    this module imported it eagerly; importing the subpackage `kiln.dialects` must not replace it
    (the import system sets a loaded subpackage as its parent's attribute)."""

    def __setattr__(self, name, value):
        if name == "dialects" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Kiln
