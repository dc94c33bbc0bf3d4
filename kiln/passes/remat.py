"""Rematerialization under a memory budget: activations the backward reads are recomputed there instead of
being kept from the forward, cheapest first, until the step's predicted peak fits the budget.

Kiln sees the whole step, so for every forward node whose outputs the backward reads it can choose: keep
them (they live from the forward to their last backward use, the usual cause of the peak at the start of
the backward), or recompute them right before the backward's first use (they live only in the forward,
and again from that use to the last). Recomputing a node needs its inputs then: a parameter, a value
the backward reads anyway, or a value itself recomputed (chains share the work: each recomputed node is
emitted once, before its first use); any other input is kept longer, which the memory model counts.

`plan()` simulates the memory model (kiln/passes/memory.py) with each decision. The greedy pass tries the
candidates in order of cost per byte freed, ops of the cheapest kinds first (elementwise, views, then norms
and reductions, attention, matmuls last), each kept only if it lowers the predicted peak, until the peak
fits; then decisions that are no longer needed are dropped, costliest first. A covering integer program
(`_cheapest_cover`, scipy's HiGHS) then looks for the set of least recomputed FLOPs whose savings, each
measured alone on the model, cover the excess over the budget at every node; its set is checked on the
model (candidates interact), completed greedily, pruned, and kept where it costs fewer FLOPs than the
greedy plan. Without scipy, or when the program finds nothing in time, the greedy plan stands.
Random ops (dropout) are never recomputed: their outputs are kept (so recomputing what follows them reuses
the same random numbers), as are ops with side effects, opaque fallbacks and anything the optimizer reads.
`apply()` rewrites the graph: the copies are ordinary backward nodes (their module path kept), so the
generated code shows each recomputation where it runs, and the later passes fuse recomputed elementwise ops
into backward regions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.ir import symbolic
from kiln.ir.graph import Graph, Node, Phase, Value, tree_map_values
from kiln.ops.registry import Kind
from kiln.passes import memory

SOLVER_SECONDS = 10.0        # the covering program's time limit; the greedy plan stands without it
# cheapest kinds first: what RAF and checkpointing folklore recompute before matmuls
_RANK = {Kind.VIEW: 0, Kind.POINTWISE: 0, Kind.CREATION: 0, Kind.NORM: 1, Kind.REDUCTION: 1, Kind.INDEX: 1,
         Kind.LOSS: 2, Kind.ATTENTION: 3, Kind.MATMUL: 4}


@dataclass(eq=False)
class Recompute:
    """One decision: `node` (with the views of its outputs the backward reads) recomputed in the backward."""

    node: Node
    views: list[Node]
    nbytes: int                     # bytes of its outputs the backward read
    flops: float
    # producers of its inputs that nothing else reads, recomputed with it (a concatenation of row slices
    # and the slices' projections: alone, recomputing the concatenation would keep every slice alive)
    extra: list["Recompute"] = field(default_factory=list)

    @property
    def cost(self) -> float:
        return self.flops + sum(e.flops for e in self.extra)

    def __str__(self) -> str:
        where = f" in {self.node.scope}" if self.node.scope else ""
        with_ = f" with the {len(self.extra)} op(s) making its inputs" if self.extra else ""
        return (f"{self.node.op.name}{where}{with_}: {self.nbytes / 2**20:.1f} MiB recomputed for "
                f"{self.cost / 1e6:.1f} MFLOP")


def _expand(chosen: list[Recompute]) -> list[Recompute]:
    """The decisions with the producers recomputed along with them, each node once."""
    out, seen = [], set()
    for r in chosen:
        for x in [r, *r.extra]:
            if x.node.uid not in seen:
                seen.add(x.node.uid)
                out.append(x)
    return out


@dataclass
class Plan:
    """What the pass decided, for `step.memory()` and `explain`."""

    budget: int | None
    before: int                     # predicted peak without rematerialization (bytes)
    after: int                      # predicted peak with it
    floor: int                      # the smallest peak rematerialization reaches here
    persistent: int                 # parameters, buffers, optimizer state, the batch
    chosen: list[Recompute] = field(default_factory=list)
    outside: int = 0                # bytes of a byte budget the process holds beyond the step's tensors
    solver: str = "greedy"          # which found `chosen`: the greedy pass, or the covering program ("milp")
    chunking: object = None         # the chunk pass's report (kiln.passes.chunk.Chunking): row slices used

    @property
    def extra_flops(self) -> float:
        return _flops(self.chosen)

    @property
    def step_budget(self) -> int | None:
        """What the budget leaves for the step's own peak (persistent tensors included)."""
        return None if self.budget is None else self.budget - self.outside


