"""benchmarks/dynamic_shapes.py: the modes take turns batch by batch, each in its own process, and every mode
trains on the same batches (Kiln's losses against eager's, the benchmark's own check, are compared here too)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *extra) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dynamic_shapes.py"), "--model", "gpt2",
                           "--modes", "kiln,eager", "--batches", "4", "--min-len", "8", "--max-len", "16", "--batch",
                           "3", "--last-batch", "2", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["results"]


@pytest.mark.parametrize("how", [(), ("--sequential",)], ids=["taking turns", "sequential"])
def test_every_mode_trains_on_the_same_batches(tmp_path, how):
    results = _run(tmp_path, *how)
    assert set(results) == {"kiln", "eager"}
    kiln, eager = results["kiln"], results["eager"]
    assert kiln["lengths"] == eager["lengths"] and len(kiln["step_s"]) == len(eager["step_s"]) == 4
    assert kiln["programs"] == 2                                  # a static program, then one dynamic
    assert kiln["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    for r in results.values():                                    # taking turns: a mode's time is its own steps'
        assert r["total_s"] == pytest.approx(sum(r["step_s"]), rel=0.05 if how else 1e-6)
