"""Dialect dispatch: choose, for every node, the kernel that will run it."""
from __future__ import annotations

from torch._ops import OpOverload

from kiln.dialects import registry as dialects
from kiln.errors import UnsupportedError
from kiln.ir.graph import Graph
from kiln.passes.regions import Region


def dispatch(graph: Graph, names: tuple[str, ...]) -> int:
    generic: dict = {}
    for n in graph.nodes:
        if isinstance(n.target, Region):     # a fused region: its dialect gave it its kernel
            n.impl = n.target.impl
            continue
        impl = dialects.select(n, names, "kernel")
        if impl is None:
            if not isinstance(n.target, OpOverload) and not n.op.name.startswith("kiln.fallback"):
                raise UnsupportedError(f"no enabled dialect implements {n.op.name} (enabled: {list(names)})")
            # every ATen op (and fallback node) is its own aten kernel
            impl = generic.get(n.target) or generic.setdefault(
                n.target, dialects.Impl(dialects.DIALECTS["aten"], n.target, kernel=n.target))
        n.impl = impl
    return len(graph.nodes)
