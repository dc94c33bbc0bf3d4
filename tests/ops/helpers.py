"""Kiln's VJP rules versus torch.autograd, one ATen op call at a time.

`kiln_vjp` builds a Kiln graph by hand around a single op call (floating tensors become trainable
parameters, everything else plain inputs), forms the scalar loss sum_i sum(out_i * cot_i), lets Kiln's
own autodiff differentiate it, and runs the generated code. `torch_vjp` computes the same gradients
with torch.autograd on the same OpOverload. `check_vjp` compares the two.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import pytest
import torch
import torch.utils._pytree as pytree

import kiln.autodiff
from kiln.errors import KilnError
from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Phase, Role, TensorMeta
from kiln.passes.dispatch import dispatch
from kiln.runtime.codegen import generate

aten = torch.ops.aten


def _is_param(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside args/kwargs (lists, tuples and dicts included), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in flat_tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in flat_tensors(x)]
    return []


def _map_tensors(fn, obj: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, fn, obj)


def _as_list(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def float_outputs(outs: Sequence) -> list[int]:
    return [i for i, o in enumerate(outs) if _is_param(o)]


def run_op(target, args, kwargs=None, seed: int | None = None) -> list:
    """The op's outputs as a flat list (under `seed` when given)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return _as_list(target(*args, **(kwargs or {})))


def make_cotangents(target, args, kwargs=None, seed: int | None = None, gen_seed: int = 1234,
                    strided: bool = False) -> list:
    """A random cotangent for every floating output (None for the others). `strided`: laid out
    non-contiguously (transposed, or every other element), so rules see non-contiguous gradients."""
    outs = run_op(target, args, kwargs, seed)
    gen = torch.Generator().manual_seed(gen_seed)

    def cot(o):
        shape = list(o.shape)
        if not strided or not shape:
            return torch.randn(shape, generator=gen, dtype=torch.float64).to(o.dtype)
        if len(shape) == 1:
            return torch.randn(shape[0] * 2, generator=gen, dtype=torch.float64).to(o.dtype)[::2]
        t = torch.randn(shape[:-2] + [shape[-1], shape[-2]], generator=gen, dtype=torch.float64)
        return t.to(o.dtype).transpose(-1, -2)
    return [cot(o) if _is_param(o) else None for o in outs]


def kiln_vjp(target, args, kwargs, cotangents, seed: int | None = None, return_outputs: bool = False,
             frozen: frozenset = frozenset(), info: dict | None = None):
    """Gradients of sum_i sum(out_i * cot_i) w.r.t. every floating tensor in (args, kwargs), computed
    by Kiln's autodiff and generated code. Entries are None where Kiln gives no gradient.
    Tensors whose id() is in `frozen` are plain inputs, not parameters. `info`, when given, gets
    "fallback": whether autodiff used the torch.func.vjp fallback, and "source": the generated code.
    With `return_outputs`, returns (forward outputs, grads)."""
    kwargs = kwargs or {}
    is_param = lambda t: _is_param(t) and id(t) not in frozen  # noqa: E731
    graph = Graph()
    concrete: list[torch.Tensor] = []
    params = []

    def to_value(t: torch.Tensor):
        name = f"p{len(concrete)}" if is_param(t) else f"x{len(concrete)}"
        v = graph.add_input(name, TensorMeta.of(t), Role.PARAM if is_param(t) else Role.INPUT, name)
        concrete.append(t.detach())
        if is_param(t):
            params.append(v)
        return v

    vargs, vkwargs = _map_tensors(to_value, (tuple(args), dict(kwargs)))
    b = Builder(graph, Phase.FORWARD)
    outs = _as_list(b.emit(target, vargs, vkwargs))
    assert len(outs) == len(cotangents), (len(outs), len(cotangents))
    loss = None
    for i, (o, c) in enumerate(zip(outs, cotangents)):
        if c is None or not o.is_float:
            continue
        cv = graph.add_input(f"cot{i}", TensorMeta.of(c), Role.INPUT, f"cot{i}")
        concrete.append(c)
        term = b(aten.sum.default, b(aten.mul.Tensor, o, cv))
        loss = term if loss is None else b(aten.add.Tensor, loss, term)
    assert loss is not None, "the op has no floating output to differentiate"
    graph.outputs = [loss]
    grads = kiln.autodiff.differentiate(graph, loss, params)
    have = [p for p in params if p in grads]
    graph.outputs = [loss] + [grads[p] for p in have] + outs
    dispatch(graph, ("aten",))
    source, fn = generate(graph, "kiln_vjp_step", return_all=True)
    if info is not None:
        info["fallback"] = any(n.op.name.startswith("kiln.fallback") for n in graph.nodes)
        info["source"] = source
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        result = fn(*concrete)
    got = dict(zip(have, result[1:1 + len(have)]))
    out_grads = [got.get(p) for p in params]
    if return_outputs:
        return list(result[1 + len(have):]), out_grads
    return out_grads


