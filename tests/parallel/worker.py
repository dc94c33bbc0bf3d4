"""One rank of the data-parallel tests (launched by tests/parallel/launch.py). Each scenario runs several
checks in one launch (starting ranks costs seconds) and writes this rank's findings as JSON; the asserts
live in tests/parallel/test_data_parallel.py.

References: torch.nn.parallel.DistributedDataParallel with torch.optim.AdamW (zero=0 and 2), with
torch.distributed.optim.ZeroRedundancyOptimizer(AdamW) (zero=1), under torch.autocast for bf16; for
checkpoints resumed on another number of ranks, eager AdamW on the whole global batch.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import kiln
from kiln.dialects import upcast
from kiln.kernels import activations
from kiln.passes import pipeline


VOCAB, SEQ, LOCAL = 96, 8, 4          # tokens, sequence length, sequences per rank and step
LR, WD = 1e-2, 0.01


class TinyLM(nn.Module):
    """Embedding tied to the output head (its gradient sums two uses, one transposed), layer norm, MLP.

    `bf16=True` is the eager reference of Kiln's amp="bf16" on a CPU without bf16 matrix instructions,
    written out with explicit casts: the matrix products take bf16-rounded operands, compute in fp32 and
    round their result to bf16 once (the upcast dialect's contract), GELU runs on bf16 values, layer
    norm and the loss in fp32. Autograd then rounds each gradient to its forward value's dtype, as Kiln
    does. torch.autocast on this CPU runs ATen's emulated bf16 GEMMs, which round otherwise (the
    single-process amp tests compare Kiln with autocast within 2% of the loss)."""

    def __init__(self, d: int = 32, bf16: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.bf16 = bf16

    def forward(self, ids, labels):
        low = (lambda t: t.bfloat16().float()) if self.bf16 else (lambda t: t)
        out = (lambda t: t.bfloat16()) if self.bf16 else (lambda t: t)
        h = self.emb(ids)
        a = F.gelu(out(F.linear(low(self.norm(h)), low(self.up.weight), low(self.up.bias))))
        h = h + out(F.linear(low(a), low(self.down.weight), low(self.down.bias))).float()
        logits = out(low(h) @ low(self.emb.weight).T).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches(steps: int, world: int, seed: int = 1):
    """The global batches (the same on every rank): (ids, labels) of LOCAL * world sequences each."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (LOCAL * world, SEQ), generator=g),
             torch.randint(0, VOCAB, (LOCAL * world, SEQ), generator=g)) for _ in range(steps)]


def local(batch, rank: int, world: int, share: int | None = None):
    """This rank's slice of a global batch (`share` sequences, default LOCAL)."""
    share = share or len(batch[0]) // world
    return tuple(t[rank * share:(rank + 1) * share] for t in batch)


def model(seed: int = 0, d: int = 32, bf16: bool = False) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(d, bf16)


def rel_diff(a: nn.Module, b: nn.Module) -> float:
    """max |p - q| / max(|q|, 1e-3) over all parameters (entries near 0 compared absolutely)."""
    return max(((p.detach() - q.detach()).abs() / q.detach().abs().clamp_min(1e-3)).max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def digest(m: nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def same_on_all_ranks(m: nn.Module) -> bool:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest(m))
    return len(set(out)) == 1


# ---- parity with DDP / ZeroRedundancyOptimizer ---------------------------------------------------
def parity(zero: int, amp: str | None, world: int, rank: int, steps: int = 5, bucket_mb: float = 0.004,
           clip: float | None = None, keep: dict | None = None, overlap=True, budget=None) -> dict:
    """5 steps of Kiln and of the reference from the same weights; `keep` gets the step (to reuse it)."""
    mine, ref = model(), model(bf16=amp == "bf16")
    step = kiln.compile(mine, optimizer=kiln.optim.AdamW(lr=LR, weight_decay=WD, max_grad_norm=clip), amp=amp,
                        parallel=kiln.DataParallel(zero=zero, bucket_mb=bucket_mb, overlap=overlap), verify=True,
                        memory_budget=budget)
    ddp = DDP(ref)
    if zero == 1:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for batch in batches(steps, world):
        ids, labels = local(batch, rank, world)
        got = step(ids, labels)
        opt.zero_grad()
        want = ddp(ids, labels)
        want.backward()
        if clip is not None:       # the norm before clipping, of the gradient averaged over the ranks
            norms.append((step.grad_norm.item(), torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip).item()))
        opt.step()
        losses.append((got.item(), want.item()))
    text = io.StringIO()
    kiln.explain(step, file=text)
    stats = step.parallel.stats(step)
    if keep is not None:
        keep[(zero, amp)] = (step, mine)
    # explain lists the collectives in the order they are issued: an all-gather before the last gradient
    # collective was started during the backward (ZeRO's updates moved into it)
    kinds = ["gather" if "all-gather of" in line else "grad" for line in text.getvalue().splitlines()
             if "all-gather of" in line or "reduce-scatter of" in line or "all-reduce of gradients" in line]
    in_backward = "gather" in kinds and kinds.index("gather") < len(kinds) - 1 - kinds[::-1].index("grad")
    return {"zero": zero, "amp": amp, "clip": clip, "overlap": overlap, "budget": budget,
            "gathers_in_backward": in_backward,
            "rel": rel_diff(mine, ref), "losses": losses, "norms": norms,
            "same": same_on_all_ranks(mine), "state_bytes": stats["state_bytes"],
            "peak_grad_bytes": stats["peak_grad_bytes"], "explain": text.getvalue() if rank == 0 else "",
            "buckets": len(step.parallel.layout)}


