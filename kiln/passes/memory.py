"""The memory model of a training step: which buffers are live after every node, and the peak.

The generated step (kiln/runtime/codegen.py) deletes each value after its last use, so a value's buffer
lives from the node that makes it to the last node reading it *or any view of it* (views alias their
base's storage: the storage is freed when its last alias dies). What lives longer:
- the step's inputs (parameters, buffers, optimizer state, the batch): persistent, counted apart;
- the step's outputs and buffer mutations: until the end;
- what an update kernel stages for the commit (kiln/transaction.py): its arguments (the gradients) and the
  values it computed out of place are held by the transaction until the step returns;
- what an autograd-fallback pair saves (its closure holds its inputs) until its backward node.
Sizes are in bytes at the compiled batch's sizes (`hint` for symbolic ones). A kernel's own temporaries
count at its node where its op declares them (`OpDef.workspace`: the loss kernels' chunk of logits);
other workspaces (a matmul's packing buffers) are small and not modelled. `step.memory(measure=True)`
checks the values against the allocator on a replay (kiln/runtime/step.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.ir.graph import Graph, Node, Phase, Role, Value
from kiln.ir import symbolic
from kiln.ir.symbolic import hint
from kiln.ops.registry import Kind

PERSISTENT = (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.CONSTANT, Role.STATE, Role.INPUT)


@dataclass(eq=False)
class Buffer:
    """One storage: the value that owns it and every value that aliases it."""

    owner: Value
    nbytes: int
    born: int                       # index of the node that makes it (-1: a graph input)
    dies: int                       # index of the last node that reads it or an alias (len(nodes): the end)
    values: list[Value] = field(default_factory=list)
    saved: bool = False             # made in the forward and read in the backward (an activation kept)

    @property
    def persistent(self) -> bool:
        return self.born < 0


@dataclass
class Profile:
    """Bytes live after each node (`live[i]`, persistent buffers excluded), and where the peak is."""

    buffers: list[Buffer]
    live: list[int]
    persistent: int                 # parameters, buffers, optimizer state, the batch
    peak: int                       # persistent + max(live)
    at: int                         # the node after which the peak is reached
    workspace: list[int] = field(default_factory=list)   # bytes of each node's own temporaries (in `live`)

    def live_at(self, i: int) -> list[Buffer]:
        """The transient buffers live after node i, biggest first."""
        return sorted((b for b in self.buffers if not b.persistent and b.born <= i <= b.dies),
                      key=lambda b: -b.nbytes)

    @property
    def saved_bytes(self) -> int:
        """Bytes of activations the backward reads, live when the forward ends."""
        return sum(b.nbytes for b in self.buffers if b.saved)


def aliases(n: Node) -> bool:
    """Whether `n`'s tensor outputs share its (single tensor) input's storage: views, and a reshape of a
    contiguous value (which is a view)."""
    if n.op.kind is not Kind.VIEW:
        return False
    ins = [v for v in n.inputs if v.meta is not None]
    if len(ins) != 1:
        return False
    if n.op.name == "aten.reshape":
        return ins[0].meta.as_meta_tensor().is_contiguous()
    return True


def _nbytes(v: Value) -> int:
    return hint(v.meta.nbytes) if v.meta is not None else 0


def buffers(graph: Graph) -> list[Buffer]:
    """Every storage of the step with its lifetime (see the module docstring)."""
    nodes = graph.nodes
    end = len(nodes)
    owner: dict[Value, Buffer] = {}
    out: list[Buffer] = []
    for v in graph.inputs:
        if v.meta is not None:
            b = Buffer(v, _nbytes(v), -1, end, [v])
            owner[v] = b
            out.append(b)
    for i, n in enumerate(nodes):
        base = owner.get(next(iter(v for v in n.inputs if v.meta is not None)), None) if aliases(n) else None
        for o in n.outputs:
            if o.meta is None:
                continue
            if base is not None:
                base.values.append(o)
                owner[o] = base
            else:
                b = Buffer(o, _nbytes(o), i, i, [o])
                owner[o] = b
                out.append(b)
    phase = {v: n.phase for n in nodes for v in n.outputs}
    for i, n in enumerate(nodes):
        held = n.op.kind is Kind.OPTIMIZER or n.op.side_effects     # staged until the commit
        for v in n.inputs:
            b = owner.get(v)
            if b is None:
                continue
            b.dies = max(b.dies, end if held else i)
            if n.phase is Phase.BACKWARD and phase.get(v) is Phase.FORWARD:
                b.saved = True
        closure = [o for o in n.outputs if o.meta is None]
        if closure:                   # a fallback's saved state holds its inputs until its backward reads it
            last = max((j for j, m in enumerate(nodes) if closure[0] in m.inputs), default=i)
            for v in n.inputs:
                if v in owner:
                    owner[v].dies = max(owner[v].dies, last)
    for v in list(graph.outputs) + [new for _, new in graph.mutations]:
        if v in owner:
            owner[v].dies = end
    return out


def workspace(n: Node) -> int:
    """Bytes node `n`'s kernel makes and frees inside itself, as its op declares (0 if it does not)."""
    return int(n.op.workspace(n)) if n.op.workspace is not None else 0


