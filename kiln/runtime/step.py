"""`CompiledStep`: what `kiln.compile` returns. Caches one program per input signature and runs it."""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from kiln.capture import capture, export
from kiln.dialects import inductor as inductor_dialect
from kiln.dialects import measure
from kiln.dialects import registry as dialect_registry
from kiln.dialects.tuning import Tuner, replaying
from kiln.errors import InputError, KilnError, StepError
from kiln.guards import NONFINITE, BranchChanged, NonFiniteError, SkippedStep
from kiln.ir import symbolic
from kiln.ir.graph import Graph, Role
from kiln.kernels import native
from kiln.optim import Optimizer
from kiln.passes.amp import AmpPolicy, cpu_has_native
from kiln.passes.pipeline import ACCUM_STATE, AFTER_TUNING, AMP_STATE, METRICS, Context, run_pipeline
from kiln.runtime import checkpoint, heap, memory, shapes
from kiln.runtime.codegen import generate
from kiln.runtime.failures import describe_failure
from kiln.runtime.programs import CacheInfo, Program, ProgramCache
from kiln.runtime.parallel import Parallel
from kiln.torch_optim import TorchOptimizer
from kiln import torch_optim
from kiln.transaction import step_transaction

log = logging.getLogger("kiln")
_COMPILE_LOCK = threading.RLock()


def _rng_untouched():
    """Restores the CPU (and any initialized CUDA) random state afterwards: work Kiln does on its own behalf
    (compiling, measuring, profiling) must leave the user's seeded stream where eager would find it."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else [])


def _rng_state():
    """The default generators' states (CPU, and CUDA once initialized)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _check_leaf(x: Any) -> None:
    if not isinstance(x, (torch.Tensor, int, float, bool, str, type(None))):
        raise InputError(f"step() got an input of type {type(x).__name__}; pass tensors, Python numbers, "
                         "strings, None, or lists/tuples/dicts of them")


def _unalias(args, kwargs):
    """Give capture distinct tensors where the user passed one tensor twice (input_ids=x, labels=x).
    Export would otherwise specialize the program on that aliasing, and a later call with two
    different tensors of the same signature would silently read the wrong one."""
    seen: set[int] = set()

    def fresh(x):
        if not isinstance(x, torch.Tensor):
            return x
        key = x.untyped_storage().data_ptr()
        if key in seen and x.numel():
            return x.clone()
        seen.add(key)
        return x
    return pytree.tree_map(fresh, (tuple(args), dict(kwargs)))