def dynamic_parity(world: int, rank: int, steps: int = 5) -> dict:
    """Every rank gets its own sequence length and batch size at every step (a data loader with per-batch
    padding): one program for every size on every rank, parameters as DDP's."""
    mine, ref = model(), model()
    # SGD: an update proportional to the gradient (AdamW's sign(grad) * lr first steps turned the float order
    # of a CPU's other vector kernels into 4.5e-4 differences at this model's near-zero gradients)
    step = kiln.compile(mine, optimizer=kiln.optim.SGD(lr=0.1, momentum=0.9, weight_decay=WD),
                        parallel=kiln.DataParallel(zero=1))
    ddp = DDP(ref)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9,
                                  weight_decay=WD)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        sizes = [(int(torch.randint(2, 6, (), generator=g)), int(torch.randint(4, 13, (), generator=g)))
                 for _ in range(world)]
        b, t = sizes[rank]
        ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(100 * rank + t))
        got = step(ids, ids)
        opt.zero_grad()
        want = ddp(ids, ids)
        want.backward()
        opt.step()
        losses.append((got.item(), want.item()))
    info = step.cache_info()
    return {"rel": rel_diff(mine, ref), "same": same_on_all_ranks(mine), "losses": losses,
            "programs": len(info.programs), "dynamic": [p.dynamic for p in info.programs]}


def scenario_parity(out: Path, world: int, rank: int, which: str = "default", keep: dict | None = None) -> dict:
    """default: zero 0/1/2 fp32, ZeRO-1 bf16, ZeRO-2 with clipping; fp32: zero 0/1/2; all: every zero in
    fp32 and bf16, clipping, and one bucket for the whole model."""
    amps = (None, "bf16") if which == "all" else (None,)
    results = [parity(z, a, world, rank, keep=keep) for a in amps for z in (0, 1, 2)]
    if which == "default":
        results.append(parity(1, "bf16", world, rank))
        results.append(parity(1, None, world, rank, overlap="gradients"))       # updates after the backward
        results.append(parity(1, None, world, rank, budget="64GiB"))            # so under a budget too
    if which != "fp32":
        results.append(parity(2, None, world, rank, clip=0.05))                 # clipping over shards
    if which == "all":
        results.append(parity(1, None, world, rank, bucket_mb=25.0))            # one bucket
        return {"parity": results, "sgd": sgd_parity(world, rank), "fp16": fp16_check(world, rank)}
    return {"parity": results}


def sgd_parity(world: int, rank: int) -> dict:
    """ZeRO-2 with SGD (nesterov momentum, weight decay) against DDP + torch.optim.SGD."""
    mine, ref = model(), model()
    kw = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    step = kiln.compile(mine, optimizer=kiln.optim.SGD(**kw), parallel=kiln.DataParallel(zero=2, bucket_mb=0.004))
    ddp = DDP(ref)
    opt = torch.optim.SGD(ddp.parameters(), **kw)
    for batch in batches(5, world):
        ids, labels = local(batch, rank, world)
        step(ids, labels)
        opt.zero_grad()
        ddp(ids, labels).backward()
        opt.step()
    return {"rel": rel_diff(mine, ref), "same": same_on_all_ranks(mine)}


