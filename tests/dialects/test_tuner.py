"""One owner for tuning state: each `CompiledStep` has its own `Tuner` (trials, background workers, their
lifecycle), and the pipeline's passes alone compile, time, cache and spawn nothing."""
from __future__ import annotations

import gc
import json
import subprocess
import time
import weakref

import pytest
import torch

import kiln
from kiln.capture import capture
from kiln.dialects import measure, registry, tuning
from kiln.errors import KilnError
from kiln.passes.pipeline import Context, run_pipeline
from tests.dialects.test_cache_safety import Net, _alive, _data, _gone_within, _leftovers, _loss
from tests.dialects.test_onednn import _loss as _mlp_loss
from tests.dialects.test_onednn import _mlp
from tests.passes.graphs import aten

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def _online(monkeypatch, tmp_path, keep="faster"):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", "online")
    monkeypatch.setenv("KILN_KEEP", keep)


def _trials(step) -> set[int]:
    return {id(n.impl.trial) for n in step.graph.nodes if n.impl is not None and n.impl.trial is not None}


@needs_onednn
def test_two_steps_on_the_same_shapes_have_their_own_trials(monkeypatch, tmp_path):
    _online(monkeypatch, tmp_path)
    (a_model, args), (b_model, _) = _mlp(), _mlp()
    a = kiln.compile(a_model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_mlp_loss, dialects=["onednn"])
    b = kiln.compile(b_model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_mlp_loss, dialects=["onednn"])
    a(*args)
    b(*args)
    assert a.tuner is not b.tuner and a.tuner.trials and b.tuner.trials
    assert a.tuner.trials.keys() == b.tuner.trials.keys()          # the same keys (same shapes) ...
    assert not _trials(a) & _trials(b)                               # ... but trials of their own
    pending = b.pending_tuning()
    assert pending and a.pending_tuning() == pending
    a.close()
    assert a.pending_tuning() == [] and not a.tuner.trials          # closed: its trials settled on ATen
    assert {n.impl.label for n in a.graph.nodes if n.op.name == "aten.linear"} == {"aten"}
    assert not list((tmp_path / "kernels").rglob("*.timing.json"))  # a closed trial decided nothing
    assert b.pending_tuning() == pending                              # the other one still measures
    with pytest.raises(KilnError, match="closed"):
        a(*args)
    for _ in range(11):
        b(*args)
    assert b.pending_tuning() == [] and not b.tuner.trials            # ... and settles
    assert list((tmp_path / "kernels").rglob("*.timing.json"))


@pytest.mark.inductor
def test_closing_a_step_stops_its_worker_and_leaves_the_other_steps_running(monkeypatch, tmp_path):
    _online(monkeypatch, tmp_path, keep="all")          # no region is dropped as too cheap: workers start
    args = _data()
    a, b = (kiln.compile(Net(), optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["inductor", "aten"])
            for _ in range(2))
    a(*args)
    b(*args)
    (wa,), (wb,) = ([w for w in s.tuner.workers if w.proc is not None] for s in (a, b))
    assert wa is not wb and _alive(wa.proc.pid) and _alive(wb.proc.pid)
    assert a.pending_tuning() and b.pending_tuning()
    a.close()
    assert _gone_within(wa.proc.pid, 5.0), "the closed step's worker still runs"
    assert a.pending_tuning() == []
    assert all(r.online is None and r.compiled is None for r in a.last.regions)
    a.close()                                           # idempotent
    assert _alive(wb.proc.pid) and b.pending_tuning()
    deadline = time.monotonic() + 300
    while b.pending_tuning() and time.monotonic() < deadline:
        b(*args)
        time.sleep(0.05)
    assert b.pending_tuning() == [], "the other step's worker and trials did not settle"
    assert any(r.compiled is not None for r in b.last.regions)        # KILN_KEEP=all: its kernels are used
    b.close()
    assert not tuning.busy() and _leftovers(tmp_path) == []


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["online", "ahead"])
def test_the_passes_alone_compile_measure_write_and_spawn_nothing(monkeypatch, tmp_path, mode):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_TUNING", mode)
    measure.machine()                                    # (asks the C++ compiler its version once per process)
    from kiln.dialects import inductor

    calls = []

    def refused(*a, **k):                            # (an error a pass might swallow: recorded too)
        calls.append(a)
        raise AssertionError("a pass did a tuner's work")
    monkeypatch.setattr(subprocess, "Popen", refused)
    monkeypatch.setattr(measure, "medians", refused)
    monkeypatch.setattr(inductor, "_compile_source", refused)
    model, args = Net(), _data()
    graph, _ = capture(model, _loss, args, {})
    names = ("inductor", "onednn", "aten")
    ctx = run_pipeline(Context(graph, kiln.optim.AdamW(lr=1e-3), names))
    assert ctx.regions and all(r.compiled is None and r.online is None for r in ctx.regions)   # requested
    assert not torch.backends.mkldnn.is_available() or ctx.choices       # oneDNN linear, mm: choices to make
    assert {n.target for n in ctx.choices} <= {aten.linear.default, aten.mm.default}
    assert list(tmp_path.rglob("*")) == []               # nothing written, not even a folder
    assert calls == []


