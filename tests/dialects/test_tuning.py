"""Online tuning: kernels measured on the step's own calls (`measure.Trial`), oneDNN linear decided
during training, and fused regions compiled by a background worker, then measured, then cached so the
next compilation decides before the first step. Numerics are checked against PyTorch eager."""
from __future__ import annotations

import copy
import json
import time

import pytest
import torch

import kiln
from kiln.dialects import background, inductor, measure, registry, tuning
from kiln.errors import KilnError
from tests.dialects.test_onednn import _assert_eager_adamw, _loss, _mlp
from tests.passes.graphs import aten, fuse_regions
from tests.passes.test_regions import _graph_with_layer_norm_chain as _layer_norm_chain


class FakeClock:
    """perf_counter stand-in: each arm's call lasts what `costs` says (ms)."""

    def __init__(self):
        self.now, self.next = 0.0, 0.0

    def __call__(self):
        self.now += self.next
        return self.now


def _trial(costs: dict[str, list[float]], samples=3, busy=None):
    clock, done = FakeClock(), []
    trial = measure.Trial(tuple(costs), done.append, samples=samples, clock=clock, busy=busy)
    left = {arm: list(v) for arm, v in costs.items()}

    def call(arm):
        clock.next = left[arm].pop(0) / 1e3
        return arm
    return trial, done, lambda: trial.run({arm: (lambda a=arm: call(a)) for arm in costs})


def test_a_trial_alternates_drops_each_arms_first_call_and_settles_on_medians():
    trial, done, call = _trial({"aten": [50.0, 1.0, 1.2, 0.9], "new": [70.0, 0.5, 0.4, 0.6]})
    ran = [call() for _ in range(8)]
    assert ran == ["aten", "new"] * 4
    assert trial.settled and done == [{"aten": pytest.approx(1.0), "new": pytest.approx(0.5)}]   # 50/70: warm-up


def test_a_trial_settles_after_three_samples_each_only_when_they_leave_no_doubt():
    # every candidate call beats every ATen call by the keep rule: settled after 1 + 3 calls each
    trial, done, call = _trial({"aten": [9.0, 2.0, 2.1, 1.9], "new": [9.0, 1.0, 1.1, 0.9]}, samples=5)
    [call() for _ in range(8)]
    assert trial.settled and done == [{"aten": pytest.approx(2.0), "new": pytest.approx(1.0)}]
    # every candidate call is slower than every ATen call: settled as early, ATen wins
    trial, done, call = _trial({"aten": [9.0, 1.0, 1.1, 0.9], "new": [9.0, 2.0, 2.1, 1.9]}, samples=5)
    [call() for _ in range(8)]
    assert done == [{"aten": pytest.approx(1.0), "new": pytest.approx(2.0)}]
    # overlapping samples (the candidate's 1.0 could pass against ATen's 1.2, its 1.3 could not): all 5 each
    costs = {"aten": [9.0, 1.2, 1.0, 1.1, 1.0, 1.0], "new": [9.0, 1.0, 1.3, 0.9, 0.9, 0.9]}
    trial, done, call = _trial(costs, samples=5)
    [call() for _ in range(8)]
    assert not trial.settled and not done
    [call() for _ in range(4)]
    assert done == [{"aten": pytest.approx(1.0), "new": pytest.approx(0.9)}]


def test_a_trial_waits_while_a_compiler_runs():
    compiling = [True]
    trial, done, call = _trial({"aten": [1.0] * 7, "new": [2.0] * 4}, busy=lambda: compiling[0])
    assert [call() for _ in range(3)] == ["aten"] * 3 and trial.calls == 0
    compiling[0] = False
    for _ in range(8):
        call()
    assert done == [{"aten": pytest.approx(1.0), "new": pytest.approx(2.0)}]


def test_tuning_is_checked(monkeypatch):
    model, args = _mlp()
    with pytest.raises(KilnError, match="tuning must be one of"):
        kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, tuning="later")
    monkeypatch.setenv("KILN_TUNING", "sometimes")
    with pytest.raises(KilnError, match="KILN_TUNING must be one of"):
        measure.tuning()


