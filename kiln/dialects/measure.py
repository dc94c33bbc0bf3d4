"""Measured kernel choices: time two implementations on inputs of a node's shapes, once per machine.

A dialect that is only sometimes faster than ATen (Inductor regions, oneDNN linear) asks here instead
of guessing: both implementations run interleaved (a warm-up, then 5 runs each) on tensors with the
node's shapes, strides and dtypes, and the medians are kept in a small JSON file per key under
`cache_dir()`, so each distinct case is timed once per machine and torch version.

The cache (`cache_dir()`): one folder per torch version and machine (`machine()`: CPU ISA and flags,
compiler, ISA/oneDNN/Inductor environment, threads), so a cache shared between machines (a home folder, a
baked container) never hands one CPU's kernels or timings to another. It is used only if this user owns
it and no one else can write it (created 0700). Files are written atomically (temp file + rename, the temp
file removed on any failure): a reader never sees half a file, and a cache that cannot be written only
costs a later run the measurement again. Code (Inductor's generated wrappers) is stored with its sha256
in the folder's index and loaded only if it matches (`store_artifact`, `load_artifact`).

Tuning (`tuning()`): *when* an unknown case is measured. Which mode a step uses, its live trials and
its workers belong to the step's `kiln.dialects.tuning.Tuner`; this module holds the measuring and the
cache helpers, and no state of any step.
- "online" (the default on CPU): nothing is timed before the first step. The step starts on ATen's
  kernels; a `Trial` then alternates the two implementations on the calls the step really makes,
  times each (5 each, after one unmeasured call each; 3 each when those leave no doubt), settles on
  the faster, and stores the result like an ahead-of-time measurement, so the next run decides at
  compile time. Kernels that must be compiled first (Inductor regions) are compiled by a background
  process meanwhile.
- "ahead" ($KILN_TUNING=ahead or `kiln.compile(..., tuning="ahead")`): everything is compiled and timed
  on example tensors before the first step, so every step, the first included, runs the chosen
  kernels: the numerics of a run do not depend on when a measurement finished. Always used on GPUs,
  where a host clock around an asynchronous kernel measures nothing.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from kiln import cachedir
from kiln.dialects import background
from kiln.errors import KilnError

log = logging.getLogger("kiln")

KEEP_IF_FASTER = 0.95      # a kernel replaces ATen's only if it takes at most 95 % of its time
MIN_SAVING_MS = 0.05       # ... and saves at least this much per call: less is noise, and not worth
                           # loading a compiler's runtime at start-up (Inductor's takes about a second)


def keep() -> str:
    """Which measured kernels replace ATen's: "faster" (default: those measured faster here, by the two
    thresholds above) or "all" ($KILN_KEEP=all: every one, e.g. to test their numerics)."""
    value = os.environ.get("KILN_KEEP", "faster")
    if value not in ("faster", "all"):
        raise ValueError(f"KILN_KEEP must be 'faster' or 'all', got {value!r}")
    return value


def worth_it(new_ms: float, aten_ms: float) -> bool:
    return keep() == "all" or (new_ms <= KEEP_IF_FASTER * aten_ms and aten_ms - new_ms >= MIN_SAVING_MS)


def clear_cut(base_ms: list[float], new_ms: list[float]) -> bool:
    """Whether timings already give `worth_it`'s answer whatever comes next: the candidate's slowest
    call passes against the baseline's fastest, or its fastest fails against the baseline's slowest."""
    return worth_it(max(new_ms), min(base_ms)) or not worth_it(min(new_ms), max(base_ms))


TUNINGS = ("online", "ahead")


def tuning(value: str | None = None) -> str:
    """"online" or "ahead" (see the module docstring): `value` (a step's `tuning=`) if given, else
    $KILN_TUNING, else online. A step's `tuning.Tuner` holds its own."""
    value = value or os.environ.get("KILN_TUNING") or "online"
    if value not in TUNINGS:
        raise KilnError(f"KILN_TUNING must be one of {', '.join(TUNINGS)}, got {value!r}")
    return value


class Trial:
    """An A/B measurement on the real calls of a training step, shared by every call with one key.

    `arm()` says which implementation the next call runs (in turn, the baseline first; each arm's
    first call is not measured: it pays one-off costs; one arm alone just times it); `record(arm, ms)`
    adds a sample. After `samples` samples per arm, `on_done(medians)` is called once and `settled` is
    set: the caller runs the winner from then on. A baseline/candidate pair settles after `early`
    samples each when they are already a clear cut (`clear_cut`): a node that runs once per step then
    settles in 8 steps instead of 12. `busy()` says when a compiler loads the cores (the trial then waits:
    `tuning.busy`); `clock` is replaceable for tests."""

    def __init__(self, arms: tuple[str, ...], on_done: Callable[[dict[str, float]], None], samples: int = 5,
                 clock: Callable[[], float] = time.perf_counter, early: int = 3,
                 busy: Callable[[], bool] | None = None):
        self.arms, self.on_done, self.samples, self.clock, self.busy = arms, on_done, samples, clock, busy
        self.early = min(early, samples)
        self.times: dict[str, list[float]] = {a: [] for a in arms}
        self.calls = 0
        self.settled = False

    def arm(self) -> str:
        return self.arms[self.calls % len(self.arms)]

    def record(self, arm: str, ms: float) -> None:
        self.calls += 1
        if self.calls > len(self.arms):     # the first call of each arm is a warm-up
            self.times[arm].append(ms)
        if not self.settled and (all(len(v) >= self.samples for v in self.times.values()) or self._clear()):
            self.settled = True
            self.on_done({a: statistics.median(v) for a, v in self.times.items()})

    def _clear(self) -> bool:
        if len(self.arms) != 2:               # only a baseline/candidate pair has a keep rule
            return False
        base, new = (self.times[a] for a in self.arms)
        return len(base) >= self.early and len(new) >= self.early and clear_cut(base, new)

    def run(self, fns: dict[str, Callable[[], object]], scale: float = 1.0) -> object:
        """Run the arm whose turn it is and time it (the first arm, untimed, while a background worker
        compiles: its load on the cores would be measured too). `scale`: this call's work relative to the
        compiled sizes' (calls of a dynamic program differ in size): the sample is the time divided by it."""
        if self.busy is not None and self.busy():
            return fns[self.arms[0]]()
        arm = self.arm()
        t = self.clock()
        out = fns[arm]()
        self.record(arm, (self.clock() - t) * 1e3 / (scale or 1.0))
        return out


def faster_than_aten(impl, node, key: str | None = None, timing: dict | None = None) -> bool:
    """Whether `impl`'s kernel beats the op's ATen kernel on this node's shapes, strides and dtypes
    (measured once per machine; the decision is logged)."""
    from kiln.ir.graph import tree_map_values
    key = key or kernel_key(impl, node)
    folder = cache_dir("kernels")
    known = timing is not None or (folder / f"{key}.timing.json").exists()

    def run() -> dict:
        from kiln.ir.symbolic import hinted
        args, kwargs = hinted(tree_map_values(lambda v: example(v.meta), (node.args, node.kwargs)))
        return medians({"new_ms": lambda: impl.kernel(*args, **kwargs), "aten_ms": lambda: node.target(*args, **kwargs)})
    try:
        timing = timing or timed_once(folder, key, run)
    except Exception as exc:     # a kernel that cannot even be measured is not used
        log.warning("kiln: %s could not be measured on %s (%s: %s); using ATen", impl.label, node.op.name,
                    type(exc).__name__, exc)
        return False
    chosen = worth_it(timing["new_ms"], timing["aten_ms"])
    if not known:
        _log_decision(impl, node, timing, chosen, "")
    return chosen


def _log_decision(impl, node, timing: dict, chosen: bool, how: str) -> None:
    from kiln.ir.graph import Value
    shapes = ", ".join(str(v.meta) for v in node.inputs if isinstance(v, Value) and v.meta is not None)
    log.info("kiln: %s %s(%s): %.2f ms, ATen %.2f ms%s: %s", impl.label, node.op.name, shapes, timing["new_ms"],
             timing["aten_ms"], how, "used" if chosen else "ATen kept")


def kernel_key(impl, node) -> str:
    """The cache key of `impl` on `node`'s shapes, strides and dtypes (symbolic sizes by their place among
    the node's symbols, so every program's node of that structure shares it)."""
    from kiln.ir import symbolic
    from kiln.ir.graph import tree_map_values, tree_values
    symbols = sorted(symbolic.free_symbols([(v.meta.shape, v.meta.stride) for v in tree_values((node.args, node.kwargs))
                                            if v.meta is not None]), key=str)
    names = symbolic.canonical(symbols)
    sig = tree_map_values(lambda v: (str(symbolic.rename(v.meta.shape, names)), str(v.meta.dtype),
                                     str(symbolic.rename(v.meta.stride, names))) if v.meta else None,
                          (node.args, node.kwargs))
    return hashlib.sha256(repr((impl.label, str(node.target), sig)).encode()).hexdigest()[:24]


def device_of(node) -> str:
    types = {v.meta.device.type for v in node.outputs if v.meta is not None}
    return types.pop() if len(types) == 1 else "cpu"


def cached_timing(path: Path) -> dict | None:
    got = read_json(path)
    return got if isinstance(got, dict) and got and all(isinstance(v, (int, float)) for v in got.values()) else None


@dataclasses.dataclass(eq=False)
class TrialImpl:
    """A measured kernel under online measurement: the node's kernel alternates between the dialect's
    and ATen's until the trial settles, then runs the faster one (`explain` shows which). Owned by a
    step's `tuning.Tuner` (shared by the nodes with one key); `settled()` is called once decided."""

    base: object                        # the dialect's registry.Impl
    trial: Trial | None = None
    chosen: bool | None = None          # None while measuring

    @classmethod
    def of(cls, impl, node, key: str, folder: Path, settled: Callable[[], None] = lambda: None,
           busy: Callable[[], bool] | None = None):
        from kiln.dialects.registry import Impl
        me = cls(impl)

        def done(ms: dict[str, float]) -> None:
            timing = {"new_ms": ms["new"], "aten_ms": ms["aten"]}
            write_atomic(folder, f"{key}.timing.json", json.dumps(timing))
            me.chosen = worth_it(timing["new_ms"], timing["aten_ms"])
            _log_decision(impl, node, timing, me.chosen, ", measured during training")
            settled()
        me.trial = Trial(("aten", "new"), done, busy=busy)
        new, aten = impl.kernel, node.target

        def kernel(*args, **kwargs):
            if me.chosen is not None:
                return (new if me.chosen else aten)(*args, **kwargs)
            return me.trial.run({"aten": lambda: aten(*args, **kwargs), "new": lambda: new(*args, **kwargs)})
        kernel.__name__ = kernel.__qualname__ = getattr(new, "__name__", "kernel")
        return Impl(impl.dialect, impl.target, kernel=kernel, checker=impl.checker, priority=impl.priority,
                    name=impl.name, fallback=impl.fallback, trial=me)

    def close(self) -> None:
        """The owning step closed: an open measurement settles on ATen (not cached: nothing was decided)."""
        if self.chosen is None:
            self.chosen = False


@dataclasses.dataclass(eq=False)
class BucketedImpl:
    """A measured kernel on a node with symbolic sizes (a dynamic program serves many sizes, and which
    kernel is faster can change with them): chosen per size *bucket* at run time. A call's bucket is the
    bit length of each tensor argument's element count (sizes within a factor of two share one choice).
    Each bucket's decision is kept in the cache like any measured kernel's (the node's symbolic key plus the
    bucket), so later runs decide at once; a bucket not in the cache is measured on its first call: tuning
    ahead, then and there on that call's tensors; online, by a `Trial` over that bucket's calls."""

    base: object                        # the dialect's registry.Impl
    key: str
    folder: Path
    online: bool
    busy: Callable[[], bool] | None = None
    choices: dict = dataclasses.field(default_factory=dict)     # bucket -> True/False, or a Trial measuring
    closed: bool = False

    @property
    def chosen(self) -> bool | None:
        """None while a bucket is measured; else whether the dialect's kernel runs for some bucket."""
        if any(isinstance(c, Trial) for c in self.choices.values()):
            return None
        return any(c is True for c in self.choices.values())

    @classmethod
    def of(cls, impl, node, key: str, folder: Path, online: bool, busy: Callable[[], bool] | None = None):
        from kiln.dialects.registry import Impl
        me = cls(impl, key, folder, online, busy)
        new, aten = impl.kernel, node.target

        def kernel(*args, **kwargs):
            bucket = _bucket(args, kwargs)
            choice = me.choices.get(bucket)
            if choice is None:
                choice = me.choices[bucket] = me._decide(bucket, node, new, aten, args, kwargs)
            if choice is True:
                return new(*args, **kwargs)
            if choice is False:
                return aten(*args, **kwargs)
            return choice.run({"aten": lambda: aten(*args, **kwargs), "new": lambda: new(*args, **kwargs)})
        kernel.__name__ = kernel.__qualname__ = getattr(new, "__name__", "kernel")
        return Impl(impl.dialect, impl.target, kernel=kernel, checker=impl.checker, priority=impl.priority,
                    name=impl.name, fallback=impl.fallback, trial=me)

    def _decide(self, bucket: tuple, node, new, aten, args, kwargs):
        name = f"{self.key}-{'-'.join(map(str, bucket))}.timing.json"
        timing = cached_timing(self.folder / name)
        if timing is None and self.closed:
            return False
        if timing is None and self.online:
            def done(ms: dict[str, float]) -> None:
                got = {"new_ms": ms["new"], "aten_ms": ms["aten"]}
                write_atomic(self.folder, name, json.dumps(got))
                self.choices[bucket] = worth_it(got["new_ms"], got["aten_ms"])
                _log_decision(self.base, node, got, self.choices[bucket], f" (size bucket {bucket}), measured "
                              "during training")
            return Trial(("aten", "new"), done, busy=self.busy)
        if timing is None:
            try:
                timing = medians({"new_ms": lambda: new(*args, **kwargs), "aten_ms": lambda: aten(*args, **kwargs)})
            except Exception as exc:     # a kernel that cannot even be measured is not used for this bucket
                log.warning("kiln: %s could not be measured on %s (%s: %s); using ATen", self.base.label,
                            node.op.name, type(exc).__name__, exc)
                return False
            write_atomic(self.folder, name, json.dumps(timing))
            _log_decision(self.base, node, timing, worth_it(timing["new_ms"], timing["aten_ms"]),
                          f" (size bucket {bucket})")
        return worth_it(timing["new_ms"], timing["aten_ms"])

    def close(self) -> None:
        """The owning step closed: buckets still measured, and new ones, run ATen's kernel (nothing cached)."""
        self.closed = True
        for b, c in list(self.choices.items()):
            if isinstance(c, Trial):
                self.choices[b] = False


def _bucket(args, kwargs) -> tuple:
    return tuple(t.numel().bit_length() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))


