"""Pattern-based dialect fusion (RAF's FuseDialect): subgraphs -> one fused op of a dialect.

Each enabled dialect registers fusions (`kiln.dialects.registry.fusion`): a pattern over the IR and a
builder emitting the fused op. Fusions are tried in priority order; each one scans the graph from the
end (so the largest match claims its nodes first), groups its matches when it asks to, and replaces
every accepted match. A match is refused, leaving the graph as it was, when:
- one of its inner nodes (all but the root) has a user outside the match or is a step output: fusing
  would have to compute it twice (unless the fusion names that value `shared` and its builder gives the value
  that replaces it: a residual sum the fused op writes too);
- an inner node has side effects or draws random numbers (the fused op would change the RNG stream);
- for a group, a user of an earlier root's outputs comes before the place the fused op goes;
- the builder declines (returns None) or fails, or returns another form than its fusion's; a failure is
  logged as a warning, never a wrong graph.
"""
from __future__ import annotations

import collections
import logging

from kiln.dialects import registry
from kiln.ir.builder import Builder
from kiln.ir.graph import Fused, Graph, Node, Value, tree_map_values
from kiln.ir.pattern import Match, match
from kiln.ops.registry import Kind
from kiln.passes.rewrite import refresh_metas

log = logging.getLogger("kiln")


def fuse(graph: Graph, names: tuple[str, ...], phase: str) -> int:
    """Apply every enabled fusion of `phase`. Returns how many subgraphs were fused. The metas after a
    fused op are inferred again (its outputs' layouts may differ from the ops it replaced)."""
    fused = sum(_apply(graph, f) for f in registry.fusions(names, phase))
    if fused:
        refresh_metas(graph)
    return fused


def _apply(graph: Graph, f: registry.Fusion) -> int:
    users = graph.users()
    live = graph.live_outputs()
    taken: set[int] = set()
    found: list[Match] = []
    for n in reversed(graph.nodes):
        if n.uid in taken:
            continue
        m = match(f.pattern, n)
        if m is None or not _self_contained(m, users, live, _shared(m, f)) or any(x.uid in taken for x in m.nodes):
            continue
        taken.update(x.uid for x in m.nodes)
        found.append(m)
    if not found:
        return 0
    groups = _group(found, f)
    pos = {n.uid: i for i, n in enumerate(graph.nodes)}
    subst: dict[Value, Value] = {}
    inserts: dict[int, list[Node]] = {}
    removed: set[int] = set()
    fused = 0
    for group in groups:
        at = max(pos[m.root.uid] for m in group)
        if not _placeable(group, at, users, pos, _shared(group[0], f)):
            log.debug("kiln: fusion %s: a user comes before the fused op's place; not fused", f.label)
            continue
        anchor = graph.nodes[at]
        b = Builder(graph, anchor.phase, anchor.scope, dest=[])
        try:
            results = f.build(b, group)
        except Exception as exc:  # a broken fusion costs speed, never correctness
            log.warning("kiln: fusion %s failed at %s (%s: %s); keeping the unfused ops",
                        f.label, anchor.scope or "<top>", type(exc).__name__, exc)
            continue
        if results is None:
            continue
        exported: dict[Value, Value] = {}
        if f.shared:                              # (root's replacement, {name: replacement}) per match
            try:
                (root, named), = results
                named = dict(named)
            except (TypeError, ValueError):
                log.warning("kiln: fusion %s returned %r, not [(root's values, {name: value})]; keeping the unfused "
                            "ops", f.label, results)
                continue
            results = [root]
            exported = {group[0][name]: new for name, new in named.items()}
            if set(exported) != _shared(group[0], f):
                log.debug("kiln: fusion %s gives no value for a shared inner value; not fused", f.label)
                continue
        covered = sorted((x for m in group for x in m.nodes), key=lambda x: pos[x.uid])
        record = Fused(f.label, tuple(x.op.name for x in covered))
        for new in b.dest:
            new.fused = record
        replaced = _replacements(group, results, users, live)
        if replaced is None:
            log.debug("kiln: fusion %s gives no value for a used output; not fused", f.label)
            continue
        subst.update(replaced)
        subst.update(exported)
        for m in group:
            removed.update(x.uid for x in m.nodes)
        inserts[at] = b.dest
        fused += len(group)
    if not fused:
        return 0
    nodes: list[Node] = []
    fix = lambda v: subst.get(v, v)  # noqa: E731
    for i, old in enumerate(graph.nodes):
        # fused ops too: one may read the root of another match (gelu(gelu(x)) fuses twice)
        for n in [*inserts.get(i, ()), *([] if old.uid in removed else [old])]:
            n.args, n.kwargs = tree_map_values(fix, n.args), tree_map_values(fix, n.kwargs)
            nodes.append(n)
    graph.nodes = nodes
    graph.outputs = [fix(v) for v in graph.outputs]
    graph.mutations = [(t, fix(v)) for t, v in graph.mutations]
    log.debug("kiln: fusion %s fused %d subgraph(s)", f.label, fused)
    return fused


def _replacements(group: list[Match], results, users: dict, live: set) -> dict[Value, Value] | None:
    """old root output -> new value; None when a root output that is used gets no replacement."""
    out: dict[Value, Value] = {}
    for m, result in zip(group, results):
        news = [result] if isinstance(result, Value) or result is None else list(result)
        news += [None] * (len(m.root.outputs) - len(news))
        for old, new in zip(m.root.outputs, news):
            if new is not None:
                out[old] = new
            elif users.get(old) or old in live:
                return None
    return out


def _shared(m: Match, f: registry.Fusion) -> set:
    """The inner values of `m` that `f` lets escape the match (`Fusion.shared`)."""
    return {m[name] for name in f.shared if name in m.bindings}


def _self_contained(m: Match, users: dict, live: set, shared: set = frozenset()) -> bool:
    inside = {x.uid for x in m.nodes}
    for x in m.nodes[1:]:
        if x.op.side_effects or x.op.kind is Kind.RANDOM:
            return False
        for o in x.outputs:
            if o in shared:
                continue
            if o in live or any(u.uid not in inside for u in users.get(o, ())):
                return False
    return True


def _group(found: list[Match], f: registry.Fusion) -> list[list[Match]]:
    if f.group_by is None:
        return [[m] for m in reversed(found)]
    groups: dict = collections.OrderedDict()
    for m in reversed(found):                     # graph order
        key = f.group_by(m)
        if key is not None:
            groups.setdefault(key, []).append(m)
    size = f.group_size
    chunks = [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)] if size else list(groups.values())
    return [c for c in chunks if len(c) >= f.min_group]


def _placeable(group: list[Match], at: int, users: dict, pos: dict, shared: set = frozenset()) -> bool:
    """The fused op goes at index `at` (the last root): every outside user of a root, and of a shared inner
    value, must come later."""
    inside = {x.uid for m in group for x in m.nodes}
    outs = [o for m in group for o in m.root.outputs] + list(shared)
    return all(pos[u.uid] > at for o in outs for u in users.get(o, ()) if u.uid not in inside)
