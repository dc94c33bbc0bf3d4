"""Data parallel: the gradient collectives of a step, inserted as graph ops (`kiln.DataParallel`).

Two passes of the pipeline, around the optimizer:

`reduce_gradients` (after autodiff). The trainable parameters' gradients are grouped into buckets in the
order the backward produces them (`kiln/distributed/layout.py`; the first program fixes the layout, later
programs reuse it). Inserted:
- `step_begin` first: counts the step attempt (lockstep check);
- `loss_start` right after the loss: all-reduce of the loss (the guard decides on the mean loss, so
  every rank decides alike) and of the attempt count;
- one `reduce_start` per bucket right after its last gradient: the gradients, divided by the world
  size, copied into one flat buffer whose all-reduce (zero=0) or reduce-scatter (ZeRO) starts at once
  and runs while the rest of the backward computes;
- the waits just before the update. zero=0: each gradient becomes its averaged copy; ZeRO: one update
  per bucket, on this rank's shard of the parameters (`shard_params`), out of place.
Every start takes the previous collective's handle as an input (`after`): the issue order is a data
dependency, the same on every rank, whatever later passes (regions) reorder.

`gather_params` (after the optimizer, ZeRO): each updated shard's all-gather starts right after its
update; the waits at the end stage every parameter's write, applied at the step's commit. With overlap,
a bucket's wait and update move into the backward (after the next bucket's collective is issued) where
nothing they read comes later, so its all-gather overlaps the rest of the backward.

The optimizer pass asks the `Plan` for what needs every rank when gradients are sharded: the guard
(`check_finite`), the clipping norm (`grad_norm`), fp16's overflow flag (`sum_over_ranks`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.distributed.layout import Bucket, plan_buckets
from kiln.errors import KilnError
from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Node, Phase, Role, TensorMeta, Value
from kiln.ops import collectives as C
from kiln.ops.registry import Kind

ZERO_STATE = "__zero__.bucket"   # step.state key of a ZeRO bucket's shard of optimizer state: ZERO_STATE + index
SCOPE = "data_parallel"


@dataclass
class Plan:
    """What `reduce_gradients` decided, read by the optimizer and `gather_params` passes and by `explain`."""

    comm: object                  # kiln.distributed.comm.Comm
    zero: int
    layout: tuple[Bucket, ...]
    loss: Value                   # the loss averaged over the ranks: what the non-finite guard checks
    last: Value                   # the latest collective's handle: the next one is issued after it

    @property
    def sharded(self) -> bool:
        return self.zero > 0

    def _chain(self, b: Builder, op, args: tuple, meta) -> Value:
        (out,) = b.emit(op, (self.comm, self.last, *args), {}, metas=[meta])
        self.last = out
        return out

    def sum_over_ranks(self, b: Builder, x: Value) -> Value:
        return self._chain(b, C.SUM_OVER_RANKS, (x,), x.meta)

    def grad_norm(self, b: Builder, grads: list[Value]) -> Value:
        """The global 2-norm: one Kiln op (the same kernel on every rank, so zero=0 replicas stay equal);
        over shards, the squares are all-reduced."""
        meta = TensorMeta((), torch.float32, (), grads[0].meta.device)
        if not self.sharded:
            (out,) = b.emit(C.GRAD_NORM, (None, None, grads), {}, metas=[meta])
            return out
        return self._chain(b, C.GRAD_NORM, (grads,), meta)

    def check_finite(self, b: Builder, loss: Value, grads: list[Value], names: list[str], mode: str) -> None:
        if mode != "ignore":
            self._chain(b, C.CHECK_FINITE_RANKS, (loss, grads, tuple(names), mode),
                        TensorMeta((1,), torch.float32, (1,), loss.meta.device))


class _Inserts:
    """Nodes to insert after given positions of the graph (-1: before the first node), then spliced in."""

    def __init__(self, graph: Graph):
        self.graph, self.after = graph, {}

    def emit(self, at: int, phase: Phase, scope: str, op, args: tuple, metas: list, name: str | None = None):
        b = Builder(self.graph, phase, scope, dest=self.after.setdefault(at, []))
        return b.emit(op, args, {}, name=name, metas=metas)

    def splice(self) -> int:
        nodes: list[Node] = list(self.after.get(-1, ()))
        for i, n in enumerate(self.graph.nodes):
            nodes.append(n)
            nodes.extend(self.after.get(i, ()))
        added = len(nodes) - len(self.graph.nodes)
        self.graph.nodes = nodes
        return added


def _contiguous(shape, dtype, device) -> TensorMeta:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return TensorMeta(tuple(shape), dtype, tuple(reversed(stride)), device)


def reduce_gradients(ctx) -> int:
    """The pass (see the module docstring); a no-op without data parallel. Returns the nodes added."""
    dp = ctx.parallel
    if dp is None:
        return 0
    from kiln.passes.pipeline import Update       # the pipeline imports this module
    g, comm, zero = ctx.graph, dp.comm, dp.zero
    pos = {n.uid: i for i, n in enumerate(g.nodes)}

    def born(v: Value) -> int:
        return pos[v.producer.uid] if v.producer is not None else -1
    order = sorted(range(len(ctx.updates)), key=lambda i: born(ctx.updates[i].grad))   # as the backward makes them
    ups = [ctx.updates[i] for i in order]
    layout = dp.layout or plan_buckets([(u.param.source, u.param.meta.shape, u.param.meta.dtype,
                                         u.param.meta.device) for u in ups], dp.bucket_mb, comm.world, comm.rank)
    _check_layout(layout, ups)
    by_name = {u.param.source: u for u in ups}
    ins = _Inserts(g)
    (token,) = ins.emit(-1, Phase.FORWARD, SCOPE, C.STEP_BEGIN, (comm,), [None])
    loss = g.outputs[0]
    issue_at = born(loss)
    (loss_handle,) = ins.emit(issue_at, Phase.FORWARD, SCOPE, C.LOSS_START, (comm, token, loss), [None])
    last, handles = loss_handle, []
    for bucket in layout:
        members = [by_name[name] for name in bucket.names]
        # overlap: issued as soon as the bucket's last gradient exists; else all at the end of the backward
        issue_at = max(issue_at, *(born(u.grad) for u in members)) if dp.overlap else len(g.nodes) - 1
        (last,) = ins.emit(issue_at, Phase.BACKWARD, f"{SCOPE}.bucket{bucket.index}", C.REDUCE_START,
                           (comm, bucket, zero, last, [u.grad for u in members]), [None])
        handles.append(last)
    end = len(g.nodes) - 1              # the waits: just before the update
    (mean_loss,) = ins.emit(end, Phase.OPTIMIZER, SCOPE, C.LOSS_WAIT, (loss_handle,),
                            [TensorMeta((), loss.meta.dtype, (), loss.meta.device)])
    reduced: dict[int, Update] = {}
    sharded: list[Update] = []
    for bucket, h in zip(layout, handles):
        members = [by_name[name] for name in bucket.names]
        scope = f"{SCOPE}.bucket{bucket.index}"
        if not zero:
            metas = [_contiguous(s, bucket.dtype, bucket.device) for s in bucket.shapes]
            outs = ins.emit(end, Phase.OPTIMIZER, scope, C.REDUCE_WAIT, (h, 0), metas)
            for u, o in zip(members, outs):
                reduced[id(u)] = dataclasses.replace(u, grad=o)
            continue
        flat = _contiguous((bucket.shard_size,), bucket.dtype, bucket.device)
        (grad,) = ins.emit(end, Phase.OPTIMIZER, scope, C.REDUCE_WAIT, (h, zero), [flat])
        (shard,) = ins.emit(end, Phase.OPTIMIZER, scope, C.SHARD_PARAMS, (bucket, [u.param for u in members]), [flat],
                            name=f"bucket{bucket.index}")
        sharded.append(Update(shard, grad, bucket.label(), f"{ZERO_STATE}{bucket.index}", out_of_place=True))
    ctx.updates = sharded if zero else [reduced[id(u)] for u in ctx.updates]    # zero=0: parameter order
    ctx.collectives = Plan(comm, zero, layout, mean_loss, last)
    return ins.splice()


def gather_params(ctx) -> int:
    """ZeRO: all-gather each bucket's updated shard (started right after its update), then stage the
    parameters' writes (at the end: the step commits them with everything else).

    With `overlap=True` and no memory budget, a bucket's wait, update and all-gather move into the backward,
    right after the next bucket's collective is issued (`_update_early`), so the all-gathers overlap the rest
    of the backward instead of starting after it."""
    plan = ctx.collectives
    if plan is None or not plan.sharded:
        return 0
    g = ctx.graph
    params = {v.source: v for v in g.inputs_with(Role.PARAM)}
    ups = [u for u in ctx.updates if u.out_of_place]
    # not under a memory budget: a gathered bucket would then be held through the backward's peak, and the
    # memory model does not see the collectives' buffers
    early = _update_early(g, plan, ups) if ctx.parallel.overlap is True and ctx.memory_budget is None else {}
    pos = {n.uid: i for i, n in enumerate(g.nodes)}
    ins = _Inserts(g)
    handles = []
    for bucket, u in zip(plan.layout, ups):
        at = early.get(bucket.index, u.new.producer)
        (h,) = ins.emit(pos[at.uid], Phase.OPTIMIZER, f"{SCOPE}.bucket{bucket.index}", C.GATHER_START,
                        (plan.comm, bucket, None, u.new), [None])
        handles.append(h)
    for bucket, h in zip(plan.layout, handles):
        ins.emit(len(g.nodes) - 1, Phase.OPTIMIZER, f"{SCOPE}.bucket{bucket.index}", C.GATHER_WAIT,
                 (h, [params[name] for name in bucket.names]), [])
    added = ins.splice()
    plan.last = _chain_in_order(g)
    return added


def _update_early(g: Graph, plan: Plan, ups: list) -> dict[int, Node]:
    """Moves each bucket's wait, shard copy and out-of-place update (every optimizer-phase node its new
    shard is computed from) to right after the next bucket's collective is issued, where the bucket's own
    collective has had a bucket's worth of backward to complete. Returns {bucket index: the last moved
    node}, after which its all-gather starts.

    Only where that is exact: the moved nodes may read nothing computed after that point but their own
    wait (graph inputs, this bucket's handle), so an update that needs every gradient (the clipping norm,
    fp16's overflow flag) stays after the backward. The non-finite guard stays at the end: the updates
    only stage their writes, so a guard that raises or skips drops them with the rest of the step."""
    starts = {n.args[1].index: n for n in g.nodes if n.op is C.REDUCE_START}
    moved: dict[int, Node] = {}
    taken: set[int] = set()        # moved for an earlier bucket (a node two updates share): already in place
    for bucket, u in zip(plan.layout[:-1], ups):
        anchor = starts.get(bucket.index + 1)
        nodes = _optimizer_slice(u.new) if anchor is not None and u.new is not None else None
        nodes = [n for n in nodes or () if n.uid not in taken]
        if not nodes:
            continue
        pos = {n.uid: i for i, n in enumerate(g.nodes)}
        mine = {n.uid for n in nodes}
        if any(v.producer is not None and v.producer.uid not in mine and pos[v.producer.uid] > pos[anchor.uid]
               for n in nodes for v in n.inputs):
            continue
        rest = [n for n in g.nodes if n.uid not in mine]
        at = rest.index(anchor) + 1
        g.nodes = rest[:at] + sorted(nodes, key=lambda n: pos[n.uid]) + rest[at:]
        moved[bucket.index] = max(nodes, key=lambda n: pos[n.uid])
        taken |= mine
    return moved


def _optimizer_slice(new: Value) -> list[Node] | None:
    """The optimizer-phase nodes `new` is computed from; None when one of them is a collective other than
    its bucket's wait and shard copy (a norm or flag over every rank's gradients)."""
    seen, stack, out = set(), [new.producer], []
    while stack:
        n = stack.pop()
        if n is None or n.uid in seen or n.phase is not Phase.OPTIMIZER:
            continue
        seen.add(n.uid)
        if n.op.kind is Kind.COLLECTIVE and n.op not in (C.REDUCE_WAIT, C.SHARD_PARAMS):
            return None
        out.append(n)
        stack.extend(v.producer for v in n.inputs)
    return out


def _chain_in_order(g: Graph) -> Value | None:
    """Each collective's `after` argument becomes the handle of the collective issued before it in the
    program's order (passes may have moved them): the issue order is the same data dependency on every
    rank. Returns the last one."""
    last = None
    for n in g.nodes:
        if n.op is C.LOSS_START:            # the first collective of a step
            last = n.outputs[0]
            continue
        at = C.AFTER.get(n.op.name)
        if at is None or n.args[0] is None:
            continue
        if last is not None:
            n.args = n.args[:at] + (last,) + n.args[at + 1:]
        last = n.outputs[0]
    return last


def _check_layout(layout: tuple[Bucket, ...], ups: list) -> None:
    """Later programs reuse the first program's buckets: they must give gradients to the same parameters."""
    have = {u.param.source: (tuple(u.param.meta.shape), u.param.meta.dtype) for u in ups}
    want = {n: (tuple(s), b.dtype) for b in layout for n, s in zip(b.names, b.shapes)}
    if have != want:
        new, gone = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        changed = sorted(n for n in set(have) & set(want) if have[n] != want[n])
        raise KilnError("data parallel: this program gives gradients to other parameters than the step's first "
                        f"program (gradient buckets are laid out once): new {new[:5]}, missing {gone[:5]}, changed "
                        f"{changed[:5]}. Every input must train the same parameters (no module skipped by a branch); "
                        "freeze parameters that are not always used (requires_grad=False) before kiln.compile")


