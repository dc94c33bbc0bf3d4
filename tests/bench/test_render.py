"""Formatting of the table cells and notes shared by the terminal and the Markdown report."""
from kiln.bench import render


def _report(**machine):
    ok = dict(status="ok", ttfs_s=12.5, step_median_s=0.0571, step_min_s=0.05, step_max_s=0.4221,
              speedup_vs_baseline=1.0, items_per_s=1130.4, achieved_flops_per_s=2.5e9, peak_fraction=0.0312,
              dtype="fp32", peak_rss_bytes=386 * 2 ** 20, memory_vs_baseline=1.0, loss_first=5.54961,
              loss_last=5.48041, measured_steps=3, budget_truncated=True)
    return {"machine": {"usable_cpus": 2, **machine},
            "config": {"baseline": "eager", "unit": "tokens", "budget_s": 120},
            "results": [dict(ok, mode="eager"), dict(mode="kiln", status="unavailable", reason="no amp")]}


def test_rows():
    (eager, kiln), head = render.rows(_report()), render.headers(_report())
    cell = dict(zip(head, eager))
    assert cell["Mode"] == "eager (base)" and cell["1st step"] == "12.50 s"
    assert cell["Step median (min-max)"] == "57 (50-422) ms"
    assert cell["tokens/s"] == "1,130" and cell["GFLOP/s (% peak)"] == "2.5 (3.1% fp32)"
    assert cell["Peak RSS MiB"] == "386 (1.00x)" and cell["Loss step 1 -> last"] == "5.5496 -> 5.4804"
    assert cell["n"] == "3*"
    assert kiln[:2] == ["kiln", "n/a"] and set(kiln[2:]) == {"-"}


def test_loss_at_common_step():
    report = _report()
    report["config"]["loss_step"] = 2
    report["results"][0]["loss_at_loss_step"] = 5.5
    cell = dict(zip(render.headers(report), render.rows(report)[0]))
    assert cell["Loss step 1 -> 2"] == "5.5496 -> 5.5000"


def test_notes():
    notes = render.notes(_report(load_average_1m=0.1))
    assert notes[0] == "kiln: not available: no amp"
    assert "120 s time budget" in notes[1] and len(notes) == 2
    assert "machine was busy" in render.notes(_report(load_average_1m=1.9))[-1]


def test_tuned_column_and_note():
    report = _report()
    report["config"]["settle_s"] = 90
    report["results"] += [dict(report["results"][0], mode="kiln-bf16", tuned_s=31.25, still_tuning=[],
                               tuning_excess_s=6.13),
                          dict(report["results"][0], mode="kiln-x", tuned_s=None, still_tuning=["a", "b"])]
    tuned = [dict(zip(render.headers(report), row))["Tuned"] for row in render.rows(report)]
    assert tuned == ["-", "-", "31.25 s (+6.13 s)", "no"]
    assert ("kiln-x: still tuning after the 90 s --settle limit (2 kernel choices pending): its measured steps "
            "include kernel trials and may overlap a background compiler") in render.notes(report)
    assert not any(n.startswith("kiln-bf16") for n in render.notes(report))


def test_markdown_table():
    lines = render.markdown_table(_report()).splitlines()
    assert lines[0].startswith("| Mode | Status | 1st step |") and lines[1].startswith("|---|---|---:|")
    assert lines[2].startswith("| eager (base) | ok | 12.50 s | - | 57 (50-422) ms |") and len(lines) == 4
