"""Named torch.profiler events around Kiln's own work: its dialect kernels (kiln/dialects/registry.py), its
fused regions (kiln/passes/regions.py) and its step's commit (kiln/transaction.py), so a profiled step shows
them as the ops they are (kiln/bench/split.py counts them by name).

An event costs what it records, not more: torch's C++ event (`torch._C._profiler._RecordFunctionFast`, the one
torch.compile's generated code opens around its kernels) where this torch has it, 0.7 us a pair on the EPYC of
docs/bf16.md against 6.7 us for `torch.profiler.record_function`, which calls two ops through the dispatcher. At
about 300 events a bf16 bench step that was ~2 ms of profiler cost charged to Kiln's own categories and to
none of torch.compile's. Older torch: `record_function`.
"""
from __future__ import annotations

import torch

_FAST = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)


def event(name: str):
    """A context manager recording one profiler event called `name` (while a profiler records)."""
    return _FAST(name) if _FAST is not None else torch.profiler.record_function(name)


# whether a profiler records now: torch's flag itself (called on every kernel call, so no wrapper around it)
recording = torch.autograd._profiler_enabled
