"""Start N rank processes of tests/parallel/worker.py (as torchrun would, without its agent: a rank that
dies stays dead, so the test sees what the others do by themselves), with a hard timeout."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, scenario: str, out: Path, timeout: float = 150.0, args: tuple = ()) -> list[dict]:
    """Run `scenario` on `world` ranks; return each rank's result (None for a rank that wrote none).
    Every rank is killed after `timeout` seconds, and the launch then fails: a hang never outlives it."""
    out.mkdir(parents=True, exist_ok=True)
    # kernels chosen by measurement (oneDNN linear, Inductor regions) are off: under load a measurement may
    # choose another kernel, whose summation order moves parameters by more than the 1e-5 compared here
    # (their own parity is tested in one process, tests/dialects, tests/models)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", KILN_DIALECTS="-inductor,-onednn",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for r in range(world):
        log = open(out / f"rank{r}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.parallel.worker", scenario, str(out), *args],
                                       cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    try:
        for p, _ in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p, _ in procs:
            p.kill()
        raise AssertionError(f"{scenario} on {world} ranks did not finish within {timeout:g} s:\n" + logs(out, world))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results


def logs(out: Path, world: int, tail: int = 3000) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-tail:] for r in range(world)
                     if (out / f"rank{r}.log").exists())
