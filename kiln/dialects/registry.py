"""Operator dialects (after RAF): several kernel providers per op, chosen by priority and checker.

A dialect is a kernel provider (ATen, PyTorch's fused attention, later Inductor, oneDNN, Triton).
Each registers implementations of ops, of two forms:
- a *kernel*: the callable the generated step calls for a node of that op;
- a *lowering*: a graph rewrite that replaces the op with other ops before autodiff (e.g. sdpa ->
  PyTorch's flash-attention kernels whose backward kernel exists; or -> math ops).
- a *fusion*: a pattern over several nodes (`kiln.ir.pattern`) and a builder that replaces the
  matched subgraph with one fused op of the dialect (RAF's FuseDialect), run by the `fuse` pass.
For every node, the highest-priority implementation whose dialect is enabled, whose devices include
the node's device, and whose checker accepts the node's concrete shapes/dtypes is used; the others
are the fallback. `aten` implements every ATen op, so there is always one, and a kernel that raises
at run time hands over to the op's ATen kernel (`Impl.runnable`), with a warning.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kiln.errors import KilnError
from kiln.once import Once

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class Dialect:
    name: str
    priority: int                 # higher wins when two dialects implement an op
    devices: tuple[str, ...]      # device types it runs on
    doc: str


@dataclass
class Impl:
    dialect: Dialect
    target: Any                   # the op it implements (ATen overload)
    kernel: Callable | None = None
    lower: Callable | None = None  # lower(b, node) -> replacement values
    checker: Callable[[Any], bool] = field(default=lambda node: True)
    priority: int = 0             # tie-break within a dialect
    name: str = ""
    fallback: bool = True         # on a run-time failure, run the op's ATen kernel instead (logged)
    measured: bool = False        # used only where measured faster than the op's ATen kernel here
    trial: Any = None             # measure.TrialImpl while (and after) it is measured during training

    @functools.cached_property
    def runnable(self) -> Callable | None:
        """The kernel the generated step calls: a non-aten kernel of a side-effect-free ATen or custom
        op falls back to the op's own (ATen) implementation if it raises, with a warning, and keeps
        using that implementation afterwards. Kernels with side effects never retry (a partial
        in-place update must surface)."""
        from torch._ops import OpOverload

        from kiln.ops.registry import lookup
        if (self.kernel is None or not self.fallback or self.dialect.name == "aten"
                or not isinstance(self.target, OpOverload) or self.kernel is self.target
                or lookup(self.target).side_effects):
            return _profiled(self, self.kernel)
        return _profiled(self, _with_fallback(self))

    @property
    def label(self) -> str:
        label = f"{self.dialect.name}:{self.name}" if self.name else self.dialect.name
        if self.trial is not None and self.trial.chosen is not True:    # measured online: not decided, or lost
            return f"{label} (measuring)" if self.trial.chosen is None else "aten"
        return label

    def accepts(self, node) -> bool:
        devices = {v.meta.device.type for v in node.outputs if v.meta is not None} or {"cpu"}
        return devices <= set(self.dialect.devices) and bool(self.checker(node))


@dataclass
class Fusion:
    """Replace every match of `pattern` (rooted at a value) by what `build(b, matches)` emits.

    `build` gets a Builder positioned where the fused op goes and the list of matches it fuses (one, or
    a group: see `group_by`); it returns, per match, the replacement of the root node's outputs, or
    None to decline (the nodes stay as they are). `group_by(match)` groups matches with equal keys into
    one build call (a key of None: leave the match alone), split in graph order into chunks of
    `group_size` (all of them if None); chunks smaller than `min_group` are left alone. `phase` says which graph it applies to: "forward" (before amp and autodiff, so the fused op's
    own VJP rule and cast class apply) or "training" (after autodiff and the optimizer).

    `shared`: names of inner values of the pattern (bound by `name=`) that may be used outside the match (a
    residual sum the fused op also writes); `build` then returns, per match, a pair: the root's replacement and
    a dict {name: the value that replaces that inner value everywhere}. Not with `group_by`.
    """

    dialect: Dialect
    name: str
    pattern: Any                   # kiln.ir.pattern.Pattern
    build: Callable
    priority: int = 0
    phase: str = "forward"
    group_by: Callable | None = None
    group_size: int | None = None
    min_group: int = 1
    doc: str = ""
    shared: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.dialect.name}:{self.name}"


@dataclass
class RegionFusion:
    """A dialect that compiles whole regions of elementwise/reduction ops (`kiln.passes.regions`).

    `accepts(node)` says which nodes it can put in a region; `compile_all(regions, tuner)`, called by the
    step's `tuning.Tuner` after the passes (`Tuner.realize`), gives each region its compiled kernel
    (`region.compiled`) or its online trial (`region.online`), or leaves both None (the region runs its
    reference ops)."""

    dialect: Dialect
    accepts: Callable
    compile_all: Callable
    max_ops: int = 64
    doc: str = ""

    @property
    def label(self) -> str:
        return f"{self.dialect.name}:region"


DIALECTS: dict[str, Dialect] = {}
_IMPLS: dict[Any, list[Impl]] = {}
_FUSIONS: list[Fusion] = []
_REGIONS: list[RegionFusion] = []


def dialect(name: str, priority: int, devices=("cpu", "cuda"), doc: str = "") -> Dialect:
    d = Dialect(name, priority, tuple(devices), doc)
    DIALECTS[name] = d
    return d


def kernel(d: Dialect, target: Any, fn: Callable, checker=None, priority: int = 0, name: str = "",
           fallback: bool = True, measured: bool = False) -> Impl:
    """`measured=True`: the kernel is used for a node only if it is faster than the op's ATen kernel on
    the node's shapes on this machine (`kiln.dialects.measure`, timed once per machine)."""
    return _add(Impl(d, target, kernel=fn, checker=checker or (lambda n: True), priority=priority, name=name,
                     fallback=fallback, measured=measured))