def torch_vjp(target, args, kwargs, cotangents, seed: int | None = None, return_outputs: bool = False,
              frozen: frozenset = frozenset(), ref=None):
    """The reference: torch.autograd.grad of the same OpOverload call with the same cotangents
    (or of `ref`, an equivalent call, for the few ops autograd has no formula for)."""
    kwargs = kwargs or {}
    leaves = []

    def leaf(t: torch.Tensor):
        frozen_t = id(t) in frozen
        t = t.detach()
        if _is_param(t) and not frozen_t:
            t = t.requires_grad_()
            leaves.append(t)
        return t

    largs, lkwargs = _map_tensors(leaf, (tuple(args), dict(kwargs)))
    if seed is not None:
        torch.manual_seed(seed)
    with torch.enable_grad():
        outs = _as_list((ref or target)(*largs, **lkwargs))
        pairs = [(o, c) for o, c in zip(outs, cotangents)
                 if c is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
        else:
            grads = [None] * len(leaves)
    if return_outputs:
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], list(grads)
    return list(grads)


def _is_zero(t) -> bool:
    return t is None or not bool(t.ne(0).any())


def check_vjp(target, args, kwargs=None, *, rtol: float, atol: float, seed: int | None = None,
              cotangents=None, outputs: Sequence[int] | None = None, ref=None, strided_cotangents: bool = False,
              fallback: bool = False, what: str = "") -> None:
    """Assert that Kiln's gradients (and forward outputs) match torch.autograd's.
    `outputs`: indices of the outputs that get a cotangent (default: every floating output).
    `ref`: an equivalent callable for torch's side, where autograd has no formula for `target`.
    `strided_cotangents`: non-contiguous cotangents (so the rule gets non-contiguous gradients).
    `fallback`: whether Kiln is expected to take the torch.func.vjp fallback (no rule, or a rule that
    declines these arguments); by default a rule must handle the call itself."""
    kwargs = kwargs or {}
    if cotangents is None:
        cotangents = make_cotangents(target, args, kwargs, seed, strided=strided_cotangents)
    if outputs is not None:
        cotangents = [c if i in outputs else None for i, c in enumerate(cotangents)]
    label = f"{target}{' ' + what if what else ''}"
    frozen = frozenset()
    while True:
        try:
            t_outs, t_grads = torch_vjp(target, args, kwargs, cotangents, seed, return_outputs=True,
                                        frozen=frozen, ref=ref)
            break
        except RuntimeError as e:
            # torch refuses to differentiate some arguments (nll_loss's weight, ...): Kiln must refuse
            # too rather than train with a silently wrong gradient; then check the others without it
            m = re.search(r"not differentiable with respect to argument '(\w+)'", str(e))
            more = _argument_tensors(target, args, kwargs, m.group(1)) if m else frozenset()
            if not more or more <= frozen:
                raise
            frozen |= more
    if frozen:
        with pytest.raises(KilnError):
            kiln_vjp(target, args, kwargs, cotangents, seed)
    info: dict = {}
    k_outs, k_grads = kiln_vjp(target, args, kwargs, cotangents, seed, return_outputs=True, frozen=frozen, info=info)
    assert info["fallback"] == fallback, (f"{label}: expected {'the fallback' if fallback else 'the VJP rule'}, "
                                          f"got {'the fallback' if info['fallback'] else 'the rule'}:\n{info['source']}")
    for i, (ko, to) in enumerate(zip(k_outs, t_outs)):
        if isinstance(to, torch.Tensor):
            torch.testing.assert_close(ko, to, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{label}: forward output {i} differs: {m}")
    assert len(k_grads) == len(t_grads)
    for i, (kg, tg) in enumerate(zip(k_grads, t_grads)):
        if kg is None or tg is None:
            assert _is_zero(kg) and _is_zero(tg), \
                f"{label}: gradient of floating input {i}: kiln {_desc(kg)} vs torch {_desc(tg)}"
            continue
        assert kg.shape == tg.shape, f"{label}: grad {i} shape {tuple(kg.shape)} vs torch {tuple(tg.shape)}"
        assert kg.dtype == tg.dtype, f"{label}: grad {i} dtype {kg.dtype} vs torch {tg.dtype}"
        torch.testing.assert_close(kg, tg, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, i=i: f"{label}: gradient of floating input {i} differs: {m}")


def _argument_tensors(target, args, kwargs, name: str) -> frozenset:
    """ids of the floating tensors passed as schema argument `name`."""
    for i, a in enumerate(target._schema.arguments):
        if a.name == name:
            value = args[i] if i < len(args) else kwargs.get(name)
            return frozenset(id(t) for t in flat_tensors(value) if _is_param(t))
    return frozenset()


def _desc(t) -> str:
    return "None" if t is None else f"tensor{tuple(t.shape)} (max |g| {t.abs().max().item() if t.numel() else 0})"
