"""Compiling fused regions in a background process while training runs (online tuning).

`Worker(folder, jobs)` prepares a compilation; its owner, the step's `tuning.Tuner`, starts it after the
step has run (`Tuner.start()`), so the first step never shares the cores with a compiler. A
worker is `python .../kiln/dialects/background.py`: one process that compiles each job's FX graph with
Inductor (`inductor.compile_graph`) and stores the generated source in the region cache under the
job's key, exactly as a compilation ahead of time would (`inductor.store_source`: with its hash in the
cache's index). The training process never waits for it: regions run their ATen ops until
`Worker.finished()`, then load what the worker stored.

The worker runs at the training's priority. On a machine whose cores the training keeps busy, a
compiler at a lower priority barely progresses (measured: a worker at nice 19 had not finished after
14 steps of Llama), so the kernels would never arrive; at the same priority it takes about 10 s of
one core and slows the steps it overlaps (`docs/fusion-results.md`).

Lifecycle: a worker never outlives what started it and leaves nothing on disk but complete cache entries.
- Its jobs and its log are anonymous temporary files (no name, so nothing to clean up after any death).
- It dies with the training process: a parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`, armed when
  started from the main thread: the signal follows the thread that started it), and, everywhere, a
  watchdog thread that exits on EOF of the pipe the training holds (closed by the kernel however the
  training ends, `kill -9` included) or when its parent pid changes. It runs in its own process group,
  and takes its compiler subprocesses with it.
- It is stopped (`close()`) when all its regions are settled, when its tuner is stopped or closed
  (`CompiledStep.close()`), when the `Worker` is garbage collected (its step was), and at interpreter exit.
- A start that fails or is interrupted finishes the worker with nothing stored (warned): its regions
  report it and keep their ATen ops; tuning is never left pending.
A job that fails leaves no source; its error is in the worker's log, which `Worker.errors()` reads back.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

log = logging.getLogger("kiln")


class Worker:
    """A background compilation of `jobs` ({key: (fx GraphModule, input metas)}) into `folder`, owned
    and started by a `tuning.Tuner`. `before_start` may drop jobs first; `ready` says whether it is worth
    starting yet (the tuner asks after every step; None: at once). Both are kept weakly when they are bound
    methods, so a worker does not keep its owner alive."""

    POLL_S = 0.25           # how often `finished()` asks the operating system

    def __init__(self, folder: Path, jobs: dict[str, tuple], before_start: Callable[[], None] | None = None):
        self.folder, self.jobs, self.before_start = folder, dict(jobs), before_start
        self.ready: Callable[[], bool] | None = None
        self.started = 0.0
        self.seconds: float | None = None
        self.failure = ""                 # why it did not start (it is then finished, having stored nothing)
        self._began = False
        self._borrowing = False           # holds one of the training's cores (`_take_core`)
        self._polled = 0.0
        self._os = _Process()
        weakref.finalize(self, self._os.stop)     # garbage collected, or interpreter exit: stopped

    @property
    def before_start(self) -> Callable[[], None] | None:
        return _deref(self._before_start)

    @before_start.setter
    def before_start(self, fn: Callable[[], None] | None) -> None:
        self._before_start = _weak(fn)

    @property
    def ready(self) -> Callable[[], bool] | None:
        return _deref(self._ready)

    @ready.setter
    def ready(self, fn: Callable[[], bool] | None) -> None:
        self._ready = _weak(fn)

    def worth_starting(self) -> bool:
        """Whether to start now: its `ready` says so, or there is none (a dead owner's worker never starts)."""
        ready = self.ready
        return bool(ready()) if ready is not None else not isinstance(self._ready, weakref.WeakMethod)

    @property
    def keys(self) -> list[str]:
        return list(self.jobs)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._os.proc

    def start(self) -> None:
        """Start compiling what is still wanted (`before_start` may drop jobs first: regions the first step
        showed too cheap to gain anything); with nothing left, the worker is finished at once. Never half
        started: on any failure, an interrupt included, it is finished with nothing stored (warned) and
        an exception that is not an `Exception` (KeyboardInterrupt, SystemExit) propagates."""
        if self._began:
            return
        self._began = True
        self.started = time.perf_counter()
        try:
            before = self.before_start
            if before is not None:
                before()
            if not self.jobs:
                self._done(self.started)
                return
            import torch
            self._os.spawn({"folder": str(self.folder), "threads": torch.get_num_threads(), "jobs": self.jobs})
            _take_core()
            self._borrowing = True
        except Exception as exc:
            self._fail(exc)
            return
        except BaseException as exc:
            self._fail(exc)
            raise
        log.info("kiln: compiling %d fused regions in the background (pid %d)", len(self.jobs), self.proc.pid)

    def _fail(self, exc: BaseException) -> None:
        self.failure = f"the background compilation did not start ({type(exc).__name__}: {exc})"
        log.warning("kiln: cannot start the background compilation (%s: %s); %d fused regions run their ATen ops",
                    type(exc).__name__, exc, len(self.jobs))
        self.jobs.clear()
        self._os.stop()
        if self.seconds is None:
            self._done(time.perf_counter())

    @property
    def began(self) -> bool:
        """Whether `start()` was called (or the worker was closed before): it will not start again."""
        return self._began

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
        return True

    def _done(self, now: float) -> None:
        self.seconds = now - self.started
        if self._borrowing:
            self._borrowing = False
            _give_back_core()

    def errors(self) -> str:
        """The last lines of the worker's log (its errors, if a job failed), or why it did not start."""
        text = self._os.read_log()
        lines = [line for line in text.splitlines()[-20:] if line.strip()]
        return "\n".join(([self.failure] if self.failure else []) + lines)

    def close(self) -> None:
        """Stop the worker (with its compilers) if it runs, and release its pipe and log; a worker closed
        before it started never starts."""
        self._began = True
        self._os.stop()
        if self.seconds is None:
            self._done(time.perf_counter())


def _weak(fn):
    """A bound method as a weak reference (its object may be collected), anything else as it is."""
    return weakref.WeakMethod(fn) if hasattr(fn, "__self__") and hasattr(fn, "__func__") else fn


def _deref(ref):
    return ref() if isinstance(ref, weakref.WeakMethod) else ref


# What a worker costs the training (measured on 2 cores, docs/fusion-results.md): about 6 s of one core to
# start (importing torch and Inductor, ~3.5 s; Inductor's check of the compiler's vector instructions,
# ~2.75 s with an empty Inductor cache), then about 1-1.5 s per distinct region (code generation, g++).
STARTUP_S = 6.0
PER_JOB_S = 1.5


def training_cost_s(jobs: int) -> float:
    """Seconds of training a worker compiling `jobs` regions is expected to cost the steps it overlaps.
    Where the training's threads fill every core, it lends the worker one (`_take_core`) and runs that much
    slower meanwhile: the worker's time over the thread count (a Llama job of 5 regions on 2 cores: about
    14 s of compiling, and its steps lost 7.4 s); with a core to spare, nothing."""
    import torch
    threads = torch.get_num_threads()
    if threads < _cores():
        return 0.0
    return (STARTUP_S + PER_JOB_S * jobs) / max(threads, 1)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Process:
    """The operating-system side of a worker: the process, the pipe whose EOF tells it the training is gone,
    and its anonymous log. Holds no reference to its `Worker`, so the worker's finalizer can stop it."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.log = None

    def spawn(self, spec: dict) -> None:
        args = [sys.executable, str(Path(__file__).resolve()), "--parent", str(os.getpid())]
        if threading.current_thread() is threading.main_thread():
            args.append("--pdeathsig")      # the signal follows the starting thread: only the main one lives as long
        self.log = tempfile.TemporaryFile()
        with tempfile.TemporaryFile() as jobs:
            pickle.dump(spec, jobs)
            jobs.flush()
            jobs.seek(0)
            self.proc = subprocess.Popen(args + ["--jobs-fd", str(jobs.fileno())], pass_fds=(jobs.fileno(),),
                                         stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def read_log(self) -> str:
        """The log's last 64 KiB, read without moving the file offset the worker writes at."""
        try:
            fd = self.log.fileno()
            size = os.fstat(fd).st_size
            return os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16))).decode(errors="replace")
        except (AttributeError, OSError, ValueError):
            return ""

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)       # its own group: the worker and its compilers
            except (AttributeError, OSError):
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in (proc.stdin if proc is not None else None, self.log):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self.log = None


