"""Row chunking: the forward's row-wise blocks (projections, MLPs, norms, residual adds) run on slices of
their rows, so that under a memory budget rematerialization keeps and recomputes one slice at a time.

A row-wise op computes each row of its leading dims (a token, for a transformer's (batch, sequence, hidden)
activations) from the same row of its inputs alone, every other input applying to all rows: a linear layer
(its weight), a norm over the last dim, any pointwise op, a reshape that keeps the rows. Ops say so with
`OpDef.rows` / `OpDef.shape_arg`; pointwise ops by their shapes. A *block* is a connected set of row-wise
forward ops grown from a matmul, all of whose values have the same number of rows N (their leading dims,
flattened: (8, 256, 512) and (2048, 512) are both 2048 rows). Attention, rotary embeddings (they read the
position), the loss, random ops (dropout: a slice would draw other numbers) and fallbacks end a block.

`chunk_rows(graph, k)` runs each block as k copies, one per slice of about N/k rows:
- the block's inputs that carry rows are flattened to (N, ...) and split (views where the layout allows);
- each op is emitted once per slice, its row arguments the slice's pieces (a reshape's shape becomes the
  slice's), the other arguments shared;
- values read outside the block are concatenated again (one copy) and reshaped to their shape; values a
  later part of the same block reads stay in slices.
Outside paths that leave a block and come back (a layer's attention between its projections and the next
residual add) cut it into stages, each run as a unit where its last op was, so the order stays valid.

Autodiff then differentiates each slice on its own (the weights' gradients are the sum over slices), and
the remat pass sees one slice's intermediates at a time: recomputing a slice's MLP in the backward needs
that slice's memory only. What changes numerically is the order of sums: the weights' gradients are summed
over slices (in bf16, each slice's gradient of a bf16 weight copy is rounded before the sum), and the fused
loss sums over smaller chunks.

The pass does nothing unless a step's budget needs it: `CompiledStep` compiles again with 2, 4, 8, 16
slices while the remat pass cannot meet the budget (`CHUNKS`). Symbolic sizes are left whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Node, Phase, Value
from kiln.ops.registry import Kind

aten = torch.ops.aten

CHUNKS = (2, 4, 8, 16)          # slices tried, in order, while the budget is not met


@dataclass
class Chunking:
    """What the pass found and did, for `step.memory()`."""

    chunks: int = 1                 # slices per block (1: nothing chunked)
    blocks: int = 0                 # row-wise blocks found (chunked when chunks > 1)
    ops: int = 0                    # ops in them
    rows: list[int] = field(default_factory=list)     # each block's rows
    scopes: list[str] = field(default_factory=list)   # modules the blocks cover
    kernels: int = 0                # kernels whose own chunks were made smaller (the fused loss)

    def __str__(self) -> str:
        if self.chunks <= 1:
            return ""
        where = ", ".join(self.scopes[:4]) + (f" and {len(self.scopes) - 4} more" if len(self.scopes) > 4 else "")
        return (f"{self.blocks} row-wise block(s) of {self.ops} ops run in {self.chunks} slices of rows each "
                f"({'/'.join(str(r) for r in sorted(set(self.rows)))} rows; {where})"
                + (f"; {self.kernels} kernel(s) with {self.chunks}x smaller chunks of their own" if self.kernels else ""))


def chunk_rows(graph: Graph, chunks: int) -> Chunking:
    """Find the row-wise blocks; with `chunks` > 1, rewrite each to run on that many row slices."""
    blocks = find_blocks(graph)
    scopes = sorted({_module(n.scope) for b in blocks for n in b.nodes if n.scope})
    report = Chunking(1, len(blocks), sum(len(b.nodes) for b in blocks), [b.rows for b in blocks], scopes)
    if chunks <= 1 or not blocks:
        return report
    report.chunks = chunks
    for block in blocks:
        _Rewrite(graph, block, min(chunks, block.rows)).run()
    for n in graph.nodes:                  # kernels that chunk inside themselves: smaller chunks
        if n.phase is Phase.FORWARD and n.op.smaller is not None:
            n.args = n.op.smaller(n, chunks)
            report.kernels += 1
    return report


def _module(scope: str) -> str:
    """A scope without its last part past a layer index: model.layers.0.mlp.up_proj -> model.layers.0.mlp."""
    parts = scope.split(".")
    return ".".join(parts[:-1]) if len(parts) > 3 else scope


@dataclass(eq=False)
class Block:
    rows: int                              # N: every value's leading dims hold N rows
    nodes: list[Node]                      # in graph order
    lead: dict[Value, int]                 # how many leading dims of a value are rows (its outputs and inputs)
    row_args: dict[int, tuple[int, ...]]   # node uid -> the argument positions carrying rows


# ---- finding blocks ---------------------------------------------------------------------------------
def _rule(n: Node):
    """(argument positions carrying rows, most leading dims that may be rows, whether a reshape), or None."""
    op = n.op
    if n.phase is not Phase.FORWARD or op.side_effects or op.kind in (Kind.RANDOM, Kind.OPAQUE) or not n.outputs:
        return None
    if any(o.meta is None or o.meta.symbolic for o in n.outputs):
        return None
    if op.rows is not None:
        rule = op.rows(n)
        return None if rule is None else (*rule, False)
    if op.shape_arg is not None:
        return (0,), None, True
    if op.kind is Kind.POINTWISE and not any(isinstance(v, Value) for v in n.kwargs.values()):
        ndim = len(n.outputs[0].meta.shape)
        pos = tuple(i for i, a in enumerate(n.args) if isinstance(a, Value) and a.meta is not None
                    and len(a.meta.shape) == ndim)
        return pos, ndim - 1, False
    return None


def _prefix(shape, rows: int) -> int | None:
    """The fewest leading dims of `shape` holding `rows` rows (None: no prefix does)."""
    total = 1
    for i, s in enumerate(shape):
        if total == rows and i > 0:
            return i
        total *= int(s)
    return len(shape) if total == rows and shape else None


def _fits(n: Node, rows: int, inside: dict[Value, object]) -> dict | None:
    """Whether `n` is row-wise over `rows` rows here: the leading dims of its row arguments and outputs."""
    rule = _rule(n)
    if rule is None:
        return None
    pos, most, reshape = rule
    out = n.outputs[0].meta.shape
    lead = {}
    if reshape:
        x = n.args[0]
        if not isinstance(x, Value) or x.meta is None or x.meta.symbolic:
            return None
        lx, lo = _prefix(x.meta.shape, rows), _prefix(out, rows)
        if lx is None or lo is None:
            return None
        lead[x] = lx
    else:
        lo = _prefix(out, rows)
        if lo is None or lo > most or not pos:
            return None
        for i in pos:
            a = n.args[i] if i < len(n.args) else None
            if not isinstance(a, Value) or a.meta is None or a.meta.symbolic or \
                    tuple(a.meta.shape[:lo]) != tuple(out[:lo]):
                return None
            lead[a] = lo
        pointwise = n.op.rows is None
        for i, a in enumerate(n.args):           # the other tensors apply to every row
            if isinstance(a, Value) and i not in pos:
                if a in inside or (pointwise and a.meta is not None and len(a.meta.shape) > len(out) - lo):
                    return None
    for o in n.outputs:
        if tuple(o.meta.shape[:lo]) != tuple(out[:lo]):
            return None
        lead[o] = lo
    return lead


def find_blocks(graph: Graph) -> list[Block]:
    """The forward's row-wise blocks that hold a matmul, grown from each matmul along row-carrying values."""
    users = graph.users()
    taken: set[int] = set()
    blocks = []
    for seed in graph.nodes:
        if seed.uid in taken or seed.op.kind is not Kind.MATMUL:
            continue
        rule = _rule(seed)
        if rule is None or rule[2]:
            continue
        rows = math.prod(int(s) for s in seed.outputs[0].meta.shape[:rule[1]])
        inside: dict[Value, object] = {}
        lead: dict[Value, int] = {}
        row_args: dict[int, tuple[int, ...]] = {}
        members: dict[int, Node] = {}

        def join(n: Node) -> bool:
            if n.uid in taken or n.uid in members:
                return False
            got = _fits(n, rows, inside)
            if got is None:
                return False
            members[n.uid] = n
            lead.update(got)
            row_args[n.uid] = tuple(i for i, a in enumerate(n.args) if isinstance(a, Value) and a in got)
            inside.update({o: n for o in n.outputs})
            return True

        if rows < 2 or not join(seed):
            continue
        queue = [seed]
        while queue:
            n = queue.pop()
            for i in row_args[n.uid]:
                p = n.args[i].producer
                if p is not None and join(p):
                    queue.append(p)
            for o in n.outputs:
                for u in users.get(o, ()):
                    if join(u):
                        queue.append(u)
        nodes = [n for n in graph.nodes if n.uid in members]
        # a block value read where rows do not apply (a weight position, a kwarg) would be sliced wrongly
        if any(v in inside and (i not in row_args[n.uid])
               for n in nodes for i, v in enumerate(n.args) if isinstance(v, Value)) or \
                any(v in inside for n in nodes for v in _kwarg_values(n)):
            continue
        taken.update(members)
        blocks.append(Block(rows, nodes, lead, row_args))
    return blocks


