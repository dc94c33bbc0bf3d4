"""Every VJP rule against torch.autograd on PyTorch's own OpInfo sample inputs.

Each OpInfo's samples are run once under a dispatch mode that records the ATen overloads called at
the top level. A sample whose whole call is exactly one call of a registered overload (autograd's
bookkeeping `detach` aside) tests that op and nothing else: its recorded arguments are replayed
through Kiln (hand-built graph, Kiln autodiff, generated code) and through torch.autograd.
"""
from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.ops.registry import all_ops
from tests.ops.helpers import check_vjp, flat_tensors

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install expecttest)")

aten = torch.ops.aten
SAMPLES_PER_OPINFO = 12     # samples drawn from each OpInfo while mapping
MAX_SAMPLES = 8             # samples checked per op in float64
MAX_SAMPLES_FP32 = 3        # ... of which this many are re-checked in float32
FP64 = dict(rtol=1e-7, atol=1e-7)
FP32 = dict(rtol=1e-5, atol=1e-5)


def differentiable_ops():
    """Registered ops with a VJP rule and ATen overload targets."""
    return [op for op in all_ops() if op.vjp is not None and op.differentiable
            and all(isinstance(t, OpOverload) for t in op.targets)]


OP_NAMES = [op.name for op in differentiable_ops()]


class _TopLevelCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not aten.detach.default:          # autograd saving an output, not the op
            self.calls.append((func, args, kwargs, out))
        return out


@functools.cache
def opinfo_samples() -> dict[str, list]:
    """{op name: [(opinfo label, target, args, kwargs), ...]} of single-call float64 samples."""
    from torch.testing._internal.common_methods_invocations import op_db

    by_target = {t: op.name for op in differentiable_ops() for t in op.targets}
    found: dict[str, dict] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in op_db:
            if not info.supports_autograd or torch.float64 not in info.supported_dtypes("cpu"):
                continue
            label = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
            try:
                # sample_inputs_func directly: OpInfo.sample_inputs wraps it in a tracker that walks
                # the interpreter stack for every sample (slow with many modules loaded)
                torch.manual_seed(0)
                samples = info.sample_inputs_func(info, "cpu", torch.float64, True)
                for s in itertools.islice(samples, SAMPLES_PER_OPINFO):
                    mode = _TopLevelCalls()
                    try:
                        with mode:
                            info.op(s.input, *s.args, **s.kwargs)
                    except Exception:
                        continue
                    if len(mode.calls) != 1 or mode.calls[0][0] not in by_target:
                        continue
                    func, args, kwargs, out = mode.calls[0]
                    if not any(t.dtype.is_floating_point for t in flat_tensors(out)):
                        continue        # e.g. a cast to an integer or complex dtype: nothing real to check
                    args, kwargs = _detach((args, kwargs))
                    found.setdefault(by_target[func], {}).setdefault((func, label), []).append(
                        (label, func, args, kwargs))
            except Exception:       # an OpInfo whose sample generator itself fails on this build
                continue
    # round-robin over (overload, OpInfo) so each op's checked samples are as varied as possible
    out = {}
    for name, groups in found.items():
        lists = list(groups.values())
        picked = [s for batch in itertools.zip_longest(*lists) for s in batch if s is not None]
        out[name] = picked[:MAX_SAMPLES]
    return out


def _detach(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    return obj


def _to_fp32(obj):
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.float32) if obj.dtype == torch.float64 else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_fp32(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_fp32(v) for k, v in obj.items()}
    return obj


def _describe(args, kwargs) -> str:
    shapes = [f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (strided)'}" for t in flat_tensors((args, kwargs))]
    return f"tensors {shapes}"


@pytest.mark.parametrize("name", OP_NAMES)
def test_vjp_matches_autograd(name):
    samples = opinfo_samples().get(name)
    if not samples:
        pytest.skip("no OpInfo sample is exactly one call of this op; covered by test_vjp_cases")
    failures = []
    for i, (label, target, args, kwargs) in enumerate(samples):
        runs = [("float64", args, kwargs, FP64)]
        if i < MAX_SAMPLES_FP32:
            runs.append(("float32", *_to_fp32((args, kwargs)), FP32))
        for dtype, a, k, tol in runs:
            try:
                check_vjp(target, a, k, seed=0, **tol, what=f"[{label} sample {i} {dtype}, {_describe(a, k)}]")
            except Exception as e:       # report every failing sample, not just the first
                failures.append(f"{type(e).__name__}: {e}")
    assert not failures, "\n\n".join(failures)


def test_every_rule_is_checked():
    """Each differentiable op is checked against autograd by OpInfo samples or by a hand-written case."""
    from tests.kernels.test_vjp_rules import covered_ops as kernel_ops   # kiln.* fused kernels
    from tests.models.test_wrong_gradients import covered_ops as complex_ops   # FFT and complex ops
    from tests.ops.test_vjp_cases import covered_ops

    # a user's autograd.Function: its rule runs the user's backward (tests/autodiff/test_custom_function.py)
    model_level = {"kiln.autograd_function"}
    missing = sorted(set(OP_NAMES) - set(opinfo_samples()) - covered_ops() - kernel_ops() - complex_ops()
                     - model_level)
    assert not missing, f"VJP rules checked by neither OpInfo samples nor test_vjp_cases: {missing}"
