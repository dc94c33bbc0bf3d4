"""Python branches on tensor values: compiled for the batch at hand, checked on every later batch.

`if labels.max() >= vocab_size: raise ...` (every Hugging Face CTC head), `if is_global_attn:`
(Longformer), `assert torch.all(ids >= 0).item()` (ProphetNet), a distribution's argument validation:
torch.export cannot trace a Python decision on a tensor's value. When plain export fails on one,
capture exports again with real-tensor propagation (`values_decide()`): the example batch's values decide
each such branch, and torch.export records every decision it took that way as a runtime assertion
(`aten._assert_scalar` over the `.item()`s it read).

`decisions(graph)` turns each group of assertions into a `kiln.branch_guard` node: the step's tensors the
decision read and a check that recomputes it from them (with the nodes computed only for it: `.max()`,
comparisons, `.item()`, even a `unique_consecutive` whose size is compared). The step runs it where the forward read them; a batch
that would take another branch raises `BranchChanged` before anything is written, and the step compiles
a variant for that batch (kiln/runtime/step.py). Shapes that depend on values (`x[mask]`) stay refused,
and so do decisions on parameters' values (`parameter_dependent`: real-tensor propagation misreads them).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from kiln.capture.aliasing import from_parameters, schema_of
from kiln.errors import UnsupportedError
from kiln.ir import symbolic

aten = torch.ops.aten

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
    tainted = from_parameters(ep)
    return any(n.op == "call_function" and n.target is _ASSERT and n in tainted for n in ep.graph.nodes)


def guard_only(fx_graph) -> set:
    """FX nodes computed only for the recorded decisions: every user is one of them or an assertion
    (`labels.max() >= n`, `unique_consecutive(...).numel()`, the `.item()`s). The guard recomputes them;
    the training step never does. In-place and random ops are never among them."""
    only: set = set()
    for n in reversed(list(fx_graph.nodes)):
        if n.op != "call_function" or not n.users:
            continue
        s = schema_of(n)
        if s is not None and (s.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags):
            continue
        if all(u in only or (u.op == "call_function" and u.target is _ASSERT) for u in n.users):
            only.add(n)
    return only


class Decision:
    """One recorded decision: `check(*tensors)` recomputes it from the tensors of the training step it
    read (`reads`: inputs, or values the step computes anyway), through the nodes computed only for
    decisions (`steps`, run eagerly: reductions, comparisons, `.item()`, Python scalar ops)."""

    def __init__(self, assertion, only: set, line: str):
        self.reads: list = []
        self.steps: list = []
        self.line = line
        self._cond = assertion.args[0]
        seen: set = set()

        def visit(n):
            if not hasattr(n, "op") or n in seen:
                return
            seen.add(n)
            if n in only:
                for a in n.all_input_nodes:
                    visit(a)
                self.steps.append(n)
                return
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor) or symbolic.unbacked(val):
                raise UnsupportedError(f"a decision on tensor values ({line}) reads {n.op} {n.target}, which the "
                                       "training step also computes and Kiln cannot check at run time; branch on "
                                       "shapes, or use torch.where")
            self.reads.append(n)
        visit(self._cond)

    def check(self, *tensors) -> bool:
        env: dict[Any, Any] = dict(zip(self.reads, tensors))
        for n in self.steps:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
        return bool(env[self._cond]) if self._cond in env else bool(self._cond)

    __call__ = check


def decisions(fx_graph, line_of: Callable[[Any], str]) -> tuple[dict, set, list]:
    """({first assertion node of a group: [Decision, ...]}, FX nodes the guards compute, [errors]).
    Assertions over the same reads form one group (one guard node); the capture skips the nodes computed
    only for decisions and the other assertions of each group. An assertion over something the step
    computes with a shape set by values (`x[mask]` used by the loss) cannot be a guard: its error is
    returned, for the capture to raise unless it refuses that value-dependent shape first."""
    groups: dict[tuple, list] = {}
    first: dict[tuple, Any] = {}
    used: set = set()
    errors: list = []
    only = guard_only(fx_graph)
    for n in fx_graph.nodes:
        if n.op == "call_function" and n.target is _ASSERT:
            used.add(n)
            try:
                d = Decision(n, only, line_of(n))
            except UnsupportedError as e:
                errors.append(e)
                continue
            key = tuple(d.reads)
            groups.setdefault(key, []).append(d)
            first.setdefault(key, n)
            used.update(d.steps)
    return {first[k]: ds for k, ds in groups.items()}, used, errors