PROFILE_EVENT = "kiln.kernel"       # what a profiled step calls a dialect kernel's call (kiln/bench/split.py)


def _profiled(impl: Impl, fn: Callable | None) -> Callable | None:
    """`fn`, seen by torch.profiler as one event named after the op's kind, the op and the kernel
    (`kiln.kernel:<kind>:<op> (<dialect>:<name>)`; an op outside Kiln's registry without a kind) while a
    profiler records: work a kernel does outside ATen's ops (native loops, Kiln's own optimizer) is then
    counted as that op's, not as untraced time. ATen's own ops are seen by the profiler already. A check of a
    flag per call otherwise."""
    from torch._ops import OpOverload, OpOverloadPacket

    if fn is None or isinstance(fn, (OpOverload, OpOverloadPacket)):
        return fn
    from kiln.ops.registry import find
    op = find(impl.target)
    what = f"{op.kind.value}:{op.name}" if op is not None else str(getattr(impl.target, "__name__", impl.target))
    event = f"{PROFILE_EVENT}:{what} ({impl.dialect.name}{':' + impl.name if impl.name else ''})"
    from kiln.profiling import event as profiler_event, recording

    def run(*args, **kwargs):
        if recording():
            with profiler_event(event):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "kernel")
    return run


def _with_fallback(impl: Impl) -> Callable:
    primary, reference = impl.kernel, impl.target
    failed = False

    def run(*args, **kwargs):
        nonlocal failed
        if not failed:
            try:
                return primary(*args, **kwargs)
            except Exception as exc:     # a broken provider costs speed, never the step
                failed = True
                log.warning("kiln: kernel %s of %s failed at run time (%s: %s); using ATen's kernel from now on",
                            impl.label, reference, type(exc).__name__, exc)
        return reference(*args, **kwargs)

    run.__name__ = run.__qualname__ = getattr(primary, "__name__", "kernel")
    return run


def lowering(d: Dialect, target: Any, fn: Callable, checker=None, priority: int = 0, name: str = "") -> Impl:
    return _add(Impl(d, target, lower=fn, checker=checker or (lambda n: True), priority=priority, name=name))


def fusion(d: Dialect, name: str, pattern: Any, build: Callable, *, priority: int = 0, phase: str = "forward",
           group_by: Callable | None = None, group_size: int | None = None, min_group: int = 1,
           doc: str = "", shared: tuple[str, ...] = ()) -> Fusion:
    if phase not in ("forward", "training"):
        raise ValueError(f"fusion {name}: phase must be 'forward' or 'training', got {phase!r}")
    if shared and group_by is not None:
        raise ValueError(f"fusion {name}: shared inner values are for single matches, not groups")
    f = Fusion(d, name, pattern, build, priority, phase, group_by, group_size, min_group, doc, tuple(shared))
    _FUSIONS.append(f)
    return f


def region_provider(d: Dialect, accepts: Callable, compile_all: Callable, max_ops: int = 64,
                    doc: str = "") -> RegionFusion:
    r = RegionFusion(d, accepts, compile_all, max_ops, doc)
    _REGIONS.append(r)
    return r


def region_fusion(names: tuple[str, ...]) -> RegionFusion | None:
    """The region dialect to use: the first enabled one in preference order (None: no region fusion)."""
    _ensure_loaded()
    for n in names:
        for r in _REGIONS:
            if r.dialect.name == n:
                return r
    return None


def fusions(names: tuple[str, ...], phase: str) -> list[Fusion]:
    """The fusions of enabled dialects for `phase`, in the order to try them: dialect preference
    (the order of `names`), then priority."""
    _ensure_loaded()
    rank = {n: i for i, n in enumerate(names)}
    chosen = [f for f in _FUSIONS if f.dialect.name in rank and f.phase == phase]
    return sorted(chosen, key=lambda f: (-f.priority, rank[f.dialect.name]))


