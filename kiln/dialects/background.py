"""Compiling fused regions in a background process while training runs (online tuning).

`Worker(folder, jobs)` prepares a compilation; `start_pending()`, called by the compiled step after
each step, starts the prepared ones, so the first step never shares the cores with a compiler. A
worker is `python -m kiln.dialects.background JOBFILE`: one process that compiles each job's FX graph
with Inductor (`inductor.compile_graph`) and stores the generated source in the region cache under
the job's key, exactly as a compilation ahead of time would. The training process never waits for it:
regions run their ATen ops until `Worker.finished()`, then load what the worker stored.

The worker runs at the training's priority. On a machine whose cores the training keeps busy, a
compiler at a lower priority barely progresses (measured: a worker at nice 19 had not finished after
14 steps of Llama), so the kernels would never arrive; at the same priority it takes about 10 s of
one core and slows the steps it overlaps (`docs/fusion-results.md`).

A job that fails leaves no source; its error is in the worker's log, which `Worker.errors()` reads
back. Workers still running when the training process exits are stopped (they hold no state a later
run needs: stored sources are complete files, written atomically).
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable

log = logging.getLogger("kiln")

_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()       # prepared or running
_pending: "list[Worker]" = []                                  # prepared, not started
_leftovers: set[str] = set()                                   # logs of finished workers, removed at exit


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Worker:
    """A background compilation of `jobs` ({key: (fx GraphModule, input metas)}) into `folder`,
    started by `start_pending()`."""

    POLL_S = 0.25           # how often `finished()` asks the operating system

    def __init__(self, folder: Path, jobs: dict[str, tuple], before_start: Callable[[], None] | None = None):
        self.folder, self.jobs, self.before_start = folder, dict(jobs), before_start
        self.jobfile, self.log_path = "", Path()
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.seconds: float | None = None
        self._polled = 0.0
        _live.add(self)
        _pending.append(self)

    @property
    def keys(self) -> list[str]:
        return list(self.jobs)

    def start(self) -> None:
        """Start compiling what is still wanted (`before_start` may drop jobs first: regions the first step
        showed too cheap to gain anything); with nothing left, the worker is finished at once."""
        import torch
        if self.before_start is not None:
            self.before_start()
        self.started = time.perf_counter()
        if not self.jobs:
            self._done(self.started)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, self.jobfile = tempfile.mkstemp(dir=self.folder, prefix=".jobs.", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"folder": str(self.folder), "threads": torch.get_num_threads(), "jobs": self.jobs}, f)
        self.log_path = Path(self.jobfile).with_suffix(".log")
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])       # kiln importable, installed or not
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        _take_core()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kiln.dialects.background", self.jobfile],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.info("kiln: compiling %d fused regions in the background (pid %d)", len(self.jobs), self.proc.pid)

    def finished(self) -> bool:
        """Whether the worker is done (asked at most every POLL_S seconds: this sits on the step's path)."""
        if self.seconds is not None:
            return True
        if self.proc is None:
            return False
        now = time.perf_counter()
        if now - self._polled < self.POLL_S:
            return False
        self._polled = now
        if self.proc.poll() is None:
            return False
        self._done(now)
        _unlink(self.jobfile)                  # read; the log stays for errors() until close() or exit
        _leftovers.add(str(self.log_path))
        return True

    def _done(self, now: float) -> None:
        self.seconds = now - self.started
        _live.discard(self)
        _give_back_core()

    def errors(self) -> str:
        """The last lines of the worker's log (its errors, if a job failed)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in lines[-20:] if line.strip())

    def close(self) -> None:
        if self in _pending:
            _pending.remove(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.seconds is None:
            self._done(time.perf_counter())
        if self.proc is not None:
            _unlink(self.jobfile)
            _unlink(self.log_path)
            _leftovers.discard(str(self.log_path))


_lent: int | None = None          # the training's thread count while a worker has one of its cores
_lowered: int | None = None       # ... and the count it was lowered to


def _take_core() -> None:
    """While a worker runs, the training uses one thread fewer if its threads fill every core: two
    OpenMP threads sharing their cores with a compiler wait at every barrier for the one that was
    descheduled (measured on 2 cores: Llama steps took 2.5x as long; with one thread, about 2x)."""
    global _lent, _lowered
    import torch
    threads = torch.get_num_threads()
    if _lent is None and threads > 1 and threads >= len(os.sched_getaffinity(0)):
        _lent, _lowered = threads, threads - 1
        torch.set_num_threads(_lowered)


def _give_back_core() -> None:
    """The training's threads back once no worker runs (unless the user set another count meanwhile)."""
    global _lent
    if _lent is not None and not any(w.proc is not None and w.seconds is None for w in list(_live)):
        import torch
        if torch.get_num_threads() == _lowered:
            torch.set_num_threads(_lent)
        _lent = None


_stepped = False                   # whether a compiled step has finished in this process


def stepped() -> bool:
    """Whether a step has run: kernels found in the cache are loaded after it (loading Inductor's
    runtime takes about 2 s, which the first step should not wait for)."""
    return _stepped


def start_pending() -> None:
    """Start the prepared workers (the compiled step calls this after each step)."""
    global _stepped
    _stepped = True
    while _pending:
        worker = _pending.pop(0)
        try:
            worker.start()
        except Exception as exc:     # no background process: its regions keep their ATen ops
            log.warning("kiln: cannot start the background compilation (%s: %s); %d fused regions run their "
                        "ATen ops", type(exc).__name__, exc, len(worker.keys))
            worker.jobs.clear()
            worker.close()           # finished, with nothing stored: each region reports it cannot load


def busy() -> bool:
    """Whether a worker is still compiling: timings taken now would measure the contention, not the
    kernels (`measure.Trial` waits)."""
    return any(not w.finished() for w in list(_live))


@atexit.register
def _stop_all() -> None:
    for w in list(_live):
        w.close()
    for path in list(_leftovers):
        _unlink(path)
    _live.clear()
    _give_back_core()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kiln.dialects.background JOBFILE (started by kiln, not by hand)", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        spec = pickle.load(f)
    import torch
    torch.set_num_threads(spec["threads"])      # Inductor's C++ kernels are generated for this many threads
    from torch._inductor import config
    config.compile_threads = 1                  # no pool of compile processes on top of this one

    from kiln.dialects import inductor, measure
    folder, failed = Path(spec["folder"]), 0
    for key, (fx, metas) in spec["jobs"].items():
        t = time.perf_counter()
        try:
            measure.write_atomic(folder, f"{key}.py", inductor.compile_graph(fx, metas))
            print(f"kiln worker: compiled {key} in {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as exc:     # reported through the log; the region keeps its ATen ops
            failed += 1
            print(f"kiln worker: {key} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
