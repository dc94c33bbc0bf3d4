"""Data-parallel training inside the compiled step, over torch.distributed.

    torchrun --nproc_per_node=2 train.py
    # train.py
    torch.distributed.init_process_group("gloo")        # "nccl" on GPUs
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=3e-4), parallel=kiln.DataParallel(zero=1))
    loss = step(**local_batch)                           # gradients averaged over the ranks

The collectives are graph ops (kiln/ops/collectives.py) inserted by a pass (kiln/passes/collectives.py);
`kiln/distributed/comm.py` runs them with timeouts; `kiln/runtime/parallel.py` binds a step to its ranks
(same model everywhere, same program everywhere, sharded optimizer state, checkpoints).
"""
from __future__ import annotations

import math

from kiln.errors import KilnError


class DataParallel:
    """How a compiled step trains on several processes (`kiln.compile(..., parallel=DataParallel(...))`).

    Every rank runs the same program on its own batch; the gradients are averaged over the ranks, as
    `torch.nn.parallel.DistributedDataParallel` does, with the collectives inside the compiled step:
    gradients are grouped into buckets of `bucket_mb` MiB in the order the backward produces them, and
    each bucket's collective starts as soon as its last gradient exists, overlapping the rest of the
    backward (see `overlap`).

    Args:
        zero: 0: every rank holds and updates everything (an all-reduce per bucket). 1 (ZeRO-1): each rank
            keeps the optimizer state of its 1/N shard of every bucket and updates only that shard
            (reduce-scatter per bucket, then the updated parameters are all-gathered). 2 (ZeRO-2): as 1,
            and the gradients are sharded too: a bucket's full gradients are freed as soon as they are
            reduced.
        bucket_mb: the size of a gradient bucket in MiB (a larger parameter gets a bucket of its own).
        process_group: the torch.distributed group to train over (default: the default group). Kiln
            creates a small gloo group of its own for its checks, so every process of the default group
            calls kiln.compile.
        timeout: seconds any collective of a step may wait for the other ranks before the step fails with a
            `StepError` (a rank that exits makes the others fail at once).
        check_timeout: seconds the ranks may take to reach the same compile (they compare their programs
            after compiling, and a compile with measured kernels can take minutes).
        overlap: True (default): each bucket's collective starts as soon as its gradients exist; with ZeRO,
            each bucket's update and all-gather also run during the backward, right after the next
            bucket's collective is issued (not with clipping or fp16, which need every gradient first, nor
            under a memory budget), which holds each updated bucket's gathered parameters from then to the
            step's end.
            "gradients": only the gradient collectives overlap the backward; ZeRO's updates and
            all-gathers follow it. False: every collective starts at the end of the backward (to measure
            what overlap hides).

    The ranks check at `kiln.compile` that they hold the same model (names, shapes, dtypes) and
    arguments, then take rank 0's parameters and buffers (as DDP does); after each compile, that they
    compiled the same program. Buffers changed by the forward (BatchNorm running statistics) stay per rank,
    as DDP with `broadcast_buffers=False`. `step.state_dict()` is collective with ZeRO (see its doc).
    """

    def __init__(self, zero: int = 0, bucket_mb: float = 25.0, process_group=None, timeout: float = 60.0,
                 check_timeout: float = 900.0, overlap: bool | str = True):
        if zero not in (0, 1, 2) or isinstance(zero, bool):
            raise KilnError(f"DataParallel(zero=...) must be 0, 1 or 2, got {zero!r}")
        for name, v in (("bucket_mb", bucket_mb), ("timeout", timeout), ("check_timeout", check_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise KilnError(f"DataParallel({name}=...) must be a positive number, got {v!r}")
        if not isinstance(overlap, bool) and overlap != "gradients":
            raise KilnError(f"DataParallel(overlap=...) must be True, \"gradients\" or False, got {overlap!r}")
        self.zero, self.bucket_mb, self.process_group = zero, float(bucket_mb), process_group
        self.timeout, self.check_timeout, self.overlap = float(timeout), float(check_timeout), overlap

    def __repr__(self) -> str:
        return (f"DataParallel(zero={self.zero}, bucket_mb={self.bucket_mb:g}, timeout={self.timeout:g}, "
                f"overlap={self.overlap!r})")


def consolidate(shards: list[dict]) -> dict:
    """One checkpoint from the per-rank ones `step.state_dict(sharded=True)` wrote (all ranks' files): the
    same per-parameter dict `step.state_dict()` gives, loadable on any number of ranks or on one."""
    from kiln.runtime.parallel import consolidate_shards
    return consolidate_shards(shards)


__all__ = ["DataParallel", "consolidate"]
