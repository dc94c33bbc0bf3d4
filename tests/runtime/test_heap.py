"""The heap policy between steps (kiln/runtime/heap.py), observed the way it matters: page faults.

Each case runs in its own Python: the policy is process-wide. After one compiled step, a 64 MiB buffer
is allocated, written and freed three times; returned to the OS, each round faults its 16384 pages in
again; kept, the rounds after the first reuse them.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.errors import KilnError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = 64 * 2 ** 20 // 4096

SCRIPT = r"""
import json, resource, sys
import torch
import kiln
from kiln.runtime import heap
budget = None if sys.argv[1] == "none" else sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
step = kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, x: m(x).square().mean(),
                    memory_budget=budget)
step(torch.randn(8, 16))

def rounds():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        block = torch.empty(64 * 2 ** 20 // 4)
        block.fill_(1.0)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

rounds()                                  # the first round may grow the heap
print(json.dumps({"faults": rounds(), "policy": step.heap, "line": heap.describe(),
                  "explained": "heap: " in kiln.explain(step, file=None)}))
"""


def _run(env: dict, budget: str = "none") -> dict:
    child = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "KILN_HEAP"}
    child.update(env, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT, budget], env=child, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    from kiln.runtime import heap
    return heap._glibc() is not None and "jemalloc" not in os.environ.get("LD_PRELOAD", "")


needs_glibc = pytest.mark.skipif(not _glibc(), reason="the heap policy sets glibc's malloc")


@needs_glibc
def test_keep_is_the_default_and_reuses_freed_memory():
    got = _run({})
    assert got["policy"] == "keep" and got["line"].startswith("heap: keep") and got["explained"]
    assert got["faults"] < PAGES // 8, got          # the pages stayed: almost nothing faults


@needs_glibc
def test_system_returns_freed_memory_to_the_os():
    got = _run({"KILN_HEAP": "system"})
    assert got["policy"] == "system" and got["line"].startswith("heap: system")
    assert got["faults"] > 2 * PAGES, got           # every round faulted its pages in again


@needs_glibc
def test_a_memory_budget_returns_freed_memory_unless_told_otherwise():
    assert _run({}, budget="1GiB")["faults"] > 2 * PAGES
    assert _run({"KILN_HEAP": "keep"}, budget="1GiB")["faults"] < PAGES // 8


@needs_glibc
def test_settings_from_the_environment_are_left_alone():
    got = _run({"MALLOC_MMAP_THRESHOLD_": "131072"})   # the user pinned glibc's threshold: their choice holds
    assert "left alone" in got["line"] and "environment" in got["line"]
    assert got["faults"] > 2 * PAGES, got


def test_a_bad_policy_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KILN_HEAP", "forever")
    model = torch.nn.Linear(4, 1)
    with pytest.raises(KilnError, match=r"KILN_HEAP must be one of keep, system, got 'forever'"):
        kiln.compile(model, optimizer=kiln.optim.SGD(lr=0.1), loss_fn=lambda m, x: m(x).sum())
