"""Hugging Face `Trainer` with a Kiln-compiled training step: a tiny GPT-2 learns the bytes of the Python
standard library's source (nothing is downloaded).

    python examples/trainer.py                    # 200 optimizer steps, a couple of minutes on 2 CPU cores
    python examples/trainer.py --steps 5          # a quick check
    python examples/trainer.py --eager            # the same run with transformers.Trainer, for comparison

`kiln.integrations.transformers.Trainer` is a drop-in `transformers.Trainer`: the data are examples of random
lengths (32 to --seq bytes) padded per batch by `DataCollatorForLanguageModeling(mlm=False)`, so every batch has
its own length (one dynamic Kiln program serves them all); TrainingArguments choose AdamW with the Trainer's
no-decay groups, warm-up + cosine decay, gradient accumulation, clipping and logging as usual. The tokenizer
is a byte vocabulary built in memory (256 bytes and a padding token), used by the collator to pad. At the end
the held-out loss comes from `trainer.evaluate()` and the logged losses are drawn as a PNG (skipped, with a
message, if matplotlib is not installed).
"""
from __future__ import annotations

import argparse
import pathlib
import sysconfig
import tempfile
import time

import torch
import transformers
from tokenizers import Tokenizer, models

PAD = 256


def stdlib_bytes(limit: int) -> bytes:
    """Up to `limit` bytes of the standard library's .py files (sorted paths, so runs see the same data)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            chunks.append(path.read_bytes())
        except OSError:
            continue
        total += len(chunks[-1])
        if total >= limit:
            break
    if not chunks:
        raise SystemExit(f"no .py files found under {root}")
    return b"".join(chunks)[:limit]


def examples(data: bytes, n: int, seq: int, seed: int) -> list[dict]:
    """`n` snippets of 32..seq bytes at random places: a dataset of varying lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(32, seq + 1, (1,), generator=g))
        start = int(torch.randint(0, len(data) - length, (1,), generator=g))
        out.append({"input_ids": list(data[start:start + length])})
    return out


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Token i is byte i, token 256 pads. Built in memory; the collator only uses it to pad."""
    vocab = {f"<{i:02x}>": i for i in range(256)} | {"<pad>": PAD}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                                pad_token="<pad>")


def plot(history: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve written (pip install matplotlib)")
        return
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train (logged)")
    if evals:
        ax.plot(*zip(*evals), "o", label="held-out (trainer.evaluate)")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats / byte)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curve written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    ap.add_argument("--batch", type=int, default=16, help="per-device batch size (micro-batch)")
    ap.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--seq", type=int, default=128, help="longest example, in bytes")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): Kiln's amp='bf16'")
    ap.add_argument("--eager", action="store_true", help="train with transformers.Trainer instead")
    ap.add_argument("--output-dir", default=None, help="Trainer output_dir (default: a temporary folder)")
    ap.add_argument("--out", default="trainer_loss.png", help="loss curve PNG")
    args = ap.parse_args()

    data = stdlib_bytes(4_000_000)
    split = int(len(data) * 0.95)
    n_train = args.steps * args.batch * args.accumulate
    train = examples(data[:split], n_train, args.seq, seed=0)
    held_out = examples(data[split:], 256, args.seq, seed=1)
    config = transformers.GPT2Config(vocab_size=PAD + 1, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers,
                                     n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    print(f"data: {len(train)} training snippets of 32..{args.seq} bytes from the Python standard library; "
          f"model: GPT-2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    targs = transformers.TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="kiln-trainer-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, per_device_eval_batch_size=32,
        gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine", weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, bf16=args.bf16,
        logging_steps=max(1, args.steps // 20), save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        dataloader_pin_memory=torch.cuda.is_available())
    if args.eager:
        cls = transformers.Trainer
    else:
        from kiln.integrations.transformers import Trainer as cls
    trainer = cls(model=model, args=targs, train_dataset=train, eval_dataset=held_out,
                  data_collator=transformers.DataCollatorForLanguageModeling(byte_tokenizer(), mlm=False))
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    metrics = trainer.evaluate()
    name = "transformers.Trainer (eager)" if args.eager else "kiln.integrations.transformers.Trainer"
    print(f"{name}: {args.steps} steps in {seconds:.1f}s; held-out loss {metrics['eval_loss']:.3f}")
    if not args.eager:
        info = trainer.kiln_step.cache_info()
        print(f"Kiln: {info.compiles} program(s) compiled in {info.compile_seconds:.1f}s (a micro-step and an update step, "
              "each serving every padded length)")
    plot(trainer.state.log_history, args.out, f"tiny GPT-2 on stdlib bytes: {name}")


if __name__ == "__main__":
    main()