def candidates(graph: Graph) -> list[Recompute]:
    """Forward nodes the backward could recompute, in the order they are tried."""
    users = graph.users()
    live = graph.live_outputs()
    out = []
    for n in graph.nodes:
        if n.phase is not Phase.FORWARD or n.op.kind not in _RANK or n.op.kind is Kind.VIEW:
            continue
        if n.op.side_effects or not n.outputs or any(o.meta is None for o in n.outputs):
            continue
        views, read, ok = [], [], True
        stack = list(n.outputs)
        while stack:                          # the outputs and the views of them: who reads them where
            v = stack.pop()
            if v in live:
                ok = False
                break
            for u in users.get(v, ()):
                if u.phase is Phase.OPTIMIZER:
                    ok = False
                elif u.phase is Phase.BACKWARD:
                    read.append(v)
                elif memory.aliases(u):
                    views.append(u)
                    stack.extend(u.outputs)
        if not ok or not read:
            continue
        nbytes = sum(memory.hint(o.meta.nbytes) for o in n.outputs)
        out.append(Recompute(n, _needed(views, read), nbytes, symbolic.estimate(n.op.cost(n))))
    out += [c for c in (_with_producers(r, users, live) for r in out) if c is not None]
    out.sort(key=lambda r: (max(_RANK[x.node.op.kind] for x in [r, *r.extra]), r.cost / max(r.nbytes, 1)))
    return out


def _with_producers(r: Recompute, users: dict, live: set, depth: int = 3) -> Recompute | None:
    """`r` together with the forward ops making its inputs that nothing else reads, through views and up to
    `depth` ops deep (None if there are none): rotary embeddings' inputs, views of a concatenation of row
    slices, the slices' projections."""
    mine = {x.uid for x in [r.node] + r.views}
    extra: list[Recompute] = []
    frontier = [r.node] + r.views
    for _ in range(depth):
        found = []
        stack = [v for x in frontier for v in x.inputs]
        while stack:
            v = stack.pop()
            p = v.producer
            if p is None or p.uid in mine or p.phase is not Phase.FORWARD or p.op.side_effects or \
                    any(o.meta is None or o in live for o in p.outputs) or \
                    any(u.uid not in mine for o in p.outputs for u in users.get(o, ())):
                continue
            if memory.aliases(p):                   # a view: recomputed with what it views
                mine.add(p.uid)
                stack.extend(p.inputs)
            elif p.op.kind in _RANK:
                mine.add(p.uid)
                found.append(p)
        extra += [Recompute(p, [], 0, symbolic.estimate(p.op.cost(p))) for p in found]
        frontier = found
    return Recompute(r.node, r.views, r.nbytes, r.flops, extra) if extra else None


def _needed(views: list[Node], read: list[Value]) -> list[Node]:
    """The views on a path to a value the backward reads (in forward order)."""
    need, wanted = [], set(read)
    for v in reversed(views):
        if any(o in wanted for o in v.outputs):
            need.append(v)
            wanted.update(v.inputs)
    return need[::-1]


