"""Eager PyTorch fp32 vs Kiln fp32 on the core issue's Llama-style model, in one process.

    .venv/bin/python benchmarks/core_step.py [--layers 4 --hidden 512 --batch 8 --seq 256 --steps 12]

Both modes train copies of the same model on the same batches; steps are interleaved (the order
alternates every step) so machine noise hits both alike; the first --warmup steps of each mode are
excluded (page faults, allocator growth); medians and the inter-quartile range are reported.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
import warnings

import torch
import transformers

import kiln

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def build(args):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    eager_model = build(args)
    kiln_model = copy.deepcopy(eager_model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-4, weight_decay=0.01)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        loss = eager_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    step = kiln.compile(kiln_model, optimizer=kiln.optim.AdamW(lr=1e-4, weight_decay=0.01))
    modes = {"eager": eager_step, "kiln": lambda: step(input_ids=ids, labels=ids)}
    times = {m: [] for m in modes}
    first, losses = {}, {}
    for i in range(args.warmup + args.steps):
        order = list(modes) if i % 2 == 0 else list(modes)[::-1]
        for m in order:
            t0 = time.perf_counter()
            losses[m] = modes[m]().item()
            dt = time.perf_counter() - t0
            if i == 0:
                first[m] = dt
            elif i >= args.warmup:
                times[m].append(dt)
        print(f"step {i:>3}  " + "  ".join(f"{m} {losses[m]:.4f}" for m in modes), flush=True)

    tokens = args.batch * args.seq
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "config": vars(args), "modes": {}}
    print(f"\nLlama-style {args.layers}L h{args.hidden} i{args.intermediate} v{args.vocab}, batch {args.batch} x "
          f"seq {args.seq}, {torch.get_num_threads()} threads, {args.steps} measured steps after {args.warmup} warm-up")
    print(f"{'mode':<6} {'first step s':>12} {'median ms':>10} {'IQR ms':>14} {'tokens/s':>9} {'final loss':>10}")
    for m in modes:
        q1, med, q3 = quartiles(times[m])
        result["modes"][m] = {"first_step_s": first[m], "median_step_s": med, "q1_s": q1, "q3_s": q3,
                              "tokens_per_s": tokens / med, "final_loss": losses[m]}
        print(f"{m:<6} {first[m]:>12.2f} {med * 1e3:>10.1f} {q1 * 1e3:>6.1f}-{q3 * 1e3:<7.1f} {tokens / med:>9.0f} "
              f"{losses[m]:>10.4f}")
    ratio = result["modes"]["eager"]["median_step_s"] / result["modes"]["kiln"]["median_step_s"]
    result["eager_over_kiln"] = ratio
    print(f"eager/kiln median step time: {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
