"""Hugging Face transformers code that takes another path when traced than in eager, set right for capture.

Kiln's reference is the model's eager forward. transformers checks `is_tracing()` /
`is_torchdynamo_exporting()` to keep Python decisions on tensor values out of traced graphs, and then
takes a path that can compute something else than eager does:

- `maybe_autocast(device, enabled=False)` (MoE routers, upcast attention) returns a null context unless
  autocast is on, so an fp32 capture would not see the block the model wants in fp32 under amp:
  `honour_autocast_off` makes it open `torch.autocast(enabled=False)`, which capture marks full precision
  (kiln/capture/modes.py). In fp32 the block changes no number.
- `create_causal_mask` skips the mask in eager when no token is padded (SDPA then gets no mask and the
  attention module's own `is_causal`), but always builds it when traced. For a model whose attention is
  bidirectional while its mask utility is causal (`config.use_bidirectional_attention`: PaliGemma, Gemma
  embedders), eager attends both ways on an unpadded batch and a traced forward causally: PaliGemma's
  gradients were 24 % off eager's, silently. `eager_mask_decisions` lets those calls decide as eager does,
  on the batch's values: a Python branch on them, which capture guards like any other
  (kiln/capture/branches.py), so a padded batch later compiles its own variant.

Both swap the function in every transformers module that imported it by name, for the capture only.
"""
from __future__ import annotations

import contextlib
import sys

import torch


@contextlib.contextmanager
def _swapped(module_name: str, name: str, make):
    """`module.name` (and every transformers module's reference to it) replaced by `make(original)`."""
    module = sys.modules.get(module_name)
    original = getattr(module, name, None) if module is not None else None
    if original is None:
        yield
        return
    replacement = make(original)
    # read each module's __dict__, not getattr, which would make transformers' lazy modules import
    users = [m for key, m in list(sys.modules.items()) if key.startswith("transformers.") and m is not None
             and getattr(m, "__dict__", {}).get(name) is original]
    for m in users:
        setattr(m, name, replacement)
    try:
        yield
    finally:
        for m in users:
            setattr(m, name, original)


def honour_autocast_off():
    """During capture: Hugging Face's `maybe_autocast(device, enabled=False)` opens `torch.autocast(device,
    enabled=False)` even though autocast is off (where it returns a null context), so export records the
    block the model wants in fp32. In an fp32 capture the block changes no number."""
    def make(original):
        def maybe_autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
            if not enabled and device_type != "meta":
                return torch.autocast(device_type, dtype=dtype, enabled=False, cache_enabled=cache_enabled)
            return original(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return maybe_autocast
    return _swapped("transformers.utils.generic", "maybe_autocast", make)


@contextlib.contextmanager
def eager_mask_decisions():
    """During capture: transformers' causal-mask builders, called for a config with
    `use_bidirectional_attention`, decide as in eager (no tracing seen: the skip reads the mask's values)."""

    def make(original):
        def build(*args, **kwargs):
            config = kwargs.get("config", args[0] if args else None)
            if getattr(config, "use_bidirectional_attention", None) is not True:
                return original(*args, **kwargs)
            masking = sys.modules["transformers.masking_utils"]
            saved = masking.is_tracing, masking.is_torchdynamo_exporting
            masking.is_tracing = masking.is_torchdynamo_exporting = lambda *a, **k: False
            try:
                return original(*args, **kwargs)
            finally:
                masking.is_tracing, masking.is_torchdynamo_exporting = saved
        return build
    with contextlib.ExitStack() as stack:
        for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
            stack.enter_context(_swapped("transformers.masking_utils", name, make))
        yield
