"""`kiln demo`: train a small Llama-style model with Kiln next to eager PyTorch, from the same
initial weights on the same batches, and print both losses and step times."""
from __future__ import annotations

import copy
import os
import re
import statistics
import time
import warnings


def _model_args(p) -> None:
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")


def register(sub) -> None:
    p = sub.add_parser("demo", help="train a tiny Llama-style model with Kiln next to eager PyTorch",
                       description=__doc__)
    p.add_argument("--steps", type=int, default=8, help="training steps per mode (default 8)")
    _model_args(p)
    p.set_defaults(func=run)
    e = sub.add_parser("explain", help="compile the demo model and print Kiln's op table (or the generated step)",
                       description="Compile the demo's Llama-style model for one step and print kiln.explain's "
                                   "table: every op, its phase, dialect, compute dtype and output.")
    _model_args(e)
    e.add_argument("--amp", choices=["bf16", "fp16"], help="mixed precision (default fp32)")
    e.add_argument("--dialects", help="comma list of dialects in preference order (default: all)")
    e.add_argument("--source", action="store_true", help="print the generated Python step instead")
    e.add_argument("--profile", action="store_true", help="also time every op (the batch replayed on copies of "
                   "the weights) and print the split between matmul, attention, fused ops, casts and optimizer")
    e.add_argument("--vs", choices=["compile", "eager"], help="with --profile: also profile the same model trained "
                   "by torch.compile (or eager PyTorch) with torch.optim.AdamW, under autocast for --amp, and print "
                   "where each step's time goes, category by category, beside Kiln's (kiln/bench/split.py)")
    e.add_argument("--memory", action="store_true", help="print the step's memory instead: the predicted peak, "
                   "where it is, what is live there, what a budget made Kiln recompute, checked against the "
                   "allocator on a replay")
    e.add_argument("--memory-budget", help="compile under this budget (bytes, e.g. 200MiB, or a fraction of "
                   "the unconstrained peak, e.g. 0.6)")
    e.set_defaults(func=run_explain)


def _positive(args, *names) -> None:
    for n in names:
        if getattr(args, n) <= 0:
            raise SystemExit(f"kiln demo: --{n} must be positive, got {getattr(args, n)}")


def _build(args, command: str):
    _positive(args, *(["steps"] if command == "demo" else []), "layers", "hidden", "heads", "vocab", "batch", "seq")
    if args.hidden % args.heads:
        raise SystemExit(f"kiln {command}: --hidden ({args.hidden}) must be divisible by --heads ({args.heads})")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def run_explain(args) -> int:
    import torch

    import kiln
    model = _build(args, "explain")
    dialects = [d.strip() for d in args.dialects.split(",")] if args.dialects else None
    budget = args.memory_budget
    if budget is not None and re.fullmatch(r"0?\.\d+|1\.0*", budget):
        budget = float(budget)
    if args.vs and not args.profile:
        raise SystemExit("kiln explain: --vs compares profiles: give --profile too")
    peer_model = copy.deepcopy(model) if args.vs else None
    try:
        step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=args.lr), amp=args.amp, dialects=dialects,
                            memory_budget=budget)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        step(input_ids=ids, labels=ids)
    except kiln.KilnError as e:
        raise SystemExit(f"kiln explain: {e}")
    if args.source:
        print(step.source())
    elif args.memory:
        from kiln.runtime.memory import allocated
        print(step.memory(measure=allocated() is not None))
    else:
        kiln.explain(step, profile=args.profile)
    if args.vs:
        _compare(step, peer_model, args, dict(input_ids=ids, labels=ids))
    return 0


def _compare(step, peer_model, args, batch, settle: float = 60.0, warmup: int = 3) -> None:
    """Kiln's step and the peer's (`--vs`), each warmed up (Kiln's online tuning settled, torch.compile
    compiled), then profiled the same way: where each spends a step's time."""
    import sys

    from kiln.bench.split import gaps, peer_step, profile_modes, render
    label = "torch.compile" if args.vs == "compile" else "eager"
    print(f"\nprofiling {label} beside Kiln" + (" (torch.compile compiles first: tens of seconds)"
                                                 if args.vs == "compile" else ""), file=sys.stderr, flush=True)
    peer = peer_step(peer_model, args.vs, batch, amp=args.amp, lr=args.lr)
    for _ in range(warmup):
        peer()
    kiln_step = lambda: float(step(**batch))     # noqa: E731
    deadline = time.perf_counter() + settle
    step.tune_now()                              # the tuned steady state is profiled: compile what it would
    for _ in range(warmup):
        kiln_step()
    while step.pending_tuning() and time.perf_counter() < deadline:
        kiln_step()
    results = profile_modes({"kiln": kiln_step, label: peer})      # their steps interleaved
    print("\n" + render(results))
    print(gaps(results, "kiln", label))


def run(args) -> int:
    import torch

    import kiln
    eager_model = _build(args, "demo")
    kiln_model = copy.deepcopy(eager_model)
    n_params = sum(p.numel() for p in eager_model.parameters())
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq)) for _ in range(4)]
    print(f"Llama-style model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
          f"{n_params / 1e6:.1f}M parameters; batch {args.batch} x {args.seq} tokens; "
          f"{torch.get_num_threads()} threads")

    opt = torch.optim.AdamW(eager_model.parameters(), lr=args.lr, weight_decay=0.01)

    def eager_step(ids):
        opt.zero_grad(set_to_none=True)
        loss = eager_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()

    step = kiln.compile(kiln_model, optimizer=kiln.optim.AdamW(lr=args.lr, weight_decay=0.01))

    rows, times = [], {"eager": [], "kiln": []}
    first = {}
    print(f"{'step':>4}  {'eager loss':>10}  {'kiln loss':>10}  {'eager s':>8}  {'kiln s':>8}")
    for i in range(args.steps):
        ids = batches[i % len(batches)]
        # alternate which mode goes first so neither always runs on a warmer cache
        order = [("eager", eager_step), ("kiln", lambda x: step(input_ids=x, labels=x))]
        if i % 2:
            order.reverse()
        losses = {}
        for name, fn in order:
            t0 = time.perf_counter()
            losses[name] = fn(ids).item()
            dt = time.perf_counter() - t0
            (times[name].append(dt) if i else first.__setitem__(name, dt))
        rows.append((i, losses["eager"], losses["kiln"]))
        t_e = times["eager"][-1] if i else first["eager"]
        t_k = times["kiln"][-1] if i else first["kiln"]
        print(f"{i:>4}  {losses['eager']:>10.4f}  {losses['kiln']:>10.4f}  {t_e:>8.3f}  {t_k:>8.3f}", flush=True)

    drift = max(abs(a - b) / max(abs(a), 1e-12) for _, a, b in rows)
    print()
    print(f"time to first step: eager {first['eager']:.2f}s, kiln {first['kiln']:.2f}s (includes compiling)")
    if args.steps > 1:
        # the first measured steps still pay allocator growth; report the median of the rest
        warm = max(1, len(times["eager"]) // 3)
        me, mk = statistics.median(times["eager"][warm - 1:]), statistics.median(times["kiln"][warm - 1:])
        print(f"median step time: eager {me * 1000:.1f} ms, kiln {mk * 1000:.1f} ms (eager/kiln = {me / mk:.2f}x)")
    print(f"largest relative loss difference kiln vs eager: {drift:.2e}")
    print("see the generated step with step.source(), and the op table with kiln.explain(step)")
    return 0
