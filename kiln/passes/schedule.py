"""The backward's independent ops ordered to lower the step's predicted peak.

Autodiff emits the backward in reverse forward order, each forward node's gradient ops together: a layer's
weight gradients (parameter-sized, kept until the update) next to its input gradient, and an activation the
backward reads freed only where its last gradient op happens to stand. Any order that runs every node after
its inputs computes the same values. This pass lists the backward's nodes again, each time taking, among the
nodes whose inputs exist, the one that adds the fewest bytes: the buffers it makes, less the buffers it is
the last reader of (a list scheduler with a memory heuristic; ties keep autodiff's order).

What keeps its place relative to its own kind: nodes with side effects (collectives, guards, updates: they
are also taken as soon as they are ready, so a gradient bucket's collective still starts at once), random
ops (the random stream's order) and autograd fallbacks (their closures). Where the backward is not one
contiguous phase (ZeRO's updates moved into it) nothing is reordered. The new order is kept only where the
memory model (kiln/passes/memory.py) predicts a lower peak for the whole step; `Schedule` says by how much.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.graph import Graph, Node, Phase
from kiln.ops.registry import Kind
from kiln.passes import memory


# the scheduler scans its ready nodes at every step (quadratic at worst): a longer backward keeps its order
MAX_NODES = 20000


@dataclass
class Schedule:
    """What the pass did: the predicted peak before and after (bytes), and how many nodes moved."""

    before: int
    after: int
    moved: int = 0


def schedule_backward(graph: Graph) -> Schedule:
    prof = memory.profile(graph)
    result = Schedule(prof.peak, prof.peak)
    where = [i for i, n in enumerate(graph.nodes) if n.phase is Phase.BACKWARD]
    if len(where) < 2 or where[-1] - where[0] + 1 != len(where):
        return result
    start, end = where[0], where[-1] + 1
    seg = graph.nodes[start:end]
    if len(seg) > MAX_NODES:
        return result
    order = _list_schedule(seg, prof.buffers, end)
    if order is None or [n.uid for n in order] == [n.uid for n in seg]:
        return result
    graph.nodes[start:end] = order
    after = memory.profile(graph).peak
    if after >= prof.peak:
        graph.nodes[start:end] = seg
        return result
    result.after = after
    result.moved = sum(a is not b for a, b in zip(order, seg))
    return result


def _pinned(n: Node) -> bool:
    return n.op.side_effects or n.op.kind in (Kind.RANDOM, Kind.OPAQUE) or any(o.meta is None for o in n.outputs)


def _list_schedule(seg: list[Node], buffers: list, end: int) -> list[Node] | None:
    pos = {n.uid: i for i, n in enumerate(seg)}
    made = {o: n for n in seg for o in n.outputs}
    owner = {v: b for b in buffers for v in b.values}
    preds: dict[int, set[int]] = {n.uid: {made[v].uid for v in n.inputs if v in made} for n in seg}
    last_pinned = None
    for n in seg:                                   # pinned nodes keep their relative order
        if _pinned(n):
            if last_pinned is not None:
                preds[n.uid].add(last_pinned.uid)
            last_pinned = n
    succs: dict[int, list[Node]] = {n.uid: [] for n in seg}
    for n in seg:
        for p in preds[n.uid]:
            succs[p].append(n)
    # a buffer is freed by its last reader here when nothing outside the segment reads it later
    readers: dict[int, int] = {}
    reads: dict[int, list] = {}
    for n in seg:
        bufs = {id(owner[v]): owner[v] for v in n.inputs if v in owner}
        reads[n.uid] = list(bufs.values())
        for b in bufs.values():
            readers[id(b)] = readers.get(id(b), 0) + 1
    freeable = {id(b) for b in buffers if not b.persistent and b.dies < end}
    new_bytes = {n.uid: sum(owner[o].nbytes for o in n.outputs if o in owner and owner[o].owner is o) for n in seg}
    waiting = {n.uid: len(preds[n.uid]) for n in seg}

    def key(n: Node):
        freed = sum(b.nbytes for b in reads[n.uid] if id(b) in freeable and readers[id(b)] == 1)
        return (0 if n.op.side_effects else 1, new_bytes[n.uid] - freed, pos[n.uid])

    ready = [n for n in seg if waiting[n.uid] == 0]
    out: list[Node] = []
    while ready:
        best = min(ready, key=key)
        ready.remove(best)
        out.append(best)
        for b in reads[best.uid]:
            readers[id(b)] -= 1
        for s in succs[best.uid]:
            waiting[s.uid] -= 1
            if waiting[s.uid] == 0:
                ready.append(s)
    return out if len(out) == len(seg) else None