def _add(impl: Impl) -> Impl:
    impls = _IMPLS.setdefault(impl.target, [])
    impls.append(impl)
    impls.sort(key=lambda i: (i.dialect.priority, i.priority), reverse=True)
    return impl


def lowered_targets() -> list[Any]:
    """Ops some dialect implements by a graph lowering."""
    _ensure_loaded()
    return [t for t, impls in _IMPLS.items() if any(i.lower is not None for i in impls)]


def impls_for(target: Any) -> list[Impl]:
    _ensure_loaded()
    return list(_IMPLS.get(target, ()))


# ---- which dialects are enabled --------------------------------------------------------------
_enabled: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("kiln_dialects", default=None)


def enabled() -> tuple[str, ...]:
    """The enabled dialects, in the order given by the innermost `kiln.dialects(...)`; outside one, all
    of them by priority, as changed by $KILN_DIALECTS (see `from_env`)."""
    _ensure_loaded()
    chosen = _enabled.get()
    if chosen is not None:
        return chosen
    everything = tuple(sorted(DIALECTS, key=lambda n: -DIALECTS[n].priority))
    return from_env(os.environ.get("KILN_DIALECTS", ""), everything)


def from_env(value: str, everything: tuple[str, ...]) -> tuple[str, ...]:
    """$KILN_DIALECTS: "sdpa,kiln" enables those (in that order, aten last); "-inductor,-upcast" turns
    those off and keeps the rest. Empty: everything."""
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        return everything
    off = [x[1:] for x in items if x.startswith("-")]
    on = [x for x in items if not x.startswith("-")]
    if off and on:
        raise KilnError(f"KILN_DIALECTS={value!r}: either list the dialects to use or the ones to turn off "
                        "(prefixed with '-'), not both")
    unknown = [n for n in off + on if n not in DIALECTS]
    if unknown:
        raise KilnError(f"KILN_DIALECTS={value!r}: unknown dialect(s) {unknown}; available: {sorted(DIALECTS)}")
    if "aten" in off:
        raise KilnError("KILN_DIALECTS: aten cannot be turned off: it is every op's fallback")
    return check_names(on) if on else tuple(n for n in everything if n not in off)


def check_names(names) -> tuple[str, ...]:
    _ensure_loaded()
    names = tuple(names)
    unknown = [n for n in names if n not in DIALECTS]
    if unknown:
        raise KilnError(f"unknown dialect(s) {unknown}; available: {sorted(DIALECTS)}")
    if "aten" not in names:
        names = names + ("aten",)   # the reference provider is always the last resort
    return names


@contextlib.contextmanager
def dialects(*names: str) -> Iterator[tuple[str, ...]]:
    """Restrict and reorder dialects for compilations inside the block: `with kiln.dialects("aten"):`.
    The order given is the preference order; `aten` is always appended as the fallback."""
    token = _enabled.set(check_names(names))
    try:
        yield _enabled.get()
    finally:
        _enabled.reset(token)


def select(node, names: tuple[str, ...], form: str, choose: Callable | None = None) -> Impl | None:
    """The implementation of `form` ('kernel' or 'lower') to use for node, or None.

    A measured kernel (`Impl.measured`) is used only where `choose(impl, node)` (a `tuning.Tuner`'s: known,
    measured now, or measured online) returns an implementation; None there tries the next candidate.
    Without `choose` nothing is measured: the first candidate is returned, measured or not, and the caller
    (the dispatch pass) leaves the choice to the tuner."""
    rank = {n: i for i, n in enumerate(names)}
    candidates = [i for i in impls_for(node.target) if i.dialect.name in rank and getattr(i, form) is not None]
    candidates.sort(key=lambda i: (rank[i.dialect.name], -i.priority))
    for impl in candidates:
        if impl.accepts(node):
            if impl.measured and choose is not None:
                impl = choose(impl, node)
                if impl is None:
                    continue
            return impl
    return None


def aten_kernel(target) -> Impl:
    """The `aten` implementation of an ATen op (or fallback node): its target itself."""
    return Impl(DIALECTS["aten"], target, kernel=target)


def _load() -> None:
    """Import the modules that register (once: `_ensure_loaded`)."""
    from kiln.dialects import aten, sdpa  # noqa: F401  (register)
    from kiln.dialects import kiln_kernels  # noqa: F401  (kiln.kernels custom ops)
    from kiln.dialects import upcast  # noqa: F401  (low precision on CPUs without it)
    from kiln.dialects import inductor  # noqa: F401  (fused regions compiled by Inductor)
    from kiln.dialects import onednn  # noqa: F401  (oneDNN linear where measured faster)
    from kiln.dialects import attention  # noqa: F401  (attention's backward by measurement)


_ensure_loaded = Once(_load)