def fp16_check(world: int, rank: int) -> dict:
    """fp16 with ZeRO-1: the loss scale (overflow decided over every rank's shards) follows GradScaler's."""
    mine, ref = model(), model()
    step = kiln.compile(mine, optimizer=kiln.optim.AdamW(lr=LR), amp="fp16",
                        parallel=kiln.DataParallel(zero=1, bucket_mb=0.004))
    ddp = DDP(ref)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)          # overflows at first: scale backs off
    step.state["__amp__"]["scale"].fill_(2.0 ** 40)
    for batch in batches(8, world):
        ids, labels = local(batch, rank, world)
        got = step(ids, labels)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            want = ddp(ids, labels)
        scaler.scale(want).backward()
        scaler.step(opt)
        scaler.update()
    return {"scale": step.loss_scale, "ref_scale": scaler.get_scale(), "loss": got.item(), "ref_loss": want.item(),
            "same": same_on_all_ranks(mine)}


# ---- checkpoints: consolidated, sharded, resumed on another number of ranks ---------------------
def eager_reference(steps: int) -> nn.Module:
    """AdamW on the whole global batch: what averaging over any number of ranks must give."""
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for ids, labels in batches(steps, 4):
        opt.zero_grad()
        ref(ids, labels).backward()
        opt.step()
    return ref


def scenario_checkpoint(out: Path, world: int, rank: int) -> dict:
    """3 steps on `world` ranks (ZeRO-1), then checkpoints: rank 0 resumes the consolidated one alone (no
    parallel=), and every rank in a new ZeRO-2 step of other buckets, loaded before its first compile."""
    mine = model()
    step = kiln.compile(mine, optimizer=kiln.optim.AdamW(lr=LR, weight_decay=WD),
                        parallel=kiln.DataParallel(zero=1, bucket_mb=0.004))
    early = step.state_dict()                       # before any compile: the initial state, on rank 0
    for batch in batches(3, 4):                     # the global batch of 16 sequences, split over the ranks
        step(*local(batch, rank, world))
    full = step.state_dict()
    part = step.state_dict(sharded=True)
    torch.save(part, out / f"part{rank}.pt")
    res = {"early_is_none": early is None, "full_is_none": full is None}
    if rank == 0:
        torch.save({"model": mine.state_dict(), "optim": full}, out / "ckpt.pt")
    dist.barrier()
    ckpt = torch.load(out / "ckpt.pt")
    if rank == 0:
        parts = [torch.load(out / f"part{r}.pt") for r in range(world)]
        joined = kiln.distributed.consolidate(parts)
        res["consolidate_equal"] = all(torch.equal(joined["state"][n][k], t) for n, s in full["state"].items()
                                       for k, t in s.items())
        alone = model()                             # world size 1: a plain step loads the consolidated state
        alone.load_state_dict(ckpt["model"])
        single = kiln.compile(alone, optimizer=kiln.optim.AdamW(lr=LR, weight_decay=WD))
        single.load_state_dict(ckpt["optim"])
        for batch in batches(5, 4)[3:]:
            single(*batch)
        res["resume_1_rel"] = rel_diff(alone, eager_reference(5))
    again = model()
    again.load_state_dict(ckpt["model"])
    step = kiln.compile(again, optimizer=kiln.optim.AdamW(lr=LR, weight_decay=WD),
                        parallel=kiln.DataParallel(zero=2, bucket_mb=0.002))
    step.load_state_dict(ckpt["optim"])             # before the first compile: cut into shards then
    for batch in batches(5, 4)[3:]:
        step(*local(batch, rank, world))
    res["resume_zero2_rel"] = rel_diff(again, eager_reference(5))
    res["resume_zero2_same"] = same_on_all_ranks(again)
    return res


