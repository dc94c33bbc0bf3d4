"""A compiled step bound to its ranks (`kiln.compile(..., parallel=kiln.DataParallel(...))`).

At `kiln.compile`: torch.distributed must be initialized with at least two processes; the ranks compare
their models and arguments (a KilnError names what differs), then take rank 0's parameters and buffers.
After each compile (`compiled`, called by `CompiledStep` before the program's inputs are bound): the ranks
compare the rank-independent signature of what they compiled (bucket layout, the collectives in order,
the optimizer's ops); the first program fixes the bucket layout, and with ZeRO this rank's shards of the
optimizer state are created (from a checkpoint loaded earlier, if any).

Checkpoints. `state_dict()` is consolidated: rank 0 gets the per-parameter dict a single-process step
gives (with ZeRO the shards are gathered to it: every rank must call it), the other ranks get None.
`state_dict(sharded=True)` gives each rank its own part plus the layout, and `kiln.distributed.consolidate`
turns all ranks' parts into the per-parameter dict. A per-parameter dict loads on any number of ranks (and
on one, without `parallel=`): each rank cuts its shards from it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import kiln
from kiln.distributed import DataParallel
from kiln.distributed.comm import Comm
from kiln.distributed.layout import Bucket
from kiln.errors import KilnError
from kiln.ir.graph import Phase
from kiln.ops.registry import Kind
from kiln.passes.collectives import ZERO_STATE
from kiln.runtime import checkpoint
from kiln.transaction import stage, step_transaction

SAME = ("every rank must build the same model (same parameters, shapes and dtypes) and call kiln.compile with "
        "the same arguments")


class Parallel:
    def __init__(self, config: DataParallel, step):
        if not isinstance(config, DataParallel):
            raise KilnError(f"parallel= takes kiln.DataParallel(...), got {type(config).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise KilnError("kiln.DataParallel needs torch.distributed.init_process_group(...) before kiln.compile: "
                            "launch the script with `torchrun --nproc_per_node=N train.py` and call "
                            "torch.distributed.init_process_group('gloo') (or 'nccl' on GPUs) first")
        world = dist.get_world_size(config.process_group)
        if world < 2:
            raise KilnError("kiln.DataParallel with a world size of 1: there is nothing to average over; launch N "
                            "processes (torchrun --nproc_per_node=N), or compile without parallel= (a step's "
                            "state_dict() loads either way)")
        self.config = config
        self.zero, self.bucket_mb, self.overlap = config.zero, config.bucket_mb, config.overlap
        self.comm = Comm(config.process_group, config.timeout, config.check_timeout)
        self.layout: tuple[Bucket, ...] | None = None
        self.pending: dict | None = None       # ZeRO: optimizer state loaded before the layout was fixed
        self.comm.check_same("their models", self._model_parts(step), SAME)
        tensors = [t.detach() for t in step.model.parameters()] + [t.detach() for t in step.model.buffers()]
        with torch.no_grad():
            self.comm.broadcast(tensors, "the broadcast of rank 0's parameters and buffers")

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world

    def _model_parts(self, step) -> dict:
        m = step.model
        return {"parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in m.named_parameters()],
                "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers()],
                "optimizer": repr(step.optimizer), "parallel": repr(self.config),
                "options": (str(step.amp.dtype) if step.amp else None, step.nonfinite),
                "versions": (kiln.__version__, torch.__version__)}

    # ---- after each compile -----------------------------------------------------------------
    def compiled(self, step, ctx) -> None:
        plan = ctx.collectives
        self.comm.check_same("the programs they compiled", self._program_parts(ctx.graph, plan),
                             "Every rank must compile the same training step: give every rank inputs of the same "
                             "shapes and dtypes, the same model, and the same Python branches")
        if self.layout is None:              # the first program fixes the layout (and the ZeRO state's)
            shards = self._make_shards(step, plan.layout) if self.zero else {}
            step.state.update(shards)
            self.layout, self.pending = plan.layout, None

    def _program_parts(self, graph, plan) -> dict:
        collectives = [(n.op.name, next((a.index for a in n.args if isinstance(a, Bucket)), None))
                       for n in graph.nodes if n.op.kind is Kind.COLLECTIVE]
        # zero=0: every rank updates every parameter, so the update's kernels must be the same everywhere
        updates = [(n.op.name, n.impl.label if n.impl is not None else "") for n in graph.nodes
                   if n.phase is Phase.OPTIMIZER and n.op.kind is Kind.OPTIMIZER]
        return {"bucket layout": [b.signature() for b in plan.layout], "collectives": collectives,
                "optimizer updates": updates}

    def _make_shards(self, step, layout: tuple[Bucket, ...]) -> dict:
        """This rank's optimizer state for `layout`: new, or cut from a checkpoint loaded before (a failure here
        keeps that checkpoint pending, so the next compile fails the same way rather than dropping it)."""
        pending = self.pending
        if pending is not None and "parallel" in pending:         # this rank's part of a sharded checkpoint
            self._check_sharded(pending, layout)
            return {k: {s: t.clone() for s, t in v.items()} for k, v in pending["state"].items()}
        out = {}
        for b in layout:
            template = torch.empty(b.shard_size, dtype=b.dtype, device=b.device)
            out[f"{ZERO_STATE}{b.index}"] = step.optimizer.init_state(template)
            if pending is not None:
                out[f"{ZERO_STATE}{b.index}"].update(self._cut(b, pending["state"]))
        if pending is not None and checkpoint.AMP in pending["state"]:
            out[checkpoint.AMP] = {k: t.clone() for k, t in pending["state"][checkpoint.AMP].items()}
        return out

    def _cut(self, b: Bucket, state: dict) -> dict[str, torch.Tensor]:
        """This rank's shard of bucket `b` from a per-parameter state."""
        first = state[b.names[0]]
        out = {}
        for slot, t in first.items():
            if t.dim() == 0:                    # per-parameter counters: one per bucket
                values = {float(state[n][slot]) for n in b.names}
                if len(values) != 1:
                    raise KilnError(f"load_state_dict: the parameters of {b.label()} have different {slot!r} values "
                                    f"({sorted(values)[:4]}); ZeRO keeps one per bucket. Nothing was loaded")
                out[slot] = t.detach().clone()
                continue
            shard = torch.zeros(b.shard_size, dtype=t.dtype, device=b.device)
            for i, lo, hi, at in b.pieces():
                shard[at:at + hi - lo].copy_(state[b.names[i]][slot].reshape(-1)[lo:hi])
            out[slot] = shard
        return out

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self, step, sharded: bool = False) -> dict | None:
        opt = step.optimizer
        head = {"optimizer": type(opt).__name__, "hyperparameters": opt.hyperparameters()}
        if sharded:
            return {**head, "state": {n: {k: t.clone() for k, t in s.items()} for n, s in step.state.items()},
                    "parallel": self._meta(step)}
        if not self.zero:
            return checkpoint.state_dict(step) if self.rank == 0 else None
        if self.layout is None:                 # nothing compiled yet: the initial (or loaded) state
            if self.rank:
                return None
            state = dict(self.pending["state"]) if self.pending and "parallel" not in self.pending else {}
            for n, p in step.params.items():
                state.setdefault(n, opt.init_state(p))
            return {**head, "state": {n: {k: t.clone() for k, t in s.items()} for n, s in state.items()}}
        state: dict = {}
        for b in self.layout:
            shards = step.state[f"{ZERO_STATE}{b.index}"]
            for slot, t in shards.items():
                if t.dim() == 0:
                    for n in b.names:
                        state.setdefault(n, {})[slot] = t.clone()
                    continue
                flat = self._gather(t, f"the gather of {b.label()}'s {slot!r} state for state_dict()")
                if flat is not None:
                    for n, off, k, shape in zip(b.names, b.offsets, b.numels, b.shapes):
                        state.setdefault(n, {})[slot] = flat[off:off + k].view(shape).clone()
        if self.rank:
            return None
        for n, p in step.params.items():        # parameters that never got a gradient keep their initial state
            state.setdefault(n, opt.init_state(p))
        if checkpoint.AMP in step.state:
            state[checkpoint.AMP] = {k: t.clone() for k, t in step.state[checkpoint.AMP].items()}
        return {**head, "state": state}

    def _gather(self, shard: torch.Tensor, what: str) -> torch.Tensor | None:
        """Every rank's shard, concatenated on rank 0 (None elsewhere)."""
        group = self.comm.group
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        parts = [torch.empty_like(shard) for _ in range(self.world)] if self.rank == 0 else None
        work = dist.gather(shard.contiguous(), parts, dst=dst, group=group, async_op=True)
        try:
            work.wait(self.comm.timeout)
        except Exception as e:  # noqa: BLE001
            self.comm.fail(what, e)
        return torch.cat(parts) if parts is not None else None

    def _meta(self, step) -> dict:
        return {"zero": self.zero, "world": self.world, "rank": self.rank,
                "layout": [b.signature() for b in self.layout] if self.layout is not None else None,
                "params": {n: (tuple(p.shape), str(p.dtype)) for n, p in step.params.items()}}

    def load_state_dict(self, step, sd) -> None:
        if not isinstance(sd, dict):
            raise checkpoint.refuse(f"expected the dict that step.state_dict() returns, got {type(sd).__name__} "
                                    "(with data parallel, state_dict() returns None on ranks other than 0: load "
                                    "rank 0's checkpoint on every rank)")
        if "parallel" in sd:
            return self._load_sharded(step, sd)
        if not self.zero:
            return checkpoint.load_state_dict(step, sd)
        checkpoint.check_keys(step, sd)
        candidate = checkpoint.checked_optimizer(step.optimizer, sd)
        checkpoint.check_state(self._templates(step), sd["state"])
        if self.layout is None:                 # cut into shards once the first program fixes the layout
            self.pending = {"state": sd["state"]}
        else:
            cut = {f"{ZERO_STATE}{b.index}": self._cut(b, sd["state"]) for b in self.layout}
            if checkpoint.AMP in sd["state"]:
                cut[checkpoint.AMP] = sd["state"][checkpoint.AMP]
            _commit(step.state, cut)
        step.optimizer.__dict__.update(candidate.__dict__)

    def _templates(self, step) -> dict:
        """Per-parameter state shapes, dtypes and devices, without memory (what check_state compares)."""
        out = {}
        for n, p in step.params.items():
            made = step.optimizer.init_state(p.detach().to("meta"))
            out[n] = {k: torch.empty((), dtype=t.dtype, device=p.device if t.device.type == "meta" else t.device)
                      .expand(t.shape) for k, t in made.items()}
        if checkpoint.AMP in step.state:
            out[checkpoint.AMP] = step.state[checkpoint.AMP]
        return out

    def _load_sharded(self, step, sd) -> None:
        meta = sd["parallel"]
        if isinstance(meta, dict) and meta.get("zero") == 0:      # every rank's part is the whole state
            return self.load_state_dict(step, {k: v for k, v in sd.items() if k != "parallel"})
        if not isinstance(meta, dict) or (meta.get("world"), meta.get("zero"), meta.get("rank")) != \
                (self.world, self.zero, self.rank):
            raise checkpoint.refuse(
                f"this is rank {meta.get('rank')}'s part of a checkpoint sharded over {meta.get('world')} ranks with "
                f"zero={meta.get('zero')}, and this is rank {self.rank} of {self.world} with zero={self.zero}: "
                "combine every rank's part with kiln.distributed.consolidate([...]) and load the result")
        candidate = checkpoint.checked_optimizer(step.optimizer, sd)
        if self.layout is None:               # checked against the layout when the first program fixes it
            self.pending = sd
        else:
            self._check_sharded(sd)
            checkpoint.check_state(step.state, sd["state"])
            _commit(step.state, sd["state"])
        step.optimizer.__dict__.update(candidate.__dict__)

    def _check_sharded(self, sd, layout=None) -> None:
        if sd["parallel"].get("layout") != [b.signature() for b in (layout or self.layout)]:
            raise KilnError("load_state_dict: this rank's part of the checkpoint was saved with another bucket layout "
                            "(another model, bucket_mb or program); combine every rank's part with "
                            "kiln.distributed.consolidate([...]) and load the result. Nothing was loaded")

    def stats(self, step) -> dict:
        """Measurements of the latest completed step: comm_s (time some collective of this rank was running),
        blocked_s (time the step waited for one: comm_s - blocked_s was hidden behind compute),
        peak_grad_bytes (gradient buffers the collectives held), state_bytes (this rank's optimizer state)."""
        state = sum(t.nbytes for s in step.state.values() for t in s.values())
        return {**self.comm.last, "state_bytes": state}


