"""THE compilation pipeline: reading this list tells the whole story of a compilation.

capture -> forward clean-up -> autodiff -> optimizer -> training-graph clean-up -> regions, dispatch
-> (the step's tuner realizes their requests: compiles, measures, caches) -> region placement.
Passes are pure graph-to-graph functions: what needs compiling or timing is recorded on the `Context`
(`regions`: candidate regions wanting a kernel; `choices`: nodes whose measured kernel needs a choice)
for `tuning.Tuner.realize`, which `CompiledStep` calls between `PIPELINE` and `AFTER_TUNING`.
Set KILN_DUMP=1 to print the graph after every pass; `verify=True` runs the verifier after each.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kiln.autodiff import differentiate
from kiln.guards import emit_check
from kiln.ir.builder import Builder
from kiln.ir.graph import Graph, Phase, Role, TensorMeta, Value
from kiln.ir.printer import format_graph
from kiln.optim import (ACCUMULATE, LOSS_SCALE, RECORD_METRIC, ZERO_ACCUMULATED, Optimizer, clip_by_global_norm,
                        unscale_and_check)
from kiln.passes.amp import AmpPolicy, autocast
from kiln.passes.canonicalize import canonicalize, lower_dialects
from kiln.passes.chunk import chunk_rows
from kiln.passes.accumulate import fold_accumulation, fold_column_sums
from kiln.passes.casts import fold_narrowing_casts, fold_widening_casts
from kiln.passes.schedule import Schedule, schedule_backward
from kiln.passes.collectives import gather_params, reduce_gradients
from kiln.passes.cse import common_subexpression_elimination
from kiln.passes.dce import dead_code_elimination
from kiln.passes.dispatch import dispatch
from kiln.passes.keep_probs import keep_attention_probs
from kiln.passes.fuse import fuse
from kiln.passes.noops import remove_noops
from kiln.passes.regions import find_regions, place_regions
from kiln.passes.remat import rematerialize
from kiln.passes.verify import verify

log = logging.getLogger("kiln")
aten = torch.ops.aten


@dataclass
class Update:
    """One optimizer update, from `autodiff` to `optimizer` (the `collectives` pass may rewrite them)."""

    param: Value                 # the trainable parameter; ZeRO: this rank's flat shard of a bucket's parameters
    grad: Value                  # its gradient (data parallel: averaged over the ranks, or this rank's shard)
    name: str                    # what messages call it
    state: str                   # key of its optimizer state in the step's state (the parameter's source)
    out_of_place: bool = False   # ZeRO: the update returns the new values (`new`), all-gathered before the commit
    new: Value | None = None


@dataclass
class Context:
    graph: Graph                   # graph.outputs[0] is the loss
    optimizer: Optimizer
    dialects: tuple[str, ...]
    amp: AmpPolicy | None = None
    verify: bool = False
    nonfinite: str = "raise"       # kiln.guards.NONFINITE
    parallel: object = None        # data parallel (kiln.runtime.parallel.Parallel): the collectives pass's input
    timings: list[tuple[str, float, int]] = field(default_factory=list)   # (pass, seconds, nodes after)
    regions: list = field(default_factory=list)  # every fused region considered (kiln.passes.regions.Region)
    choices: list = field(default_factory=list)  # nodes whose measured kernel the tuner chooses (registry.select)
    memory_budget: int | float | None = None     # bytes, or a fraction of the unconstrained peak (remat)
    heap_outside: int = 0          # bytes the process holds beyond the step's tensors (a byte budget covers them)
    memory: object = None                        # what the remat pass decided (kiln.passes.remat.Plan)
    schedule: object = None                      # what the schedule pass did (kiln.passes.schedule.Schedule)
    updates: list[Update] = field(default_factory=list)   # autodiff -> (collectives) -> optimizer
    loss_scale: Value | None = None                       # fp16: the backward's seed, a state input
    collectives: object = None     # data parallel: the collectives pass's Plan (kiln/passes/collectives.py)
    accumulate: int = 1            # gradient accumulation: micro-batches per update (loss seeded with 1/N)
    update: bool = True            # accumulate > 1: whether this program is the cycle's last micro-step
    chunks: int = 1                # row slices of the forward's row-wise blocks (a budget remat alone misses)
    chunking: object = None        # what the chunk pass found and did (kiln.passes.chunk.Chunking)
    peak_reference: int | None = None    # a fractional budget is of this peak (the unchunked program's)


def add_backward(ctx: Context) -> int:
    """Autodiff w.r.t. every trainable parameter: one `Update` per parameter that gets a gradient."""
    g = ctx.graph
    params = g.inputs_with(Role.PARAM)
    scaling = ctx.amp is not None and ctx.amp.dtype == torch.float16
    scale = g.add_input("loss_scale", _scalar_meta(torch.float32), Role.STATE, f"{AMP_STATE}:scale") if scaling else None
    ctx.loss_scale = scale
    loss = g.outputs[0]
    if ctx.accumulate > 1:         # as eager's (loss / N).backward(): the backward starts from 1/N
        scale = Builder(g, Phase.BACKWARD, scope="accumulate")(
            aten.full.default, [], 1.0 / ctx.accumulate, dtype=loss.meta.dtype, device=loss.meta.device)
    grads = differentiate(g, loss, params, seed=scale)
    for p in params:
        if p not in grads:
            log.info("kiln: parameter %s gets no gradient from this loss; it is not updated", p.source)
    ctx.updates = [Update(p, grads[p], p.source, p.source) for p in params if p in grads]
    return len(ctx.updates)


def add_update(ctx: Context) -> int:
    """The optimizer as graph code: non-finite guard (or fp16 unscaling), clipping, one update per `Update`.
    Data parallel (`ctx.collectives`): the guard reads the loss averaged over the ranks; with ZeRO shards
    the guard, the clipping norm and fp16's overflow flag are decided over every rank's shards."""
    g = ctx.graph
    plan = ctx.collectives
    sharded = plan is not None and plan.sharded
    b = Builder(g, Phase.OPTIMIZER, scope="optimizer")
    updated = ctx.updates
    gs = [u.grad for u in updated]
    loss = plan.loss if plan is not None else g.outputs[0]
    found_inf = None
    if ctx.accumulate > 1:         # the step's persistent gradient sums, one per parameter
        accs = [g.add_input(f"{u.param.name}__grad_sum", u.param.meta, Role.STATE, f"{ACCUM_STATE}:{u.state}")
                for u in updated]
        if not ctx.update:         # a micro-step: guard, then the sums grow at the commit; no update
            b.scope = "optimizer:accumulate"
            emit_check(b, loss, gs, [u.name for u in updated], ctx.nonfinite)
            b.emit(ACCUMULATE, (accs, gs), {}, metas=[])
            return 0
        gs = [b(aten.add.Tensor, a, grad) for a, grad in zip(accs, gs)]   # eager's order: ((g1 + g2) + ...) + gN
    if ctx.loss_scale is not None:
        gs, found_inf = unscale_and_check(b, gs, ctx.loss_scale)
        if sharded:
            found_inf = plan.sum_over_ranks(b, found_inf)     # overflow on any rank skips every rank's update
    elif sharded:
        plan.check_finite(b, loss, gs, [u.name for u in updated], ctx.nonfinite)
    else:                          # fp16's loss scaler skips overflowing steps itself
        emit_check(b, loss, gs, [u.name for u in updated], ctx.nonfinite)
    if ctx.optimizer.max_grad_norm is not None and gs:
        gs, total = clip_by_global_norm(b, gs, ctx.optimizer.max_grad_norm,
                                        total=plan.grad_norm(b, gs) if plan is not None else None)
        b.scope = "optimizer:grad_norm"         # reported as step.grad_norm (what clip_grad_norm_ returns)
        sink = g.add_input("grad_norm", _scalar_meta(torch.float32, total.meta.device), Role.STATE,
                           f"{METRICS}:grad_norm")
        b.emit(RECORD_METRIC, (sink, total), {}, metas=[])
    opt = ctx.optimizer
    hypers: dict[int, dict[str, Value]] = {}       # per parameter group: its runtime scalars (lr, betas, ...)
    for u, grad in zip(updated, gs):
        group = opt.group_of(u.state)
        if group is None:                           # a torch optimizer that does not hold this parameter
            log.info("kiln: parameter %s is in no parameter group of the optimizer; it is not updated", u.name)
            continue
        if group not in hypers:
            hypers[group] = {k: g.add_input(f"g{group}_{k}", None, Role.SCALAR, f"{group}:{k}")
                             for k in opt.scalar_keys}
        state = {slot: g.add_input(f"{u.param.name}__{slot}", _state_meta(u.param, slot), Role.STATE,
                                   f"{u.state}:{slot}") for slot in opt.slots_of(group)}
        b.scope = f"optimizer:{u.name}"
        if u.out_of_place:
            u.new = opt.emit_update_out(b, u.param, grad, state, hypers[group], found_inf, group)
        else:
            opt.emit_update(b, u.param, grad, state, hypers[group], found_inf, group)
    if ctx.accumulate > 1:
        b.scope = "optimizer:accumulate"
        b.emit(ZERO_ACCUMULATED, (accs,), {}, metas=[])
    if ctx.loss_scale is not None:
        b.scope = "optimizer:loss_scale"
        tracker = g.add_input("growth_tracker", _scalar_meta(torch.int32), Role.STATE, f"{AMP_STATE}:growth_tracker")
        b.emit(LOSS_SCALE, (ctx.loss_scale, tracker, found_inf, *ctx.amp.scaler), {}, metas=[])
    return len(updated)


METRICS = "__metrics__"    # source prefix of numbers the step reports (`CompiledStep.grad_norm`), not state
AMP_STATE = "__amp__"      # optimizer-state entry holding the fp16 loss scale and its growth tracker
ACCUM_STATE = "__accum__"  # source prefix of the gradient sums (`CompiledStep.grad_sums`, not optimizer state)


def _scalar_meta(dtype, device=None):
    return TensorMeta((), dtype, (), device or torch.device("cpu"))


def _state_meta(p: Value, slot: str):
    return _scalar_meta(torch.float32) if slot == "step" else p.meta


def _schedule(ctx: Context) -> int:
    ctx.schedule = schedule_backward(ctx.graph)
    return ctx.schedule.moved


def _chunk(ctx: Context) -> int:
    if ctx.memory_budget is None:       # only a budget remat alone cannot meet asks for slices
        return 0
    ctx.chunking = chunk_rows(ctx.graph, ctx.chunks)
    return ctx.chunking.blocks


def _remat(ctx: Context) -> int:
    if ctx.memory_budget is None:       # no budget: nothing to decide (step.memory() profiles the program)
        return 0
    ctx.memory = rematerialize(ctx.graph, ctx.memory_budget, ctx.heap_outside, amp=ctx.amp is not None,
                               reference=ctx.peak_reference, chunking=ctx.chunking)
    return len(ctx.memory.chosen)


def _limit(ctx: Context) -> int | None:
    """The bytes a budget leaves the step's peak (regions must not push it past them), or None."""
    plan = ctx.memory
    return plan.step_budget if plan is not None and plan.budget is not None else None