def scenario_resume(out: Path, world: int, rank: int, src: str = "") -> dict:
    """Parity with DDP / ZeroRedundancyOptimizer in fp32 on these ranks; then the ZeRO-1 step of that check
    loads the consolidated checkpoint of `scenario_checkpoint` (2 ranks' state, cut into this many shards of
    other buckets) and trains 2 more steps."""
    keep: dict = {}
    res = scenario_parity(out, world, rank, "fp32", keep)
    ckpt = torch.load(Path(src) / "ckpt.pt")
    step, mine = keep[(1, None)]
    mine.load_state_dict(ckpt["model"])
    step.load_state_dict(ckpt["optim"])
    for batch in batches(5, 4)[3:]:
        step(*local(batch, rank, world))
    res["resume_zero1_rel"] = rel_diff(mine, eager_reference(5))
    res["resume_zero1_same"] = same_on_all_ranks(mine)
    return res


# ---- failures: clear errors, never a hang -------------------------------------------------------
def _error(fn) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        fn()
    except kiln.KilnError as e:
        return f"{type(e).__name__}: {e}", time.perf_counter() - t0
    return "", time.perf_counter() - t0


def scenario_failures(out: Path, world: int, rank: int) -> dict:
    res = _Partial(out / f"rank{rank}.json")       # rank 1 kills itself at the end: written as it goes
    # a model that differs on one rank: refused by kiln.compile on every rank, the group stays usable
    res["mismatch"], _ = _error(lambda: kiln.compile(model(d=32 if rank == 0 else 48), optimizer=kiln.optim.AdamW(),
                                                     parallel=kiln.DataParallel()))
    # short timeouts where a rank is meant to wait in vain (the compile check's covers compile-time skew)
    fast = dict(timeout=3.0, check_timeout=8.0)

    # rank 1's loss is NaN at the 2nd step (every label ignored): every rank skips that step, then goes on
    mine = model()
    step = kiln.compile(mine, optimizer=kiln.optim.AdamW(lr=LR), nonfinite="skip",
                        parallel=kiln.DataParallel(zero=1, bucket_mb=0.004, process_group=dist.new_group(backend="gloo")))
    for i, batch in enumerate(batches(3, world)):
        ids, labels = local(batch, rank, world)
        step(ids, torch.full_like(labels, -100) if (i == 1 and rank == 1) else labels)
    res["skipped"] = step.skipped_steps
    res["skipped_same"] = same_on_all_ranks(mine)

    def bad_batch():                                # then rank 1's batch breaks its forward; it retries alone
        errors = []
        for i, batch in enumerate(batches(3, world)):
            ids, labels = local(batch, rank, world)
            if i == 0 and rank == 1:
                ids = ids.clone()
                ids[0, 0] = VOCAB + 5               # out of the embedding's range
            try:
                step(ids, labels)
            except kiln.KilnError as e:
                errors.append(str(e).splitlines()[0])
                if len(errors) >= 3:
                    break
        raise kiln.KilnError(" | ".join(errors))
    res["bad_batch"], res["bad_batch_s"] = _error(bad_batch)

    def diverge():                                  # rank 1 feeds int32 ids at the 3rd step: another program
        step = kiln.compile(model(), optimizer=kiln.optim.AdamW(lr=LR),
                            parallel=kiln.DataParallel(process_group=dist.new_group(backend="gloo"), **fast))
        for i, batch in enumerate(batches(4, world)):
            ids, labels = local(batch, rank, world)
            step(ids.int() if (i == 2 and rank == 1) else ids, labels)
    res["diverge"], res["diverge_s"] = _error(diverge)

    group = dist.new_group(backend="gloo")

    def killed():                                   # rank 1 dies before its 3rd step; rank 0 must fail alone
        step = kiln.compile(model(), optimizer=kiln.optim.AdamW(lr=LR),
                            parallel=kiln.DataParallel(process_group=group, timeout=60.0))
        for i, batch in enumerate(batches(4, world)):
            if i == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if i == 2:
                t[0] = time.perf_counter()
            step(*local(batch, rank, world))
    t = [0.0]
    res["killed"], _ = _error(killed)
    res["killed_s"] = time.perf_counter() - t[0]
    return res


