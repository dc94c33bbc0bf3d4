"""Python branches on tensor values: compiled for the batch at hand, checked on every later batch.

`if labels.max() >= vocab_size: raise ...` (every Hugging Face CTC head), `if is_global_attn:`
(Longformer), `assert torch.all(ids >= 0).item()` (ProphetNet), a distribution's argument validation:
torch.export cannot trace a Python decision on a tensor's value. When plain export fails on one,
capture exports again with real-tensor propagation (`values_decide()`): the example batch's values decide
each such branch, and torch.export records every decision it took that way as a runtime assertion
(`aten._assert_scalar` over the `.item()`s it read).

`guards(graph)` turns each assertion into a `kiln.branch_guard` node: the tensors whose values were read
and a check that recomputes the decision from them. The step runs it where the forward read them; a batch
that would take another branch raises `BranchChanged` before anything is written, and the step compiles
a variant for that batch (kiln/runtime/step.py). Shapes that depend on values (`x[mask]`) stay refused,
and so do decisions on parameters' values (`parameter_dependent`: real-tensor propagation misreads them).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from kiln.errors import UnsupportedError

aten = torch.ops.aten

_READS = {aten.item.default, aten._local_scalar_dense.default}     # tensor -> Python scalar
_ASSERT = aten._assert_scalar.default


def data_dependent(e: BaseException) -> bool:
    """Whether export failed on a Python decision (or a size) that depends on a tensor's value."""
    while e is not None:
        text = f"{type(e).__name__}: {e}"
        if "DataDependent" in type(e).__name__ or "data-dependent" in text or "data dependent" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def values_decide():
    """Export with real tensors beside the fake ones: value-dependent decisions take the example's
    values, each recorded as a runtime assertion."""
    import torch._functorch.config as functorch_config
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        yield


def parameter_dependent(ep) -> bool:
    """Whether some recorded decision depends on a parameter's value. Real-tensor propagation does not
    see parameters' values (torch 2.13 decides `if self.weight.sum() > 0` as if they were zero), so such a
    decision cannot be trusted; the capture reports the original failure instead."""
    params = set(ep.graph_signature.inputs_to_parameters)
    tainted = set()
    for n in ep.graph.nodes:
        if (n.op == "placeholder" and n.name in params) or any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
        if n.op == "call_function" and n.target is _ASSERT and n in tainted:
            return True
    return False


class Decision:
    """One recorded decision: `check(*values)` recomputes it from the Python scalars read from
    `reads` (FX nodes of `.item()`), through the FX scalar nodes between them and the assertion."""

    def __init__(self, assertion, line: str):
        self.reads: list = []
        self.steps: list = []
        self.line = line
        self._cond = assertion.args[0]
        seen: set = set()

        def visit(n):
            if not hasattr(n, "op") or n in seen:
                return
            seen.add(n)
            if n.op == "call_function" and n.target in _READS:
                self.reads.append(n)
                return
            if n.op != "call_function" or isinstance(n.meta.get("val"), torch.Tensor):
                raise UnsupportedError(f"a decision on tensor values ({line}) reads {n.op} {n.target}, which Kiln "
                                       "cannot check at run time; branch on shapes, or use torch.where")
            for a in n.all_input_nodes:
                visit(a)
            self.steps.append(n)
        visit(self._cond)

    def check(self, *values) -> bool:
        env: dict[Any, Any] = dict(zip(self.reads, values))
        for n in self.steps:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
        return bool(env[self._cond]) if self._cond in env else bool(self._cond)

    __call__ = check


def decisions(fx_graph, line_of: Callable[[Any], str]) -> tuple[dict, set, list]:
    """({first assertion node of a group: [Decision, ...]}, FX nodes the guards consume, [errors]).
    Assertions over the same `.item()` reads form one group (one guard node, the values read once); the
    capture skips the consumed scalar nodes and the other assertions of each group. An assertion over
    something other than values read by `.item()` (the size of a `x[mask]`) cannot be a guard: its error
    is returned, for the capture to raise unless it refuses that value-dependent shape first."""
    groups: dict[tuple, list] = {}
    first: dict[tuple, Any] = {}
    used: set = set()
    errors: list = []
    for n in fx_graph.nodes:
        if n.op == "call_function" and n.target is _ASSERT:
            used.add(n)
            try:
                d = Decision(n, line_of(n))
            except UnsupportedError as e:
                errors.append(e)
                continue
            key = tuple(d.reads)
            groups.setdefault(key, []).append(d)
            first.setdefault(key, n)
            used.update(d.steps)
            used.update(d.reads)
    return {first[k]: ds for k, ds in groups.items()}, used, errors
