"""Fused regions tuned online (the `inductor` dialect with `tuning="online"`, the default on CPU).

A region not measured on this machine yet runs its ATen ops from the first step, timed. Its kernel is
compiled by a background worker (`kiln.dialects.background`), but only once those ATen ops have taken as long
as compiling is expected to cost the training (`_Board.paid_for`); then the kernel is loaded and measured
against the ATen ops on the step's own calls (`measure.Trial`), kept only if faster, and the result cached
like an ahead-of-time measurement, so the next compilation decides before the first step.
"""
from __future__ import annotations

import json
import logging
import time
import weakref
from pathlib import Path

from kiln.dialects import background, inductor, measure, tuning

log = logging.getLogger("kiln")


def go_online(folder: Path, pending: dict[str, list], tuner: tuning.Tuner) -> None:
    """Regions not measured here yet, tuning online: they run their ATen ops from the first step (timed);
    a background worker compiles the kernels not in the cache once that is worth its cost
    (`_Board.paid_for`); once it is done, each kernel is measured against its ATen ops on the step's own
    calls and kept only if faster (`_Online`)."""
    jobs = {key: inductor.job(group[0]) for key, group in pending.items() if not inductor._cached(folder, key)}
    worker = None
    if jobs:
        try:
            worker = tuner.prepare(folder, jobs)
        except Exception as exc:        # no background process: these regions keep their ATen ops
            log.warning("kiln: inductor: cannot prepare the background compilation (%s: %s); %d regions run "
                        "their ATen ops", type(exc).__name__, exc, len(jobs))
            pending = {k: g for k, g in pending.items() if k not in jobs}
        else:
            log.info("kiln: inductor: %d distinct fused regions run their ATen ops; they are compiled in the "
                     "background once those have taken as long as compiling would cost the training (about "
                     "%.1f s; step.tune_now() starts at once), then kept if measured faster", len(jobs),
                     background.training_cost_s(len(jobs)))
    board = _Board(worker, len(pending), tuner)
    for key, group in pending.items():
        board.onlines[key] = _Online(key, group, folder, worker, board)
        for r in group:
            r.online = board.onlines[key]
    if worker is not None:
        worker.before_start = board.drop_cheap       # kept weakly: the worker does not keep the step alive
        worker.ready = board.paid_for
    tuner.on_stop(board.stop)


class _Board:
    """What the online regions of one compilation came to, logged once all have settled."""

    def __init__(self, worker, count: int, tuner: tuning.Tuner):
        self.worker, self.left, self.kept, self.saved, self.other = worker, count, 0, 0.0, {}
        self.onlines: dict[str, _Online] = {}
        self._tuner = weakref.ref(tuner)

    def stepped(self) -> bool:
        """Whether the owning step has run a step (kernels found in the cache are loaded after it: loading
        Inductor's runtime takes about 2 s, which the first step should not wait for)."""
        tuner = self._tuner()
        return tuner is not None and tuner.stepped

    def busy(self) -> bool:
        """Whether a trial should wait for a compiler (`tuning.busy`)."""
        return tuning.busy(self._tuner())

    def stop(self) -> None:
        """The tuner stopped: every region still open keeps its ATen ops (not cached: nothing was decided)."""
        for online in list(self.onlines.values()):
            online._settle("stopped", None)

    def drop_cheap(self) -> None:
        """Before the worker starts: regions whose ATen ops took under 2 * MIN_SAVING_MS a call in the first
        step cannot save a worthwhile amount: they settle as too cheap and are not compiled (the rule of
        tuning ahead; first-step times are, if anything, too long, so no region is dropped unfairly)."""
        if measure.keep() == "all":
            return
        for key, online in self.onlines.items():
            if online.cheap() and key in self.worker.jobs:
                del self.worker.jobs[key]
                online._settle("too cheap to compile", {"aten_ms": min(online.first)})

    def _to_compile(self) -> list["_Online"]:
        return [o for k, o in self.onlines.items() if k in self.worker.jobs and not o.cheap()]

    def paid_for(self) -> bool:
        """Whether the worker is worth starting: its regions' ATen ops have taken, since the program's first
        step, as long as compiling them is expected to cost the training (`background.training_cost_s`).
        A compilation never saves more than the time of the ops it replaces, so waiting until then keeps
        a short run from paying more for its kernels than they could give back (a cold 200-batch Llama
        run lost 7.4 s of training to a worker whose 5 regions then saved 1 ms a step), and costs a long
        run at most as much again as the compilation (the rule of renting skis until their price is spent).
        KILN_KEEP=all (every region wanted, whatever it saves) starts at once."""
        if measure.keep() == "all":
            return True
        spent, cost = self._spent_and_cost()
        return spent >= cost

    def waited(self) -> str:
        """How far the worker is from being worth starting, for `pending_tuning()`."""
        return "{:.1f} s of {:.1f} s".format(*self._spent_and_cost())

    def _spent_and_cost(self) -> tuple[float, float]:
        """Seconds the regions still to compile have spent in their ATen ops, and what compiling them costs
        (nothing to compile: nothing to wait for)."""
        waiting = self._to_compile()
        return sum(o.spent_ms for o in waiting) / 1e3, background.training_cost_s(len(waiting)) if waiting else 0.0

    def settle(self, outcome: str, saved_ms: float = 0.0) -> None:
        self.left -= 1
        if outcome == "kept":
            self.kept += 1
            self.saved += saved_ms
        else:
            self.other[outcome] = self.other.get(outcome, 0) + 1
        if self.left == 0:
            rest = ", ".join(f"{n} {k}" for k, n in sorted(self.other.items()))
            log.info("kiln: inductor: fused regions measured during training: %d kept (%.2f ms faster per call "
                     "together)%s", self.kept, self.saved, f", {rest}" if rest else "")
            if self.worker is not None:
                self.worker.close()


