"""Hugging Face Trainer, whole run: eager, `torch_compile=True` and Kiln's Trainer side by side.

    .venv/bin/python benchmarks/trainer_compare.py [--model gpt2|llama] [--steps 200] [--accumulate 2]
        [--batch 8] [--min-len 32] [--max-len 128] [--modes eager,compile,kiln] [--cache cold|warm] [--json out.json]

What a user of `transformers.Trainer` runs: the 4-layer bench model (kiln/bench/zoo.py, random weights), a
dataset of token sequences of random lengths padded per batch by `DataCollatorForLanguageModeling(mlm=False)`
(dynamic padding: every batch has its own length), and the same TrainingArguments for every mode: AdamW with
the Trainer's no-decay groups, linear warm-up and decay, gradient accumulation, clipping at 1.0, logging every
10 steps. The modes:
- eager: `transformers.Trainer`;
- compile: `transformers.Trainer` with `TrainingArguments(torch_compile=True)` (torch.compile's defaults: it
  recompiles on the second length, then goes dynamic);
- kiln: `kiln.integrations.transformers.Trainer`.
Each mode runs in its own process, one after the other, from empty Kiln and Inductor caches (a first run on
this machine; `--cache warm` keeps the user's). Reported per mode: `trainer.train()`'s wall time (compiles
included), and the logged losses and gradient norms against eager's (max relative difference).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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


def dataset(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, vocab, (length,), generator=g).tolist()})
    return out


def padding_collator(vocab: int):
    """DataCollatorForLanguageModeling(mlm=False) with an in-memory word-level tokenizer (token 0 pads)."""
    import transformers
    from tokenizers import Tokenizer, models
    words = {"<pad>": 0, **{f"t{i}": i for i in range(1, vocab)}}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t1")),
                                               pad_token="<pad>")
    return transformers.DataCollatorForLanguageModeling(tok, mlm=False)


def worker(args) -> dict:
    import transformers
    from kiln.bench import zoo
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = zoo.get(args.model, "default", seq=args.max_len).build_model()
    vocab = model.config.vocab_size
    train = dataset(args.steps * args.batch * args.accumulate, vocab, args.min_len, args.max_len)
    mode = args.worker
    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="kiln-trainer-bench-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulate, learning_rate=3e-4,
        warmup_steps=max(1, args.steps // 10), lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=10, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
        dataloader_pin_memory=False, torch_compile=mode == "compile")
    if mode == "kiln":
        from kiln.integrations.transformers import Trainer as cls
    else:
        cls = transformers.Trainer
    trainer = cls(model=model, args=targs, train_dataset=train, data_collator=padding_collator(vocab))
    usage = Usage()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    resources = usage.stop()
    hist = trainer.state.log_history
    out = dict(mode=mode, total_s=seconds, losses={h["step"]: h["loss"] for h in hist if "loss" in h},
               grad_norms={h["step"]: h["grad_norm"] for h in hist if "grad_norm" in h}, heap=heap.describe(),
               **resources)
    if mode == "kiln":
        info = trainer.kiln_step.cache_info()
        out.update(programs=info.compiles, compile_s=info.compile_seconds)
        trainer.kiln_step.close()
    elif mode == "compile":
        from torch._dynamo.utils import counters
        out["programs"] = int(counters["stats"]["unique_graphs"])
    return out


def _rel(got: dict, ref: dict) -> float | None:
    common = [k for k in ref if k in got]
    if not common:
        return None
    return max(abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in common)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--batch", type=int, default=8, help="per-device (micro-)batch size")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--modes", default="eager,compile,kiln")
    p.add_argument("--cache", default="cold", choices=["cold", "warm"],
                   help="cold (default): each mode starts with empty Kiln and Inductor caches; warm: the user's")
    p.add_argument("--threads", type=int, default=0, help="torch threads per mode (default: torch's)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--baseline-heap", default="system", choices=["system", "keep"],
                   help="glibc's heap in the eager and torch.compile processes: system (default, as they run "
                        "unless told) or keep (what Kiln's default $KILN_HEAP=keep sets: freed memory stays in "
                        "the process; a like-for-like run, see docs/memory.md)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 1 or args.accumulate < 1 or args.batch < 1 or not 2 <= args.min_len <= args.max_len:
        p.error("need --steps, --accumulate, --batch >= 1 and 2 <= --min-len <= --max-len")
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - {"eager", "compile", "kiln"})
    if unknown:
        p.error(f"unknown mode(s) {unknown}: choose among eager, compile, kiln")
    if args.worker:
        with open(args.out, "w") as f:
            json.dump(worker(args), f)
        return 0
    env = dict(machine=platform.processor() or platform.machine(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
               threads=args.threads or torch.get_num_threads(), torch=torch.__version__, command=" ".join(sys.argv),
               cache=args.cache, baseline_heap=args.baseline_heap, load_start=os.getloadavg()[0])
    results = {}
    for mode in modes:
        print(f"{mode}: {args.steps} steps x {args.accumulate} micro-batches of {args.batch} x "
              f"{args.min_len}..{args.max_len} tokens...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="kiln-trainer-cache-") as scratch:
            out = os.path.join(scratch, "result.json")
            child = dict(os.environ)
            if args.cache == "cold":
                child.update(KILN_CACHE_DIR=os.path.join(scratch, "kiln"),
                             TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))
            if mode != "kiln" and args.baseline_heap == "keep":
                child.update(heap.KEEP_ENV)
            cmd = [sys.executable, __file__, "--worker", mode, "--out", out] + [
                a for a in sys.argv[1:] if not a.startswith("--json") and a != args.json]
            proc = subprocess.run(cmd, env=child)
            if proc.returncode:
                print(f"{mode} failed (exit {proc.returncode})", file=sys.stderr)
                continue
            with open(out) as f:
                r = json.load(f)
        # json turns the step keys into strings
        r["losses"] = {int(k): v for k, v in r["losses"].items()}
        r["grad_norms"] = {int(k): v for k, v in r["grad_norms"].items()}
        results[mode] = r
    eager = results.get("eager")
    print(f"\n{'mode':8} {'train()':>9} {'programs':>8} {'loss vs eager':>14} {'grad_norm vs eager':>19} "
          f"{'sys CPU':>8} {'peak RSS':>9}")
    for mode, r in results.items():
        loss = norm = "-"
        if eager and mode != "eager":
            rl, rn = _rel(r["losses"], eager["losses"]), _rel(r["grad_norms"], eager["grad_norms"])
            loss = "-" if rl is None else f"{rl:.1e}"
            norm = "-" if rn is None else f"{rn:.1e}"
            r.update(loss_rel=rl, grad_norm_rel=rn)
        print(f"{mode:8} {r['total_s']:8.1f}s {r.get('programs', '-')!s:>8} {loss:>14} {norm:>19} "
              f"{r['sys_s']:7.1f}s {r['max_rss_mib'] or 0:6.0f}MiB")
    if "kiln" in results:
        for other in ("compile", "eager"):
            if other in results:
                ratio = results[other]["total_s"] / results["kiln"]["total_s"]
                print(f"kiln's whole run vs {other}: {ratio:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env, results=results, load_end=os.getloadavg()[0]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