def _commit(dst: dict, src: dict) -> None:
    """Copy `src` into `dst` (same keys and shapes) in one transaction."""
    pairs = [(dst[n][k], src[n][k]) for n in src for k in src[n]]
    with step_transaction() as txn:
        stage(torch._foreach_copy_, [a for a, _ in pairs], [b for _, b in pairs])
    with torch.no_grad():
        txn.commit()


def consolidate_shards(shards: list[dict]) -> dict:
    """The per-parameter optimizer state from every rank's `state_dict(sharded=True)`."""
    if not shards or not all(isinstance(s, dict) and isinstance(s.get("parallel"), dict) for s in shards):
        raise KilnError("consolidate: pass every rank's step.state_dict(sharded=True), as a list")
    metas = [s["parallel"] for s in shards]
    world = metas[0]["world"]
    by_rank = {m["rank"]: s for m, s in zip(metas, shards)}
    if sorted(by_rank) != list(range(world)) or len(shards) != world:
        raise KilnError(f"consolidate: the checkpoint was sharded over {world} ranks; got the parts of ranks "
                        f"{sorted(m['rank'] for m in metas)}")
    if any((m["world"], m["zero"], m["layout"]) != (world, metas[0]["zero"], metas[0]["layout"]) for m in metas):
        raise KilnError("consolidate: the parts come from different runs (world size, zero or layout differ)")
    head = {k: shards[0][k] for k in ("optimizer", "hyperparameters")}
    if not metas[0]["zero"]:
        return {**head, "state": shards[0]["state"]}
    state: dict = {}
    slots: dict[str, tuple] = {}
    for sig in metas[0]["layout"] or []:
        index, names, shapes, dtype, device, _ = sig
        b = Bucket(index, tuple(names), tuple(tuple(s) for s in shapes), getattr(torch, dtype.split(".")[-1]),
                   torch.device(device), world, 0)
        key = f"{ZERO_STATE}{index}"
        for slot, t in by_rank[0]["state"][key].items():
            slots[slot] = (t.dim(), t.dtype)
            if t.dim() == 0:
                for n in names:
                    state.setdefault(n, {})[slot] = t.clone()
                continue
            flat = torch.cat([by_rank[r]["state"][key][slot] for r in range(world)])
            for n, off, k, shape in zip(b.names, b.offsets, b.numels, b.shapes):
                state.setdefault(n, {})[slot] = flat[off:off + k].view(shape).clone()
    for n, (shape, dtype) in metas[0]["params"].items():       # never got a gradient: initial state
        if n not in state:
            state[n] = {slot: torch.zeros(() if dim == 0 else shape, dtype=dt if dim == 0 else
                                          getattr(torch, dtype.split(".")[-1])) for slot, (dim, dt) in slots.items()}
    if checkpoint.AMP in by_rank[0]["state"]:
        state[checkpoint.AMP] = by_rank[0]["state"][checkpoint.AMP]
    return {**head, "state": state}
