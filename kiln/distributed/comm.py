"""The communicator of a data-parallel step: torch.distributed process groups, timeouts, what is in flight.

Every collective a compiled step issues goes through `Comm`: it is asynchronous (`async_op=True`) on the
step's process group and waited for with the step's `timeout`, so a rank that dies (its sockets close) or
stops answering (a hang, another program) makes the others fail with a `StepError` naming the collective,
never hang. Kiln's own checks (same model, same program on every rank) exchange small Python objects on a
separate gloo group with its own timeout, so a rank that checks while another runs a step fails cleanly
instead of pairing a check with a gradient collective.

Lockstep: each step attempt counts itself (`begin`), and the loss all-reduce carries the count; ranks that
disagree (one rank failed a step and retried alone) stop before any gradient is used. A step that fails
with collectives still in flight leaves this rank out of step with the others: the communicator is then
*broken* and refuses every later step (restart the processes and resume from a checkpoint).
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from kiln.errors import KilnError, StepError

# torch 2.13 names (the *_tensor spellings warn as deprecated); older torch has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """One collective in flight: its work handle, the buffers it reads and writes, and its timing.

    `drop` says when the gradient buffer it reads is let go (and no longer counted as held gradient
    bytes): "done" as soon as the collective has completed (ZeRO-2), "wait" when it is waited for
    (ZeRO-1); None: it is the result, or not a gradient buffer. `finish`: what makes `out` the result once
    the transfer is done, before the buffer goes (a reduce-scatter on gloo sums the slices it received, see
    `Comm.issue`)."""

    __slots__ = ("comm", "what", "work", "buffer", "out", "issued", "done", "event", "info", "drop", "error",
                 "finish")

    def __init__(self, comm: "Comm", what: str, work, buffer, out, info=None, drop: str | None = None,
                 finish=None):
        self.comm, self.what, self.work, self.buffer, self.out = comm, what, work, buffer, out
        self.info, self.drop, self.finish = info, drop, finish
        self.issued, self.done, self.error = time.perf_counter(), None, None
        self.event = None                     # NCCL: the stream semantics of work.wait() are what is wanted
        if buffer.device.type == "cpu":       # gloo: completion is observed (timing; ZeRO-2 frees on it)
            try:
                fut = work.get_future()
            except RuntimeError:              # some gloo works have no future: waited for as NCCL's
                return
            self.event = threading.Event()
            fut.then(self._finished)          # runs on the process group's thread

    def _finished(self, fut) -> None:
        self.done = time.perf_counter()
        try:
            fut.value()
        except Exception as e:  # noqa: BLE001 - reported by `wait`, on the step's thread
            self.error = e
        if self.drop == "done" and self.error is None:
            self._let_go()
        self.event.set()

    def _let_go(self) -> None:
        if self.buffer is None:
            return
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.comm.held(-self.buffer.nbytes)
        self.buffer = None                    # the work holds its inputs too: both go, the result stays
        self.work = None

    def wait(self):
        """Block until the collective is done (at most the step's timeout); its result."""
        comm = self.comm
        t0 = time.perf_counter()
        try:
            if self.event is not None:
                if not self.event.wait(comm.timeout.total_seconds()):
                    raise RuntimeError(f"timed out after {comm.timeout.total_seconds():g} s")
                if self.error is not None:
                    raise self.error
            else:
                self.work.wait(comm.timeout)
        except Exception as e:  # noqa: BLE001 - every failure of a collective becomes one clear error
            comm.fail(self.what, e)
        comm.blocked += time.perf_counter() - t0
        comm.in_flight.pop(id(self), None)
        comm.intervals.append((self.issued, self.done or time.perf_counter()))
        if self.drop is not None:
            self._let_go()
        self.buffer = self.work = None
        return self.out


class Comm:
    """Process group, rank, world size, timeouts and the state of the collectives of one compiled step."""

    def __init__(self, group=None, timeout: float = 60.0, check_timeout: float = 900.0):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.checks = _checks_group(group, check_timeout)
        self.check_timeout = check_timeout
        self.gloo = dist.get_backend(group) == "gloo"
        self.in_flight: dict[int, Pending] = {}
        self.attempts = 0                    # steps started on this rank: the lockstep check
        self.broken: str | None = None
        # measurements, per step: comm busy intervals, time blocked in waits, gradient bytes held
        self.intervals: list[tuple[float, float]] = []
        self.blocked = 0.0
        self.grad_bytes = 0
        self.peak_grad_bytes = 0
        self.last: dict[str, float] = {}
        self._count = threading.Lock()
        self.tag = 0                         # numbers the point-to-point exchanges (every rank alike)
        self._wait_thread: _Waiter | None = None

    # ---- the step's collectives -----------------------------------------------------------
    def begin(self) -> int:
        """A step starts: refuse if an earlier one left this rank out of step; count the attempt."""
        if self.broken:
            raise StepError(f"rank {self.rank}: {self.broken}")
        if self.in_flight:
            stale = ", ".join(p.what for p in self.in_flight.values())
            self.broken = (f"a previous step failed on this rank while collectives were in flight ({stale}), so this "
                           "rank is out of step with the others; restart the processes and resume from the last "
                           "checkpoint")
            raise StepError(f"rank {self.rank}: {self.broken}")
        if self.intervals:
            self.last = {"comm_s": _union(self.intervals), "blocked_s": self.blocked,
                         "peak_grad_bytes": float(self.peak_grad_bytes)}
        self.intervals, self.blocked, self.grad_bytes, self.peak_grad_bytes = [], 0.0, 0, 0
        self.attempts += 1
        return self.attempts

    def settle(self) -> None:
        """Wait for every collective of this step still in flight and discard the results: for a step that
        stops where every rank stops alike (the non-finite guard, decided over all ranks), after every rank
        has issued the same collectives (ZeRO's all-gathers started during the backward), so the ranks
        stay in step and the next step may run."""
        for p in list(self.in_flight.values()):
            p.wait()

    def issue(self, what: str, kind: str, out, buffer, info=None, drop: str | None = None) -> Pending:
        """Start `kind` ("all_reduce", "reduce_scatter", "all_gather") of `buffer` into `out` asynchronously;
        `info` travels with the handle (the bucket); `drop`: see `Pending`.

        On gloo a reduce-scatter is an exchange of slices between every pair of ranks (`_exchange`): each
        rank sends every other rank that rank's slice and sums what it receives into its own, so it moves
        (N-1)/N of the buffer. gloo's own reduce-scatter took 1.2-2.2x an all-reduce's time here, and an
        all-reduce moves the whole buffer twice: 25-40 MiB on 2 ranks, exchange 18.5 ms against all-reduce
        33 ms and gloo's reduce-scatter 54 ms (docs/distributed.md). An all-gather on gloo is one broadcast
        per rank from the owner of each slice: 31-35 ms on 81 MiB against 101 ms for gloo's all-gather on 2
        ranks, 71 against 160 ms on 4."""
        finish = None
        try:
            if kind == "all_reduce":
                work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            elif kind == "reduce_scatter" and self.gloo:
                work, finish = self._exchange(out, buffer)
            elif kind == "reduce_scatter":
                work = _reduce_scatter(out, buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            elif self.gloo:
                work = self._broadcast_gather(out, buffer)
            else:
                work = _all_gather(out, buffer, group=self.group, async_op=True)
        except Exception as e:  # noqa: BLE001
            self.fail(what, e)
        p = Pending(self, what, work, buffer, out, info, drop, finish)
        self.in_flight[id(p)] = p
        return p

    def _exchange(self, out, buffer):
        """Reduce-scatter as point-to-point transfers: rank o's slice of `buffer` goes to rank o, and this
        rank's slice from every other rank arrives (into `out` from the first, a temporary from the rest).
        Every rank issues its exchanges in the same order, numbered by `tag`, so transfers pair up even with
        several buckets in flight. Returns the works (one completion, observed by `_waiter`) and the sum."""
        n, me = out.numel(), self.rank
        self.tag = (self.tag + 1) % (1 << 20)
        peers = [o for o in range(self.world) if o != me]
        extra = None
        if len(peers) > 1:
            extra = torch.empty((len(peers) - 1) * n, dtype=out.dtype, device=out.device)
            self.held(extra.nbytes)
        into = [out] + [extra[i * n:(i + 1) * n] for i in range(len(peers) - 1)]
        works = []
        for o, dst in zip(peers, into):
            g = self._global(o)
            works.append(dist.isend(buffer[o * n:(o + 1) * n], dst=g, group=self.group, tag=self.tag))
            works.append(dist.irecv(dst, src=g, group=self.group, tag=self.tag))
        mine = buffer[me * n:(me + 1) * n]

        def finish():
            out.add_(mine)
            if extra is not None:
                out.add_(extra.view(len(peers) - 1, n).sum(0))
                self.held(-extra.nbytes)
        return _Works(works, waiter=self._waiter()), finish

    def _waiter(self) -> "_Waiter":
        if self._wait_thread is None:
            self._wait_thread = _Waiter()
        return self._wait_thread

    def _broadcast_gather(self, out, shard) -> "_Works":
        """All-gather as every rank's broadcast of its own slice of `out` (issued in rank order on every rank,
        so the broadcasts pair up)."""
        n = shard.numel()
        out[self.rank * n:(self.rank + 1) * n].copy_(shard)
        return _Works([dist.broadcast(out[o * n:(o + 1) * n], src=self._global(o), group=self.group, async_op=True)
                       for o in range(self.world)])

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def held(self, nbytes: int) -> None:
        """Gradient bytes the collectives hold (flat buckets, reduced shards): measured for `explain`/bench.
        Called by the step and by the process group's thread (ZeRO-2 frees on completion)."""
        with self._count:
            self.grad_bytes += nbytes
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes)

    def fail(self, what: str, error: BaseException):
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        low = text.lower()
        if "closed" in low or "reset" in low or "broken pipe" in low or "peer" in low:
            why = "another rank exited (crashed or was killed)"
        elif "timed out" in low or "timeout" in low:
            why = (f"another rank did not take part within {self.timeout.total_seconds():g} s (it is stuck, much "
                   "slower, or runs a different step: inputs of other shapes, or a Python branch decided "
                   "otherwise, make it compile another program)")
        else:
            why = "the collective failed"
        self.broken = f"{what} failed earlier ({why}); restart the processes and resume from the last checkpoint"
        raise StepError(f"rank {self.rank} of {self.world}: {what} failed: {why} ({text}). This rank's parameters "
                        "and optimizer state are unchanged (nothing is written before every collective of the step "
                        "has completed); other ranks may have completed the step, so restart the processes and "
                        "resume from the last checkpoint") from error

    # ---- Kiln's own checks ------------------------------------------------------------------
    def gather_objects(self, obj: Any, what: str) -> list:
        """`obj` of every rank (all_gather_object on the checks group, with its timeout)."""
        out: list = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.checks)
        except Exception as e:  # noqa: BLE001
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise KilnError(f"rank {self.rank} of {self.world}: the ranks could not compare {what} ({text}): another "
                            f"rank exited, or did not reach the same point within {self.check_timeout:g} s (every "
                            "rank must call kiln.compile and compile its programs at the same steps: give every rank "
                            "inputs of the same shapes)") from e
        return out

    def check_same(self, what: str, parts: dict[str, Any], hint: str) -> None:
        """Every rank has equal `parts` (compared by value); a KilnError naming the first part that differs."""
        everyone = self.gather_objects(parts, what)
        for key in parts:
            values = [p.get(key) for p in everyone]
            if any(v != values[0] for v in values):
                if all(isinstance(v, list) for v in values):     # show where the lists part
                    at = next((i for i in range(max(map(len, values)))
                               if len({repr(v[i]) if i < len(v) else "<end>" for v in values}) > 1), 0)
                    key = f"{key} (from item {at} on)"
                    values = [v[at:at + 3] for v in values]
                groups: dict = {}
                for r, v in enumerate(values):
                    groups.setdefault(repr(v), []).append(r)
                shown = "; ".join(f"ranks {rs}: {_short(v)}" for v, rs in groups.items())
                raise KilnError(f"the ranks differ in {what}: {key} is not the same on every rank ({shown}). {hint}")

    def broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's values into `tensors` on every rank (as DistributedDataParallel does at construction)."""
        src = self._global(0)
        works = [(dist.broadcast(t, src=src, group=self.group, async_op=True), t) for t in tensors]
        for w, _ in works:
            try:
                w.wait(self.timeout)
            except Exception as e:  # noqa: BLE001
                self.fail(what, e)