# ---- oneDNN linear, measured during training -------------------------------------------------------
def _onednn_linear():
    return next(i for i in registry.impls_for(aten.linear.default) if i.dialect.name == "onednn")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_onednn_linear_is_measured_during_training_and_the_decision_cached(monkeypatch, tmp_path, kiln_log):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    real = _onednn_linear().kernel

    def slow(*args, **kwargs):          # 3 ms slower than ATen on these tiny shapes: ATen must win
        time.sleep(0.003)
        return real(*args, **kwargs)
    monkeypatch.setattr(_onednn_linear(), "kernel", slow)
    monkeypatch.setattr(measure, "medians", lambda *a, **k: pytest.fail("measured before the first step"))
    model, args = _mlp()
    ref = copy.deepcopy(model)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["onednn"])
    step(*args)
    linears = [n for n in step.graph.nodes if n.op.name == "aten.linear"]
    assert linears and {n.impl.label for n in linears} == {"onednn:linear (measuring)"}
    # one per distinct shape (the backward's products, `onednn:mm`, are measured beside them)
    pending = [line for line in step.pending_tuning() if " aten.linear(" in line]
    assert len(pending) == len({(n.inputs[0].meta, n.inputs[1].meta) for n in linears})
    assert all(line.startswith("onednn:linear (measuring) aten.linear(float32[") for line in pending)
    for _ in range(11):                 # each linear runs once a step: 1 + 5 calls per arm at most
        step(*args)
    assert {n.impl.label for n in linears} == {"aten"} and step.pending_tuning() == []
    assert any("measured during training: ATen kept" in r.getMessage() for r in kiln_log.records)
    timings = [json.loads(p.read_text()) for p in (tmp_path / "kernels").rglob("*.timing.json")]
    slowed = [t for t in timings if t["new_ms"] > t["aten_ms"] + 2]      # the linears' (the products' beside them)
    assert len(slowed) == len({(n.inputs[0].meta, n.inputs[1].meta) for n in linears})
    # the trained parameters are eager AdamW's, whichever kernel ran each call
    _assert_eager_adamw(model, ref, args, steps=12)
    # the next compilation reads the decision before the first step
    step2 = kiln.compile(_mlp()[0], optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["onednn"])
    step2(*args)
    assert {n.impl.label for n in step2.graph.nodes if n.op.name == "aten.linear"} == {"aten"}


# ---- fused regions: compiled in the background, measured during training ----------------------------
def _compiled(g, tuner):
    from kiln.passes.regions import Region
    from kiln.runtime.codegen import generate
    considered = fuse_regions(g, ("inductor", "aten"), tuner)
    (region,) = [n.target for n in g.nodes if isinstance(n.target, Region)]
    return considered, region, generate(g, return_all=True)[1]


def _eager(g, tensors):
    from kiln.passes.dispatch import dispatch
    from kiln.runtime.codegen import generate
    g = copy.deepcopy(g)
    dispatch(g, ("aten",))
    return generate(g, return_all=True)[1](*tensors)


@pytest.mark.inductor
def test_a_region_compiles_in_the_background_then_is_measured_and_cached(monkeypatch, tmp_path, kiln_log):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setattr(inductor, "_compile_source", lambda r: pytest.fail("compiled in the training process"))
    # the chain's ATen ops take ~0.1 ms: on a fast, warm CPU under 2 * MIN_SAVING_MS, and then never compiled
    monkeypatch.setattr(measure, "MIN_SAVING_MS", 0.0)
    g, tensors = _layer_norm_chain()
    want = _eager(g, tensors)
    tuner = tuning.Tuner()
    considered, region, fn = _compiled(g, tuner)
    assert region.online is not None and region.online.state.startswith("waiting to be compiled")
    assert region.compiled is None
    for got, exp in zip(fn(*tensors), want):          # runs its ATen ops meanwhile
        torch.testing.assert_close(got, exp)
    tuner.hurry()                                       # (without it, the worker waits: the test below)
    tuner.start()                                       # what the compiled step does after a step
    assert region.online.state == "compiling in the background"
    deadline = time.monotonic() + 240
    while region.online is not None and time.monotonic() < deadline:
        for got, exp in zip(fn(*tensors), want):        # kernel or ATen ops, every call is right
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
        time.sleep(0.05)
    assert region.online is None, "the background compilation and measurement did not finish"
    assert region.failed is None
    timing = json.loads((inductor.cache_dir() / f"{region.key}.timing.json").read_text())
    assert set(timing) == {"aten_ms", "compiled_ms"} and region.timing == timing
    assert (region.compiled is not None) == measure.worth_it(timing["compiled_ms"], timing["aten_ms"])
    assert any("measured during training" in r.getMessage() for r in kiln_log.records)
    assert not tuning.busy() and not list(inductor.cache_dir().glob(".jobs.*"))

    # the next compilation decides before the first step, from the cache, compiling nothing
    g2, _ = _layer_norm_chain()
    (again,) = fuse_regions(g2, ("inductor", "aten"))
    assert again.online is None and again.timing == timing
    assert (again.compiled is not None) == (region.compiled is not None)