def summary(graph: Graph, seconds: list[float] | None = None) -> list[str]:
    """For `explain`: each collective in the order it is issued, its bucket, where it is waited for and
    the ops it overlaps with (those between its start and its wait; measured time with `profile=True`)."""
    starts = [(i, n) for i, n in enumerate(graph.nodes) if n.op in C.STARTS]
    if not starts:
        return []
    wait_at = {id(n.args[0]): j for j, n in enumerate(graph.nodes) if n.op in C.WAITS}
    comm = starts[0][1].args[0]
    buckets = [n.args[1] for _, n in starts if n.op is C.REDUCE_START]
    zero = starts[1][1].args[2] if len(starts) > 1 and starts[1][1].op is C.REDUCE_START else 0
    lines = [f"collectives: data parallel over {comm.world} ranks, zero={zero}, {len(buckets)} gradient bucket(s) of "
             f"{sum(b.nbytes for b in buckets) / 2 ** 20:.2f} MiB in all; each starts after the op before it and "
             "overlaps the ops up to its wait:"]
    for i, n in starts:
        j = wait_at.get(id(n.outputs[0]), i)
        between = [m for m in graph.nodes[i + 1:j] if m.op.kind is not Kind.COLLECTIVE]
        if n.op is C.LOSS_START:
            what = "all-reduce of the loss (and the lockstep count)"
        else:
            b = n.args[1]
            kind = "all-gather of parameters" if n.op is C.GATHER_START else (
                "reduce-scatter of gradients" if n.args[2] else "all-reduce of gradients")
            what = f"{kind}, {b.label()}, {b.nbytes / 2 ** 20:.2f} MiB"
        scopes = [m.scope.split(":")[0] for m in between if m.scope and not m.scope.startswith(SCOPE)]
        where = f" ({scopes[0]} .. {scopes[-1]})" if scopes else ""
        ms = (f", {sum(seconds[k] for k in range(i + 1, j) if graph.nodes[k] in between) * 1000:.1f} ms measured"
              if seconds is not None else "")
        lines.append(f"  #{i} {what}: waited at #{j}; overlaps {len(between)} ops{ms}{where}")
    last = comm.last
    if last:
        lines.append(f"  latest step: collectives running {last['comm_s'] * 1000:.1f} ms, of which the step waited "
                     f"{last['blocked_s'] * 1000:.1f} ms (the rest hidden behind compute); gradient buffers held at "
                     f"most {last['peak_grad_bytes'] / 2 ** 20:.2f} MiB")
    return lines