class _Works:
    """Several works in flight as one: done when all are (the all-gather made of broadcasts, the exchange of
    a reduce-scatter). Point-to-point works give no future on gloo: `waiter` then observes their completion
    on a thread of its own."""

    def __init__(self, works: list, waiter: "_Waiter | None" = None):
        self.works, self.waiter = works, waiter

    def get_future(self) -> torch.futures.Future:
        if self.waiter is not None:
            return self.waiter.watch(self.works)
        return torch.futures.collect_all([w.get_future() for w in self.works]).then(
            lambda all_done: [f.value() for f in all_done.value()])      # the first failure is this one's

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait(timeout) if timeout is not None else w.wait()
        return True


class _Waiter:
    """A daemon thread that waits for works without futures, in the order given, and completes a future for
    each group of them (the step's thread waits on that future with the step's timeout, so a transfer that
    never completes still ends in a clear error)."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kiln-comm-waiter", daemon=True).start()

    def watch(self, works: list) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self.queue.put((works, fut))
        return fut

    def _run(self) -> None:
        while True:
            works, fut = self.queue.get()
            try:
                for w in works:
                    w.wait()
            except Exception as e:  # noqa: BLE001 - handed to the step's thread through the future
                fut.set_exception(e)
                continue
            fut.set_result(None)


_CHECKS: dict = {}      # (process group, timeout) -> Kiln's gloo group for its checks over those ranks


def _checks_group(group, timeout: float):
    """A gloo group of Kiln's own over the ranks of `group`, for its checks (one per group and timeout: every
    process creates it, in the same order, as new_group requires)."""
    key = (group if group is not None else dist.group.WORLD, timeout)
    if key not in _CHECKS:
        ranks = dist.get_process_group_ranks(key[0])
        _CHECKS[key] = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    return _CHECKS[key]


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (collectives running at the same time count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _short(v: Any, n: int = 160) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."