# ---- the cache: one folder per machine, used only when private, code loaded only when its hash is known ----
_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "CXX",
        "KILN_AMX")


def cache_dir(kind: str) -> Path:
    """$KILN_CACHE_DIR/<kind>/torch-<version>/<machine()> (default ~/.cache/kiln/...), each level created 0700.
    A cache root or level not owned by this user, or writable by group or others, is not used (one warning):
    this process then caches in a private temporary folder, removed at exit."""
    root = cachedir.root()
    parts = (kind, f"torch-{torch.__version__}", machine())
    try:
        return cachedir.private(root, parts)
    except OSError as exc:
        if str(root) not in _refused:
            _refused.add(str(root))
            log.warning("kiln: not using the compile cache %s (%s); this run caches in a private temporary "
                        "folder, removed at exit (what to do: use a folder only you can write: chmod 700 it, or "
                        "set KILN_CACHE_DIR)", root, exc)
    try:
        return cachedir.private(_scratch(), parts)
    except OSError:                   # no private folder either: a path nothing can be read from or written to
        return Path(os.devnull).joinpath(*parts)


def existing_cache_dir(kind: str) -> Path | None:
    """`cache_dir(kind)` if it exists already (None otherwise): for readers that must create nothing, such
    as the passes."""
    version = cachedir.root() / kind / f"torch-{torch.__version__}"
    if not version.is_dir() or not (version / machine()).is_dir():   # machine() runs the compiler: only if needed
        return None
    return cache_dir(kind)


