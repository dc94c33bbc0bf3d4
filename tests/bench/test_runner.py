"""The subprocess runner: broken modes are reported as failed, the others still run."""
import math

from kiln.bench import runner, zoo

# resnet needs no transformers import, which keeps each worker process quick.
CONFIG = dict(model="resnet", size="tiny", overrides={}, seed=0, steps=2, warmup=1, budget_s=0,
              baseline="eager")


def test_failing_mode_does_not_stop_the_others():
    config = dict(CONFIG, modes=["eager", "no-such-mode", "eager-bf16"],
                  faults={"eager-bf16": {"fault": "raise"}})
    started, finished = [], []
    report = runner.run(config, timeout_s=120, on_start=started.append, on_done=finished.append,
                        measure_peak=False)
    assert started == ["eager", "no-such-mode", "eager-bf16"]
    eager, unknown, broken = report["results"]
    assert finished == report["results"]
    assert unknown["status"] == "failed" and "unknown mode 'no-such-mode'" in unknown["error"]
    assert broken["status"] == "failed" and "injected fault" in broken["error"]
    assert "RuntimeError" in broken["traceback"]
    assert eager["status"] == "ok" and eager["measured_steps"] == 2
    assert math.isfinite(eager["loss_last"]) and eager["speedup_vs_baseline"] == 1.0
    assert eager["flops_per_step"] == zoo.get("resnet", "tiny").flops_per_step
    assert report["config"]["params"] == eager["params"] > 0


def test_crashing_and_hanging_workers():
    crashed = runner.run_worker(dict(CONFIG, kind="mode", mode="eager", fault="exit"), timeout_s=120)
    assert crashed["status"] == "failed"
    assert "exited with code 3" in crashed["error"]
    hung = runner.run_worker(dict(CONFIG, kind="mode", mode="eager", fault="hang"), timeout_s=8)
    assert hung["status"] == "failed" and "timed out after 8 s" in hung["error"]
    assert 8 <= hung["wall_s"] < 30


def test_budget_stops_measuring_early():
    got = runner.run_worker(dict(CONFIG, kind="mode", mode="eager", steps=1000, budget_s=1.0),
                            timeout_s=120)
    assert got["status"] == "ok"
    assert 1 <= got["measured_steps"] < 1000 and got["budget_truncated"] is True
    assert sum(got["step_times_s"]) <= 1.0 + max(got["step_times_s"])
