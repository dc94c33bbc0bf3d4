"""The op registry is complete, and ops without a VJP rule take the logged torch.func.vjp fallback."""
from __future__ import annotations

import pytest
import torch

from kiln.ops.registry import Cast, Kind, OpDef, all_ops, by_name, lookup
from tests.ops.helpers import check_vjp

aten = torch.ops.aten
FP64 = dict(rtol=1e-7, atol=1e-7)


def _registered_targets() -> set:
    return {t for op in all_ops() for t in op.targets}


@pytest.mark.parametrize("op", all_ops(), ids=lambda op: op.name)
def test_opdef_is_complete(op: OpDef):
    assert isinstance(op.name, str) and op.name
    assert isinstance(op.kind, Kind), f"{op.name}: kind {op.kind!r}"
    assert isinstance(op.cast, Cast), f"{op.name}: cast {op.cast!r}"
    assert callable(op.cost), f"{op.name}: cost {op.cost!r}"
    assert op.targets, f"{op.name}: no targets"
    assert op.vjp is not None or not op.differentiable, \
        f"{op.name}: differentiable but no VJP rule (give one, or register it with differentiable=False)"
    assert op.vjp is None or callable(op.vjp)
    for t in op.targets:
        assert lookup(t) is op, f"{t} resolves to {lookup(t).name}, not {op.name}"
    assert by_name(op.name) is op


def test_op_names_are_unique():
    names = [op.name for op in all_ops()]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"op names registered twice: {dupes}"


# ---- the fallback: ops without a rule still train, visibly ------------------------------------
@pytest.mark.parametrize("target,make", [
    (aten.atan.default, lambda: ((torch.randn(3, 4, dtype=torch.float64),), {})),
    (aten.logit.default, lambda: ((torch.rand(3, 4, dtype=torch.float64) * 0.8 + 0.1,), {})),
    # a multi-output op (two floating outputs, both with a cotangent)
    (aten.var_mean.correction, lambda: ((torch.randn(3, 4, dtype=torch.float64), [1]), dict(correction=1))),
    # broadcasting through the fallback node
    (aten.atan2.default, lambda: ((torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)), {})),
], ids=["atan", "logit", "var_mean", "atan2-bcast"])
def test_unregistered_op_uses_logged_fallback(target, make, kiln_log):
    assert target not in _registered_targets(), f"{target} is registered now; pick another unregistered op"
    args, kwargs = make()
    check_vjp(target, args, kwargs, fallback=True, **FP64)
    name = str(target).rsplit(".default", 1)[0] if str(target).endswith(".default") else str(target)
    assert any("no gradient rule for" in r.getMessage() and name in r.getMessage() and "fallback" in r.getMessage()
               for r in kiln_log.records), [r.getMessage() for r in kiln_log.records]


def test_declined_rule_uses_logged_fallback(kiln_log):
    """A rule that raises NotImplementedError for arguments it does not cover (index_put with a
    boolean mask among several indices) hands the node to the fallback, which says why, and the
    gradient is still right."""
    x, v = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    mask = torch.tensor([True, False, False, True])
    check_vjp(aten.index_put.default, (x, [None, mask], v.view(3, 1)), {}, fallback=True, **FP64)
    msgs = [r.getMessage() for r in kiln_log.records]
    assert any("aten.index_put" in m and "boolean mask among several indices" in m for m in msgs), msgs