@pytest.mark.inductor
def test_a_step_lists_what_it_still_tunes(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setattr(background.Worker, "start", lambda self: None)
    model, args = _mlp()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["inductor", "aten"])
    step(*args)
    regions = {r.online: r for r in step.last.regions if r.online is not None}
    assert regions
    assert sorted(line.split(" (")[0] for line in step.pending_tuning()) == sorted(
        f"fused region {r.name}: waiting to be compiled in the background until its ATen ops have taken as long "
        "as compiling would cost" for r in regions.values())
    next(iter(regions)).worker.seconds = 1.0             # the worker is done, having stored nothing
    step(*args)                                          # each region reports it and keeps its ops
    assert step.pending_tuning() == []


@pytest.mark.inductor
def test_a_region_the_worker_could_not_compile_keeps_its_ops(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setattr(background.Worker, "start", lambda self: None)

    g, tensors = _layer_norm_chain()
    want = _eager(g, tensors)
    tuner = tuning.Tuner()
    _, region, fn = _compiled(g, tuner)
    worker = region.online.worker
    worker.seconds = 1.0                                 # finished, having stored nothing
    monkeypatch.setattr(worker, "errors", lambda: f"kiln worker: {region.key} failed: LoweringException: nope")
    for got, exp in zip(fn(*tensors), want):
        torch.testing.assert_close(got, exp)
    assert region.online is None and region.compiled is None and region.failed == "compile"
    assert any("could not compile fused region" in r.getMessage() and "LoweringException" in r.getMessage()
               for r in caplog.records)
    worker.close()


@pytest.mark.inductor
def test_regions_the_first_step_shows_too_cheap_are_not_compiled(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setattr(measure, "MIN_SAVING_MS", 1e6)        # nothing could save that much
    g, tensors = _layer_norm_chain()
    tuner = tuning.Tuner()
    _, region, fn = _compiled(g, tuner)
    worker = region.online.worker
    fn(*tensors)                                              # the first step times the ATen ops
    tuner.start()
    assert worker.proc is None and worker.finished() and not worker.jobs   # nothing to compile
    assert region.online is None and region.compiled is None
    assert set(region.timing) == {"aten_ms"} and region.timing["aten_ms"] > 0
    assert json.loads((inductor.cache_dir() / f"{region.key}.timing.json").read_text()) == region.timing


@pytest.mark.inductor
def test_a_worker_starts_once_its_regions_ops_have_taken_what_compiling_would_cost(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setattr(measure, "MIN_SAVING_MS", 0.0)          # not too cheap to compile, however fast
    started = []
    monkeypatch.setattr(background.Worker, "start", lambda self: started.append(self))
    cost = [1e9]
    monkeypatch.setattr(background, "training_cost_s", lambda jobs: cost[0] * jobs)
    g, tensors = _layer_norm_chain()
    tuner = tuning.Tuner()
    _, region, fn = _compiled(g, tuner)
    online = region.online
    for _ in range(3):                                           # steps: the ATen ops run, timed
        fn(*tensors)
        tuner.start()
    assert started == [] and online.spent_ms > 0 and len(online.first) == 1
    assert online.state.startswith("waiting to be compiled") and "of 1000000000.0 s" in online.state
    cost[0] = online.spent_ms / 1e3 * 1.5                        # ... not yet paid for
    fn(*tensors)
    tuner.start()
    assert started == []
    spent = online.spent_ms
    while online.spent_ms < 1.5 * spent:                         # ... now it is
        fn(*tensors)
    tuner.start()
    assert started == [online.worker]


@pytest.mark.inductor
@pytest.mark.parametrize("how", ["hurry", "keep all"])
def test_a_worker_starts_after_the_first_step_when_asked(monkeypatch, tmp_path, how):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    if how == "keep all":
        monkeypatch.setenv("KILN_KEEP", "all")
    started = []
    monkeypatch.setattr(background.Worker, "start", lambda self: started.append(self))
    monkeypatch.setattr(background, "training_cost_s", lambda jobs: 1e9)
    g, tensors = _layer_norm_chain()
    tuner = tuning.Tuner()
    _, region, fn = _compiled(g, tuner)
    if how == "hurry":
        tuner.hurry()
    fn(*tensors)
    tuner.start()
    assert started == [region.online.worker]


def test_what_a_worker_is_expected_to_cost_the_training(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(background.os, "sched_getaffinity", lambda pid: {0, 1})
        assert background.training_cost_s(4) == pytest.approx((background.STARTUP_S + 4 * background.PER_JOB_S) / 2)
        monkeypatch.setattr(background.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        assert background.training_cost_s(4) == 0.0                # a core to spare: compiling costs nothing
    finally:
        torch.set_num_threads(threads)


def test_the_training_lends_a_core_to_a_worker_and_gets_it_back(monkeypatch):
    monkeypatch.setattr(background.os, "sched_getaffinity", lambda pid: {0, 1})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        background._take_core()
        assert torch.get_num_threads() == 1
        background._give_back_core()
        assert torch.get_num_threads() == 2
        background._take_core()
        torch.set_num_threads(2)                          # the user's own choice, made meanwhile, stays
        torch.set_num_threads(3)
        background._give_back_core()
        assert torch.get_num_threads() == 3 and background._lent is None
        torch.set_num_threads(1)
        background._take_core()                            # one thread: nothing to lend
        assert torch.get_num_threads() == 1 and background._lent is None
    finally:
        background._lent, background._borrowers = None, 0
        torch.set_num_threads(threads)


def test_inductor_is_readied_beside_the_capture_only_where_the_cache_has_regions_to_load(monkeypatch, tmp_path):
    """A warm cache (measured regions of this machine): `kiln.compile` starts Inductor's imports and ISA probe in
    a thread; a cold cache, or a step without the inductor dialect, starts nothing."""
    calls = []
    monkeypatch.setattr(inductor, "codegen_facts", lambda: calls.append(1))
    monkeypatch.setattr(inductor, "_prefetching", [])
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    model = torch.nn.Linear(4, 4)

    def compile_step(dialects=("aten", "inductor")):
        kiln.compile(model, loss_fn=lambda out, *_: out.sum(), optimizer=kiln.optim.SGD(lr=0.1), dialects=dialects)
        return list(inductor._prefetching)

    assert compile_step() == [] and not calls                       # cold: nothing to load before the first step
    folder = inductor.cache_dir()
    (folder / "0123abcd.timing.json").write_text(json.dumps({"aten_ms": 1.0}))
    assert compile_step(dialects=("aten",)) == []                   # the step cannot use Inductor
    started = compile_step()
    assert len(started) == 1
    started[0].join(10)
    assert calls == [1]
    assert compile_step() == started and calls == [1]               # once per process


def test_a_wrapper_is_loaded_without_the_extern_kernels_import_it_does_not_use():
    src = ("import torch\nfrom torch._inductor.select_algorithm import extern_kernels\n"
           "def call(args):\n    return [a + 1 for a in args]\n")
    assert "select_algorithm" not in inductor._lean(src) and "def call" in inductor._lean(src)
    uses = src + "mm = extern_kernels.mm\n"            # a wrapper that calls one keeps the import
    assert inductor._lean(uses) == uses
    assert inductor._load_kernel(src)([torch.ones(2)])[0].tolist() == [2.0, 2.0]


@pytest.mark.inductor
def test_a_compiled_regions_wrapper_runs_without_the_extern_kernels_import(monkeypatch, tmp_path):
    """Inductor's wrapper for a region imports `extern_kernels` and uses none; loaded without the import, the
    step computes what the region's ATen ops compute."""
    from kiln.runtime.codegen import generate
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "ahead")
    monkeypatch.setenv("KILN_KEEP", "all")
    monkeypatch.setattr(inductor, "_modules", {})
    g, tensors = _layer_norm_chain()
    want = _eager(g, tensors)
    (region,) = fuse_regions(g, ("inductor", "aten"))
    assert region.compiled is not None
    (mod,) = inductor._modules.values()
    source = "".join(__import__("linecache").cache[f"<{mod.__name__}>"][2])
    assert "extern_kernels" not in source and not hasattr(mod, "extern_kernels")
    for got, exp in zip(generate(g, return_all=True)[1](*tensors), want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