class _Model:
    """The memory model's lifetimes, re-simulated for a set of decisions without rewriting the graph."""

    def __init__(self, graph: Graph):
        self.n = len(graph.nodes)
        self.pos = {x.uid: i for i, x in enumerate(graph.nodes)}
        self.prof = memory.profile(graph)
        self.bufs = [b for b in self.prof.buffers if not b.persistent]
        self.owner = {v: b for b in self.prof.buffers for v in b.values}
        users = graph.users()
        self.fwd_last: dict[int, int] = {}
        self.bwd: dict[int, list[int]] = {}
        for b in self.bufs:
            reads = [(self.pos[u.uid], u.phase) for v in b.values for u in users.get(v, ())]
            self.fwd_last[id(b)] = max([i for i, ph in reads if ph is Phase.FORWARD] + [b.born])
            self.bwd[id(b)] = sorted(i for i, ph in reads if ph is Phase.BACKWARD)

    def peak(self, chosen: list[Recompute]) -> int:
        return self.prof.persistent + max(self.live(chosen), default=0)

    def live(self, chosen: list[Recompute]) -> list[int]:
        """Bytes of the program's own values (and its kernels' temporaries) live at each node."""
        chosen = _expand(chosen)
        dies = {id(b): b.dies for b in self.bufs}
        extra: list[tuple[int, int, int]] = []              # (born, dies, bytes) of recomputed copies
        point: dict[int, int] = {}                          # node uid -> where its copy is made
        mine = {id(self.owner[o]): r for r in chosen for o in r.node.outputs}
        readers: dict[int, list[Recompute]] = {}           # buffer -> the chosen copies reading it
        for q in chosen:
            for b in {id(self.owner[v]) for x in [q.node] + q.views for v in x.inputs if v in self.owner}:
                readers.setdefault(b, []).append(q)
        made: dict[int, list[tuple[Recompute, object, int]]] = {}   # point -> (copy, buffer, its last use)
        for r in sorted(chosen, key=lambda r: -self.pos[r.node.uid]):     # consumers first
            bufs = [self.owner[o] for o in r.node.outputs]
            first = min(i for b in bufs for i in self.bwd[id(b)]) if any(self.bwd[id(b)] for b in bufs) else self.n
            later = [point[q.node.uid] for b in bufs for q in readers.get(id(b), ()) if q.node.uid in point]
            at = min([first] + later)
            point[r.node.uid] = at
            for b in bufs:
                dies[id(b)] = self.fwd_last[id(b)]
                made.setdefault(at, []).append((r, b, max(self.bwd[id(b)] + later + [at])))
        for at, items in made.items():
            extra += self._at_point(at, items, readers, point)
        for r in chosen:                                    # inputs must live until the copy is made
            for x in [r.node] + r.views:
                for v in x.inputs:
                    b = self.owner.get(v)
                    if b is not None and not b.persistent and id(b) not in mine:
                        dies[id(b)] = max(dies[id(b)], point[r.node.uid])
        delta = [0] * (self.n + 2)
        for b in self.bufs:
            delta[b.born] += b.nbytes
            delta[min(dies[id(b)], self.n) + 1] -= b.nbytes
        for born, last, nbytes in extra:
            delta[born] += nbytes
            delta[min(last, self.n) + 1] -= nbytes
        out, cur = [], 0
        for i in range(self.n):
            cur += delta[i]
            out.append(cur + self.prof.workspace[i])
        return out

    def _at_point(self, at: int, items: list, readers: dict, point: dict) -> list[tuple[int, int, int]]:
        """(born, dies, bytes) of the copies made before node `at`. The generated step makes them one after
        the other (producers first) and frees a copy read only by later copies there once they are made, so
        the bytes at `at` are the most the sequence holds at once, not the sum of everything it makes."""
        out = [(at + 1, last, b.nbytes) for r, b, last in items if last > at]
        short = {id(b): b for r, b, last in items if last == at and at not in self.bwd[id(b)]}
        pending = {k: {q.node.uid for q in readers.get(k, ()) if point.get(q.node.uid) == at} for k in short}
        cur = most = 0
        made = set()
        for r in sorted(dict.fromkeys(r for r, _, _ in items), key=lambda r: self.pos[r.node.uid]):
            for q, b, _ in items:
                if q is r:
                    cur += b.nbytes
                    made.add(id(b))
            most = max(most, cur)
            for k in [k for k in pending if k in made]:
                pending[k].discard(r.node.uid)
                if not pending[k]:
                    cur -= short[k].nbytes
                    del pending[k]
        out.append((at, at, most))
        return out