Pass = tuple[str, Callable[[Context], object]]

PIPELINE: list[Pass] = [
    # forward graph, as captured by torch.export
    ("canonicalize", lambda c: canonicalize(c.graph)),            # composite ops -> ops with backward kernels
    ("lower_dialects", lambda c: lower_dialects(c.graph, c.dialects)),  # attention -> chosen dialect's kernels
    ("remove_noops", lambda c: remove_noops(c.graph)),
    ("cse", lambda c: common_subexpression_elimination(c.graph)),
    ("dce", lambda c: dead_code_elimination(c.graph)),
    ("fuse", lambda c: fuse(c.graph, c.dialects, "forward")),     # dialect fusion patterns -> fused ops
    ("amp", lambda c: autocast(c.graph, c.amp) if c.amp else 0),   # casts per op cast class (bf16/fp16)
    ("chunk", _chunk),                   # a budget remat alone misses: row-wise blocks run on row slices
    # the training graph: forward + backward + update
    ("autodiff", add_backward),                                   # gradients of the trainable parameters
    ("collectives", reduce_gradients),   # data parallel: gradient buckets, async all-reduce / reduce-scatter
    ("optimizer", add_update),           # guard, clipping, one update per gradient (ZeRO: per shard, out of place)
    ("gather_params", gather_params),    # ZeRO: updated shards all-gathered, parameter writes staged
    ("remove_noops", lambda c: remove_noops(c.graph)),
    ("cse", lambda c: common_subexpression_elimination(c.graph)),
    ("dce", lambda c: dead_code_elimination(c.graph)),
    ("fuse", lambda c: fuse(c.graph, c.dialects, "training")),    # e.g. all AdamW updates -> one kernel
    # residual gradients' sums into the kernel that makes one addend (rms_norm_backward's grad_sum)
    # and bias gradients' sums into the kernel making the summed gradient (gelu_backward's twin); a tied
    # embedding's two gradients summed by embedding_dense_backward's twin
    ("fold_accumulation",
     lambda c: fold_accumulation(c.graph, c.dialects) + fold_column_sums(c.graph, c.dialects)),
    # bf16 -> fp32 casts read by ops that promote; fp32 -> bf16 casts of kernel outputs into the kernels
    # (and the bias sums of the outputs those casts become: layer_norm_backward's low copy)
    ("fold_casts", lambda c: fold_widening_casts(c.graph) + fold_narrowing_casts(c.graph)
     + fold_column_sums(c.graph, c.dialects)),
    # attention's forward keeps its probabilities for its backward where they are small (no budget)
    ("keep_probs", lambda c: keep_attention_probs(c.graph, c.dialects, c.memory_budget)),
    ("schedule", _schedule),             # the backward's independent ops reordered where the predicted peak drops
    ("remat", _remat),                   # under a memory budget: activations recomputed in the backward
    ("regions", lambda c: c.regions.extend(find_regions(c.graph, c.dialects, _limit(c)))),   # elementwise/reduction regions: kernels wanted
    ("dispatch", lambda c: dispatch(c.graph, c.dialects, c.choices)),   # each node -> a dialect's kernel (measured: a choice)
]

# after the step's tuner has given the regions their kernels and made the choices (`Tuner.realize`)
AFTER_TUNING: list[Pass] = [
    ("place_regions", lambda c: place_regions(c.graph, c.regions, c.dialects)),   # regions with a kernel -> one node each
]


def run_pipeline(ctx: Context, passes: list[Pass] = PIPELINE) -> Context:
    dump = os.environ.get("KILN_DUMP") == "1"
    for name, fn in passes:
        t0 = time.perf_counter()
        fn(ctx)
        ctx.timings.append((name, time.perf_counter() - t0, len(ctx.graph.nodes)))
        if ctx.verify:
            verify(ctx.graph, name)
        if dump:
            print(f"==== after {name} ({len(ctx.graph.nodes)} nodes) ====\n{format_graph(ctx.graph)}")
    return ctx
