"""`kiln bench`: the command line of the benchmark harness.

``register(subparsers)`` is called by ``kiln/cli.py``; it adds

* ``kiln bench [options]``: run the modes, print the table, optionally write
  ``--json`` and ``--plot``;
* ``kiln bench report JSON [--out FILE] [--image FILE]``: render a JSON report
  as Markdown (how docs/benchmarks.md is made).

Every handler returns an exit code: 0 when all modes ran or were reported as
not available, 1 when a mode failed, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time

from kiln.bench import modes, report, zoo

DEFAULT_MODES = "eager,eager-bf16,kiln"

DESCRIPTION = """\
Train the same model for a few steps in several modes (eager PyTorch, autocast
bf16, torch.compile, Kiln), each in a fresh process with the same seed and data,
and compare them side by side: time to first step (compilation included), step
time (median, min-max), throughput, achieved model FLOP/s and its fraction of
this machine's measured peak matmul rate, peak memory, and the loss.

examples:
  kiln bench                                   # llama, modes eager,eager-bf16,kiln
  kiln bench --model gpt2 --modes eager,compile,kiln --steps 10 --json out.json --plot out.png
  kiln bench --model llama-32k --batch 4       # a real vocabulary: logits memory shows
  kiln bench report out.json --out docs/benchmarks.md   # Markdown + chart from a JSON report

models: {models}
modes:  {modes}
For vit and resnet, --seq is the image side in pixels and --vocab the number of classes.
On CPUs without bf16 matmul instructions (AVX512-BF16, AMX) the bf16 modes run
many times slower than fp32; --budget keeps such a mode to a step or two.
"""


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="benchmark eager / torch.compile / Kiln training side by side",
        description=DESCRIPTION.format(models=", ".join(zoo.MODELS), modes=", ".join(modes.MODES)),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="{report}")
    rep = sub.add_parser("report", help="render a --json report as Markdown plus a chart",
                         description=report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_arguments(rep)
    # One handler for both: argparse's precedence between parent and sub-parser
    # defaults has changed across Python versions.
    parser.set_defaults(func=handle)
    return parser


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama", help=f"zoo model (default llama): {', '.join(zoo.MODELS)}")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated modes (default {DEFAULT_MODES})")
    p.add_argument("--baseline", help="mode the ratios are against (default eager, else the first mode)")
    p.add_argument("--size", default="default", choices=list(zoo.SIZES),
                   help="size preset; flags below override it (default: default)")
    for name, text in (("layers", "transformer layers (resnet: residual blocks)"), ("hidden", "hidden size"),
                       ("heads", "attention heads"), ("intermediate", "MLP width"),
                       ("seq", "sequence length (vit/resnet: image side)"), ("batch", "batch size"),
                       ("vocab", "vocabulary size (vit/resnet: classes)")):
        p.add_argument(f"--{name}", type=int, help=text)
    p.add_argument("--steps", type=int, default=5, help="measured steps per mode (default 5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="unmeasured warm-up steps, the first (compiling) step included (default 3)")
    p.add_argument("--budget", type=float, default=120.0,
                   help="seconds per mode for the measured steps (warm-up: half): stop before a step "
                        "that would overrun it, after at least one; 0 = no budget (default 120)")
    p.add_argument("--memory-budget", metavar="B",
                   help="Kiln modes: kiln.compile(memory_budget=B), bytes (e.g. 900MiB) or a fraction of the "
                        "unconstrained peak (e.g. 0.6); compile modes: torch._functorch.config."
                        "activation_memory_budget=B (a fraction only)")
    p.add_argument("--settle", type=float, default=180.0,
                   help="Kiln modes tuning online (the default on CPU): after the warm-up, run unmeasured steps "
                        "until the kernels compiled and measured during training are chosen, for at most this "
                        "many seconds, so the measured steps are the steady state; the table's 'Tuned' column "
                        "says when that was. 0 = measure at once (default 180)")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill a mode after this many seconds "
                   "and report it as failed (default 1800)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    p.add_argument("--json", metavar="FILE", help="write every figure and the machine description here")
    p.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of step time and peak memory here")
    p.add_argument("--cold-cache", action="store_true",
                   help="give every mode empty compile caches (Inductor's and Kiln's), so time to first step "
                        "includes all compilation; default: the caches this machine already has")
    p.add_argument("--no-peak", action="store_true", help="skip measuring the peak matmul rate")
    p.add_argument("--baseline-heap", default="system", choices=["system", "keep"],
                   help="glibc's heap in the modes that are not Kiln's: system (default: as they run unless told) "
                        "or keep (the setting Kiln's default KILN_HEAP=keep makes: freed memory stays in the "
                        "process for the next step; a like-for-like run, see docs/memory.md)")


def handle(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "report":
        missing = missing_extras(plot=bool(args.image or args.out))
        return _fail(missing) if missing else report.run(args)
    return run(args)


def _installed(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def missing_extras(model: str | None = None, plot: bool = False) -> str | None:
    """What optional dependency this run needs and lacks, said up front with the extra that installs it
    (None when all are there): transformers for the transformers-built models, matplotlib for a chart."""
    need = []
    if model is not None and model not in zoo.PLAIN_TORCH and not _installed("transformers"):
        need.append(f"transformers (model {model!r} is built by it; `--model resnet` needs only torch)")
    if plot and not _installed("matplotlib"):
        need.append("matplotlib (for the chart: --plot, or report --out/--image)")
    if not need:
        return None
    return (f"missing optional dependenc{'ies' if len(need) > 1 else 'y'}: {'; '.join(need)}. "
            "Install the bench extra: pip install 'kiln[bench]'")


def _fail(message: str) -> int:
    print(f"kiln bench: error: {message}", file=sys.stderr)
    return 2


def build_config(args: argparse.Namespace) -> dict:
    """Validate the arguments into the runner's config; raises ValueError with a user message."""
    names = modes.parse_modes(args.modes)
    overrides = {k: getattr(args, k) for k in zoo.OVERRIDABLE if getattr(args, k) is not None}
    resolved = zoo.resolve(args.model, args.size, **overrides)
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 1:
        raise ValueError(f"--warmup must be at least 1 (the first step always warms up), got {args.warmup}")
    if args.budget < 0 or args.settle < 0 or args.timeout <= 0:
        raise ValueError("--budget and --settle must be >= 0 and --timeout > 0")
    missing = missing_extras(args.model, plot=bool(args.plot))
    if missing:
        raise ValueError(missing)
    baseline = args.baseline or ("eager" if "eager" in names else names[0])
    if baseline not in names:
        raise ValueError(f"--baseline {baseline} is not one of --modes ({', '.join(names)})")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ValueError(f"{flag} {path}: directory {folder} does not exist")
    memory_budget = getattr(args, "memory_budget", None)
    if memory_budget is not None:
        from kiln.runtime.memory import parse_budget
        memory_budget = parse_budget(float(memory_budget) if re.fullmatch(r"0?\.\d+|1(\.0*)?", memory_budget)
                                     else memory_budget)
    config = {"model": args.model, "size": args.size, "overrides": overrides, "resolved": resolved,
              "seed": args.seed, "steps": args.steps, "warmup": args.warmup, "budget_s": args.budget,
              "settle_s": args.settle, "modes": names, "baseline": baseline,
              "cold_cache": bool(getattr(args, "cold_cache", False)), "memory_budget": memory_budget,
              "baseline_heap": getattr(args, "baseline_heap", "system")}
    parts = ["kiln bench", "--model", args.model, "--modes", ",".join(names), "--size", args.size]
    parts += [x for k, v in overrides.items() for x in (f"--{k}", str(v))]
    parts += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--budget", f"{args.budget:g}",
              "--settle", f"{args.settle:g}"]
    parts += ["--seed", str(args.seed)] if args.seed else []
    parts += ["--cold-cache"] if config["cold_cache"] else []
    parts += ["--baseline-heap", "keep"] if config["baseline_heap"] == "keep" else []
    parts += ["--memory-budget", args.memory_budget] if memory_budget is not None else []
    parts += ["--baseline", args.baseline] if args.baseline else []
    parts += [x for flag, v in (("--json", args.json), ("--plot", args.plot)) if v for x in (flag, v)]
    config["command"] = " ".join(shlex.quote(p) if i else p for i, p in enumerate(parts))
    return config