@pytest.mark.inductor
def test_garbage_collecting_a_step_stops_its_worker(monkeypatch, tmp_path):
    _online(monkeypatch, tmp_path, keep="all")
    step = kiln.compile(Net(), optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_loss, dialects=["inductor", "aten"])
    step(*_data())
    (worker,) = [w for w in step.tuner.workers if w.proc is not None]
    pid, owner = worker.proc.pid, weakref.ref(step.tuner)
    assert _alive(pid)
    del step, worker
    gc.collect()
    assert owner() is None, "the step's tuner outlived it"
    assert _gone_within(pid, 5.0), "the worker of a collected step still runs"
    assert not tuning.busy() and _leftovers(tmp_path) == []


def test_a_stopped_tuner_settles_what_its_worker_left_open(monkeypatch, tmp_path):
    """stop() without a process: the prepared worker never starts, its regions keep their ATen ops."""
    from kiln.dialects import inductor
    from tests.passes.graphs import fuse_regions
    from tests.passes.test_regions import _graph_with_layer_norm_chain
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_DIALECTS", raising=False)
    tuner = tuning.Tuner("online")
    g, _ = _graph_with_layer_norm_chain()
    (region,) = fuse_regions(g, ("inductor", "aten"), tuner)
    (worker,) = tuner.workers
    assert region.online is not None and region.online.state.startswith("waiting to be compiled")
    other = tuning.Tuner("online")
    assert not tuning.busy(tuner) and not tuning.busy(other)    # a worker prepared, not compiling: no one waits
    tuner.stop()
    assert region.online is None and region.compiled is None and worker.finished() and worker.proc is None
    tuner.start()                                        # a stopped worker never starts
    assert worker.proc is None
    assert not (inductor.cache_dir() / f"{region.key}.timing.json").exists()
    tuner.close()
    tuner.close()
    assert tuner.closed and json.dumps(tuner.pending([])) == "[]"


def test_a_kernel_failing_at_run_time_falls_back_for_its_own_step_only(caplog):
    calls = []

    def broken(x, y):
        calls.append(1)
        raise RuntimeError("no kernel here")
    registry.check_names(["kiln"])                                          # (the dialects registered)
    impl = registry.Impl(registry.DIALECTS["kiln"], aten.add.Tensor, kernel=broken, name="broken_add")
    a, b = tuning.Tuner(), tuning.Tuner()
    assert a._own(impl) is a._own(impl) and a._own(impl) is not b._own(impl)
    x = torch.ones(2)
    for _ in range(2):
        torch.testing.assert_close(a._own(impl).runnable(x, x), x + x)     # ATen's kernel from the first failure
    assert calls == [1]
    torch.testing.assert_close(b._own(impl).runnable(x, x), x + x)         # the other step tries its own
    assert calls == [1, 1]


@needs_onednn
def test_a_profile_replay_neither_samples_nor_advances_a_trial(monkeypatch, tmp_path):
    """`step.profile()` (explain --profile) replays the step under per-op timers: its calls are not training
    calls, so the open trials run their baseline untimed and keep what training measured."""
    _online(monkeypatch, tmp_path)
    model, args = _mlp()
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3), loss_fn=_mlp_loss, dialects=["onednn"])
    step(*args)
    step(*args)
    trials = {id(t): t for t in (getattr(n.impl.trial, 'trial', None) for n in step.graph.nodes if n.impl is not None)
              if t is not None and not t.settled}
    assert trials
    before = {k: (t.calls, {a: list(v) for a, v in t.times.items()}) for k, t in trials.items()}
    step.profile()
    step.memory(measure=True)
    assert {k: (t.calls, {a: list(v) for a, v in t.times.items()}) for k, t in trials.items()} == before
    assert not tuning.busy()
    step(*args)                                                    # training samples again
    assert any(t.calls > before[k][0] for k, t in trials.items())