class CompiledStep:
    """Forward + backward + optimizer update of `model` as one compiled program per input signature.

    Call it like the model (or like `loss_fn` without its first argument): it returns the loss
    (detached) and updates the module's parameters in place.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optimizer, loss_fn: Callable | None = None,
                 dialects=None, max_programs: int = 8, verify: bool = False, amp: str | None = None,
                 amp_overrides: dict | None = None, init_loss_scale: float = 2.0 ** 16, tuning: str | None = None,
                 nonfinite: str = "raise", dynamic: Any = None, fail_on_max_programs: bool = False,
                 memory_budget: Any = None, parallel=None, accumulate: int = 1, max_grad_norm: float | None = None):
        if not isinstance(model, torch.nn.Module):
            raise KilnError(f"kiln.compile expects a torch.nn.Module, got {type(model).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer):     # its param_groups and state stay the truth
            if parallel is not None:
                raise KilnError("parallel= with a torch.optim optimizer is not supported yet (ZeRO shards Kiln's own "
                                "state); use kiln.optim.AdamW(...) or kiln.optim.SGD(...) with kiln.DataParallel")
            optimizer = TorchOptimizer(optimizer, max_grad_norm)
        elif max_grad_norm is not None:
            raise KilnError("max_grad_norm= of kiln.compile is for torch.optim optimizers; a kiln.optim optimizer "
                            "clips with its own argument: kiln.optim.AdamW(..., max_grad_norm=1.0)")
        if not isinstance(optimizer, Optimizer):
            raise KilnError("optimizer must be torch.optim.AdamW/Adam/SGD or a kiln.optim optimizer "
                            f"(kiln.optim.AdamW(...) or kiln.optim.SGD(...)), got {type(optimizer).__name__}")
        if parallel is not None and optimizer.groups:
            raise KilnError("parallel= with parameter groups (groups=) is not supported yet: ZeRO shards mix the "
                            "parameters of several groups")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.params = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.params[name] = p
        if not self.params:
            raise KilnError(f"{type(model).__name__} has no trainable parameters (all requires_grad=False)")
        self.dialects = dialect_registry.check_names(dialects) if dialects is not None else None
        self.policy = shapes.Policy(dynamic)  # which dimensions new programs make symbolic
        self.memory_budget = memory.parse_budget(memory_budget)   # bytes, a fraction of the peak, or None
        self.heap = heap.policy(self.memory_budget)   # keep freed memory for the next step, or return it
        self._heap_set = False
        self.cache = ProgramCache(max_programs)
        self.fail_on_max_programs = bool(fail_on_max_programs)
        if tuning is not None and tuning not in measure.TUNINGS:
            raise KilnError(f"tuning must be one of {', '.join(map(repr, measure.TUNINGS))} (or None: $KILN_TUNING, "
                            f"default 'online'), got {tuning!r}")
        self.tuning = tuning
        self.tuner = Tuner(tuning)            # this step's trials, background workers and their lifecycle
        native.prepare()                      # Kiln's native loops built beside the capture (on a fresh machine)
        if nonfinite not in NONFINITE:
            raise KilnError(f"nonfinite must be one of {', '.join(map(repr, NONFINITE))}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0                # steps skipped by nonfinite="skip"
        self.verify = verify
        self.amp = AmpPolicy.make(amp, amp_overrides) if amp is not None else None
        on_cpu = all(p.device.type == "cpu" for p in self.params.values())
        if on_cpu:                            # a warm cache's compiled regions: Inductor readied beside the capture
            inductor_dialect.prefetch(self.dialects or dialect_registry.enabled())
        if self.amp is not None and on_cpu and cpu_has_native(self.amp.dtype) is False:
            low = str(self.amp.dtype).replace("torch.", "")
            if "upcast" in (self.dialects or dialect_registry.enabled()):
                log.info("kiln: amp=%r on a CPU without native %s matrix multiply: the upcast dialect runs "
                         "matmul, conv and attention on fp32 copies", amp, low)
            else:
                log.warning("kiln: amp=%r on a CPU without native %s matrix multiply (torch CPU capability %s) "
                            "and the upcast dialect disabled: ATen emulates it, much slower than fp32",
                            amp, low, torch.backends.cpu.get_cpu_capability())
        # ---- data parallel: with ZeRO each rank keeps only its shards, made when the first program fixes them
        sharded = parallel is not None and getattr(parallel, "zero", 0) > 0
        # a torch optimizer's state is its own `state[p]`, looked up at every call (`_torch_state`)
        self.state: dict[str, dict[str, torch.Tensor]] = {} if sharded or self._torch_opt else {
            n: optimizer.init_state(p) for n, p in self.params.items()}
        if self.amp is not None and self.amp.dtype == torch.float16:
            self.state[AMP_STATE] = {"scale": torch.tensor(float(init_loss_scale)),
                                     "growth_tracker": torch.zeros((), dtype=torch.int32)}
        # ---- gradient accumulation: persistent gradient sums, an update every `accumulate` calls
        if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
            raise KilnError(f"accumulate must be a positive int (micro-batches per update), got {accumulate!r}")
        if accumulate > 1 and parallel is not None:
            raise KilnError("accumulate= with parallel= is not supported yet; accumulate in the data loader "
                            "(larger per-rank batches) or train without parallel=")
        if accumulate > 1 and self.amp is not None and self.amp.dtype == torch.float16:
            raise KilnError("accumulate= with amp='fp16' (dynamic loss scaling) is not supported yet; use amp='bf16'")
        self.accumulate = accumulate
        self.accumulated = 0                  # micro-batches in the gradient sums now (0 .. accumulate - 1)
        self.grad_sums: dict[str, torch.Tensor] = {
            n: torch.zeros_like(p, memory_format=torch.preserve_format) for n, p in self.params.items()
        } if accumulate > 1 else {}
        self._update_now = True               # whether the program being compiled runs the update
        self._metrics: dict[str, torch.Tensor] = {}     # numbers the programs report (grad_norm), and
        self._reported: set[str] = set()                # which of them a committed step has written
        self.last: Program | None = None
        self._lock = threading.RLock()        # calls (and compiles) on one step run one at a time
        self._tensors = self._module_tensors()
        self._warned_full = False
        self._static_only: set = set()      # structures whose dynamic compile failed: static programs only
        self.parallel = Parallel(parallel, self) if parallel is not None else None   # checks the ranks agree
        # memory_budget in bytes: the process's heap beyond the step (data parallel: the largest of the ranks')
        self._heap = memory.HeapBudget(None if self.parallel is None else
                                       lambda obj, what: self.parallel.comm.gather_objects(obj, what))
        # ---- end data parallel

    # ---- running ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        grad_mode = torch.is_grad_enabled()
        with self._lock:
            if self.tuner.closed:
                raise KilnError("this compiled step was closed (step.close()); call kiln.compile again")
            try:
                return self._step(args, kwargs)
            finally:                        # an interrupt inside a no_grad block must not leave it off
                torch.set_grad_enabled(grad_mode)

    @property
    def _torch_opt(self) -> bool:
        return isinstance(self.optimizer, TorchOptimizer)

    def _torch_state(self) -> list:
        """A torch optimizer: this call's view of its groups and `state[p]` tensors (kiln/torch_optim.py);
        returns the fresh state to install once the step has committed."""
        view, pending = self.optimizer.state_view()
        if AMP_STATE in self.state:
            view[AMP_STATE] = self.state[AMP_STATE]
        self.state = view
        return pending

    def _step(self, args, kwargs) -> torch.Tensor:
        self.optimizer.check()              # hyper-parameters set between steps are validated too
        if not self._heap_set:              # process-wide: see kiln/runtime/heap.py
            heap.apply(self.heap)
            self._heap_set = True
        self._follow_replaced_tensors()
        self.optimizer.bind(self.model, self.params)    # parameter groups -> the model's parameters
        pending = self._torch_state() if self._torch_opt else []
        kwargs = dict(sorted(kwargs.items()))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for x in leaves:
            _check_leaf(x)
        names = self.dialects or dialect_registry.enabled()
        # numeric hyper-parameters are runtime inputs; what the code bakes in (groups, nesterov, clipping) is
        # part of the key: changing it compiles another program
        base = (str(spec), tuple(shapes.leaf_kind(x) for x in leaves), self.model.training, names,
                self.optimizer.structure())
        if self.accumulate > 1:             # micro-steps and the cycle's last (update) step: two programs
            self._update_now = self.accumulated == self.accumulate - 1
            base += (("accumulate", self.accumulate, self._update_now),)
        sizes = shapes.sizes_of(leaves)
        tried: list[Program] = []
        rng = _rng_state()
        # several programs may serve these sizes (value-dependent branches compile one variant per way they
        # go): each is tried in turn, most recently used first; none left -> a new one for this batch
        while True:
            prog = next((p for p in self.cache.candidates(base, sizes) if p not in tried), None)
            fresh = prog is None
            # the random numbers eager would draw for this step, for every attempt: a rejected variant drew
            # some already (a layer-drop `if torch.rand([]) < p:`). Capture with real values then decides the
            # branch on the same draws as the program makes, and gives back what it drew (`_rng_untouched`)
            if tried:
                _set_rng_state(rng)
            if fresh:
                prog = self._new_program(base, sizes, args, kwargs, leaves, names)
            tried.append(prog)
            self.last = prog
            self._last_leaves = leaves      # kiln.explain(step, profile=True) replays this batch
            hyper = self.optimizer.scalars()
            inputs = [f(leaves, hyper) for f in prog.fetch]
            try:
                with torch.no_grad(), step_transaction() as txn:
                    loss = prog.fn(*inputs)
                break
            except BranchChanged as e:      # nothing was written; try (or compile) another variant
                if fresh:
                    self.cache.remove(prog)
                    self.last = None
                    raise StepError(f"the program compiled for this very batch rejects it ({e}): the forward "
                                    "decides a Python branch differently on the same values (random numbers in "
                                    "the condition?); make the branch deterministic, or move it out of the "
                                    "model") from e
                log.info("kiln: %s; using (or compiling) another variant", e)
            except SkippedStep as e:       # nonfinite="skip": nothing was written
                self.skipped_steps += 1
                log.warning("kiln: step skipped (%d so far): %s", self.skipped_steps, e)
                prog.ran = True
                self.cache.used(prog)
                return e.loss
            except KilnError:
                raise
            except Exception as e:
                if not prog.ran:            # a program that never ran to the end does not keep its slot
                    self.cache.remove(prog)
                    self.last = None
                raise StepError(describe_failure(prog, e, evicted=not prog.ran)) from e
        try:
            with torch.no_grad():
                txn.commit()                # parameters, optimizer state and buffers, all at once
        except Exception as e:
            raise StepError(f"applying the step's update failed: {type(e).__name__}: {e}; the fused update "
                            "kernels run before any other write, so parameters and state are unchanged unless an "
                            "earlier fused group had already been applied. Check the optimizer's hyper-parameters, "
                            "or try kiln.compile(..., dialects=['aten'])") from e
        if not prog.ran:
            self._recheck_budget(prog, leaves)
        self._reported.update(prog.metrics)     # what this commit wrote (not a metric an earlier failed call made)
        if pending:
            self.optimizer.install(pending)  # torch's lazily made state, now that an update wrote it
        if self._torch_opt and self._update_now:
            self.optimizer.stepped()
        if self.accumulate > 1:
            self.accumulated = 0 if self._update_now else self.accumulated + 1
        prog.ran = True
        self.cache.used(prog)
        self.tuner.start()                  # online tuning: compilers start once a step has run
        return loss.detach()

    def _new_program(self, base, sizes, args, kwargs, leaves, names) -> Program:
        """Compile a program for this call: for its exact sizes, or (the policy decides, kiln/runtime/shapes.py)
        with symbolic ones. At `max_programs`, the least recently used program makes room (once warned)."""
        go_dynamic = self.cache.seen_other_sizes(base, sizes)
        if self.parallel is not None:       # data parallel: each rank sees its own sizes, so a program for exact
            go_dynamic = True               # sizes would make the ranks recompile at different steps
        if len(self.cache) >= self.cache.max_programs:
            if self.fail_on_max_programs:
                raise InputError(
                    f"kiln has compiled {len(self.cache)} programs for {type(self.model).__name__} (max_programs="
                    f"{self.cache.max_programs}, fail_on_max_programs=True); every new input structure (dtypes, "
                    "train/eval, optimizer settings), value-dependent branch or, with dynamic=False, shape compiles "
                    "another. Pass a larger max_programs= or dynamic=None to kiln.compile")
            if not self._warned_full:
                self._warned_full = True
                log.warning("kiln: %d programs compiled for %s (max_programs=%d): the least recently used one is "
                            "dropped for each new one from now on%s; cache_info() lists them",
                            len(self.cache), type(self.model).__name__, self.cache.max_programs,
                            "" if self.policy.mode == "static" else ", and new programs are compiled for dynamic sizes")
                self.cache.notes.append(f"max_programs={self.cache.max_programs} reached: least recently used "
                                        "programs are dropped")
            go_dynamic = True
            self.cache.evict_least_recent()
        dims = self.policy.dims(args, kwargs, leaves, go_dynamic and base not in self._static_only)
        if dims and self.policy.mode == "auto":
            seen = next((p.signature.describe() for p in self.cache.values() if p.base == base), "")
            log.info("kiln: %s: a batch with other sizes (%s; compiled for %s): compiling one program for dynamic "
                     "sizes, which serves every size from now on", type(self.model).__name__,
                     shapes.static_signature(sizes, export.leaf_names(args, kwargs)).describe(), seen or "-")
        try:
            prog = self._compile(args, kwargs, names, dims, len(leaves))
        except Exception as e:
            if dims is None or self.policy.mode != "auto" or isinstance(e, (StepError, NonFiniteError)):
                raise
            # a model (or a Kiln pass) that cannot be compiled with symbolic sizes trains on exact ones: this
            # structure gets static programs from now on (dynamic=True or a spec would raise instead)
            first = (str(e).splitlines() or [type(e).__name__])[0]
            log.warning("kiln: could not compile %s for dynamic sizes (%s: %s); compiling for this batch's sizes, "
                        "and for each new shape from now on", type(self.model).__name__, type(e).__name__, first)
            self.cache.notes.append(f"dynamic compile failed ({type(e).__name__}: {first[:160]}); static programs used")
            self._static_only.add(base)
            prog = self._compile(args, kwargs, names, None, len(leaves))
        prog.base = base
        if prog.dynamic:                    # it serves the sizes the static programs of this structure were
            for old in self.cache.values():  # tuned for: their background tuning stops (ATen ops, nothing cached)
                if old.base == base and not old.dynamic and any(old.tuning):
                    self.tuner.retire(old.tuning)
                    old.tuning = ((), ())
        if prog.signature is None:
            prog.signature = shapes.static_signature(sizes, export.leaf_names(args, kwargs))
        if not prog.signature.matches(sizes):
            raise KilnError(f"Kiln bug: the program compiled for sizes {sizes} does not accept them "
                            f"({prog.signature.describe()})")
        self.cache.add(prog)
        return prog

    def close(self) -> None:
        """Stop tuning: background compilers are stopped, what they or the trials left open keeps ATen's
        kernels (nothing pending). Idempotent; garbage collection and interpreter exit stop the compilers too.
        The step cannot be called afterwards."""
        with self._lock:
            self.tuner.close()

    def __enter__(self) -> "CompiledStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _module_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        return tensors

    def _follow_replaced_tensors(self) -> None:
        """`model.load_state_dict(sd, assign=True)` (or `module.weight = nn.Parameter(...)`) after compiling
        puts new tensors on the model: the step follows them when they fit (same shape, dtype, device and
        trainability, ties unchanged), and refuses otherwise, rather than keep updating the old ones."""
        now = self._module_tensors()
        if now.keys() == self._tensors.keys() and all(now[k] is t for k, t in self._tensors.items()):
            return
        trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        def sig(t):
            return tuple(t.shape), t.dtype, t.device, t.requires_grad
        if (now.keys() != self._tensors.keys() or trainable.keys() != self.params.keys()
                or any(sig(now[k]) != sig(t) for k, t in self._tensors.items())):
            changed = sorted(k for k in now.keys() | self._tensors.keys()
                             if k not in now or k not in self._tensors or sig(now[k]) != sig(self._tensors[k]))
            raise InputError(f"the parameters or buffers of {type(self.model).__name__} were replaced after "
                             f"kiln.compile by tensors that do not fit ({changed[:5]}: shape, dtype, device, "
                             "requires_grad or weight tying changed); call kiln.compile again for the new model")
        log.info("kiln: the model's parameters/buffers were replaced (e.g. load_state_dict(assign=True)); "
                 "the step follows the new tensors")
        self._tensors, self.params = now, trainable

    def _compile(self, args, kwargs, names, dims=None, nleaves=0) -> Program:
        with _COMPILE_LOCK:                 # torch.export and the registries are process-wide state
            return self._compile_locked(args, kwargs, names, dims, nleaves)

    def _compile_locked(self, args, kwargs, names, dims, nleaves) -> Program:
        t0 = time.perf_counter()
        args, kwargs = _unalias(args, kwargs)
        with _rng_untouched():              # capture, measurement and trials draw nothing from the user's stream:
            ctx, constants, env, guards_before = self._passes(args, kwargs, names, dims)   # the dropout masks
            t1 = time.perf_counter()        # the passes asked; the tuner compiles, measures, prepares workers
            mark = self.tuner.mark()
            self.tuner.realize(ctx)
            ctx.timings.append(("tuning", time.perf_counter() - t1, len(ctx.graph.nodes)))
            run_pipeline(ctx, AFTER_TUNING)
            if self.parallel is not None:   # data parallel: the ranks compiled alike; ZeRO state shards exist
                self.parallel.compiled(self, ctx)
        source, fn = generate(ctx.graph)
        signature = None
        if env is not None:                 # every guard recorded so far goes into the signature's check
            signature = shapes.dynamic_signature(ctx.graph, export.leaf_names(args, kwargs), nleaves, dims,
                                                 guards_before, memory.guards(ctx.graph, ctx.memory))
            symbolic.seal(env)              # a guard recorded after this would not be checked: make it an error
        fetch = [self._fetcher(v, constants) for v in ctx.graph.inputs]
        seconds = time.perf_counter() - t0
        fallbacks = sum(n.op.name == "kiln.fallback_forward" for n in ctx.graph.nodes)
        log.info("kiln: compiled %s in %.2fs: %d nodes%s%s", type(self.model).__name__, seconds, len(ctx.graph.nodes),
                 f", {fallbacks} fallback(s)" if fallbacks else "",
                 f", dynamic sizes ({signature.describe()})" if signature is not None and signature.dynamic else "")
        prog = Program(ctx.graph, source, fn, fetch, seconds, ctx.timings, ctx.regions, signature)
        prog.tuning = self.tuner.since(mark)
        prog.memory = ctx.memory
        prog.schedule = ctx.schedule
        prog.metrics = tuple(v.source[len(METRICS) + 1:] for v in ctx.graph.inputs
                             if v.role is Role.STATE and v.source.startswith(METRICS + ":"))
        return prog

    def _passes(self, args, kwargs, names, dims):
        """Capture and the pipeline, again with row slices while a budget is not met (`memory.in_slices`)."""
        def attempt(chunks: int, reference: int | None):
            graph, constants = capture(self.model, self.loss_fn, args, kwargs, dims)
            env = symbolic.shape_env([v.meta.shape for v in graph.inputs if v.meta is not None])
            guards_before = len(env.guards) if env is not None else 0
            ctx = run_pipeline(Context(graph, self.optimizer, names, amp=self.amp, verify=self.verify,
                                       nonfinite=self.nonfinite, memory_budget=self.memory_budget,
                                       heap_outside=self._heap_outside(args, kwargs, constants),
                                       parallel=self.parallel, accumulate=self.accumulate,
                                       update=self._update_now, chunks=chunks, peak_reference=reference))
            return ctx, constants, env, guards_before
        return memory.in_slices(attempt)

    def _heap_outside(self, args, kwargs, constants) -> int:
        """Under a byte budget: what the process holds beyond the tensors the step's prediction counts, with
        room to grow (`memory.HeapBudget.outside`); 0 otherwise."""
        if not isinstance(self.memory_budget, int):
            return 0
        return self._heap.outside([*self._tensors.values(), *pytree.tree_leaves((args, kwargs, self.state)),
                                   *constants.values(), *self.grad_sums.values()])

    def _recheck_budget(self, prog: Program, leaves) -> None:
        """After a program's first step under a byte budget: if the process now holds more than its plan left
        room for (`memory.HeapBudget.recheck`), the program is dropped and the next call compiles it again."""
        if prog.memory is None or not isinstance(self.memory_budget, int):
            return
        hyper = self.optimizer.scalars()
        note = self._heap.recheck(prog.memory, [f(leaves, hyper) for f in prog.fetch])   # the program's inputs
        if note:
            self.cache.notes.append(note)
            self.cache.remove(prog)             # `last` keeps it for step.memory() until the next call
            self.tuner.retire(prog.tuning)

    def _fetcher(self, v, constants) -> Callable[[list, dict], Any]:
        """How a graph input is found at each call, from (the call's leaves, the optimizer's scalars now)."""
        if v.role in (Role.PARAM, Role.FROZEN, Role.BUFFER):
            source = v.source
            return lambda leaves, lr: self._tensors[source]
        if v.role is Role.CONSTANT:
            t = constants[v.source]
            return lambda leaves, lr: t
        if v.role is Role.INPUT:
            i = int(v.source)
            return lambda leaves, lr: leaves[i]
        if v.role is Role.STATE and v.source.startswith(METRICS + ":"):
            key, meta = v.source[len(METRICS) + 1:], v.meta

            def metric(leaves, hyper):
                t = self._metrics.get(key)
                if t is None:
                    t = self._metrics[key] = torch.full((), math.nan, dtype=meta.dtype, device=meta.device)
                return t
            return metric
        if v.role is Role.STATE and v.source.startswith(ACCUM_STATE + ":"):
            name = self._param_name(v.source[len(ACCUM_STATE) + 1:])
            return lambda leaves, hyper: self.grad_sums[name]
        if v.role is Role.STATE:
            pname, slot = v.source.rsplit(":", 1)
            name = self._state_name(pname)
            return lambda leaves, lr: self.state[name][slot]
        if v.role is Role.SCALAR:
            key = v.source
            return lambda leaves, hyper: hyper[key]
        raise KilnError(f"graph input {v.name} has no role")

    def _param_name(self, pname: str) -> str:
        """The trainable parameter's own name (tied weights have several)."""
        if pname in self.params:
            return pname
        target = dict(self.model.named_parameters(remove_duplicate=False))[pname]
        return next(n for n, p in self.params.items() if p is target)

    def reset_accumulation(self) -> None:
        """Gradient accumulation: drop the micro-batches summed so far (the next call starts a new cycle)."""
        with self._lock:
            with torch.no_grad():
                for t in self.grad_sums.values():
                    t.zero_()
            self.accumulated = 0

    def _state_name(self, pname: str) -> str:
        """The parameter name under which optimizer state is kept (tied weights share one entry)."""
        if pname in self.state:
            return pname
        target = dict(self.model.named_parameters(remove_duplicate=False))[pname]
        return next(n for n, p in self.params.items() if p is target)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global 2-norm of the gradients before clipping at the latest update (a 0-d float32 tensor, what
        `torch.nn.utils.clip_grad_norm_` returns; with `accumulate`, of the summed gradient; data parallel, of
        the gradient averaged over the ranks). Computed when the step clips: `max_grad_norm=` (math.inf
        measures without clipping). None before the first such update."""
        t = self._metrics.get("grad_norm")
        return None if t is None or "grad_norm" not in self._reported else t.clone()

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless amp='fp16')."""
        amp = self.state.get(AMP_STATE)
        return None if amp is None else amp["scale"].item()

    # ---- looking inside --------------------------------------------------------------------
    def _program(self) -> Program:
        if self.last is None:
            raise KilnError("nothing compiled yet: call the step once with a batch first")
        return self.last

    @property
    def graph(self) -> Graph:
        return self._program().graph

    def source(self) -> str:
        """The generated Python of the most recently used program: forward, backward and update."""
        return self._program().source

    def pending_tuning(self) -> list[str]:
        """What online tuning (`tuning="online"`, the default on CPU) still compiles or measures in the
        programs compiled so far, one line per distinct kernel choice: [] once every choice is made (the
        steps from then on run the chosen kernels only). Benchmarks call `tune_now()`, then wait for this
        before timing steps."""
        return self.tuner.pending(self.cache.values())

    def tune_now(self) -> None:
        """Compile the fused regions in the background from the next step on. By default online tuning
        waits until a region's ATen ops have taken as long as compiling it would cost the training (on a
        machine whose cores the training fills), so a short run never pays more for a kernel than it
        could save; a run known to be long, or a benchmark of the tuned steady state, need not wait."""
        self.tuner.hurry()

    @property
    def programs(self) -> list[Program]:
        """The programs kept, least recently used first."""
        return self.cache.values()

    def cache_info(self) -> CacheInfo:
        """The programs compiled and kept: each one's signature (symbolic sizes as symbols), its guards,
        the dimensions the model fixed, its calls and compile time; compiles and seconds in all."""
        return self.cache.info()

    def explain(self, file=None, profile: bool = False) -> str:
        from kiln.runtime.explain import explain
        return explain(self, file=file, profile=profile)

    def profile(self, repeats: int = 3) -> list[float]:
        """Seconds per node of the latest program (median of `repeats` runs after one warm-up), replaying
        the latest batch on copies of the parameters, buffers and optimizer state: the model, the
        optimizer state and the random-number generator are left exactly as they were."""
        prog = self._program()
        n = len(prog.graph.nodes)
        times = [0.0] * n
        _, fn = generate(prog.graph, name="kiln_profiled_step", times=times)
        runs = []
        for r in range(repeats + 1):
            times[:] = [0.0] * n
            self._replay(prog, fn)
            if r:                              # the first run is a warm-up (allocator, caches)
                runs.append(list(times))
        return [sorted(col)[len(col) // 2] for col in zip(*runs)]

    def memory(self, measure: bool = False) -> memory.MemoryReport:
        """The latest program's predicted peak memory: where it is, what is live there, what the memory
        budget made Kiln recompute (and the FLOPs that costs). `measure=True` also replays the latest batch
        (like `profile`, nothing the user sees changes) and reads the allocator after every node."""
        prog = self._program()
        measured = None
        if measure:
            if memory.allocated() is None:
                raise KilnError("step.memory(measure=True) reads glibc's allocator (mallinfo2), which this "
                                "platform does not have; the prediction is step.memory()")
            counts = [0] * len(prog.graph.nodes)
            _, fn = generate(prog.graph, name="kiln_measured_step", memory=(counts, memory.allocated))
            self._replay(prog, fn)                       # warm-up: allocator and kernel caches
            base = self._replay(prog, fn, before=memory.allocated)
            measured = [c - base for c in counts]
        return memory.report(prog, prog.memory, measured)

    def _replay(self, prog: Program, fn, before=None):
        """Run `fn` (a regenerated `prog`) on the latest batch, with copies of what the step updates, under the
        user's random state restored afterwards. Returns `before()` taken just before the call, if given."""
        leaves = getattr(self, "_last_leaves", None)
        if leaves is None:
            raise KilnError("nothing to replay: call the step once with a batch first")
        owned = (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.STATE)
        hyper = self.optimizer.scalars()
        inputs = [f(leaves, hyper) for f in prog.fetch]
        inputs = [x.detach().clone() if v.role in owned and isinstance(x, torch.Tensor) else x
                  for v, x in zip(prog.graph.inputs, inputs)]
        with _rng_untouched(), torch.no_grad(), replaying():
            mark = before() if before is not None else None
            fn(*inputs)
        return mark

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self, sharded: bool = False) -> dict | None:
        """Optimizer state (per parameter name) and hyper-parameters; tensors are copies. With a torch.optim
        optimizer: `{"torch_optimizer": optimizer.state_dict()}` (torch's format, copies). Data parallel: the
        whole state on rank 0 and None on the other ranks (with ZeRO every rank must call it: the shards
        are gathered); `sharded=True`: this rank's part, see kiln/runtime/parallel.py."""
        if self.parallel is not None:
            with self._lock:
                return self.parallel.state_dict(self, sharded)
        if self._torch_opt:
            return torch_optim.state_dict(self)
        return checkpoint.state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Load what `state_dict()` returned. Every key, slot, tensor shape/dtype/device and hyper-parameter
        is checked first; anything wrong refuses the whole checkpoint with a KilnError (nothing applied).
        With a torch.optim optimizer `{"torch_optimizer": sd}` goes through its own `load_state_dict` (an
        eager run's state loads too), checked against the model, restored on any error.
        Data parallel: a whole state loads on any number of ranks (each cuts its shards)."""
        with self._lock:
            if self.parallel is not None:
                return self.parallel.load_state_dict(self, sd)
            if self._torch_opt:
                return torch_optim.load_state_dict(self, sd)
            checkpoint.load_state_dict(self, sd)
