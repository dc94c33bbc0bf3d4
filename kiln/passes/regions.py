"""Region fusion: the elementwise, broadcast and reduction ops left after pattern fusion -> fused regions.

Runs on the whole training graph (forward, backward and optimizer), after pattern fusion and before
dispatch, when a dialect that compiles regions is enabled (`inductor`). The dialect says which nodes
it can compile (`RegionFusion.accepts`); this pass decides how they are grouped, walking the graph
in program order:

- producer/consumer: a node joins the region(s) that produce its inputs (several producer regions
  merge into one);
- siblings: otherwise it joins a region that reads one of the same inputs (two reductions of one
  tensor in a layer-norm backward);
- a view joins only a region that produces its input: a view of a parameter or of a matmul result
  costs nothing alone;
- never across a matmul or any other op the dialect does not take, never across phases, at most
  `max_ops` ops per region.

A fused region is placed where its last op was, so every value it reads is computed before it. A
node may therefore join a region only when no op outside the region between them reads one of the
region's values (an op that needs a value the region computes would otherwise run before the region
produces it): this one rule keeps the graph acyclic and keeps a region from swallowing a path
through a matmul. No op is ever duplicated: a reduction whose result feeds two later regions is an
output of its own region, computed once. Ops with side effects and random ops are never in a region.
Regions with fewer than two ops that compute (views excluded) are left unfused.

The pass only decides the regions (`find_regions`: pure, no compiling, timing or cache); the step's
tuner then has the dialect compile and measure them (`kiln.dialects.tuning`), and `place_regions`
swaps them in. Each region the dialect compiles and finds worth it (or is still measuring, see
`kiln.dialects.measure`) becomes one node whose target is a `Region`: its inputs, outputs, a structural key (equal
for regions with the same ops, constants, shapes, strides and dtypes, so repeated transformer layers
are compiled once), and its reference implementation, the region's ATen ops as generated Python. The
dialect's compiled kernel runs in its place; a region that cannot be compiled keeps its ops, and a
kernel that fails at run time hands over to the reference, with a logged warning.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._pytree import tree_leaves

from kiln import profiling
from kiln.dialects import registry
from kiln.ir import symbolic
from kiln.ir.graph import Fused, Graph, Node, Value
from kiln.ir.symbolic import evaluate, hint
from kiln.ir.printer import Symbols, call_line
from kiln.passes import memory
from kiln.runtime.codegen import define, size_names
from kiln.ops.registry import Cast, Kind, OpDef

log = logging.getLogger("kiln")

# the op of a region node; not in the registry (no ATen target, made after autodiff: never differentiated)
REGION_OP = OpDef("kiln.region", (), None, Kind.OPAQUE, Cast.FOLLOW, differentiable=False,
                  doc="a fused region of elementwise/reduction ops, compiled by a region dialect")


@dataclass(eq=False)
class Region:
    """A group of nodes run as one kernel. Calling it runs the compiled kernel, or the reference."""

    nodes: list[Node]                 # program order
    inputs: list[Value]               # values from outside, in first-use order
    outputs: list[Value]              # values used after the region (or step outputs)
    key: str                          # structural hash
    name: str
    reference: Callable = field(repr=False)
    # symbolic sizes (kiln/ir/symbolic.py) the region's ops and shapes depend on: the region node passes
    # their values first, then the input tensors; every implementation takes them in that order
    sizes: list = field(default_factory=list)           # sympy symbols
    size_args: list = field(default_factory=list)       # a SymInt per symbol (printed as the code's local)
    impl: Any = None                  # registry.Impl of the dialect that runs it
    compiled: Callable | None = field(default=None, repr=False)   # kernel(list_of_inputs) -> outputs
    checked: bool = False
    failed: str | None = None         # why the compiled kernel is not used
    timing: dict | None = None        # the dialect's measurement: {"compiled_ms": .., "aten_ms": ..}
    online: Any = None                # while measured during training: the dialect's shared trial of its key

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(n.op.name for n in self.nodes)

    @property
    def __name__(self) -> str:        # the generated step calls it by this name
        return self.name

    def __call__(self, *args):
        if profiling.recording():                     # a profiled step sees the region as one event
            with profiling.event(f"kiln.region:{self.name}"):
                return self._run(args)
        return self._run(args)

    def _run(self, args):
        if self.online is not None:
            return self.online(self, args)
        if self.compiled is not None and self.failed is None:
            return self.run_kernel(args)
        return self.reference(*args)

    def values(self, args) -> dict:
        """{symbol: its value in this call} (the leading size arguments)."""
        return dict(zip(self.sizes, args))

    def run_kernel(self, args):
        """The compiled kernel's outputs; on any failure, the reference's (and the reference from now on).
        Sizes its compiler's guards exclude (e.g. a vectorization that needs a row under some length) run
        the reference for that call."""
        guard = getattr(self.compiled, "guard", None)     # sizes the kernel was compiled for (its compiler's guards)
        if guard is not None and not guard(args[:len(self.sizes)]):
            return self.reference(*args)
        try:
            outs = self.compiled(list(args))
            if not self.checked:
                self._check(outs, self.values(args))
            return outs
        except Exception as exc:     # a broken kernel costs speed, never the step
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("kiln: fused region %s failed at run time (%s); running its %d ops unfused from now on",
                        self.name, self.failed, len(self.nodes))
        return self.reference(*args)

    def _check(self, outs, values: dict) -> None:
        """The first call: every output must have the shape, dtype and strides the graph expects (later
        ops such as view depend on strides), symbolic ones at this call's sizes."""
        if len(outs) != len(self.outputs):
            raise RuntimeError(f"compiled kernel returned {len(outs)} outputs, expected {len(self.outputs)}")
        for t, v in zip(outs, self.outputs):
            m = v.meta
            shape, stride = evaluate(m.shape, values), evaluate(m.stride, values)
            if tuple(t.shape) != tuple(shape) or t.dtype != m.dtype or \
                    (t.numel() > 1 and _strides(t.shape, t.stride()) != _strides(shape, stride)):
                raise RuntimeError(f"compiled kernel returned {t.dtype}{list(t.shape)} strides {tuple(t.stride())} "
                                   f"for {v.name}, expected {m} strides {m.stride}")
        self.checked = True

    def scale(self, args) -> float:
        """How much more work this call is than one at the compiled batch's sizes (the biggest input's
        elements now over its hint): online trials compare kernels on calls of differing sizes."""
        if not self.sizes:
            return 1.0
        big = max(self.inputs, key=lambda v: hint(v.meta.numel))
        return max(evaluate(big.meta.numel, self.values(args)), 1) / max(hint(big.meta.numel), 1)