class _Partial(dict):
    """A result dict saved to `path` at every update."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self))


def budget_agreement(world: int, rank: int) -> dict:
    """A byte budget covers each process's heap beyond its step; ranks holding different amounts (64 MiB more
    on rank 1) plan for the largest, so they compile the same program and re-plan alike."""
    ballast = torch.ones(16 * 2 ** 20) if rank == 1 else None
    step = kiln.compile(model(), optimizer=kiln.optim.AdamW(lr=LR, weight_decay=WD),
                        parallel=kiln.DataParallel(zero=0), memory_budget="64GiB")
    for batch in batches(2, world):
        step(*local(batch, rank, world))
    del ballast
    return {"outside": step.memory().outside, "programs": step.cache_info().compiles}


def scenario_two(out: Path, world: int, rank: int) -> dict:
    """The default 2-rank launch: parity, then checkpoints (one launch: starting ranks costs seconds), then a
    byte budget (last: it sets the process's heap policy)."""
    return {**scenario_parity(out, world, rank), "dynamic": dynamic_parity(world, rank),
            **scenario_checkpoint(out, world, rank), "budget": budget_agreement(world, rank)}


def scenario_collectives(out: Path, world: int, rank: int) -> dict:
    """Kiln's communicator on its own: several reduce-scatters in flight at once (on gloo, point-to-point
    exchanges paired by number), each kept until waited for (ZeRO-1) or let go when done (ZeRO-2), then
    all-gathers. Every rank's buffer is known from its seed and holds small integers, so the sums are exact
    in any order and the reference is the sum computed here."""
    from kiln.distributed.comm import Comm
    comm = Comm(timeout=30.0)
    sizes = (6, 4099, 30000, 6)                          # per-rank slices: tiny, odd, large
    def buffer(r, i):
        return torch.randint(-50, 50, (sizes[i] * world,), generator=torch.Generator().manual_seed(100 * r + i)).float()
    mine = [buffer(rank, i) for i in range(len(sizes))]
    outs = [torch.empty(n) for n in sizes]
    comm.begin()
    for b in mine:
        comm.held(b.nbytes)
    pending = [comm.issue(f"bucket {i}", "reduce_scatter", o, b, drop="done" if i % 2 else "wait")
               for i, (o, b) in enumerate(zip(outs, mine))]
    del mine
    got = [p.wait() for p in pending]
    want = [sum(buffer(r, i) for r in range(world))[rank * n:(rank + 1) * n] for i, n in enumerate(sizes)]
    fulls = [torch.empty(n * world) for n in sizes]
    gathers = [comm.issue(f"gather {i}", "all_gather", f, g) for i, (f, g) in enumerate(zip(fulls, got))]
    gathered = [p.wait() for p in gathers]
    every = [sum(buffer(r, i) for r in range(world)) for i in range(len(sizes))]
    return {"scatter_equal": [bool(torch.equal(g, w)) for g, w in zip(got, want)],
            "gather_equal": [bool(torch.equal(g, w)) for g, w in zip(gathered, every)],
            "held_after": comm.grad_bytes, "in_flight": len(comm.in_flight)}


SCENARIOS = {"parity": scenario_parity, "checkpoint": scenario_checkpoint, "resume": scenario_resume,
             "failures": scenario_failures, "two": scenario_two, "collectives": scenario_collectives}


def main() -> None:
    scenario, out, *args = sys.argv[1:]
    out = Path(out)
    torch.set_num_threads(1)
    # The bf16 reference (TinyLM) is written to the upcast dialect's contract; on a CPU with bf16 matrix
    # instructions Kiln would take ATen's native GEMMs instead, which round the same way but sum in another
    # order, and AdamW's first steps (sign(grad) * lr) turn that order into 1e-2 differences. Data parallel's
    # communication and sharding do not depend on the GEMM: the ranks run the upcast dialect on every CPU
    # (the native path is checked in one process against torch.autocast, tests/models/test_amp_parity.py).
    upcast._lacks_native = lambda dtype: True
    # For the same reason the GELU backward stays ATen's: Kiln's bf16 steps fold a bias's gradient sum into their
    # own GELU backward (kiln/passes/accumulate.py) and read the derivative from a table (kiln/kernels/
    # activations.py), which round in other places than ATen's (closer to float64: tests/kernels), and Adam's
    # first steps would turn that into the same 1e-4 differences. The ranks' machinery does not depend on it.
    pipeline.fold_column_sums = lambda graph, dialects: 0
    activations._lut = lambda *tensors, approximate: None     # nor by table (its derivative rounds once, in fp32)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = SCENARIOS[scenario](out, world, rank, *args)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)                  # skip process-group teardown: after a failure scenario it may abort


if __name__ == "__main__":
    main()
