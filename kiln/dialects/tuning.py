"""One owner for a compiled step's tuning state: its `Tuner`.

The passes only record requests on the compilation's `Context` (`regions`: candidate fused regions
wanting a kernel; `choices`: nodes whose measured kernel needs a choice). `Tuner.realize(ctx)`, which
`CompiledStep` calls after the passes and before the regions are placed and code is generated, does
the work: the region dialect compiles, measures or sends regions online (`RegionFusion.compile_all`),
measured kernels are looked up in the cache, timed now or given a live trial (`choose`), and the
step's nodes get kernels of their own (a kernel that fails at run time falls back to ATen for this
step only). Everything that lives on afterwards belongs to the tuner, never to a module:
- `mode`: "online" or "ahead" (`measure.tuning`: the step's `tuning=`, else $KILN_TUNING);
- `trials`: the live online measurements of measured kernels, by (cache folder, key), shared by the
  nodes of all the step's programs with that key;
- `workers`: its background compilations (`background.Worker`), prepared at compile time and started
  by `start()` after a step has run, once worth it (`Worker.ready`); `stepped`: whether one has;
- what to settle when stopped (the region dialect's boards: `on_stop`), and the per-step kernels.

Lifecycle: `start()` (the step calls it after each successful step: prepared workers start once worth it),
`stop()` (workers stopped; their regions settle on their ATen ops, nothing left pending; trials go
on), `close()` (stop, and every open trial settles on ATen without caching; idempotent). A tuner is
closed by `CompiledStep.close()`; its workers are stopped when it is garbage collected and at
interpreter exit (`weakref.finalize`, and `stop_all` as a safety net). The measurement cache itself
is per machine on disk (`kiln.dialects.measure`).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import threading
import weakref
from pathlib import Path
from typing import Callable

from kiln.dialects import background, measure
from kiln.dialects import registry

_tuners: "weakref.WeakSet[Tuner]" = weakref.WeakSet()     # the live owners (a registry, holding no state)


class Tuner:
    """The tuning state of one `CompiledStep` (see the module docstring)."""

    def __init__(self, tuning: str | None = None):
        self.requested = tuning
        self.trials: dict[tuple[str, str], object] = {}     # (cache folder, key) -> registry.Impl of a trial
        self.workers: list[background.Worker] = []          # prepared or running (finished ones until pruned)
        self.stepped = False
        self.hurried = False                                 # `hurry()`: workers start without waiting
        self.closed = False
        self._on_stop: list[Callable[[], None]] = []
        self._kernels: dict[int, registry.Impl] = {}        # id(registry's Impl) -> this step's copy
        _tuners.add(self)
        weakref.finalize(self, _stop_workers, self.workers)  # collected, or interpreter exit: stopped

    @property
    def mode(self) -> str:
        return measure.tuning(self.requested)

    def online(self, device_type: str) -> bool:
        """Whether a case on `device_type` is measured during training (CPU only: see `measure`)."""
        return device_type == "cpu" and self.mode == "online"

    # ---- the realize phase: after the passes, before codegen ---------------------------------------
    def realize(self, ctx) -> None:
        """Do what the passes asked for: kernels for `ctx.regions` (compiled, measured or online) and the
        choices of `ctx.choices`; every node then runs a kernel of this step's own."""
        if self.closed:
            raise RuntimeError("this step's tuner is closed")
        provider = registry.region_fusion(ctx.dialects) if ctx.regions else None
        if provider is not None:
            provider.compile_all(ctx.regions, self)
        placed = {n.uid for r in ctx.regions if r.compiled is not None or r.online is not None for n in r.nodes}
        for n in ctx.choices:
            if n.uid not in placed:
                n.impl = registry.select(n, ctx.dialects, "kernel", choose=self.choose) or registry.aten_kernel(n.target)
        for n in ctx.graph.nodes:
            if n.impl is not None and n.impl.trial is None and n.impl.dialect.name != "aten" and n.impl.fallback:
                n.impl = self._own(n.impl)

    def _own(self, impl: registry.Impl) -> registry.Impl:
        """This step's copy of a registered kernel: its run-time fallback (`Impl.runnable`) is per step."""
        mine = self._kernels.get(id(impl))
        if mine is None:
            mine = self._kernels[id(impl)] = dataclasses.replace(impl)
        return mine

    def choose(self, impl, node):
        """`impl` if it is known (or, tuning ahead, measured now) to be faster than ATen on `node`, None if
        ATen is, or, tuning online with nothing known yet, a trial `Impl` measuring both during training."""
        key = measure.kernel_key(impl, node)
        folder = measure.cache_dir("kernels")
        if any(v.meta is not None and v.meta.symbolic for v in node.inputs):   # a dynamic program: per size bucket
            live = (str(folder), key)
            if live not in self.trials:
                self.trials[live] = measure.BucketedImpl.of(impl, node, key, folder, self.online(measure.device_of(node)),
                                                            busy=lambda: busy(self))
            return self.trials[live]
        timing = measure.cached_timing(folder / f"{key}.timing.json")
        if timing is None and self.online(measure.device_of(node)):
            live = (str(folder), key)
            trial = self.trials.get(live)
            if trial is None:
                trial = self.trials[live] = measure.TrialImpl.of(
                    impl, node, key, folder, settled=lambda: self.trials.pop(live, None), busy=lambda: busy(self))
            return trial
        return impl if measure.faster_than_aten(impl, node, key, timing) else None

    def prepare(self, folder: Path, jobs: dict, before_start: Callable[[], None] | None = None) -> background.Worker:
        """A background compilation of `jobs` into `folder`, started by `start()`."""
        worker = background.Worker(folder, jobs, before_start)
        self.workers.append(worker)
        return worker

    def mark(self) -> tuple[int, int]:
        """Where this tuner's workers and settle hooks stand now (before one program's `realize`)."""
        return len(self.workers), len(self._on_stop)

    def since(self, mark: tuple[int, int]) -> tuple[list, list]:
        """The workers and settle hooks added since `mark`: one program's tuning work."""
        return self.workers[mark[0]:], self._on_stop[mark[1]:]

    def retire(self, work: tuple[list, list]) -> None:
        """Abandon one program's tuning work (a dynamic program now serves its batches): its workers stop, the
        regions they or their trials left open keep their ATen ops (nothing cached); other programs' go on."""
        workers, settles = work
        _stop_workers(workers)
        for settle in settles:
            settle()
        self.workers[:] = [w for w in self.workers if w not in workers]
        self._on_stop[:] = [f for f in self._on_stop if f not in settles]

    def on_stop(self, settle: Callable[[], None]) -> None:
        """`settle()` is called by `stop()`: what a stopped worker leaves open settles on ATen's kernels."""
        self._on_stop.append(settle)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """A step has run: start the prepared workers that are worth starting now (`Worker.ready`: the
        region dialect waits until its regions' ATen ops have taken as long as compiling them would cost
        the training; `hurry()` lifts that). One whose start fails is finished with nothing stored
        (`Worker.start`); an interrupt propagates, the workers after it starting at the next step."""
        self.stepped = True
        self.workers[:] = [w for w in self.workers if not (w.began and w.finished())]
        for w in list(self.workers):
            if not w.began and (self.hurried or w.worth_starting()):
                w.start()

    def hurry(self) -> None:
        """Start every background compilation after the next step instead of when it has paid for itself
        (a run known to be long, or a benchmark of the tuned steps)."""
        self.hurried = True

    def busy(self) -> bool:
        """Whether one of its workers is compiling (a prepared one may wait for many steps to be worth
        starting: its trials do not wait for it)."""
        return any(w.began and not w.finished() for w in list(self.workers))

    def stop(self) -> None:
        """Stop its workers; the regions they compiled for, and those still measuring, keep their ATen ops
        (nothing is left pending). Trials of measured kernels go on."""
        _stop_workers(self.workers)
        settles, self._on_stop = self._on_stop, []
        for settle in settles:
            settle()

    def close(self) -> None:
        """Stop, and settle every open trial on ATen's kernel (not cached: nothing was decided). Idempotent."""
        if self.closed:
            return
        self.stop()
        for impl in list(self.trials.values()):
            impl.trial.close()
        self.trials.clear()
        self.closed = True
        _tuners.discard(self)

    def pending(self, programs) -> list[str]:
        """One line per distinct choice still open in `programs` ([] once all are made)."""
        pending, seen = [], set()
        for prog in programs:
            for r in prog.regions:
                if r.online is not None and id(r.online) not in seen:
                    seen.add(id(r.online))
                    pending.append(f"fused region {r.name}: {r.online.state}")
            for n in prog.graph.nodes:
                trial = n.impl.trial if n.impl is not None else None
                if trial is not None and trial.chosen is None and id(trial) not in seen:
                    seen.add(id(trial))
                    shapes = ", ".join(str(v.meta) for v in n.inputs if v.meta is not None)
                    pending.append(f"{n.impl.label} {n.op.name}({shapes})")
        return pending