class _Display:
    """Progress on stderr: which mode runs, its phase, and elapsed time.

    On a terminal that is a live rich progress display; in a log file (no
    terminal) one plain line when each mode starts and ends, because a live
    display only reaches a file when it stops.
    """

    def __init__(self, progress, console, total: int):
        self.progress, self.console, self.total = progress, console, total
        self.live = console.is_terminal
        self.index, self.task, self.started = 0, None, 0.0

    def start(self, label: str) -> None:
        self.index += 1
        self.label = f"[{self.index}/{self.total}] {label}"
        self.started = time.monotonic()
        if self.live:
            self.task = self.progress.add_task(self.label, total=None)
        else:
            self.console.print(f"{self.label}: started", markup=False, highlight=False)

    def tick(self, phase: str, elapsed: float) -> None:
        if self.live:
            self.progress.update(self.task, description=f"{self.label}: {phase}")

    def done(self, result: dict) -> None:
        status = {"ok": "done", "unavailable": "not available"}.get(result["status"], "failed")
        if self.live:
            color = {"done": "green", "not available": "yellow"}.get(status, "red")
            self.progress.update(self.task, description=f"{self.label}: [{color}]{status}", total=1, completed=1)
            self.progress.stop_task(self.task)
        else:
            self.console.print(f"{self.label}: {status} after {time.monotonic() - self.started:.0f} s",
                               markup=False, highlight=False)


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
    except ValueError as exc:
        return _fail(str(exc))
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kiln.bench import render, runner

    err = Console(stderr=True)
    total = len(config["modes"]) + (0 if args.no_peak else 1)
    with Progress(SpinnerColumn(finished_text="-"), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, disable=not err.is_terminal) as progress:
        display = _Display(progress, err, total)
        result = runner.run(config, args.timeout, on_start=display.start, tick=display.tick,
                            on_done=display.done, measure_peak=not args.no_peak)

    # Piped output has no width; do not squeeze the table into 80 columns then.
    out = Console() if sys.stdout.isatty() else Console(width=160)
    out.print(render.rich_table(result))
    for note in render.notes(result):
        out.print(f"  {note}", markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        out.print(f"wrote {args.json}", markup=False, highlight=False)
    if args.plot:
        from kiln.bench import plot

        plot.save(result, args.plot)
        out.print(f"wrote {args.plot}", markup=False, highlight=False)
    return 1 if any(r["status"] == "failed" for r in result["results"]) else 0