def profile(graph: Graph) -> Profile:
    """The live bytes at every node (its values, and its kernel's workspace while it runs) and the peak."""
    bufs = buffers(graph)
    n = len(graph.nodes)
    delta = [0] * (n + 2)
    persistent = 0
    for b in bufs:
        if b.persistent:
            persistent += b.nbytes
            continue
        delta[b.born] += b.nbytes
        delta[min(b.dies, n) + 1] -= b.nbytes
    ws = [workspace(x) for x in graph.nodes]
    live, cur = [], 0
    for i in range(n):
        cur += delta[i]
        live.append(cur + ws[i])
    at = max(range(n), key=live.__getitem__) if n else 0
    return Profile(bufs, live, persistent, persistent + (live[at] if n else 0), at, ws)


def peak_expr(graph: Graph):
    """The transient bytes live at the predicted peak, as an expression of the program's symbolic sizes (an
    int for a static program): a dynamic program compiled under a memory budget checks it for every batch."""
    prof = profile(graph)
    total = prof.workspace[prof.at] if prof.workspace else 0
    for b in prof.live_at(prof.at):
        total = total + b.owner.meta.nbytes
    return symbolic.expr(total) if not isinstance(total, int) else total


def fused_within(graph: Graph, groups: list[list[Node]], limit: int) -> list[list[Node]]:
    """The groups of ops to fuse (regions) whose placement keeps the predicted peak within `limit` bytes. A
    region node runs as soon as what it reads exists, no earlier than its first op (kiln/passes/regions.py
    `_replace`): its outputs are then made there, which can be long before their op was (the casts of every
    layer's weights, made at the first), and what it reads from outside lives until then, which can outlive
    the value's last reader before (a chain of sums waits for its last addend: every addend is then live at
    once). Greedy in program order: a group that would push the peak past the limit stays unfused."""
    prof = profile(graph)
    pos = {n.uid: i for i, n in enumerate(graph.nodes)}
    owner = {v: b for b in prof.buffers for v in b.values}
    live = list(prof.live)
    cap = limit - prof.persistent
    dies: dict[int, int] = {}
    kept = []
    for nodes in groups:
        inside = {x.uid for x in nodes}
        ins = [v for x in nodes for v in x.inputs if v.producer is None or v.producer.uid not in inside]
        place = max([pos[nodes[0].uid]] + [pos[v.producer.uid] + 1 for v in ins if v.producer is not None])
        extra: dict[int, int] = {}
        held: dict[int, Buffer] = {}
        for v in ins:                               # read from outside: held until the place
            b = owner.get(v)
            if b is None or b.persistent or id(b) in held:
                continue
            end = dies.get(id(b), b.dies)
            if end < place:
                held[id(b)] = b
                for j in range(end + 1, place + 1):
                    extra[j] = extra.get(j, 0) + b.nbytes
        for x in nodes:                             # made at the place, before their op's own position
            for o in x.outputs:
                b = owner.get(o)
                if b is not None and b.owner is o and b.born > place:
                    for j in range(place, b.born):
                        extra[j] = extra.get(j, 0) + b.nbytes
        if any(live[j] + add > cap for j, add in extra.items()):
            continue
        for j, add in extra.items():
            live[j] += add
        for k in held:
            dies[k] = place
        kept.append(nodes)
    return kept
