"""A training step's state changes, applied as one commit that an exception or a signal cannot split.

The update kernels (kiln/optim.py) and the buffer updates of a generated step do not write parameters,
optimizer state or buffers while the step computes. They compute what they can out of place and
*stage* their in-place writes (each one ATen call: `_fused_adamw_`, `_foreach_copy_`, `copy_`, ...) on
the transaction of the running step. After the step's function has returned, `commit()` applies them:
- SIGINT/SIGTERM arriving meanwhile are held and delivered right after (main thread; other threads get
  no signals);
- an exception raised between two writes (an interrupt injected by a trace function, a timer's
  KeyboardInterrupt in a thread without deferral) rolls the commit *forward*: the remaining writes are
  applied, then the exception propagates. Each write is one C++ call, and a write together with the
  count of writes done is one line, so no trace event falls between a write and its count;
- writes that can fail (the fused kernels) come first; when the first write fails nothing has changed.
A failure anywhere before the commit (forward, backward, a non-finite guard) leaves everything as it
was. Outside a step (the profiler's replay, tests calling a generated function) writes run at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable

_local = threading.local()
_HELD = (signal.SIGINT, signal.SIGTERM)


class Transaction:
    __slots__ = ("fallible", "writes")

    def __init__(self):
        self.fallible: list[tuple[Callable, tuple, dict]] = []   # kernels that may raise: applied first
        self.writes: list[tuple[Callable, tuple, dict]] = []     # copies of computed values

    def commit(self) -> None:
        writes, self.fallible, self.writes = self.fallible + self.writes, [], []
        with _signals_held(), _profiled():
            done = 0
            try:
                for fn, args, kwargs in writes:
                    fn(*args, **kwargs); done += 1  # noqa: E702  (one line: no trace event in between)
            except BaseException:
                if done:                            # begun: finish, so the update is applied whole
                    for fn, args, kwargs in writes[done:]:
                        fn(*args, **kwargs)
                raise


COMMIT_EVENT = "kiln.kernel:optimizer:commit"    # a profiled commit (kiln/bench/split.py counts it as the optimizer's)


def _profiled():
    """One torch.profiler event around the commit while a profiler records (the update kernels' work, staged
    by the optimizer ops, runs here); nothing otherwise."""
    from kiln import profiling
    return profiling.event(COMMIT_EVENT) if profiling.recording() else contextlib.nullcontext()


def stage(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """Apply an in-place write at the running step's commit (at once outside a step)."""
    _stage(False, fn, args, kwargs)


def stage_first(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """`stage` for a write that may raise (a fused kernel checking its arguments): it runs before all
    writes staged with `stage`."""
    _stage(True, fn, args, kwargs)


def _stage(fallible: bool, fn, args, kwargs) -> None:
    txn = getattr(_local, "txn", None)
    if txn is None:
        fn(*args, **kwargs)
    else:
        (txn.fallible if fallible else txn.writes).append((fn, args, kwargs))


@contextlib.contextmanager
def step_transaction():
    """The transaction of one step: writes staged inside the block are kept for `commit()`; leaving the
    block by an exception drops them (nothing was written)."""
    txn = Transaction()
    outer = getattr(_local, "txn", None)
    _local.txn = txn
    try:
        yield txn
    except BaseException:
        txn.fallible, txn.writes = [], []
        raise
    finally:
        _local.txn = outer


@contextlib.contextmanager
def _signals_held():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    try:
        for s in _HELD:
            previous[s] = signal.signal(s, lambda signum, frame: held.append(signum))
    except (ValueError, OSError):        # no signal handling here (embedded interpreter): nothing to hold
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        yield
        return
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        for s in dict.fromkeys(held):
            signal.raise_signal(s)
