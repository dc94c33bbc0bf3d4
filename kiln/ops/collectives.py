"""Collective ops of data-parallel steps: what `kiln/passes/collectives.py` inserts, one block per op.

Each op is a Kiln op of kind COLLECTIVE with side effects (never merged, moved or removed), run by the
`aten` dialect (torch.distributed is PyTorch's own engine). Their first argument is the step's
`kiln.distributed.comm.Comm`; every start op also takes `after`, the previous collective's handle, so
the order in which a rank issues its collectives is a data dependency that no pass can change: every
rank issues them in the same order, which is what matches them up across ranks.

A start op returns a handle (a non-tensor value, `Pending`) at once; its wait op, placed just before the
update, blocks (at most `timeout`) and returns the result. Nothing here writes parameters or state: the
all-gathered parameters are staged (kiln/transaction.py) and written at the step's commit, after every
collective of the step has completed.
"""
from __future__ import annotations

import torch

from kiln.errors import StepError
from kiln.ops.registry import Cast, Kind, OpDef, register
from kiln.transaction import stage


def _op(fn, doc: str, cost=lambda n: 1.0) -> OpDef:
    return register(OpDef(f"kiln.{fn.__name__}", (fn,), None, Kind.COLLECTIVE, Cast.FOLLOW, differentiable=False,
                          side_effects=True, infer=lambda args, kwargs: [None], cost=cost, doc=doc))


def _bucket_cost(n) -> float:
    return float(n.args[1].size)


# ---- the start of a step: lockstep count --------------------------------------------------------
def step_begin(comm):
    """Counts the step attempt (and refuses to run when an earlier step left this rank out of step)."""
    return (comm.begin(),)


STEP_BEGIN = _op(step_begin, "a data-parallel step starts: counts the attempt, refuses a rank out of step")


# ---- the loss: averaged over the ranks, with the lockstep check ----------------------------------
def loss_start(comm, after, loss):
    """All-reduce of [loss, attempt, attempt^2] in float64, started right after the forward."""
    a = float(comm.attempts)
    buf = torch.tensor([0.0, a, a * a], dtype=torch.float64, device=loss.device)
    buf[0] = loss.detach().reshape(())
    return (comm.issue("the loss all-reduce", "all_reduce", buf, buf, info=loss.dtype),)


def loss_wait(pending):
    """The loss averaged over the ranks (what the non-finite guard checks); refuses ranks out of step:
    equal sums of a and a^2 over the ranks mean every rank is at the same attempt a."""
    buf = pending.wait()
    comm, a, n = pending.comm, float(pending.comm.attempts), pending.comm.world
    if buf[1].item() != n * a or buf[2].item() != n * a * a:
        comm.broken = ("the ranks are out of step: they ran different numbers of step attempts (a step failed on "
                       "some ranks only and was retried); restart the processes and resume from the last checkpoint")
        raise StepError(f"rank {comm.rank} (step attempt {int(a)}): {comm.broken}")
    return ((buf[0] / n).to(pending.info),)


LOSS_START = _op(loss_start, "starts the all-reduce of the loss and the step attempt (lockstep check)")
LOSS_WAIT = _op(loss_wait, "waits for the loss all-reduce: the mean loss over the ranks; checks lockstep")


# ---- gradient buckets ---------------------------------------------------------------------------
def reduce_start(comm, bucket, zero, after, grads):
    """The bucket's gradients divided by the world size (as DistributedDataParallel does) into one flat
    buffer, whose all-reduce (zero=0) or reduce-scatter (ZeRO) starts at once."""
    flat = torch.empty(bucket.padded if zero else bucket.size, dtype=bucket.dtype, device=bucket.device)
    scale = 1.0 / comm.world
    for g, off, n, shape in zip(grads, bucket.offsets, bucket.numels, bucket.shapes):
        torch.mul(g, scale, out=flat[off:off + n].view(shape))
    if zero:
        flat[bucket.size:].zero_()
    comm.held(flat.nbytes)
    what = f"the {'all-reduce' if not zero else 'reduce-scatter'} of gradient {bucket.label()}"
    if not zero:
        return (comm.issue(what, "all_reduce", flat, flat, bucket),)
    out = torch.empty(bucket.shard_size, dtype=bucket.dtype, device=bucket.device)
    comm.held(out.nbytes)
    # ZeRO-2 frees the full buffer as soon as it is reduced; ZeRO-1 keeps it until the update
    return (comm.issue(what, "reduce_scatter", out, flat, bucket, drop="done" if zero == 2 else "wait"),)


def reduce_wait(pending, zero):
    """zero=0: each parameter's averaged gradient (views of the flat buffer); ZeRO: this rank's shard."""
    out = pending.wait()
    if zero:
        return (out,)
    b = pending.info
    return tuple(out[off:off + n].view(shape) for off, n, shape in zip(b.offsets, b.numels, b.shapes))


REDUCE_START = _op(reduce_start, "flattens a bucket of gradients and starts its all-reduce / reduce-scatter",
                   cost=_bucket_cost)
REDUCE_WAIT = _op(reduce_wait, "waits for a bucket's collective: the averaged gradients, or this rank's shard")