def _strides(shape, stride) -> tuple:
    """The strides that matter: those of dimensions longer than 1."""
    return tuple(st for st, n in zip(stride, shape) if n > 1)


def find_regions(graph: Graph, names: tuple[str, ...], limit: int | None = None) -> list[Region]:
    """Group and build the candidate regions of the first enabled region dialect, leaving the graph as it
    is: each region is a request for a kernel, which the step's tuner gives it after the passes (compiled,
    measured or tried online: `tuning.Tuner.realize`); `place_regions` then swaps in those that got one.
    Under a memory budget (`limit`: bytes for the step's peak) a region that would hold its inputs past it
    stays unfused (`memory.fused_within`)."""
    provider = registry.region_fusion(names)
    if provider is None:
        return []
    groups = group(graph, provider.accepts, provider.max_ops)
    if limit is not None:
        groups = _within(graph, memory.fused_within(graph, groups, limit), limit)
    if not groups:
        return []
    users, live = graph.users(), graph.live_outputs()
    return [make_region(nodes, i, users, live) for i, nodes in enumerate(groups)]


def place_regions(graph: Graph, regions: list[Region], names: tuple[str, ...]) -> int:
    """Replace the ops of each region with a compiled kernel, or one still to be measured during training,
    by one region node; the others keep their ops (`explain` reports them). Returns how many."""
    placed = [r for r in regions if r.compiled is not None or r.online is not None]
    provider = registry.region_fusion(names)
    if placed and provider is not None:
        _replace(graph, placed, provider)
    return len(placed)