def _kwarg_values(n: Node):
    return [v for v in n.kwargs.values() if isinstance(v, Value)]


# ---- rewriting ----------------------------------------------------------------------------------
def _stages(graph: Graph, block: Block) -> list[list[Node]]:
    """The block cut where a path leaves it and comes back: stage s holds the ops that need stage s - 1's
    values through outside ops; each stage can run as a unit."""
    mine = {n.uid for n in block.nodes}
    stage: dict[int, int] = {}
    dep: dict[int, int] = {}          # node uid -> highest stage it depends on (-1: none)
    for n in graph.nodes:
        preds = [v.producer for v in n.inputs if v.producer is not None]
        if n.uid in mine:
            s = 0
            for p in preds:
                s = max(s, stage[p.uid] if p.uid in mine else dep.get(p.uid, -1) + 1)
            stage[n.uid] = dep[n.uid] = s
        else:
            dep[n.uid] = max((dep.get(p.uid, -1) for p in preds), default=-1)
    out: dict[int, list[Node]] = {}
    for n in block.nodes:
        out.setdefault(stage[n.uid], []).append(n)
    return [out[s] for s in sorted(out)]


class _Rewrite:
    def __init__(self, graph: Graph, block: Block, k: int):
        self.graph, self.block, self.k = graph, block, k
        n = block.rows
        self.sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        self.pieces: dict[Value, list[Value]] = {}
        self.mine = {x.uid for x in block.nodes}

    def run(self) -> None:
        for stage in _stages(self.graph, self.block):
            self._stage(stage)

    def _split(self, b: Builder, v: Value) -> list[Value]:
        if v not in self.pieces:
            lead = self.block.lead[v]
            flat = b(aten.reshape.default, v, [self.block.rows, *v.meta.shape[lead:]])
            self.pieces[v] = list(b(aten.split_with_sizes.default, flat, self.sizes))
        return self.pieces[v]

    def _stage(self, stage: list[Node]) -> None:
        g, block = self.graph, self.block
        new: list[Node] = []
        b = Builder(g, Phase.FORWARD, dest=new)
        for n in stage:                               # the block's inputs carrying rows, split once
            b.scope = n.scope
            for i in block.row_args[n.uid]:
                v = n.args[i]
                if v.producer is None or v.producer.uid not in self.mine:
                    self._split(b, v)
        for c in range(self.k):
            for n in stage:
                b.scope = n.scope
                args = list(n.args)
                for i in block.row_args[n.uid]:
                    args[i] = self.pieces[n.args[i]][c]
                if n.op.shape_arg is not None:
                    out = n.outputs[0]
                    args[n.op.shape_arg] = [self.sizes[c], *out.meta.shape[block.lead[out]:]]
                res = b.emit(n.target, tuple(args), dict(n.kwargs))
                res = res if isinstance(res, tuple) else (res,)
                for o, r in zip(n.outputs, res):
                    self.pieces.setdefault(o, [None] * self.k)[c] = r
        users = g.users()
        live = g.live_outputs()
        for n in stage:                               # values read outside the block: one tensor again
            for o in n.outputs:
                if o in live or any(u.uid not in self.mine for u in users.get(o, ())):
                    b.scope = n.scope
                    whole = b(aten.cat.default, self.pieces[o], 0)
                    whole = b(aten.reshape.default, whole, list(o.meta.shape))
                    self.pieces[whole] = self.pieces[o]
                    g.replace_uses(o, whole)
        self._splice(stage, new)

    def _splice(self, stage: list[Node], new: list[Node]) -> None:
        """Put the stage's slices where its last op was; outside ops in between that read it move after."""
        g = self.graph
        pos = {n.uid: i for i, n in enumerate(g.nodes)}
        ids = {n.uid for n in stage}
        first, last = pos[stage[0].uid], pos[stage[-1].uid]
        made = {o for n in stage for o in n.outputs} | {o for n in new for o in n.outputs}
        before, after = [], []
        for n in g.nodes[first:last + 1]:
            if n.uid in ids:
                continue
            if any(v in made for v in n.inputs):
                after.append(n)
                made.update(n.outputs)
            else:
                before.append(n)
        g.nodes = g.nodes[:first] + before + new + after + g.nodes[last + 1:]