def _stop_workers(workers: list) -> None:
    for w in list(workers):
        w.close()


def busy(owner: Tuner | None = None) -> bool:
    """Whether a trial of `owner` should wait: a worker of this process compiles, or a step is being replayed
    (`replaying`). A compiler's load on the cores would be timed too (`measure.Trial` waits); process-wide on
    purpose, since the cores are shared by every step."""
    if _replays.count:
        return True
    return any(t.busy() for t in list(_tuners) if t is not owner) or (owner is not None and owner.busy())


class _Replays(threading.local):
    count = 0


_replays = _Replays()


@contextlib.contextmanager
def replaying():
    """Around a replay of a step (`CompiledStep.profile`, `memory(measure=True)`): its calls are not training
    calls, so trials neither sample nor advance meanwhile (each unsettled one runs its baseline, untimed). A
    profiler's per-op synchronisation and timers distort the samples: a replay once recorded the attention
    forward at 21 ms against ATen's 10.8 where training measured 4.6 against 6.9, and cached the wrong
    choice."""
    _replays.count += 1
    try:
        yield
    finally:
        _replays.count -= 1


@atexit.register
def stop_all() -> None:
    """Stop the workers of every live tuner (at exit; also before a private cache folder is removed)."""
    for t in list(_tuners):
        _stop_workers(t.workers)