def summary(regions: list[Region]) -> str:
    """One line for `explain`: how many regions were found, and what became of them."""
    distinct = {r.key: r for r in regions}.values()

    def fate(r: Region) -> str:
        if r.online is not None:
            return r.online.phase
        if r.compiled is not None:
            return "kept"
        if r.failed is not None:
            return "failed"
        if r.timing is not None and "compiled_ms" not in r.timing:
            return "too cheap to compile"
        return "not faster than ATen"
    counts: dict[str, int] = {}
    for r in distinct:
        counts[fate(r)] = counts.get(fate(r), 0) + 1
    kept = [r for r in regions if r.compiled is not None and r.online is None]
    saved = sum(r.timing["aten_ms"] - r.timing["compiled_ms"] for r in kept if r.timing and "compiled_ms" in r.timing)
    return (f"regions: {len(regions)} found ({len(distinct)} distinct): " +
            ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) +
            (f"; kept regions measured {saved:.2f} ms faster than their ATen ops per step" if kept else ""))


def group(graph: Graph, accepts: Callable[[Node], bool], max_ops: int = 64) -> list[list[Node]]:
    """The node groups to fuse, each in program order (see the module docstring for the rules).

    Every region has a place (`at`: the index of one of its ops) where its fused node will run. A node
    joins a region either by moving the region down to its own index, or by moving itself up to the
    region's place; either way, every value the region reads must be computed before the place and
    every op outside it that reads one of its values must run after it. Positions of ops already in
    regions are their region's place, so the check holds across regions too."""
    pos = {n.uid: i for i, n in enumerate(graph.nodes)}
    users = graph.users()
    members: dict[int, list[Node]] = {}       # region id -> nodes
    at: dict[int, int] = {}                   # region id -> index of its place
    region_of: dict[int, int] = {}            # node uid -> region id
    readers: dict[int, list[int]] = {}        # value uid -> regions reading it
    new_id = itertools.count()                # ids are never reused, even after merges

    def eff(x: Node | None) -> int:
        if x is None:
            return -1
        r = region_of.get(x.uid)
        return pos[x.uid] if r is None else at[r]

    def fits(nodes: list[Node], place: int) -> bool:
        if len(nodes) > max_ops:
            return False
        inside = {x.uid for x in nodes}
        for x in nodes:
            for v in x.inputs:
                if (v.producer is None or v.producer.uid not in inside) and eff(v.producer) >= place:
                    return False
            for o in x.outputs:
                if any(u.uid not in inside and eff(u) <= place for u in users.get(o, ())):
                    return False
        return True

    def join(n: Node, i: int) -> tuple[list[int], int] | None:
        """Which regions n joins and the merged region's place (None: none fits)."""
        producers = [r for r in dict.fromkeys(region_of.get(v.producer.uid) for v in n.inputs if v.producer)
                     if r is not None and members[r][0].phase is n.phase]
        by_place = sorted(producers, key=lambda r: -at[r])
        if producers and fits([x for r in producers for x in members[r]] + [n], i):
            return producers, i
        for r in by_place:
            if fits(members[r] + [n], i):
                return [r], i
            if fits(members[r] + [n], at[r]):
                return [r], at[r]
        if n.op.kind is Kind.VIEW:
            return None
        siblings = [r for r in dict.fromkeys(r for v in n.inputs for r in readers.get(v.uid, ()))
                    if r in members and members[r][0].phase is n.phase]
        for r in sorted(siblings, key=lambda r: -at[r]):
            for place in (i, at[r]):
                if fits(members[r] + [n], place):
                    return [r], place
        return None

    for i, n in enumerate(graph.nodes):
        if not accepts(n):
            continue
        chosen = join(n, i)
        if chosen is None:
            if n.op.kind is Kind.VIEW:     # a view alone is free: it joins a region or stays as it is
                continue
            chosen = ([next(new_id)], i)
            members[chosen[0][0]] = []
        regions, place = chosen
        target = regions[0]
        for r in regions[1:]:
            for x in members.pop(r):
                region_of[x.uid] = target
                members[target].append(x)
            del at[r]
            for lst in readers.values():
                lst[:] = [target if x == r else x for x in lst]
        members[target].append(n)
        members[target].sort(key=lambda x: pos[x.uid])
        at[target] = place
        region_of[n.uid] = target
        for v in n.inputs:
            readers.setdefault(v.uid, []).append(target)
    return [nodes for nodes in members.values() if sum(x.op.kind is not Kind.VIEW for x in nodes) >= 2]


