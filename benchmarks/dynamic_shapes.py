"""Training on batches of random sequence lengths: eager, torch.compile and Kiln, compiles included.

    .venv/bin/python benchmarks/dynamic_shapes.py [--model gpt2|llama] [--batches 200] [--min-len 32]
        [--max-len 512] [--batch 8] [--last-batch 5] [--modes eager,compile,kiln] [--json out.json]
    .venv/bin/python benchmarks/dynamic_shapes.py --static-check 64,256,512 [--model ...]

What a data loader with per-batch padding feeds a training loop: every batch has its own length (drawn from
a seeded generator, uniform in [min-len, max-len]), and the last batch is smaller. Each mode runs in its own
process on the same seeded model (the 4-layer bench model of kiln/bench/zoo.py, position embeddings for
max-len) and the same batches, with default settings: `torch.compile(model)` (it recompiles on the second
shape, then goes dynamic), `kiln.compile(model, optimizer=...)` (a static program, then one dynamic program).
Each mode starts with empty caches (Kiln's measurements and Inductor's code: a first run on this machine)
unless --cache warm. The modes take turns batch by batch (the order rotating every batch; each process waits
for its turn, and a Kiln background compiler is paused outside Kiln's turns), so the machine's drift over the
run (on a shared machine, runs of one mode alone varied by 8 %) falls on every mode alike; --sequential runs
them one after another. Reported per mode: the time of the whole run's steps (compiles included), programs
(graphs) compiled, the first step, the median step, and each step's loss against eager's (max relative
difference).

--static-check: in one process, Kiln's dynamic program against a static Kiln program and eager PyTorch at
each given length, steps interleaved on the same batch after both Kiln programs finished tuning, medians of
--repeats (is the step of a
program that serves every length as fast as one compiled for that length?).
"""
from __future__ import annotations

import argparse
import atexit
import copy
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from kiln.bench.memory import Usage
from kiln.runtime import heap

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
LR = 3e-4


def build(name: str, max_len: int) -> torch.nn.Module:
    from kiln.bench import zoo
    return zoo.get(name, "default", seq=max_len).build_model()


def batches(args) -> list[tuple[int, int]]:
    """(batch size, length) per step: seeded random lengths, the last batch smaller."""
    gen = torch.Generator().manual_seed(1234)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batches,), generator=gen).tolist()
    sizes = [(args.batch, t) for t in lengths]
    if args.last_batch:
        sizes[-1] = (args.last_batch, sizes[-1][1])
    return sizes


def make_batch(i: int, b: int, t: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(i))
    return dict(input_ids=ids, labels=ids)