# ---- ZeRO: this rank's shard of the parameters, updated out of place and all-gathered ----------
def shard_params(bucket, params):
    """This rank's slice of the bucket's parameters, flat: a view when it lies within one contiguous parameter
    (a large parameter's own bucket: nothing reads it but the out-of-place update, and the parameter is
    written only at the commit), else a copy."""
    pieces = bucket.pieces()
    if len(pieces) == 1:
        i, a, b, _ = pieces[0]
        if b - a == bucket.shard_size and params[i].is_contiguous():
            return (params[i].detach().view(-1)[a:b],)
    out = torch.empty(bucket.shard_size, dtype=bucket.dtype, device=bucket.device)
    covered = 0
    for i, a, b, at in pieces:
        out[at:at + b - a].copy_(params[i].reshape(-1)[a:b])
        covered = at + b - a
    out[covered:].zero_()                   # the padding of the last shard
    return (out,)


def gather_start(comm, bucket, after, shard):
    """Starts the all-gather of every rank's updated shard into the whole flat bucket."""
    full = torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.device)
    return (comm.issue(f"the all-gather of parameter {bucket.label()}", "all_gather", full, shard, bucket),)


def gather_wait(pending, params):
    """Waits for the all-gather and stages every parameter's write (applied at the step's commit)."""
    full = pending.wait()
    b = pending.info
    stage(torch._foreach_copy_, list(params),
          [full[off:off + n].view(shape) for off, n, shape in zip(b.offsets, b.numels, b.shapes)])


SHARD_PARAMS = _op(shard_params, "this rank's ZeRO shard of a bucket's parameters (flat copy)", cost=_bucket_cost)
GATHER_START = _op(gather_start, "starts the all-gather of the updated parameter shards of a bucket")
GATHER_WAIT = register(OpDef("kiln.gather_wait", (gather_wait,), None, Kind.COLLECTIVE, Cast.FOLLOW,
                             differentiable=False, side_effects=True, infer=lambda args, kwargs: [],
                             doc="waits for a bucket's all-gather and stages its parameters' writes"))


# ---- what the optimizer needs of gradients sharded over the ranks --------------------------------
def sum_over_ranks(comm, after, x):
    """`x` summed over the ranks, waited for at once (a few numbers: fp16 overflow flags)."""
    buf = x.detach().clone()
    return (comm.issue("the all-reduce of the optimizer's checks", "all_reduce", buf, buf).wait(),)


def grad_norm(comm, after, grads):
    """The 2-norm of all gradients (for clipping); `comm` given: the gradients are shards, the sum of
    squares is all-reduced. One Kiln op, so every rank computes it with the same kernel."""
    norms = torch.stack(torch._foreach_norm(grads)).float()
    if comm is None:
        return (torch.linalg.vector_norm(norms),)
    sq = norms.square().sum().reshape(1)
    return (comm.issue("the all-reduce of the gradient norm", "all_reduce", sq, sq).wait().sqrt().reshape(()),)


def check_finite_ranks(comm, after, loss, grads, names, mode):
    """The non-finite guard over gradients sharded on the ranks (ZeRO): each rank's partial total (its
    shards' norms) is summed over the ranks, so every rank decides alike; when the total is not finite,
    a second all-reduce counts the ranks with a truly non-finite value (a huge finite gradient only
    overflows the norm)."""
    from kiln.guards import not_finite
    local = (torch.stack(torch._foreach_norm(grads)).float().sum() if grads else torch.zeros((), device=loss.device))
    buf = local.reshape(1).clone()
    total = comm.issue("the all-reduce of the non-finite guard", "all_reduce", buf, buf).wait()
    if bool(torch.isfinite(loss)) and bool(torch.isfinite(total).all()):
        return (total,)
    first = next((nm for nm, g in zip(names, grads) if not bool(torch.isfinite(g).all())), None)
    bad = torch.tensor([0.0 if first is None else 1.0], device=loss.device)
    if bool(torch.isfinite(loss)):       # the loss is the mean over ranks: every rank knows it alike
        bad = comm.issue("the all-reduce of the non-finite guard", "all_reduce", bad, bad).wait()
        if bad.item() == 0:
            return (total,)
        what = (f"the gradient of {first} is not finite" if first is not None else
                f"a gradient on another rank is not finite ({int(bad.item())} of {comm.world} ranks)")
    else:
        what = f"the loss averaged over the {comm.world} ranks is {loss.item()}"
    comm.settle()           # every rank stops here alike: the all-gathers already issued complete everywhere
    not_finite(what, loss, mode, " on every rank")


SUM_OVER_RANKS = _op(sum_over_ranks, "sums a small tensor over the ranks (fp16 overflow of sharded gradients)")
GRAD_NORM = _op(grad_norm, "the global 2-norm of the gradients (all-reduced when they are sharded)",
                cost=lambda n: float(sum(g.meta.numel for g in n.args[2])))
CHECK_FINITE_RANKS = _op(check_finite_ranks, "the non-finite guard over ZeRO shards, decided alike on every rank",
                         cost=lambda n: float(sum(g.meta.numel for g in n.args[3])))

STARTS = (LOSS_START, REDUCE_START, GATHER_START)
# the position of `after` (the previously issued collective's handle) in each chained op's arguments
AFTER = {op.name: i for op, i in ((REDUCE_START, 3), (GATHER_START, 2), (SUM_OVER_RANKS, 1), (GRAD_NORM, 1),
                                  (CHECK_FINITE_RANKS, 1))}
WAITS = (LOSS_WAIT, REDUCE_WAIT, GATHER_WAIT)