_refused: set[str] = set()           # cache roots already warned about
_scratch_dir: list[str] = []         # this process's private cache when the user's is refused


def _scratch() -> Path:
    if not _scratch_dir:
        _scratch_dir.append(tempfile.mkdtemp(prefix="kiln-cache-"))

        def remove(path=_scratch_dir[0]) -> None:
            from kiln.dialects import tuning
            tuning.stop_all()                # no worker writes into it any more
            shutil.rmtree(path, ignore_errors=True)
        atexit.register(remove)
    return Path(_scratch_dir[0])


def machine() -> str:
    """This machine's folder name: a digest of what cached kernels and timings depend on besides torch's
    version. The vector ISA ATen dispatches to (`ATEN_CPU_CAPABILITY` lowers it) and the CPU's feature flags
    (Inductor's generated C++ hard-codes the vector width it picked: run under another ISA it reads garbage),
    the C++ compiler (path and version), the environment that configures ATen, oneDNN and Inductor
    (`TORCHINDUCTOR_*`), and the training's thread count (timings). Inductor's whole configuration is
    also recorded per compiled kernel and compared before it is loaded (`load_artifact(..., facts)`). And the
    sources of Kiln's kernels (kiln/kernels: the native loops and the Python around them): a choice measured
    against other versions of them (an upgrade, an edited checkout) is measured again. Found when a kernel's
    body changed under its name: Llama's attention backward kept the loser of a timing made before."""
    cap = torch.backends.cpu.get_cpu_capability()
    threads = background.training_threads()
    env = sorted((k, v) for k, v in os.environ.items()
                 if k in _ENV or (k.startswith("TORCHINDUCTOR_") and not k.endswith("_DIR")))
    cxx = compiler(os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++"))
    facts = (platform.machine(), cap, _cpu_flags(), cxx, env, threads, _kernel_sources())
    return f"{cap.lower()}-{threads}t-{hashlib.sha256(repr(facts).encode()).hexdigest()[:12]}"


@functools.cache
def _kernel_sources() -> str:
    """A digest of kiln/kernels' sources: the native loops (what decides the native library) and the modules."""
    from kiln.kernels import native_build
    h = hashlib.sha256(native_build.source_digest([]).encode())
    for path in sorted(native_build.HERE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def compiler(name: str) -> str:
    """The C++ compiler `name` resolves to: its real path and the first line of its `--version`."""
    path = shutil.which(name)
    if path is None:
        return f"{name} (not found)"
    path = os.path.realpath(path)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        out = f"unknown version ({type(exc).__name__})"
    return f"{path} {(out.splitlines() or [''])[0]}"


@functools.cache
def _cpu_flags() -> str:
    """A digest of the CPU's model and feature flags (what decides which ISAs Inductor may pick)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        text = "\n".join(dict.fromkeys(line for line in lines
                                       if line.split(":")[0].strip() in ("flags", "Features", "model name")))
    except OSError:
        text = platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def example(meta) -> torch.Tensor:
    """A tensor with `meta`'s shape, strides (broadcast zeros included), dtype and device: normal floats,
    ones otherwise. Drawn from a private generator: measuring must never move the user's random stream
    (a seeded run's dropout masks would differ from eager's). Symbolic sizes take the compiled batch's."""
    from kiln.ir.symbolic import hint
    shape, stride = tuple(hint(meta.shape)), tuple(hint(meta.stride))
    size = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0)
    if any(n == 0 for n in shape):
        size = 0
    flat = torch.empty(size, dtype=meta.dtype, device=meta.device)
    if meta.dtype.is_floating_point:
        gen = torch.Generator(device=meta.device).manual_seed(size)
        flat = flat.normal_(generator=gen)
    else:
        flat = flat.fill_(1)
    return flat.as_strided(shape, stride)


def medians(fns: dict[str, Callable[[], object]], runs: int = 5) -> dict[str, float]:
    """Median milliseconds of each zero-argument function, interleaved, after one warm-up round (3 runs
    instead of `runs` when a round takes over 50 ms: big GEMMs do not need more to be told apart)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in fns}
    i = 0
    while i <= runs:
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if i:
                times[name].append((time.perf_counter() - t) * 1e3)
        if i == 1 and sum(v[0] for v in times.values()) > 50:
            runs = min(runs, 3)
        i += 1
    return {name: statistics.median(v) for name, v in times.items()}


def read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomic(folder: Path, name: str, text: str) -> bool:
    """Write `text` to folder/name through a temporary file and a rename, so a reader never sees half a file.
    False (warned, once per folder) when it cannot be written, e.g. on a full disk: the temporary file is
    removed whatever failed, an interrupt included."""
    tmp = None
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / name)
        tmp = None
        return True
    except OSError as exc:
        if str(folder) not in _unwritable:
            _unwritable.add(str(folder))
            log.warning("kiln: cannot write the cache %s (%s); what is not cached is compiled or measured again",
                        folder, exc)
        return False
    finally:
        if tmp is not None:
            _unlink(tmp)


_unwritable: set[str] = set()


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


INDEX = "index.json"      # {artifact name: {"sha256": hex digest, "facts": {...}}}, written only by Kiln


def store_artifact(folder: Path, name: str, text: str, facts: dict[str, str]) -> bool:
    """Cache `text` (code that a later run will execute) as folder/name, its sha256 and `facts` (what it was
    made for) recorded in the folder's index. The index is rewritten atomically under a lock on the folder
    (a background worker stores into it too); an artifact whose index entry could not be written is removed."""
    entry = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "facts": facts}
    with _locked(folder):
        if not write_atomic(folder, name, text):
            return False
        index = _index(folder)
        index[name] = entry
        if write_atomic(folder, INDEX, json.dumps(index, indent=0, sort_keys=True)):
            return True
        _unlink(folder / name)
        return False


def load_artifact(folder: Path, name: str, facts: dict[str, str] | None = None) -> str | None:
    """folder/name's text if the index records exactly its sha256 (and, given `facts`, the same facts), else
    None: a file Kiln did not write (planted), changed since (tampered, truncated) or made for another
    configuration is never returned, so never executed (the caller compiles it again). The text returned
    is the one hashed: run it, never the file again."""
    try:
        data = (folder / name).read_bytes()
    except OSError:
        return None
    entry = _index(folder).get(name)
    if not isinstance(entry, dict) or entry.get("sha256") != hashlib.sha256(data).hexdigest():
        if (str(folder), name) not in _distrusted:
            _distrusted.add((str(folder), name))
            log.warning("kiln: ignoring %s in the cache %s: %s; it is not loaded (compiled again instead)", name,
                        folder, "not in the cache's index" if not isinstance(entry, dict) else
                        "its content differs from what Kiln wrote")
        return None
    if facts is not None and entry.get("facts") != facts:
        log.info("kiln: %s in the cache was made for another configuration (%s, here %s); compiled again", name,
                 entry.get("facts"), facts)
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


_distrusted: set[tuple[str, str]] = set()


def _index(folder: Path) -> dict:
    got = read_json(folder / INDEX)
    return got if isinstance(got, dict) else {}


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the folder itself (no lock file), where the platform has one."""
    fd = None
    try:
        import fcntl
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)          # releases the lock


def timed_once(folder: Path, key: str, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The cached timing under `key`, measured by `measure()` the first time."""
    path = folder / f"{key}.timing.json"
    got = read_json(path)
    if isinstance(got, dict) and got and all(isinstance(v, (int, float)) for v in got.values()):
        return got
    got = measure()
    write_atomic(folder, path.name, json.dumps(got))
    return got