class _Online:
    """One distinct region (all regions with its key) measured during training.

    waiting to be compiled: the regions run their ATen ops, timed (`spent_ms`, for `_Board.paid_for`; the
        first step's calls also for `_Board.drop_cheap`);
    compiling in the background: the ATen ops, untimed;
    measuring: once the worker is done, the kernel is loaded and a `measure.Trial` alternates it with
        the ATen ops; the result is stored like an ahead-of-time measurement (next runs decide at
        compile time) and the faster one runs from then on."""

    def __init__(self, key: str, regions: list, folder: Path, worker, board: _Board):
        self.key, self.regions, self.folder, self.worker, self.board = key, regions, folder, worker, board
        self.measuring = worker is None
        self.kernel = None
        self.first: list[float] = []          # ms of each call in the first step
        self.spent_ms = 0.0                   # ms in the ATen ops until the worker starts (`_Board.paid_for`)
        self.trial = measure.Trial(("aten_ms", "compiled_ms"), self._measured, busy=board.busy)

    @property
    def phase(self) -> str:
        if self.measuring:
            return "measuring"
        return "compiling in the background" if self.worker.began else "waiting to be compiled"

    @property
    def state(self) -> str:
        """The phase, and for a waiting region what it waits for (`pending_tuning()`)."""
        if self.phase != "waiting to be compiled":
            return self.phase
        return (f"waiting to be compiled in the background until its ATen ops have taken as long as compiling "
                f"would cost ({self.board.waited()}; step.tune_now() starts it)")

    def cheap(self) -> bool:
        """The first step showed its ATen ops too cheap to gain a worthwhile amount (`_Board.drop_cheap`)."""
        return bool(self.first) and min(self.first) < 2 * measure.MIN_SAVING_MS

    def __call__(self, region, args):
        if self.kernel is None and (self.worker.finished() if self.worker is not None else self.board.stepped()):
            self._load(region)
        if region.online is not self:        # settled just now: kept without measuring (KILN_KEEP=all), or failed
            return region(*args)
        if self.kernel is None:               # not compiled yet: the ATen ops, timed until the worker starts
            if self.board.stepped() and (self.worker is None or self.worker.began):
                return region.reference(*args)
            t = time.perf_counter()
            out = region.reference(*args)
            ms = (time.perf_counter() - t) * 1e3
            self.spent_ms += ms
            if not self.board.stepped():
                self.first.append(ms)
            return out
        out = self.trial.run({"aten_ms": lambda: region.reference(*args), "compiled_ms": lambda: region.run_kernel(args)},
                             scale=region.scale(args))
        if region.failed is not None:         # the kernel broke (logged by the region): nothing to measure
            self._settle("failed", None, region.failed)
        return out

    def _load(self, region) -> None:
        try:
            source = inductor._load_source(self.folder, self.key, inductor.codegen_facts())
            if source is None:
                raise RuntimeError(self.worker.errors() if self.worker is not None else "no kernel")
            self.kernel = inductor._load_kernel(source)
        except Exception as exc:
            lines = [line for line in str(exc).splitlines() if self.key in line] or str(exc).splitlines()[-1:]
            log.warning("kiln: inductor could not compile fused region %s in the background (%s); its %d ops run "
                        "unfused", region.name, lines[0] if lines else type(exc).__name__, len(region.nodes))
            self._settle("failed", None, "compile")
            return
        for r in self.regions:
            r.compiled = self.kernel
        self.measuring = True
        if measure.keep() == "all":
            self._settle("kept", None)

    def _measured(self, ms: dict) -> None:
        self._settle("kept" if inductor._worth_it(ms) else "not faster than ATen", ms)

    def _settle(self, outcome: str, timing: dict | None, failed: str | None = None) -> None:
        if self.regions[0].online is not self:
            return
        if timing is not None:
            measure.write_atomic(self.folder, f"{self.key}.timing.json", json.dumps(timing))
        keep = outcome == "kept"
        for r in self.regions:
            r.online = None
            r.timing = timing or r.timing
            r.failed = r.failed or failed
            if not keep:
                r.compiled = None
        if timing is not None and "compiled_ms" in timing:
            log.info("kiln: inductor: %s measured during training: %.3f ms, ATen %.3f ms: %s", self.regions[0].name,
                     timing["compiled_ms"], timing["aten_ms"], "kept" if keep else "ATen kept")
        saved = timing["aten_ms"] - timing["compiled_ms"] if keep and timing and "compiled_ms" in timing else 0.0
        self.board.settle(outcome, saved * len(self.regions))
