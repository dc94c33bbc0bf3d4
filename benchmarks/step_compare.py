"""Training-step time of eager PyTorch and Kiln, fp32 and bf16, side by side in one process.

    .venv/bin/python benchmarks/step_compare.py [--model llama|gpt2|bert] [--modes eager,kiln,eager-bf16,kiln-bf16]
        [--layers 4 --hidden 512 --batch 8 --seq 256 --steps 12] [--settle 120] [--split 3]

Every mode trains its own copy of the same model on the same batch; steps are interleaved (the mode
order rotates every step) so machine noise hits all modes alike; the first --warmup steps of each
mode are excluded (page faults, allocator growth); medians and the inter-quartile range are reported.
eager-bf16 is torch.autocast(bfloat16); kiln-bf16 is kiln.compile(..., amp="bf16"); a -nofuse suffix
disables the `kiln` dialect (no subgraph fused into Kiln's kernels). Peak memory per
mode needs separate processes: use `kiln bench` for that.
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
from kiln.dialects import registry as kiln_dialects

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def build(args):
    torch.manual_seed(0)
    common = dict(vocab_size=args.vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if args.model == "llama":
        config = transformers.LlamaConfig(
            hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.seq, **common)
        cls = transformers.LlamaForCausalLM
    elif args.model == "gpt2":
        config = transformers.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                                         n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                         num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                                         max_position_embeddings=args.seq, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, **common)
        cls = transformers.BertForMaskedLM
    config._attn_implementation = "sdpa"
    return cls(config)


def make_mode(name, model, ids):
    """A zero-argument function running one training step of `model` in mode `name`."""
    if name.startswith("kiln"):
        # "-no<dialect>" leaves that dialect out ("-nofuse": `kiln`, so nothing is fused into Kiln's kernels)
        # "-nonative": Kiln's kernels run as ATen compositions (KILN_NATIVE=0 around each of this mode's steps)
        off = {"kiln" if part == "nofuse" else part[2:] for part in name.split("-")[1:] if part.startswith("no")}
        native = "native" not in off
        off.discard("native")
        dialects = [d for d in kiln_dialects.enabled() if d not in off] if off else None
        step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-4, weight_decay=0.01),
                            amp="bf16" if "-bf16" in name else None, dialects=dialects)

        def run():
            before = os.environ.get("KILN_NATIVE")
            os.environ["KILN_NATIVE"] = "1" if native else "0"
            try:
                return step(input_ids=ids, labels=ids)
            finally:
                if before is None:
                    del os.environ["KILN_NATIVE"]
                else:
                    os.environ["KILN_NATIVE"] = before
        run.step = step
        return run
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    low = name.endswith("bf16")
    forward = torch.compile(model) if name.startswith("compile") else model

    def eager_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()
    return eager_step


def _valid_mode(name: str) -> bool:
    base, *parts = name.split("-")
    if base not in ("eager", "compile", "kiln"):
        return False
    for part in parts:
        if part == "bf16" or (base == "kiln" and part in ("nofuse", "nonative")):
            continue
        if base != "kiln" or not part.startswith("no") or part[2:] not in kiln_dialects.enabled():
            return False
    return True


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt2", "bert"], default="llama")
    p.add_argument("--modes", default="eager,kiln", help="comma list of eager, compile (torch.compile), kiln, each with an optional -bf16; "
                   "kiln modes also take -no<dialect> (-noinductor, -nokiln; -nofuse = -nokiln) and -nonative (Kiln's "
                   "kernels as ATen compositions instead of their native single-pass loops)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds Kiln modes may run untimed after their first step for their online tuning to finish "
                        "(0: time them while they tune, as a short run would)")
    p.add_argument("--split", type=int, default=0, metavar="N",
                   help="after the timed steps, profile N more steps of each mode and print where their time goes "
                        "(matmul, attention, fused kernels, casts, optimizer, other: kiln/bench/split.py)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()

    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in names if not _valid_mode(m)]
    if not names or bad:
        p.error(f"--modes: {bad or 'nothing'} not understood; eager, compile or kiln, then -bf16, then for kiln "
                f"-no<dialect> with a dialect of {sorted(kiln_dialects.enabled())}")
    base = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    modes = {name: make_mode(name, copy.deepcopy(base), ids) for name in names}
    del base
    times = {m: [] for m in modes}
    first, losses, ahead = {}, {}, {}
    for i in range(args.warmup + args.steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for m in order:
            t0 = time.perf_counter()
            losses[m] = modes[m]().item()
            dt = time.perf_counter() - t0
            if i == 0:
                first[m] = dt
            elif i >= args.warmup:
                times[m].append(dt)
        print(f"step {i:>3}  " + "  ".join(f"{m} {losses[m]:.4f}" for m in names), flush=True)
        if i == 0 and args.settle > 0:          # Kiln's online tuning finishes before any step is timed
            deadline = time.perf_counter() + args.settle
            for m, fn in modes.items():
                if hasattr(fn, "step"):
                    fn.step.tune_now()          # the tuned steady state is timed: compile its kernels now
                while hasattr(fn, "step") and fn.step.pending_tuning() and time.perf_counter() < deadline:
                    fn()
                    ahead[m] = ahead.get(m, 0) + 1
            print(f"kiln tuning settled after {args.settle - (deadline - time.perf_counter()):.0f} s" +
                  "".join(f"; {m} trained {k} more steps meanwhile (its losses are that far ahead)"
                          for m, k in ahead.items()), flush=True)

    tokens = args.batch * args.seq
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "config": vars(args), "modes": {}}
    print(f"\n{args.model} {args.layers}L h{args.hidden} i{args.intermediate} v{args.vocab}, batch {args.batch} x "
          f"seq {args.seq}, {torch.get_num_threads()} threads, {args.steps} measured steps after {args.warmup} warm-up")
    print(f"{'mode':<18} {'first step s':>12} {'median ms':>10} {'IQR ms':>14} {'tokens/s':>9} {'final loss':>10}")
    for m in modes:
        q1, med, q3 = quartiles(times[m])
        result["modes"][m] = {"first_step_s": first[m], "median_step_s": med, "q1_s": q1, "q3_s": q3,
                              "tokens_per_s": tokens / med, "final_loss": losses[m], "steps_ahead": ahead.get(m, 0)}
        print(f"{m:<18} {first[m]:>12.2f} {med * 1e3:>10.1f} {q1 * 1e3:>6.1f}-{q3 * 1e3:<7.1f} {tokens / med:>9.0f} "
              f"{losses[m]:>10.4f}")
    for dtype in ("", "-bf16"):
        e, k = result["modes"].get("eager" + dtype), result["modes"].get("kiln" + dtype)
        if e and k:
            ratio = e["median_step_s"] / k["median_step_s"]
            result[f"speedup{dtype or '-fp32'}"] = ratio
            print(f"eager{dtype}/kiln{dtype} median step time: {ratio:.3f}x")
    if args.split > 0:
        from kiln.bench.split import profile_modes, render
        splits = profile_modes({m: (lambda m=m: modes[m]().item()) for m in modes}, rounds=args.split)
        result["split"] = splits
        print("\n" + render(splits))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