# Core accounting is process-wide on purpose: torch's thread count is one per process, shared by every
# step, so which workers (of any step's tuner) borrow from it is a fact about the process, not a step.
_lent: int | None = None          # the training's thread count while a worker has one of its cores
_lowered: int | None = None       # ... and the count it was lowered to
_borrowers = 0                    # running workers of this process (the count comes back when none runs)


def training_threads() -> int:
    """The training's own thread count (while a worker borrows a core, the count it will get back)."""
    import torch
    return _lent if _lent is not None else torch.get_num_threads()


def _take_core() -> None:
    """While a worker runs, the training uses one thread fewer if its threads fill every core: two
    OpenMP threads sharing their cores with a compiler wait at every barrier for the one that was
    descheduled (measured on 2 cores: Llama steps took 2.5x as long; with one thread, about 2x)."""
    global _lent, _lowered, _borrowers
    import torch
    threads = torch.get_num_threads()
    if _lent is None and threads > 1 and threads >= _cores():
        _lent, _lowered = threads, threads - 1
        torch.set_num_threads(_lowered)
    _borrowers += 1


def _give_back_core() -> None:
    """The training's threads back once no worker runs (unless the user set another count meanwhile)."""
    global _lent, _borrowers
    _borrowers = max(0, _borrowers - 1)
    if _lent is not None and _borrowers == 0:
        import torch
        if torch.get_num_threads() == _lowered:
            torch.set_num_threads(_lent)
        _lent = None