def plan(graph: Graph, budget: int | float | None, outside: int = 0, reference: int | None = None) -> Plan:
    """Which forward nodes to recompute so that the predicted peak fits `budget`: bytes (an int) for the
    whole process, of which it holds `outside` beyond the step's tensors; a fraction of the step's peak
    without rematerialization (a float; of `reference` where given: the unchunked program's); or None (no
    budget: nothing recomputed)."""
    model = _Model(graph)
    before = model.prof.peak
    if isinstance(budget, float):
        budget, outside = int(budget * (reference or before)), 0
    result = Plan(budget, before, before, before, model.prof.persistent, outside=outside if budget else 0)
    if budget is None or before <= result.step_budget:
        return result
    budget = result.step_budget
    cands = candidates(graph)
    chosen, peak = _greedy(model, cands, [], before, budget)
    result.floor = peak
    if peak <= budget:
        chosen, peak = _prune(model, chosen, budget)
        solved = _cheapest_cover(model, cands, budget)
        if solved is not None:
            best, best_peak = _greedy(model, cands, solved, model.peak(solved), budget)
            if best_peak <= budget:
                best, best_peak = _prune(model, best, budget)
                if _flops(best) < _flops(chosen):
                    chosen, peak, result.solver = best, best_peak, "milp"
    result.chosen, result.after = chosen, peak
    return result


def _flops(chosen: list[Recompute]) -> float:
    return sum(r.flops for r in _expand(chosen))


def _greedy(model: _Model, cands: list[Recompute], chosen: list[Recompute], peak: int,
            budget: int) -> tuple[list[Recompute], int]:
    """From `chosen` (predicted `peak`), the candidates in order, each kept only if the peak drops, until it fits."""
    chosen = list(chosen)
    for c in cands:
        if peak <= budget:
            break
        if c in chosen:
            continue
        trial = model.peak(chosen + [c])
        if trial < peak:
            chosen.append(c)
            peak = trial
    return chosen, peak


def _prune(model: _Model, chosen: list[Recompute], budget: int) -> tuple[list[Recompute], int]:
    """Drop the decisions the budget no longer needs, costliest first."""
    peak = model.peak(chosen)
    for c in sorted(chosen, key=lambda r: -r.cost):
        rest = [r for r in chosen if r is not c]
        trial = model.peak(rest)
        if trial <= budget:
            chosen, peak = rest, trial
    return chosen, peak


