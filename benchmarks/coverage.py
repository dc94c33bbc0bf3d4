"""How much of transformers' model zoo Kiln trains exactly (issue 15).

    python benchmarks/coverage.py [--json F] [--markdown docs/model-coverage.md] [--jobs N] [--timeout S]
                                  [--only llama,gpt2] [--every K --offset J] [--resume F] [--dialects -inductor]
                                  [--amp bf16]

Every entry of transformers' auto mappings (causal LM, masked LM, seq2seq, sequence / image / audio
classification, CTC, speech seq2seq, image-text-to-text) is built from its shrunk default config and
trained with Kiln and with eager in its own process (a hang or a crash costs one entry); see
kiln/bench/coverage.py for the checks and outcomes. A progress line per entry goes to stderr; the JSON is
rewritten after every entry, so `--resume F` continues an interrupted sweep. Dialects: the shipped set
minus `inductor` (KILN_DIALECTS=-inductor) unless --dialects says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def worker(key: str, result_path: str, threads: int, amp: str | None = None) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(threads)
    from kiln.bench.coverage import result_dict, run_entry
    from kiln.bench.coverage_amp import run_entry_amp
    from kiln.bench.coverage_configs import entries
    entry = next(e for e in entries() if e.key == key)
    r = run_entry_amp(entry, amp=amp) if amp else run_entry(entry)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result_dict(r), f)
    os.replace(result_path + ".tmp", result_path)


def _env(args) -> dict:
    env = dict(os.environ)
    env.update(KILN_DIALECTS=args.dialects, KILN_TUNING="ahead", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return env


def _crash(entry, outcome: str, why: str, seconds: float, log_path: str) -> dict:
    try:
        with open(log_path, errors="replace") as f:
            tail = "\n".join(f.read().rstrip().splitlines()[-25:])
    except OSError:
        tail = ""
    return {"model_type": entry.model_type, "class": entry.class_name, "head": entry.head, "outcome": outcome,
            "why": why, "exception": "" if outcome == "timeout" else "Crash", "traceback": tail,
            "seconds": round(seconds, 2)}


def sweep(todo, args, done: dict, write) -> None:
    """Run `todo` entries, `args.jobs` processes at a time; `done[key] = result dict`; `write()` after each."""
    tmp = tempfile.mkdtemp(prefix="kiln-coverage-")
    env, running, queue, n = _env(args), {}, list(todo), len(done) + len(todo)
    while queue or running:
        while queue and len(running) < args.jobs:
            entry = queue.pop(0)
            base = os.path.join(tmp, entry.key.replace("/", "__"))
            with open(base + ".log", "w") as log:
                proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", entry.key, "--result",
                                         base + ".json", "--threads", str(args.threads)] +
                                        (["--amp", args.amp] if args.amp else []), cwd=ROOT, env=env,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            running[entry.key] = (entry, proc, time.monotonic(), base)
        time.sleep(0.2)
        for key, (entry, proc, t0, base) in list(running.items()):
            elapsed = time.monotonic() - t0
            if proc.poll() is None and elapsed < args.timeout:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)       # the worker's own process group
                proc.wait()
                res = _crash(entry, "timeout", f"no result within {args.timeout:.0f} s", elapsed, base + ".log")
            elif os.path.exists(base + ".json"):
                with open(base + ".json") as f:
                    res = json.load(f)
            else:
                code = proc.returncode
                why = f"worker died with signal {-code}" if code < 0 else f"worker exited with status {code}"
                res = _crash(entry, "error", why, elapsed, base + ".log")
            del running[key]
            done[key] = res
            write()
            note = res.get("why", "")
            err = res.get("grad_rel_err")
            print(f"[{len(done)}/{n}] {key}: {res['outcome']}" + (f" (grad err {err:.1e})" if err is not None else "") +
                  f", {res.get('seconds', 0):.1f} s" + (f": {note[:160]}" if note and res["outcome"] not in ("exact", "close") else ""),
                  file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write machine-readable results here (rewritten after every entry)")
    p.add_argument("--markdown", help="write the report here (default: docs/model-coverage.md for a sweep of "
                                      "everything, none with --only)")
    p.add_argument("--jobs", type=int, default=1, help="entries run at once (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per entry (default 1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per entry (default 120)")
    p.add_argument("--only", help="comma-separated model types (llama,gpt2) or model_type/Class keys")
    p.add_argument("--every", type=int, default=1, help="take every K-th entry (subsample)")
    p.add_argument("--offset", type=int, default=0, help="starting at entry J (with --every)")
    p.add_argument("--resume", help="results JSON of an earlier run: keep its entries, run the rest, write back")
    p.add_argument("--dialects", default="-inductor", help="KILN_DIALECTS for Kiln (default '-inductor': the "
                                                          "shipped set without Inductor regions)")
    p.add_argument("--amp", choices=["bf16", "fp16"], help="judge Kiln's mixed-precision step instead: its first "
                   "gradients against float64 eager, as close as torch.autocast's (kiln/bench/coverage_amp.py); "
                   "the full sweep's report goes to docs/model-coverage-<amp>.md")
    p.add_argument("--list", action="store_true", help="print the entries and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.result, args.threads, args.amp)
        return 0

    from kiln.bench.coverage import render_markdown, result_from_dict
    from kiln.bench.coverage_configs import entries
    todo = entries()
    if args.only:
        wanted = {x.strip() for x in args.only.split(",") if x.strip()}
        todo = [e for e in todo if e.model_type in wanted or e.key in wanted]
    todo = todo[args.offset::args.every]
    if args.list:
        for e in todo:
            print(e.key, e.head)
        return 0
    done: dict[str, dict] = {}
    json_path = args.json or args.resume
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            done = {f"{d['model_type']}/{d['class']}": d for d in json.load(f)["results"]}
    selected = {e.key for e in todo}
    done = {k: d for k, d in done.items() if k in selected}     # the report covers this selection only
    todo = [e for e in todo if e.key not in done]
    default_md = f"model-coverage-{args.amp}.md" if args.amp else "model-coverage.md"
    markdown = args.markdown or (os.path.join(ROOT, "docs", default_md) if not args.only and args.every == 1 else None)
    sample = f"every {args.every}th entry from offset {args.offset}" if args.every > 1 else "all entries"
    notes = (f"Sample: {sample}{' of ' + args.only if args.only else ''}; KILN_DIALECTS={args.dialects}; "
             f"{args.timeout:.0f} s per entry.")

    def write():
        if json_path:
            with open(json_path + ".tmp", "w") as f:
                json.dump({"dialects": args.dialects, "timeout": args.timeout, "sample": sample,
                           "results": list(done.values())}, f, indent=1)
            os.replace(json_path + ".tmp", json_path)

    print(f"coverage: {len(todo)} entries to run ({len(done)} already done), {args.jobs} at a time", file=sys.stderr)
    sweep(todo, args, done, write)
    write()
    if markdown:
        extra = {}
        if args.amp:
            from kiln.bench.coverage_amp import method
            extra = dict(title=f"Model coverage under amp={args.amp}", method=method(args.amp))
        text = render_markdown([result_from_dict(d) for d in done.values()],
                               command="python " + " ".join(["benchmarks/coverage.py"] + sys.argv[1:]), notes=notes,
                               **extra)
        with open(markdown, "w") as f:
            f.write(text)
        print(f"coverage: wrote {markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
