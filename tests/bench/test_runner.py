"""The runner and worker: broken modes are reported as failed, the others still run."""
import math

from kiln.bench import runner, worker, zoo

# resnet needs no transformers import, which keeps each worker process quick.
CONFIG = dict(model="resnet", size="tiny", overrides={}, seed=0, steps=2, warmup=1, budget_s=0,
              baseline="eager")


def test_failing_mode_does_not_stop_the_others():
    """Through real subprocesses: a mode whose process dies, then one that works."""
    config = dict(CONFIG, modes=["eager-bf16", "eager"], faults={"eager-bf16": {"fault": "exit"}})
    started, finished = [], []
    report = runner.run(config, timeout_s=120, on_start=started.append, on_done=finished.append,
                        measure_peak=False)
    assert started == ["eager-bf16", "eager"]
    broken, eager = report["results"]
    assert finished == report["results"]
    assert broken["status"] == "failed" and "exited with code 3" in broken["error"]
    assert eager["status"] == "ok" and eager["measured_steps"] == 2
    assert math.isfinite(eager["loss_last"]) and eager["speedup_vs_baseline"] == 1.0
    assert eager["flops_per_step"] == zoo.get("resnet", "tiny").flops_per_step
    assert report["config"]["params"] == eager["params"] > 0


def test_hanging_worker_is_killed():
    hung = runner.run_worker(dict(CONFIG, mode="eager", fault="hang"), timeout_s=5)
    assert hung["status"] == "failed" and "timed out after 5 s" in hung["error"]
    assert 5 <= hung["wall_s"] < 25


def test_cold_cache_gives_the_worker_empty_compile_caches():
    got = runner.run_worker(dict(CONFIG, mode="eager", steps=1, cold_cache=True), timeout_s=120)
    assert got["status"] == "ok", got
    caches = got["compile_caches"]
    assert set(caches) == {"TORCHINDUCTOR_CACHE_DIR", "KILN_CACHE_DIR"}
    assert all("kiln-bench-" in path for path in caches.values())
    warm = runner.run_worker(dict(CONFIG, mode="eager", steps=1), timeout_s=120)
    assert warm["compile_caches"] is None


def test_baseline_heap_keep_gives_other_modes_kilns_heap_setting():
    same = runner.run_worker(dict(CONFIG, mode="eager", steps=1, baseline_heap="keep"), timeout_s=120)
    assert same["status"] == "ok", same
    assert "left alone" in same["heap"] and "environment" in same["heap"]   # MALLOC_*_ set for it
    default = runner.run_worker(dict(CONFIG, mode="eager", steps=1), timeout_s=120)
    assert default["heap"].startswith("heap: system")


def test_raising_mode_reports_its_error():
    got = worker.run(dict(CONFIG, mode="eager", fault="raise"))  # in-process: run() never raises
    assert got["status"] == "failed" and "injected fault" in got["error"]
    assert "RuntimeError" in got["traceback"]


def test_unknown_mode_is_a_failed_result():
    got = worker.run(dict(CONFIG, mode="no-such-mode"))
    assert got["status"] == "failed" and "unknown mode 'no-such-mode'" in got["error"]


def test_budget_stops_measuring_early():
    got = worker.run(dict(CONFIG, mode="eager", steps=1000, budget_s=0.5))
    assert got["status"] == "ok"
    assert 1 <= got["measured_steps"] < 1000 and got["budget_truncated"] is True
    assert sum(got["step_times_s"]) <= 0.5 + max(got["step_times_s"])
    assert got["step_min_s"] <= got["step_q1_s"] <= got["step_median_s"] <= got["step_q3_s"] <= got["step_max_s"]


def test_ratios_against_baseline():
    ok = dict(status="ok", achieved_flops_per_s=5e9)
    results = [dict(ok, mode="eager", dtype="fp32", step_median_s=2.0, peak_rss_bytes=1000),
               dict(ok, mode="kiln", dtype="bf16", step_median_s=0.5, peak_rss_bytes=600),
               dict(mode="compile", status="failed")]
    runner._ratios(results, "eager", {"fp32": {"flops_per_s": 1e10}, "bf16": {"flops_per_s": 2e10}})
    assert results[1]["speedup_vs_baseline"] == 4.0 and results[1]["memory_vs_baseline"] == 0.6
    assert results[0]["peak_fraction"] == 0.5 and results[1]["peak_fraction"] == 0.25
    assert "speedup_vs_baseline" not in results[2]


class _TuningStep:
    """A step that says it is still tuning for its first `tuning_calls` calls (like kiln's online tuning)."""

    def __init__(self, tuning_calls):
        self.calls, self.tuning_calls = 0, tuning_calls

    def __call__(self, **batch):
        import time

        import torch
        self.calls += 1
        time.sleep(0.01)
        return torch.tensor(1.0 / self.calls)

    def pending_tuning(self):
        return ["fused region r0: measuring"] if self.calls < self.tuning_calls else []


def test_kiln_modes_measure_after_online_tuning_settles(monkeypatch):
    from kiln.bench import modes
    fake = _TuningStep(tuning_calls=6)
    monkeypatch.setattr(modes, "make_step", lambda mode, model, **kw: fake)
    got = worker.run(dict(CONFIG, mode="kiln", steps=3, warmup=2, settle_s=60))
    assert got["status"] == "ok", got
    assert got["warmup_steps"] == 6 and got["measured_steps"] == 3 and fake.calls == 9
    assert got["still_tuning"] == [] and got["ttfs_s"] < got["tuned_s"] < got["ttfs_s"] + 60
    assert len(got["warmup_step_times_s"]) == 5 and got["tuning_excess_s"] == sum(
        t - got["step_median_s"] for t in got["warmup_step_times_s"])
    # the --settle limit comes first: measured anyway, and the result says so
    fake = _TuningStep(tuning_calls=10 ** 6)
    monkeypatch.setattr(modes, "make_step", lambda mode, model, **kw: fake)
    got = worker.run(dict(CONFIG, mode="kiln", steps=3, warmup=2, settle_s=0.2))
    assert got["status"] == "ok" and got["measured_steps"] == 3
    assert got["tuned_s"] is None and got["still_tuning"] == ["fused region r0: measuring"]
    # no settling asked, or a step that does not tune online: measured at once
    fake = _TuningStep(tuning_calls=6)
    monkeypatch.setattr(modes, "make_step", lambda mode, model, **kw: fake)
    got = worker.run(dict(CONFIG, mode="kiln", steps=3, warmup=2, settle_s=0))
    assert got["warmup_steps"] == 2 and got["tuned_s"] is None and got["still_tuning"]
    # nothing left to tune after the first step (a warm cache): tuned when the first step ended
    monkeypatch.setattr(modes, "make_step", lambda mode, model, **kw: _TuningStep(tuning_calls=1))
    got = worker.run(dict(CONFIG, mode="kiln", steps=3, warmup=2, settle_s=60))
    assert got["tuned_s"] == got["ttfs_s"] and got["warmup_steps"] == 2
    monkeypatch.undo()
    assert "tuned_s" not in worker.run(dict(CONFIG, mode="eager", steps=1))
