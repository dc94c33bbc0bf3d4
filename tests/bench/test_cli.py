"""`kiln bench` end to end through the CLI entry point, and its input checks."""
import json
import math

import pytest

from kiln.bench import zoo


def bench_main(argv):
    """kiln.cli.main when the top-level CLI imports; else our register() on a local parser."""
    try:
        from kiln.cli import main
    except ImportError:
        import argparse

        from kiln.bench import cli

        parser = argparse.ArgumentParser(prog="kiln")
        cli.register(parser.add_subparsers(dest="command"))

        def main(argv):
            args = parser.parse_args(argv)
            return args.func(args)
    return main(argv)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    # resnet: the one zoo model whose workers need no `transformers` import (keeps this fast).
    code = bench_main(["bench", "--model", "resnet", "--size", "tiny", "--modes", "eager,eager-bf16", "--steps", "1",
                       "--warmup", "1", "--json", str(tmp / "out.json"), "--plot", str(tmp / "out.png")])
    return code, tmp


def test_smoke_two_modes(smoke):
    code, tmp = smoke
    assert code == 0
    report = json.loads((tmp / "out.json").read_text())
    assert report["schema"] == "kiln-bench/1"
    m = report["machine"]
    assert m["cpu"] and m["logical_cpus"] >= 1 and m["torch"].startswith("2.") and m["date"][:2] == "20"
    cfg = report["config"]
    assert cfg["model"] == "resnet" and cfg["baseline"] == "eager" and cfg["unit"] == "samples"
    flops = zoo.get("resnet", "tiny").flops_per_step
    assert cfg["items_per_batch"] == 2 and cfg["flops_per_step"] == flops > 0
    for dtype in ("fp32", "bf16"):
        assert report["peak_matmul"][dtype]["flops_per_s"] > 1e8
    eager, bf16 = report["results"]
    assert [eager["mode"], bf16["mode"]] == ["eager", "eager-bf16"]
    for r in (eager, bf16):
        assert r["status"] == "ok", r
        assert r["measured_steps"] == 1 and r["warmup_steps"] == 1
        assert r["ttfs_s"] > 0 and r["step_min_s"] <= r["step_median_s"] <= r["step_max_s"]
        assert r["items_per_s"] == pytest.approx(2 / r["step_median_s"])
        assert r["achieved_flops_per_s"] == pytest.approx(flops / r["step_median_s"])
        assert 0 < r["peak_fraction"] < 5
        assert r["peak_rss_bytes"] > 50 * 2 ** 20 and "VmHWM" in r["memory_method"]
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
    assert eager["dtype"] == "fp32" and bf16["dtype"] == "bf16"
    assert cfg["loss_step"] == 2 and len(eager["losses"]) == 2  # 1 warm-up + 1 measured
    assert eager["loss_at_loss_step"] == eager["losses"][1] == eager["loss_last"]
    assert eager["speedup_vs_baseline"] == 1.0 and eager["memory_vs_baseline"] == 1.0
    # Same seed, same data, same weights: the first losses differ only by bf16 rounding.
    assert bf16["loss_first"] == pytest.approx(eager["loss_first"], abs=0.05)
    assert (tmp / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_from_smoke_json(smoke, capsys):
    _, tmp = smoke
    out = tmp / "docs" / "benchmarks.md"
    assert bench_main(["bench", "report", str(tmp / "out.json"), "--out", str(out)]) == 0
    text = out.read_text()
    assert f"kiln bench report {tmp / 'out.json'} --out {out}" in text.splitlines()[3]
    assert "| eager (base) | ok |" in text and "| eager-bf16 | ok |" in text and "(100%" not in text
    assert "![Step time and peak memory per mode](benchmarks.png)" in text
    assert (tmp / "docs" / "benchmarks.png").stat().st_size > 1000
    capsys.readouterr()
    assert bench_main(["bench", "report", str(tmp / "out.json")]) == 0  # to stdout
    assert "| eager-bf16 | ok |" in capsys.readouterr().out


def test_report_of_several_models_has_a_section_and_chart_each(smoke):
    _, tmp = smoke
    data = json.loads((tmp / "out.json").read_text())
    paths = []
    for model in ("llama", "gpt2"):
        data["config"]["model"] = model
        paths.append(tmp / f"{model}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp / "multi" / "benchmarks.md"
    assert bench_main(["bench", "report", *map(str, paths), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("| eager (base) | ok |") == 2 and "## llama" in text and "## gpt2" in text
    assert text.index("## llama") < text.index("](benchmarks-llama.png)") < text.index("## gpt2")
    assert "](benchmarks-gpt2.png)" in text and (tmp / "multi" / "benchmarks-gpt2.png").stat().st_size > 1000
    assert not list((tmp / "multi").glob("*.tmp"))


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt3"], "unknown model 'gpt3'"),
    (["--modes", "eager,turbo"], "unknown mode 'turbo'"),
    (["--batch", "0"], "--batch must be positive"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--modes", "eager", "--baseline", "kiln"], "--baseline kiln is not one of --modes"),
    (["--json", "/nonexistent/dir/x.json"], "does not exist"),
    (["report", "/nonexistent.json"], "cannot read /nonexistent.json"),
])
def test_bad_input(argv, message, capsys, tmp_path):
    assert bench_main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_report_rejects_foreign_json(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"hello": 1}')
    (tmp_path / "y.json").write_text("{not json")
    assert bench_main(["bench", "report", str(tmp_path / "x.json")]) == 2
    assert "not a `kiln bench --json` report" in capsys.readouterr().err
    assert bench_main(["bench", "report", str(tmp_path / "y.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_missing_optional_dependencies_are_named_up_front(monkeypatch, capsys, tmp_path):
    """Without transformers (or matplotlib for a chart) the run stops before any mode starts, naming the
    package and the extra that installs it; resnet needs neither."""
    from kiln.bench import cli
    absent = {"transformers", "matplotlib"}
    monkeypatch.setattr(cli, "_installed", lambda module: module not in absent)
    assert bench_main(["bench", "--model", "gpt2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "transformers" in err and "pip install 'kiln[bench]'" in err and "matplotlib" not in err
    assert bench_main(["bench", "--model", "resnet", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "transformers" not in err
    (tmp_path / "r.json").write_text("{}")
    assert bench_main(["bench", "report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert cli.missing_extras("resnet") is None