def _cheapest_cover(model: _Model, cands: list[Recompute], budget: int) -> list[Recompute] | None:
    """The set of candidates of least recomputed FLOPs whose savings cover the excess over the budget at every
    node, each candidate's saving measured alone on the memory model (a covering integer program, solved by
    scipy's HiGHS within SOLVER_SECONDS). Candidates interact (a recomputed input keeps its own input alive
    longer, chains share work), which the sum of single savings does not see: `plan` checks the set on the
    model, completes it greedily and prunes it, and keeps it only where it costs less than the greedy plan.
    None without scipy, when the program has no solution, or on time out."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError:
        return None
    base = np.array(model.live([]), dtype=np.float64)
    excess = base - (budget - model.prof.persistent)
    over = np.nonzero(excess > 0)[0]
    if over.size == 0:
        return []
    useful, columns = [], []
    for c in cands:
        saving = base[over] - np.array(model.live([c]), dtype=np.float64)[over]
        if saving.max() > 0:
            useful.append(c)
            columns.append(saving)
    if not useful:
        return None
    # rows: the nodes over the budget (identical rows once); units of MiB keep the numbers well scaled
    rows = np.unique(np.column_stack(columns + [excess[over]]) / 2 ** 20, axis=0)
    a, need = rows[:, :-1], rows[:, -1]
    cost = np.array([c.cost for c in useful]) / 1e9 + 1e-3           # GFLOP, and a little per decision
    res = milp(cost, constraints=LinearConstraint(a, lb=need, ub=np.inf), integrality=np.ones(len(useful)),
               bounds=Bounds(0, 1), options={"time_limit": SOLVER_SECONDS})
    if res.x is None:
        return None
    return [c for c, x in zip(useful, res.x) if x > 0.5]


def apply(graph: Graph, chosen: list[Recompute]) -> int:
    """Rewrite the graph: each chosen node (and the views the backward reads) is copied into the backward
    right before its first use there, and backward reads take the copy. Returns the nodes added."""
    todo = {x.uid: x for r in _expand(chosen) for x in [r.node] + r.views}
    copies: dict[Value, Value] = {}
    out: list[Node] = []

    def recomputed(v: Value) -> bool:
        """Whether v comes from a recomputed node, directly or through views (a view of a recomputed value
        is recomputed too: reading the forward's would keep its storage alive)."""
        p = v.producer
        while p is not None and p.uid not in todo and memory.aliases(p):
            p = next(i for i in p.inputs if i.meta is not None).producer
        return p is not None and p.uid in todo

    def emit(x: Node) -> None:
        for v in x.inputs:                      # its recomputed inputs first (chains share the work)
            if v not in copies and recomputed(v):
                emit(v.producer)
        args, kwargs = tree_map_values(lambda v: copies.get(v, v), (x.args, x.kwargs))
        outs = [Value(graph.fresh_name(f"{o.name}_re"), o.meta) for o in x.outputs]
        copy = Node(x.op, x.target, args, kwargs, outs, Phase.BACKWARD, x.scope, fused=x.fused)
        for o, c in zip(x.outputs, outs):
            c.producer = copy
            copies[o] = c
        out.append(copy)

    added = 0
    for n in graph.nodes:
        if n.phase is Phase.BACKWARD:
            for v in n.inputs:
                if v not in copies and recomputed(v):
                    before = len(out)
                    emit(v.producer)
                    added += len(out) - before
            n.args, n.kwargs = tree_map_values(lambda v: copies.get(v, v), (n.args, n.kwargs))
        out.append(n)
    graph.nodes = out
    return added


class BudgetUnmet(KilnError):
    """A budget no plan meets; `plan.floor` is the smallest peak reached. The step compiles again with the
    forward's row-wise blocks in slices while that lowers the floor (kiln/passes/chunk.py)."""

    def __init__(self, message: str, plan: Plan):
        super().__init__(message)
        self.plan = plan


def rematerialize(graph: Graph, budget: int | float | None, outside: int = 0, amp: bool = False,
                  reference: int | None = None, chunking=None) -> Plan:
    """`plan` and `apply`; a budget the plan cannot meet raises `BudgetUnmet`, naming the smallest peak
    reachable (and, without `amp` on, suggesting it). A fractional budget is of `reference` where given."""
    result = plan(graph, budget, outside, reference)
    result.chunking = chunking
    if result.budget is not None and result.after > result.step_budget:
        held = (f"; the process holds {_size(result.outside)} besides (torch, the model's Python side, other "
                f"tensors), which the budget covers too, so the budget must be at least "
                f"{_size(result.floor + result.outside)}") if result.outside else ""
        sliced = (f", with the forward's row-wise blocks in {chunking.chunks} slices of rows"
                  if chunking is not None and chunking.chunks > 1 else "")
        raise BudgetUnmet(
            f"memory_budget of {_size(result.budget)} cannot be met: the smallest predicted peak Kiln reaches for "
            f"this batch is {_size(result.floor)}{sliced} ({_size(result.persistent)} of it parameters, optimizer "
            f"state, buffers and the batch; {_size(reference or result.before)} without rematerialization){held}. "
            "Give a larger budget" + (" or a smaller batch" if amp else ", a smaller batch, or amp='bf16'"), result)
    if result.chosen:
        apply(graph, result.chosen)
    return result


def _size(nbytes: int) -> str:
    """Bytes in MiB, or KiB below one MiB (a tiny model's peak is not '0 MiB')."""
    return f"{nbytes / 2 ** 20:.0f} MiB" if nbytes >= 2 ** 20 else f"{nbytes / 2 ** 10:.0f} KiB"