def make_region(nodes: list[Node], index: int, users: dict, live: set) -> Region:
    """The region of `nodes`: its inputs, its outputs (values read after it or produced by the step),
    its symbolic sizes, its structural key and its reference function. `users`/`live`: `graph.users()` /
    `live_outputs()`."""
    inside = {x.uid for x in nodes}
    inputs: list[Value] = []
    for x in nodes:
        for v in x.inputs:
            if (v.producer is None or v.producer.uid not in inside) and v not in inputs:
                inputs.append(v)
    outputs = [o for x in nodes for o in x.outputs
               if o in live or any(u.uid not in inside for u in users.get(o, ()))]
    sizes = _symbols(nodes, inputs, outputs)
    env = symbolic.shape_env([v.meta.shape for v in inputs + outputs if v.meta is not None] +
                             [a for x in nodes for a in tree_leaves((x.args, x.kwargs)) if isinstance(a, torch.SymInt)])
    size_args = [symbolic.symint(env, sym) for sym in sizes]
    key = structural_key(nodes, inputs, outputs, sizes)
    name = f"region{index}_" + "_".join(dict.fromkeys(
        x.op.name.split(".")[1].strip("_") for x in nodes if x.op.kind is not Kind.VIEW))[:48]
    return Region(nodes, inputs, outputs, key, name, reference_function(nodes, inputs, outputs, name, sizes),
                  sizes=sizes, size_args=size_args)


def _symbols(nodes: list[Node], inputs: list[Value], outputs: list[Value]) -> list:
    """The symbols a region depends on, in a deterministic order (first appearance: input shapes and
    strides, then the ops' arguments, then output shapes)."""
    found: dict = {}
    parts = [(v.meta.shape, v.meta.stride) for v in inputs if v.meta is not None]
    parts += [(x.args, x.kwargs) for x in nodes] + [(v.meta.shape, v.meta.stride) for v in outputs if v.meta is not None]
    for part in parts:
        for leaf in tree_leaves(part):
            if isinstance(leaf, torch.SymInt):
                e = symbolic.expr(leaf)
                if not isinstance(e, int):
                    for sym in sorted(e.free_symbols, key=str):
                        found.setdefault(sym, None)
    return list(found)


def structural_key(nodes: list[Node], inputs: list[Value], outputs: list[Value], sizes: list = ()) -> str:
    """Equal for regions that compute the same thing on tensors of the same shapes, strides and dtypes;
    symbolic sizes count by their place among the region's symbols, not by the program's names for them."""
    names = symbolic.canonical(list(sizes))
    local: dict[int, tuple] = {v.uid: ("in", i) for i, v in enumerate(inputs)}

    def enc(x):
        if isinstance(x, Value):
            return local[x.uid]
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("size", str(symbolic.rename(x, names)))
        return x
    body = []
    for k, x in enumerate(nodes):
        args, kwargs = pytree.tree_map(enc, (x.args, x.kwargs), is_leaf=lambda a: isinstance(a, Value))
        body.append((str(x.target), repr(args), repr(sorted(kwargs.items()))))
        for j, o in enumerate(x.outputs):
            local[o.uid] = ("n", k, j)
    sig = [(str(symbolic.rename(v.meta.shape, names)), str(v.meta.dtype), str(symbolic.rename(v.meta.stride, names)),
            v.meta.device.type) if v.meta is not None else None for v in inputs]
    text = repr((body, sig, [local[o.uid] for o in outputs], len(names)))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def reference_function(nodes: list[Node], inputs: list[Value], outputs: list[Value], name: str,
                       sizes: list = ()) -> Callable:
    """The region's ops as straight-line Python calling their ATen kernels (the fallback). Symbolic sizes
    come first, as arguments of their own."""
    taken = {v.name for x in nodes for v in x.outputs} | {v.name for v in inputs}
    names = size_names(sizes, taken)
    syms = Symbols(taken=taken | set(names.values()), sizes=names)
    params = [names[s] for s in sizes] + [v.name for v in inputs]
    lines = [f"def {name}({', '.join(params)}):"]
    lines += ["    " + call_line(x, syms) for x in nodes]
    lines.append(f"    return ({''.join(v.name + ', ' for v in outputs)})")
    source = "\n".join(lines) + "\n"
    fn = define(source, name, dict(syms.globals), f"<kiln-{name}>")
    fn.source = source
    return fn


