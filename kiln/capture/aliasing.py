"""Eager autograd semantics that functionalization loses: in-place updates of a `.detach()`ed tensor.

`y = x.detach(); y += z` (Kosmos-2.5 adds its segment embedding onto detached sinusoidal positions): in
eager, `y` is a new autograd leaf that shares `x`'s storage, and the in-place add gives it `z`'s
history, so `z` gets a gradient. Functionalization (`run_decompositions`) turns the mutation into an
out-of-place add on the base and then *replays the view*, `detach(add(detach(x), z))`: the replayed
detach cuts `z`'s gradient, silently.

`own_mutated_detaches(ep)` runs on the exported graph before decomposition. A detach whose result (or a
view of it) is mutated in place becomes an own copy, `clone(detach(x))`: the mutation then updates that
copy, and nothing is replayed. That is exact whenever nothing reads `x`'s storage after the mutation
(the copy no longer shares it); where something does and the mutation writes a value computed from
parameters, the construct is refused, naming the source line (writing values that need no gradient
into a detached alias is left as it is: functionalization gets those right).
"""
from __future__ import annotations

from typing import Callable

import torch

from kiln.errors import UnsupportedError

aten = torch.ops.aten


def schema_of(n):
    """The ATen schema of an FX call node (None for Python functions and other nodes)."""
    return n.target._schema if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) else None


def _is_view(n) -> bool:
    """A node whose result aliases its first argument without writing it (view, select, detach, ...)."""
    s = schema_of(n)
    if s is None or not s.returns or not s.arguments or not n.args:
        return False
    ret, arg = s.returns[0].alias_info, s.arguments[0].alias_info
    return ret is not None and not ret.is_write and arg is not None and not arg.is_write


def _mutates(n, value) -> bool:
    """Whether node `n` writes `value` in place (its first argument, annotated as written)."""
    s = schema_of(n)
    return (s is not None and bool(s.arguments) and n.args and n.args[0] is value
            and s.arguments[0].alias_info is not None and s.arguments[0].alias_info.is_write)


def _views_of(n) -> set:
    """`n` and every view derived from it, transitively (in-place ops return their argument: included)."""
    out, todo = {n}, [n]
    while todo:
        for u in todo.pop().users:
            if u not in out and (_is_view(u) or _mutates(u, u.args[0])) and u.args[0] in out:
                out.add(u)
                todo.append(u)
    return out


def _root(n):
    while _is_view(n) and hasattr(n.args[0], "users"):
        n = n.args[0]
    return n


def from_parameters(ep) -> set:
    """The FX nodes of `ep` whose values are computed from a parameter (the parameters included)."""
    params = set(ep.graph_signature.inputs_to_parameters)
    reach: set = set()
    for n in ep.graph.nodes:
        if (n.op == "placeholder" and n.name in params) or any(a in reach for a in n.all_input_nodes):
            reach.add(n)
    return reach


def own_mutated_detaches(ep, line_of: Callable[[object], str]) -> bool:
    """Rewrite `detach` nodes whose results are mutated in place into own copies (module doc). Returns
    whether the graph changed."""
    g = ep.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    from_params = None
    changed = False
    for d in [n for n in g.nodes if n.op == "call_function" and n.target is aten.detach.default]:
        family = _views_of(d)
        writes = [u for a in family for u in a.users if _mutates(u, a)]
        if not writes:
            continue
        first = min(order[w] for w in writes)
        base = _root(d.args[0])
        later = [u for a in _views_of(base) - family for u in a.users
                 if u not in family and order.get(u, -1) > first]
        if later:
            from_params = from_params if from_params is not None else from_parameters(ep)
            if any(a in from_params for w in writes for a in w.all_input_nodes if a not in family):
                raise UnsupportedError(
                    f"an in-place update of a `.detach()`ed tensor writes a value that needs gradients, and the "
                    f"original tensor is read afterwards ({line_of(writes[0])}); Kiln cannot give both the "
                    "shared storage and the gradient. Write it out of place: `y = x.detach() + z`")
            continue
        with g.inserting_after(d):
            own = g.call_function(aten.clone.default, (d,))
        own.meta = dict(d.meta)
        d.replace_all_uses_with(own, delete_user_cb=lambda u, own=own: u is not own)
        changed = True
    if changed:
        ep.graph_module.recompile()
    return changed