def worker(args) -> dict:
    """One mode's whole run, in this process."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.model, args.max_len)
    vocab = model.config.vocab_size
    sizes = batches(args)
    mode = args.worker
    if mode == "kiln":
        import kiln
        step_fn = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=LR, weight_decay=0.01))

        def run(batch):
            return step_fn(**batch).item()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        fwd = torch.compile(model) if mode == "compile" else model

        def run(batch):
            opt.zero_grad(set_to_none=True)
            loss = fwd(**batch).loss
            loss.backward()
            opt.step()
            return loss.item()
    turn = _Turns(args.turn_fd, step_fn if mode == "kiln" else None) if args.turn_fd is not None else None
    usage = Usage()
    losses, times = [], []
    start = time.perf_counter()
    for i, (b, t) in enumerate(sizes):
        batch = make_batch(i, b, t, vocab)
        if turn is not None:
            turn.wait()
        t0 = time.perf_counter()
        losses.append(run(batch))
        times.append(time.perf_counter() - t0)
        if turn is not None:
            turn.done(times[-1])
        if args.progress and (i + 1) % 20 == 0:
            print(f"  {mode}: {i + 1}/{len(sizes)} batches, {sum(times):.0f}s", file=sys.stderr)
    # interleaved: the process's own steps (the others ran between them); alone: the whole loop
    total = sum(times) if turn is not None else time.perf_counter() - start
    resources = usage.stop()
    out = dict(mode=mode, total_s=total, first_step_s=times[0], median_step_s=statistics.median(times),
               step_s=times, losses=losses, lengths=[t for _, t in sizes], heap=heap.describe(), **resources)
    if mode == "kiln":
        info = step_fn.cache_info()
        out["programs"] = info.compiles
        out["compile_s"] = info.compile_seconds
        out["cache_info"] = str(info)
        step_fn.close()
    elif mode == "compile":
        from torch._dynamo.utils import counters
        out["programs"] = int(counters["stats"]["unique_graphs"])
    return out


class _Turns:
    """A mode's side of the interleaved run: wait for the parent's go (a line on stdin) before each step,
    answer on `fd` after it. A Kiln step's background compiler (if one runs) is stopped while the other
    modes take their turns and continued for Kiln's own, so it loads the cores only while Kiln's steps
    run, as it would in a process training alone."""

    def __init__(self, fd: int, step=None):
        self.answer, self.step = os.fdopen(fd, "w", buffering=1), step
        atexit.register(self._signal, signal.SIGCONT)     # never leave a compiler stopped behind

    def _signal(self, sig) -> None:
        for w in (self.step.tuner.workers if self.step is not None else ()):
            if w.proc is not None and w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, sig)
                except OSError:
                    pass

    def wait(self) -> None:
        if not sys.stdin.readline():
            sys.exit(1)                               # the parent is gone
        self._signal(signal.SIGCONT)

    def done(self, seconds: float) -> None:
        self._signal(signal.SIGSTOP)
        self.answer.write(f"{seconds}\n")


def interleaved(modes: list[str], args, envs: dict) -> dict:
    """Every mode in its own process, taking turns batch by batch (the order rotating each batch), so that
    the machine's drift over the run falls on all modes alike; returns each mode's results."""
    procs, answers, outs = {}, {}, {}
    for mode in modes:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            outs[mode] = f.name
        read, write = os.pipe()
        cmd = [sys.executable, __file__, "--worker", mode, "--out", outs[mode], "--turn-fd", str(write)] + [
            a for a in sys.argv[1:] if not a.startswith("--json") and a != args.json]
        procs[mode] = subprocess.Popen(cmd, env=envs[mode], stdin=subprocess.PIPE, text=True, pass_fds=(write,))
        os.close(write)
        answers[mode] = os.fdopen(read)
    alive = list(modes)
    for i in range(args.batches):
        for mode in (alive[i % len(alive):] + alive[:i % len(alive)]):
            try:
                procs[mode].stdin.write("go\n")
                procs[mode].stdin.flush()
                ok = bool(answers[mode].readline())
            except (BrokenPipeError, OSError):
                ok = False
            if not ok:
                print(f"{mode} failed at batch {i} (exit {procs[mode].wait()})", file=sys.stderr)
                alive.remove(mode)
        if args.progress and (i + 1) % 20 == 0:
            print(f"  {i + 1}/{args.batches} batches", file=sys.stderr)
    results = {}
    for mode in modes:
        if mode in alive and procs[mode].wait() == 0:
            with open(outs[mode]) as f:
                results[mode] = json.load(f)
        os.unlink(outs[mode])
    return results


def static_check(args) -> list[dict]:
    """Kiln's dynamic program vs a static one at each length, interleaved, after tuning settled."""
    import kiln
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = build(args.model, args.max_len)
    vocab = base.config.vocab_size
    dyn_model = copy.deepcopy(base)
    dyn = kiln.compile(dyn_model, optimizer=kiln.optim.AdamW(lr=0.0))
    for i, t in enumerate((args.min_len + 1, args.max_len - 1)):    # a static program, then the dynamic one
        dyn(**make_batch(i, args.batch, t, vocab))
    rows = []
    for length in args.static_check:
        batch = make_batch(0, args.batch, length, vocab)
        static = kiln.compile(copy.deepcopy(base), optimizer=kiln.optim.AdamW(lr=0.0), dynamic=False)
        eager_model = copy.deepcopy(base)
        opt = torch.optim.AdamW(eager_model.parameters(), lr=0.0)

        def eager():
            opt.zero_grad(set_to_none=True)
            eager_model(**batch).loss.backward()
            opt.step()
        steps = {"dynamic": lambda: dyn(**batch), "static": lambda: static(**batch), "eager": eager}
        deadline = time.perf_counter() + args.settle
        dyn.tune_now()                              # the tuned programs are compared: compile their kernels now
        static.tune_now()
        while time.perf_counter() < deadline:       # both tune online on this length: run until settled
            for fn in (steps["dynamic"], steps["static"]):
                fn()
            if not dyn.pending_tuning() and not static.pending_tuning():
                break
        assert dyn.last.dynamic and not static.last.dynamic
        times = {k: [] for k in steps}
        for r in range(args.repeats + 1):
            for k in (list(steps) if r % 2 else list(steps)[::-1]):       # interleaved, order alternating
                t0 = time.perf_counter()
                steps[k]()
                if r:
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(length=length, dynamic_s=med["dynamic"], static_s=med["static"],
                         eager_s=med["eager"], ratio=med["dynamic"] / med["static"],
                         vs_eager=med["eager"] / med["dynamic"], still_tuning=dyn.pending_tuning() + static.pending_tuning()))
        print(f"  length {length}: dynamic {med['dynamic']:.3f}s, static {med['static']:.3f}s, "
              f"dynamic/static {med['dynamic'] / med['static']:.3f}; eager {med['eager']:.3f}s "
              f"({med['eager'] / med['dynamic']:.2f}x the dynamic program's time)", file=sys.stderr)
        static.close()
    dyn.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--last-batch", type=int, default=5, help="size of the last batch (0: as the others)")
    p.add_argument("--modes", default="eager,compile,kiln")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--static-check", type=lambda s: [int(x) for x in s.split(",")],
                   help="lengths at which to compare Kiln's dynamic and static programs instead")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--settle", type=float, default=300.0, help="seconds to wait for tuning (--static-check)")
    p.add_argument("--progress", action="store_true", help="print progress every 20 batches")
    p.add_argument("--threads", type=int, default=0, help="torch threads per mode (default: torch's)")
    p.add_argument("--cache", default="cold", choices=["cold", "warm"],
                   help="cold (default): each mode starts with empty Kiln and Inductor caches (a first run on "
                        "this machine); warm: the user's caches as they are (a later run)")
    p.add_argument("--baseline-heap", default="system", choices=["system", "keep"],
                   help="glibc's heap in the eager and torch.compile processes: system (default, as they run "
                        "unless told) or keep (what Kiln's default $KILN_HEAP=keep sets: freed memory stays in "
                        "the process; a like-for-like run, see docs/memory.md)")
    p.add_argument("--sequential", action="store_true",
                   help="run the modes one after another instead of taking turns batch by batch (each mode then "
                        "meets the machine's load of its own time: ratios drift with it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--turn-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.min_len < 2 or args.max_len < args.min_len:
        p.error("need 2 <= --min-len <= --max-len")
    if args.worker:
        result = worker(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    env = dict(machine=platform.processor() or platform.machine(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
               threads=args.threads or torch.get_num_threads(), torch=torch.__version__, command=" ".join(sys.argv),
               cache=args.cache, baseline_heap=args.baseline_heap, load_start=os.getloadavg()[0])
    if args.static_check:
        rows = static_check(args)
        report = dict(env, static_check=rows)
    else:
        results = {}
        modes = args.modes.split(",")
        with tempfile.TemporaryDirectory(prefix="kiln-dyn-cache-") as scratch:
            envs = {}
            for mode in modes:
                child = envs[mode] = dict(os.environ)
                if args.cache == "cold":            # each mode its own empty caches
                    child.update(KILN_CACHE_DIR=os.path.join(scratch, mode, "kiln"),
                                 TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, mode, "inductor"))
                if mode != "kiln" and args.baseline_heap == "keep":
                    child.update(heap.KEEP_ENV)
            if not args.sequential:
                print(f"{', '.join(modes)}: {args.batches} batches of lengths {args.min_len}..{args.max_len}, "
                      "taking turns...", file=sys.stderr)
                results = interleaved(modes, args, envs)
            for mode in modes if args.sequential else ():
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    out = f.name
                cmd = [sys.executable, __file__, "--worker", mode, "--out", out] + [
                    a for a in sys.argv[1:] if not a.startswith("--json") and a != args.json]
                print(f"{mode}: {args.batches} batches of lengths {args.min_len}..{args.max_len}...", file=sys.stderr)
                proc = subprocess.run(cmd, env=envs[mode])
                if proc.returncode:
                    print(f"{mode} failed (exit {proc.returncode})", file=sys.stderr)
                    continue
                with open(out) as f:
                    results[mode] = json.load(f)
                os.unlink(out)
        eager = results.get("eager")
        print(f"\n{'mode':8} {'total':>9} {'programs':>8} {'1st step':>9} {'median':>8} {'vs eager loss':>14} "
              f"{'sys CPU':>8} {'peak RSS':>9}")
        for mode, r in results.items():
            diff = "-"
            if eager and mode != "eager":
                diff = f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], eager['losses'])):.1e}"
            print(f"{mode:8} {r['total_s']:8.1f}s {r.get('programs', '-')!s:>8} {r['first_step_s']:8.2f}s "
                  f"{r['median_step_s']:7.3f}s {diff:>14} {r['sys_s']:7.1f}s {r['max_rss_mib'] or 0:6.0f}MiB")
        if "kiln" in results:
            for other in ("compile", "eager"):
                if other in results:
                    print(f"kiln total time vs {other}: {results[other]['total_s'] / results['kiln']['total_s']:.2f}x faster")
        report = dict(env, results=results)
    report["load_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