def _replace(graph: Graph, regions: list[Region], provider: registry.RegionFusion) -> None:
    """Swap each region's ops for one node, in an order where every value is computed before its use
    (`_placed`)."""
    units: dict[int, Node] = {}
    for r in regions:
        node = Node(REGION_OP, r, tuple(r.size_args) + tuple(r.inputs), {}, list(r.outputs), r.nodes[-1].phase,
                    _common_scope(r.nodes),
                    fused=Fused(provider.label, r.ops))
        r.impl = node.impl = registry.Impl(provider.dialect, r, kernel=r, name="region", fallback=False)
        for x in r.nodes:
            units[x.uid] = node
        for o in r.outputs:
            o.producer = node
    graph.nodes = _placed(graph.nodes, units)


def _placed(nodes: list[Node], unit: dict[int, Node]) -> list[Node]:
    """The program with each node in `unit` replaced by its unit (a region's node), in a stable topological
    order keyed by the original positions (a region takes its earliest op's): a region runs as soon as what
    it reads exists, no earlier than its first op."""
    units = list(dict.fromkeys(unit.get(n.uid, n) for n in nodes))
    rank = {id(u): k for k, u in enumerate(units)}
    producer = {o.uid: u for u in units for o in u.outputs}
    deps = {id(u): {id(producer[v.uid]) for v in u.inputs if v.uid in producer} - {id(u)} for u in units}
    waiting = {id(u): len(d) for u, d in zip(units, deps.values())}
    consumers: dict[int, list] = {}
    for u in units:
        for d in deps[id(u)]:
            consumers.setdefault(d, []).append(u)
    ready = [(rank[id(u)], id(u), u) for u in units if not waiting[id(u)]]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, _, u = heapq.heappop(ready)
        order.append(u)
        for c in consumers.get(id(u), ()):
            waiting[id(c)] -= 1
            if not waiting[id(c)]:
                heapq.heappush(ready, (rank[id(c)], id(c), c))
    if len(order) != len(units):      # cannot happen if grouping kept its invariant; never emit a bad graph
        raise AssertionError("region fusion produced a cycle")
    return order


def _within(graph: Graph, groups: list[list[Node]], limit: int) -> list[list[Node]]:
    """The groups whose placement (`_placed`, as `place_regions` will do it) keeps the predicted peak within
    `limit` bytes: each round profiles the placed program and leaves unfused the groups that make or read a
    value live at its peak, until it fits (`memory.fused_within` has already left out the groups that
    plainly would not)."""
    users, live = graph.users(), graph.live_outputs()
    while groups:
        unit, made = {}, {}
        for k, nodes in enumerate(groups):
            inside = {x.uid for x in nodes}
            ins = list(dict.fromkeys(v for x in nodes for v in x.inputs
                                     if v.producer is None or v.producer.uid not in inside))
            outs = [o for x in nodes for o in x.outputs
                    if o in live or any(u.uid not in inside for u in users.get(o, ()))]
            node = Node(REGION_OP, None, tuple(ins), {}, outs, nodes[-1].phase)
            made[node.uid] = k
            for x in nodes:
                unit[x.uid] = node
        trial = Graph()
        trial.inputs, trial.outputs, trial.mutations = graph.inputs, graph.outputs, graph.mutations
        trial.nodes = _placed(graph.nodes, unit)
        prof = memory.profile(trial)
        if prof.peak <= limit:
            return groups
        at = trial.nodes[prof.at]
        culprits = {made[at.uid]} if at.uid in made else set()
        for b in prof.live_at(prof.at):
            for x in trial.nodes:
                if x.uid in made and (any(o in b.values for o in x.outputs) or any(v in b.values for v in x.inputs)):
                    culprits.add(made[x.uid])
        if not culprits:
            return []
        groups = [g for k, g in enumerate(groups) if k not in culprits]
    return groups


def _common_scope(nodes: list[Node]) -> str:
    scopes = [x.scope.split(".") for x in nodes if x.scope]
    if not scopes:
        return ""
    common = []
    for parts in zip(*scopes):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
