"""The training modes `kiln bench` compares, each as a factory of step functions.

A step function takes the batch as keyword arguments, runs forward, backward
and the optimizer update, and returns the loss (a tensor or a float).  All
modes use AdamW(lr=1e-4, weight_decay=0.01) so they do the same work.

The Kiln modes call the public API that the compiler is growing into::

    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4, weight_decay=0.01))
    loss = step(**batch)

While that API is incomplete they raise :class:`Unavailable`, which the
harness reports as "not available: <reason>" instead of as a failure.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

LR = 1e-4
WEIGHT_DECAY = 0.01

Step = Callable[..., Any]


class Unavailable(Exception):
    """The mode cannot run in this installation (not a bug in the model or the harness)."""


@dataclass(frozen=True)
class Mode:
    name: str
    dtype: str        # the matmul dtype the mode is meant to run at: "fp32" or "bf16"
    description: str
    compiles: bool    # its first step includes compilation, so it says nothing of step time


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("eager", "fp32", "PyTorch eager, fp32, torch.optim.AdamW", False),
    Mode("eager-bf16", "bf16", "PyTorch eager under torch.autocast('cpu', bfloat16)", False),
    Mode("compile", "fp32", "torch.compile(model), eager torch.optim.AdamW", True),
    Mode("compile-bf16", "bf16", "torch.compile(model) under autocast bfloat16", True),
    Mode("kiln", "fp32", "kiln.compile(model, optimizer=kiln.optim.AdamW(...))", True),
    Mode("kiln-bf16", "bf16", "kiln.compile(..., amp='bf16')", True),
)}


def torch_step(model: torch.nn.Module, compiled: bool, low: torch.dtype | None, memory_budget=None,
               lr: float = LR) -> Step:
    """Eager PyTorch, or torch.compile(model), under torch.autocast to `low` (None: fp32), with
    torch.optim.AdamW(lr, WEIGHT_DECAY)."""
    if memory_budget is not None:
        if not compiled:
            raise Unavailable("eager PyTorch has no memory budget")
        if not isinstance(memory_budget, float):
            raise Unavailable("torch.compile's activation_memory_budget is a fraction: give --memory-budget as one")
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = memory_budget
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    # Only the model is compiled: that is how torch.compile is normally used for
    # training, and it keeps the optimizer identical to the eager modes.
    forward = torch.compile(model) if compiled else model

    def autocast():
        return torch.autocast("cpu", dtype=low) if low is not None else contextlib.nullcontext()

    def step(**batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = forward(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _kiln_step(model: torch.nn.Module, bf16: bool, memory_budget=None) -> Step:
    try:
        kiln = importlib.import_module("kiln")
    except Exception as exc:  # a half-written package must not take the harness down
        raise Unavailable(f"import kiln failed: {type(exc).__name__}: {exc}") from exc
    compile_fn = getattr(kiln, "compile", None)
    if compile_fn is None:
        raise Unavailable("kiln.compile is missing")
    try:
        optim = importlib.import_module("kiln.optim")
    except Exception as exc:
        raise Unavailable(f"import kiln.optim failed: {type(exc).__name__}: {exc}") from exc
    adamw = getattr(optim, "AdamW", None)
    if adamw is None:
        raise Unavailable("kiln.optim.AdamW is missing")
    kwargs: dict[str, Any] = {"optimizer": adamw(lr=LR, weight_decay=WEIGHT_DECAY)}
    if bf16:
        kwargs["amp"] = "bf16"
    if memory_budget is not None:
        kwargs["memory_budget"] = memory_budget
    try:
        return compile_fn(model, **kwargs)
    except NotImplementedError as exc:
        raise Unavailable(f"kiln.compile: NotImplementedError: {exc}") from exc
    except TypeError as exc:
        if bf16:  # most likely the amp= keyword is not there yet
            raise Unavailable(f"kiln.compile(amp='bf16'): TypeError: {exc}") from exc
        raise


def make_step(mode: str, model: torch.nn.Module, memory_budget=None) -> Step:
    """Build the step function of ``mode`` around ``model`` (raises Unavailable/ValueError). With
    `memory_budget` (bytes or a fraction): Kiln's memory_budget, torch.compile's activation_memory_budget
    (a fraction); eager has none."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    bf16 = MODES[mode].dtype == "bf16"
    if mode.startswith("kiln"):
        return _kiln_step(model, bf16, memory_budget)
    return torch_step(model, compiled=mode.startswith("compile"), low=torch.bfloat16 if bf16 else None,
                      memory_budget=memory_budget)


def parse_modes(text: str) -> list[str]:
    """Split a comma-separated mode list, rejecting unknown names and duplicates."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("--modes is empty")
    for name in names:
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--modes lists a mode twice: {text!r}")
    return names
