"""The `inductor` dialect: fused regions of elementwise/reduction ops compiled by PyTorch Inductor.

The `regions` pass (`kiln/passes/regions.py`) groups what pattern fusion left between matmuls; this
dialect says which ops it can take (those Inductor lowers or decomposes into ops it lowers, never one
it would run as an opaque fallback) and compiles each region to one kernel module (C++/OpenMP on CPU,
Triton on GPU):

    region ops -> torch.fx graph -> Inductor's decompositions (make_fx, fake tensors)
               -> compile_fx_inner -> the generated Python wrapper + kernels

Identical regions (same structural key: ops, constants, shapes, strides, dtypes) are compiled once.
The generated wrapper source is kept on disk under the structural key (`cache_dir()`: one folder per
torch version and machine, `measure.machine()`), so a second run of the same model loads its kernels
instead of compiling them; Inductor keeps the built kernel libraries in its own cache. The generated
C++ hard-codes the vector ISA Inductor picked, so each source is stored with its sha256 and what it was
made for (`codegen_facts()`: the ISA, Inductor's configuration, the compiler) in the cache's index, and
is executed only if both match (`measure.load_artifact`), from the very string that was checked. A
region that fails to compile runs its ATen ops instead, with a warning.

Fused is not always faster: on a CPU, ATen's own kernels for layer norm or GELU backward are hard to
beat. Each distinct region's ATen ops are therefore timed first (a region whose ops take under
0.1 ms cannot save a worthwhile amount and is not compiled), then its compiled kernel against them
(interleaved medians on inputs of its shapes, cached beside the kernel, once per machine); it
replaces them only when it takes at most 95 % of their time and saves at least 0.05 ms a call
(`kiln.dialects.measure`; `KILN_KEEP=all` keeps every compiled region). Tuning online (the default on CPU),
regions not measured on this machine yet are compiled by a background worker and measured during training
once that is worth its cost (`kiln/dialects/inductor_online.py`).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import linecache
import logging
import operator
import threading
import time
import types
from pathlib import Path

import torch
from torch._ops import OpOverload

from kiln.dialects import measure, tuning
from kiln.dialects.registry import dialect, region_provider
from kiln.ir import symbolic
from kiln.ir.symbolic import hint
from kiln.ops.registry import Kind

log = logging.getLogger("kiln")

INDUCTOR = dialect("inductor", priority=3, devices=("cpu", "cuda"),
                   doc="PyTorch Inductor: regions of elementwise/reduction ops compiled to fused kernels")

_KINDS = (Kind.POINTWISE, Kind.REDUCTION, Kind.VIEW, Kind.NORM)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.bool, torch.int64, torch.int32,
           torch.int8, torch.uint8)


@functools.cache
def _inductor_tables():
    from torch._inductor import lowering
    from torch._inductor.decomposition import select_decomp_table
    return lowering.lowerings, lowering.fallbacks, select_decomp_table()


def accepts(n) -> bool:
    """Whether Inductor can compile `n` as part of a fused kernel."""
    t = n.target
    if not isinstance(t, OpOverload) or t.namespace != "aten" or n.op.kind not in _KINDS or n.op.side_effects:
        return False
    if not n.outputs or any(o.meta is None or o.meta.dtype not in _DTYPES for o in n.outputs):
        return False
    if any(v.meta is None or v.meta.dtype not in _DTYPES for v in n.inputs):
        return False
    return _lowerable(t)


@functools.cache
def _lowerable(t: OpOverload) -> bool:
    """Whether Inductor lowers `t` (or decomposes it into ops it lowers), never as an opaque fallback.
    Read from the table shipped for this torch version (`OP_TABLE`), else from the cache folder; only an
    op in neither imports Inductor (about 2 s) to ask it. Grouping asks this: new answers are written to
    the cache later, by `compile_all` (`_save_known_ops`), not by the pass."""
    known = _known_ops()
    name = str(t)
    if name not in known:
        known[name] = _asked[name] = _ask_inductor(t)
    return known[name]


_asked: dict[str, bool] = {}     # answers not in the shipped table, to add to the cache's lowerable.json


def _save_known_ops() -> None:
    if _asked:
        cached = measure.read_json(cache_dir() / "lowerable.json")
        known = {**(cached if isinstance(cached, dict) else {}), **_asked}
        if measure.write_atomic(cache_dir(), "lowerable.json", json.dumps(known, sort_keys=True)):
            _asked.clear()


def _ask_inductor(t: OpOverload) -> bool:
    lowerings, fallbacks, decomps = _inductor_tables()
    return (t in lowerings and t not in fallbacks) or t in decomps


OP_TABLE = Path(__file__).with_name("inductor_ops.json")


@functools.cache
def _known_ops() -> dict[str, bool]:
    known = {}
    table = measure.read_json(OP_TABLE)
    if isinstance(table, dict) and table.get("torch") == torch.__version__ and isinstance(table.get("ops"), dict):
        known.update(table["ops"])
    folder = measure.existing_cache_dir("inductor")      # grouping creates nothing in the cache
    cached = measure.read_json(folder / "lowerable.json") if folder is not None else None
    if isinstance(cached, dict):
        known.update(cached)
    return known


def op_table() -> dict:
    """The table of `_lowerable` answers for every ATen op in Kiln's registry of a kind regions take, for
    the installed torch (`python -m kiln.dialects.inductor --write-op-table` writes it to OP_TABLE)."""
    from kiln.ops.registry import all_ops
    ops = sorted({str(t) for op in all_ops() if op.kind in _KINDS and not op.side_effects
                  for t in op.targets if isinstance(t, OpOverload) and t.namespace == "aten"})
    return {"torch": torch.__version__,
            "ops": {name: _ask_inductor(_overload(name)) for name in ops}}


def _overload(name: str) -> OpOverload:
    _, op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


def cache_dir() -> Path:
    """Where compiled regions are kept: $KILN_CACHE_DIR/inductor (default ~/.cache/kiln/inductor), one
    folder per torch version and machine (`measure.cache_dir`)."""
    return measure.cache_dir("inductor")


def compile_all(regions, tuner: tuning.Tuner) -> None:
    """Give every region whose kernel is worth it its compiled kernel (`region.compiled`), or, tuning
    online (`tuner`'s mode), its online trial (`region.online`). Called by the step's tuner after the
    passes (`Tuner.realize`). Per distinct structural key, measured once per machine and kept in the cache:
    1. the time of its ATen ops: a region whose ops take under twice the least worthwhile saving
       (`measure.MIN_SAVING_MS`) is not compiled at all;
    2. the compiled kernel (compiled, or loaded from the cache) timed against them, interleaved."""
    _save_known_ops()
    by_key: dict[str, list] = {}
    for r in regions:
        by_key.setdefault(r.key, []).append(r)
    folder = cache_dir()
    everything = measure.keep() == "all"
    plan, cheap, slower, pending = [], [], [], {}
    for key, group in by_key.items():
        if tuner.online(group[0].outputs[0].meta.device.type) and not (folder / f"{key}.timing.json").exists():
            pending[key] = group        # compiled in the background, measured during training
            continue
        try:
            timing = _measured(folder, key, group[0])
        except Exception as exc:     # a region whose ops cannot even be timed stays as it is
            log.warning("kiln: inductor: could not time fused region %s (%s: %s); its ops run unfused",
                        group[0].name, type(exc).__name__, exc)
            continue
        for r in group:
            r.timing = timing
        if not everything and timing["aten_ms"] < 2 * measure.MIN_SAVING_MS:
            cheap.append(key)
        elif "compiled_ms" in timing and not _worth_it(timing):
            slower.append(group[0].name)
        else:
            plan.append(key)
    facts = codegen_facts() if plan else {}
    sources = {k: _load_source(folder, k, facts) for k in plan}
    todo = [k for k in plan if sources[k] is None]
    t0 = time.perf_counter()
    if todo:
        log.info("kiln: inductor: compiling %d distinct fused regions (%d regions; %d cached; %d too cheap to "
                 "be worth compiling)...", len(todo), len(regions), len(plan) - len(todo), len(cheap))
    for key in plan:
        group = by_key[key]
        first = group[0]
        try:
            source = sources[key]
            if source is None:
                source = _compile_source(first)
                store_source(folder, key, source)
                log.info("kiln: inductor: %d/%d %s (%.1fs)", todo.index(key) + 1, len(todo), first.name,
                         time.perf_counter() - t0)
            kernel = _load_kernel(source)
            timing = _measured(folder, key, first, kernel)
        except Exception as exc:     # a region Inductor cannot compile runs its ATen ops
            log.warning("kiln: inductor could not compile fused region %s (%s: %s); its %d ops run unfused",
                        first.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", len(first.nodes))
            for r in group:
                r.failed = f"compile: {type(exc).__name__}"
            continue
        for r in group:
            r.timing = timing
            r.compiled = kernel if _worth_it(timing) else None
        if not _worth_it(timing):
            slower.append(first.name)
    if todo:
        log.info("kiln: inductor: compiled %d regions in %.1fs", len(todo), time.perf_counter() - t0)
    if slower:
        log.info("kiln: inductor: %d of %d distinct regions were not faster than their ATen ops here and stay "
                 "unfused (KILN_KEEP=all keeps them): %s", len(slower), len(by_key), ", ".join(slower))
    if pending:
        from kiln.dialects.inductor_online import go_online
        go_online(folder, pending, tuner)


def _worth_it(timing: dict) -> bool:
    return measure.worth_it(timing["compiled_ms"], timing["aten_ms"])


def _measured(folder: Path, key: str, region, kernel=None) -> dict:
    """{"aten_ms": .., "compiled_ms": ..}: median times on inputs of the region's shapes, measured once per
    machine and kept beside the kernel (`kiln.dialects.measure`). Without a kernel only the ATen ops
    are timed (if not known yet); with one, both, interleaved (if the kernel's time is not known yet)."""
    path = folder / f"{key}.timing.json"
    timing = measure.read_json(path)
    if not (isinstance(timing, dict) and isinstance(timing.get("aten_ms"), (int, float))):
        timing = {}
    if timing and (kernel is None or "compiled_ms" in timing):
        return timing
    args = [hint(s) for s in region.size_args] + [measure.example(v.meta) for v in region.inputs]
    fns = {"aten_ms": lambda: region.reference(*args)}
    if kernel is not None:
        fns["compiled_ms"] = lambda: kernel(list(args))
    timing = measure.medians(fns)
    measure.write_atomic(folder, path.name, json.dumps(timing))
    return timing


def _load_source(folder: Path, key: str, facts: dict[str, str]) -> str | None:
    """The cached source of `key`, if Kiln stored exactly this text for what `facts` describe (else None)."""
    return measure.load_artifact(folder, f"{key}.py", facts)


def _cached(folder: Path, key: str) -> bool:
    """Whether a source Kiln stored for `key` is in the cache (checked by hash; not importing Inductor)."""
    return measure.load_artifact(folder, f"{key}.py") is not None


def store_source(folder: Path, key: str, source: str) -> bool:
    """Cache the generated source of `key` with its hash and what it was made for (`codegen_facts`)."""
    return measure.store_artifact(folder, f"{key}.py", source, codegen_facts())


_prefetching: list[threading.Thread] = []      # the one prefetch thread of this process, once started
# what codegen_facts and pick_vec_isa import (check_build imports codecache and the file lock inside)
_PROBE_IMPORTS = ("torch.utils._filelock", "torch._inductor.config", "torch._inductor.cpp_builder",
                  "torch._inductor.cpu_vec_isa", "torch._inductor.codecache")


def prefetch(dialects: tuple[str, ...]) -> bool:
    """Where the step may use this dialect and this machine's cache holds measured regions (a run before this
    one: the first step will load compiled kernels before it runs), import Inductor's modules now and start its
    probe of the vector ISA in a thread (`codegen_facts`: `pick_vec_isa` test-builds and runs a Python
    subprocess per ISA, about a second, once per process), so the probe runs beside the model's capture rather
    than inside the first step. A cold cache has nothing to load before the first step, so nothing is done
    then. True when it started the thread."""
    if "inductor" not in dialects or _prefetching:
        return False
    folder = measure.existing_cache_dir("inductor")
    try:
        if folder is None or next(folder.glob("*.timing.json"), None) is None:
            return False
    except OSError:
        return False
    try:        # imported here, in the caller's thread: two threads importing one package's cycles can each
                # see the other's half-initialised modules; the thread then only probes (subprocesses)
        for name in _PROBE_IMPORTS:
            importlib.import_module(name)
    except Exception:
        return False
    thread = threading.Thread(target=codegen_facts, name="kiln-inductor-prefetch", daemon=True)
    _prefetching.append(thread)
    thread.start()
    return True


def codegen_facts() -> dict[str, str]:
    """What Inductor's generated source depends on besides the region and torch's version: the vector ISA
    its C++ code generator picks (vector widths are hard-coded in the source), its configuration (the
    entries Inductor itself keys its caches by) and the C++ compiler."""
    try:
        from torch._inductor import config, cpp_builder, cpu_vec_isa
        ignored = tuple(getattr(config, "_cache_config_ignore_prefix", ()))
        settings = sorted((k, repr(v)) for k, v in config.save_config_portable().items() if not k.startswith(ignored))
        return {"isa": str(cpu_vec_isa.pick_vec_isa()),
                "config": hashlib.sha256(repr(settings).encode()).hexdigest()[:16],
                "cxx": measure.compiler(cpp_builder.get_cpp_compiler())}
    except Exception as exc:     # matches nothing cached: compiled again (and failing, reported as such)
        return {"unknown": f"{type(exc).__name__}: {exc}"}


def to_fx(region) -> torch.fx.GraphModule:
    """The region as an FX graph of its ATen ops: one placeholder per symbolic size (`z0`, ...: ints at run
    time), then one per input, and a tuple of its outputs. Sizes in the ops' arguments are computed from the
    size placeholders, so the graph holds no SymInt of the program's and can be pickled."""
    from kiln.ir.graph import Value
    g = torch.fx.Graph()
    names = symbolic.canonical(region.sizes)
    sym_nodes = {names[s]: g.placeholder(str(names[s])) for s in region.sizes}
    env = {v.uid: g.placeholder(f"in{i}") for i, v in enumerate(region.inputs)}

    def arg(x):
        if isinstance(x, Value):
            return env[x.uid]
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return symbolic.to_fx(symbolic.rename(x, names), g, sym_nodes)
        if isinstance(x, (list, tuple)):
            return type(x)(arg(i) for i in x)
        return x

    for n in region.nodes:
        call = g.call_function(n.target, arg(tuple(n.args)), {k: arg(v) for k, v in n.kwargs.items()})
        if len(n.outputs) == 1 and not _returns_sequence(n.target):
            env[n.outputs[0].uid] = call
        else:
            for j, o in enumerate(n.outputs):
                env[o.uid] = g.call_function(operator.getitem, (call, j))
    g.output(tuple(env[o.uid] for o in region.outputs))
    return torch.fx.GraphModule({}, g)


def _returns_sequence(t: OpOverload) -> bool:
    rets = t._schema.returns
    return len(rets) != 1 or str(rets[0].type).startswith("List")


def job(region) -> tuple:
    """What compiling `region` takes (picklable, for a background worker): its FX graph, and per placeholder
    ("size", hint) or (shape, stride, dtype, device) with symbolic sizes over the canonical `z` symbols."""
    names = symbolic.canonical(region.sizes)
    sizes = [("size", hint(s)) for s in region.size_args]
    return to_fx(region), sizes + [_meta(v.meta, names) for v in region.inputs]


def _compile_source(region) -> str:
    return compile_graph(*job(region))


def _meta(m, names: dict | None = None) -> tuple:
    names = names or {}
    return (tuple(symbolic.rename(m.shape, names)), tuple(symbolic.rename(m.stride, names)), m.dtype, m.device)


def compile_graph(fx: torch.fx.GraphModule, metas: list[tuple]) -> str:
    """Inductor's generated wrapper source for `fx` (ATen ops) on inputs of `metas` (see `job`): decomposed
    with Inductor's table on fake tensors, then compiled. With symbolic sizes, the kernel is compiled for
    every size (one ShapeEnv symbol per `z`), and the guards Inductor records (sizes its code needs, e.g. a row
    short enough for a vectorized reduction) are written into the source as `KILN_GUARDS`: the region runs
    its ATen ops for sizes they exclude."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner as inductor_compile
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    def compile_fx_inner(gm, example):
        # Never through Inductor's own FX-graph cache: its key leaves out the vector ISA the code generator
        # picks, which ATEN_CPU_CAPABILITY lowers, so a kernel generated for AVX2 (Makefile's second test pass)
        # was served to AVX-512 runs and, built for AVX-512, wrote past its buffers (a heap corrupted, wrong
        # values). Kiln's own cache is keyed by that ISA (`codegen_facts`).
        with config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
            return inductor_compile(gm, example)
    hints = [m[1] for m in metas if m[0] == "size"]
    if not hints:
        example = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]
        gm = make_fx(fx, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example)
        compiled = compile_fx_inner(gm, example)
        guards: list[str] = []
    else:
        from torch._guards import TracingContext, tracing
        env, mode, ints, zs = _symbolic_inputs(hints)
        subst = {z: i.node.expr for z, i in zip(zs, ints)}
        with mode:
            tensors = [torch.empty_strided(_sym(shape, subst, env), _sym(stride, subst, env), dtype=dtype, device=device)
                       for shape, stride, dtype, device in metas[len(hints):]]
            example = ints + tensors
            gm = make_fx(fx, decomposition_table=select_decomp_table(), tracing_mode="real")(*example)
        before = len(env.guards)
        with tracing(TracingContext(mode)):
            compiled = compile_fx_inner(gm, example)
        back = {i.node.expr: z for z, i in zip(zs, ints)}
        from torch.utils._sympy.printers import PythonPrinter
        guards = [PythonPrinter().doprint(env.simplify(g.expr).xreplace(back)) for g in env.guards[before:]]
        guards = [g for g in guards if g != "True"]
    source = getattr(compiled, "source_code", None)
    if not source:
        raise RuntimeError("Inductor returned no generated source")
    return f"KILN_GUARDS = {guards!r}\n" + source if hints else source


def _symbolic_inputs(hints: list[int]):
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ints = [env.create_symintnode(env.create_symbol(h, source=ConstantSource(f"z{i}"), dynamic_dim=DimDynamic.DYNAMIC),
                                  hint=h) for i, h in enumerate(hints)]
    zs = list(symbolic.canonical(list(range(len(hints)))).values())
    return env, mode, ints, zs


def _sym(sizes: tuple, subst: dict, env) -> tuple:
    out = []
    for s in sizes:
        if isinstance(s, int):
            out.append(s)
        else:
            e = s.xreplace(subst)
            out.append(env.create_symintnode(e, hint=int(e.xreplace(env.backed_var_to_val))))
    return tuple(out)


_modules: dict[str, types.ModuleType] = {}     # sha256 of a loaded source -> its module


class Kernel:
    """A loaded region kernel compiled for symbolic sizes: `kernel(args)` runs Inductor's `call`;
    `guard(sizes)` says whether a call's sizes (the region's leading arguments) are ones its compiler's
    guards allow."""

    def __init__(self, call, guards: list[str]):
        import re
        self.call = call
        text = " and ".join("(" + re.sub(r"\bz(\d+)\b", r"sizes[\1]", g) + ")" for g in guards)
        self.guard = eval(f"lambda sizes: {text}", {"math": __import__("math")})

    def __call__(self, args):
        return self.call(args)


# Every wrapper Inductor generates imports `extern_kernels` (its ATen fallbacks for matmuls and convolutions),
# which imports select_algorithm and lowering: 0.35-0.5 s of a warm first step (BERT bench model). A region's
# wrapper calls none (regions hold no matmul), so where the name is not used the import is left out.
_EXTERN_IMPORT = "from torch._inductor.select_algorithm import extern_kernels\n"


def _lean(source: str) -> str:
    """`source` less its import of `extern_kernels` where nothing else in it names them."""
    if _EXTERN_IMPORT in source and source.count("extern_kernels") == 1:
        return source.replace(_EXTERN_IMPORT, "", 1)
    return source


def _load_kernel(source: str):
    """The `call` of Inductor's generated wrapper `source`, executed from this string (checked against the
    cache's index by the caller), never re-read from a file: what was checked is what runs (less an import
    nothing in it uses, `_lean`)."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    mod = _modules.get(digest)
    if mod is None:
        name = f"kiln_region_{digest[:24]}"
        filename = f"<{name}>"
        source = _lean(source)
        code = compile(source, filename, "exec", dont_inherit=True)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)   # tracebacks
        mod = types.ModuleType(name)
        exec(code, mod.__dict__)
        _modules[digest] = mod
    guards = getattr(mod, "KILN_GUARDS", [])
    return Kernel(mod.call, guards) if guards else mod.call


region_provider(INDUCTOR, accepts, compile_all, max_ops=64,
                doc="regions of elementwise/broadcast/reduction ops between matmuls, one Inductor kernel each")


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--write-op-table"]:
        sys.exit("usage: python -m kiln.dialects.inductor --write-op-table  (regenerates "
                 f"{OP_TABLE.name} for the installed torch)")
    measure.write_atomic(OP_TABLE.parent, OP_TABLE.name, json.dumps(op_table(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OP_TABLE}")