# ---- the worker process --------------------------------------------------------------------------------
def _die() -> None:
    """Exit now, with the compilers this worker started (its process group, when it leads one)."""
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(1)


def _follow_parent(parent: int, pdeathsig: bool) -> None:
    """Die with the training process `parent`: a parent-death signal where Linux offers one, and a watchdog
    thread for EOF on stdin (the training's end of the pipe) or a new parent pid (reparented)."""
    signal.signal(signal.SIGTERM, lambda *_: _die())
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)    # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:          # it died before the signal was armed
        _die()

    def watch() -> None:
        import select
        while True:
            try:
                ready, _, _ = select.select([0], [], [], 0.5)
                if ready and not os.read(0, 4096):
                    _die()
            except (OSError, ValueError):
                time.sleep(0.5)
            if os.getppid() != parent:
                _die()
    threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="background.py", description="a Kiln compile worker (started by kiln, "
                                     "not by hand)")
    parser.add_argument("--parent", type=int, required=True, help="the training process: die with it")
    parser.add_argument("--jobs-fd", type=int, required=True, help="an inherited file of pickled jobs")
    parser.add_argument("--pdeathsig", action="store_true", help="arm Linux's parent-death signal")
    opts = parser.parse_args(argv)
    _follow_parent(opts.parent, opts.pdeathsig)
    import torch
    with open(opts.jobs_fd, "rb") as f:
        spec = pickle.load(f)
    torch.set_num_threads(spec["threads"])      # Inductor's C++ kernels are generated for this many threads
    from torch._inductor import config
    config.compile_threads = 1                  # no pool of compile processes on top of this one

    from kiln.dialects import inductor
    folder, failed = Path(spec["folder"]), 0
    for key, (fx, metas) in spec["jobs"].items():
        t = time.perf_counter()
        try:
            if not inductor.store_source(folder, key, inductor.compile_graph(fx, metas)):
                raise OSError("the cache could not be written")
            print(f"kiln worker: compiled {key} in {time.perf_counter() - t:.1f}s", flush=True)
        except Exception as exc:     # reported through the log; the region keeps its ATen ops
            failed += 1
            print(f"kiln worker: {key} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    # run as a file (not -m kiln...): only the standard library is imported before the parent is followed
    sys.path[0] = str(Path(__file__).resolve().parents[2])      # kiln's root, not this folder
    sys.exit(main(sys.argv[1:]))
