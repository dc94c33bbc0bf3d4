"""Dialect dispatch: choose, for every node, the kernel that will run it.

Pure: a measured kernel (`registry.Impl.measured`, e.g. oneDNN linear) is not timed here. Its node is
recorded in `choices`, and the step's `tuning.Tuner` makes the choice after the passes (`Tuner.realize`:
cached, measured ahead, or a trial during training). Without `choices`, measured kernels are not used."""
from __future__ import annotations

from torch._ops import OpOverload

from kiln.dialects import registry as dialects
from kiln.errors import UnsupportedError
from kiln.ir.graph import Graph, Node
from kiln.passes.regions import Region


def _never(impl, node):
    return None


def dispatch(graph: Graph, names: tuple[str, ...], choices: list[Node] | None = None) -> int:
    generic: dict = {}
    for n in graph.nodes:
        if isinstance(n.target, Region):     # a fused region: its dialect gave it its kernel
            n.impl = n.target.impl
            continue
        impl = dialects.select(n, names, "kernel", choose=None if choices is not None else _never)
        if impl is not None and impl.measured:
            choices.append(n)                # the tuner chooses (and may measure) later
        if impl is None:
            if not isinstance(n.target, OpOverload) and not n.op.name.startswith("kiln.fallback"):
                raise UnsupportedError(f"no enabled dialect implements {n.op.name} (enabled: {list(names)})")
            # every ATen op (and fallback node) is its own aten kernel
            impl = generic.get(n.target) or generic.setdefault(n.target, dialects.aten_kernel(n.target))
        n.impl = impl
    return len(graph.nodes)
