"""A byte-level transformer language model trained with Kiln on the Python standard library's own source.

    python examples/char_lm.py                    # ~300 steps, a couple of minutes on 2 CPU cores
    python examples/char_lm.py --steps 5          # a quick check
    python examples/char_lm.py --layers 4 --dim 256 --seq 256 --steps 2000 --out curve.png

A plain PyTorch training loop: the data are the bytes of the `.py` files under `sysconfig.get_paths()["stdlib"]`
(nothing is downloaded), the model a small pre-norm transformer written here, the optimizer a torch AdamW
with the usual two parameter groups (no weight decay on biases, norms and embeddings) and a warm-up + cosine
schedule (`torch.optim.lr_scheduler.LambdaLR`). `kiln.compile` turns forward, backward, clipping and the
AdamW update into one program; the scheduler, the held-out evaluation (eager, in eval mode) and sampling use
the same module, whose parameters the step updates in place. At the end it prints a sample and writes the
loss curve as a PNG (skipped, with a message, if matplotlib is not installed).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py files (sorted paths, so runs see the same data)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise SystemExit(f"no .py files found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class ByteLM(nn.Module):
    """A GPT-style byte-level language model: `model(x, y)` is the mean next-byte cross-entropy."""

    def __init__(self, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 256, bias=False)

    def logits(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def forward(self, x, y):
        return F.cross_entropy(self.logits(x).flatten(0, 1), y.flatten())


def batch(data: torch.Tensor, size: int, seq: int, g: torch.Generator):
    start = torch.randint(0, len(data) - seq - 1, (size,), generator=g)
    idx = start[:, None] + torch.arange(seq + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, data, seq, batches=8, size=16) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    loss = sum(model(*batch(data, size, seq, g)).item() for _ in range(batches)) / batches
    model.train()
    return loss


@torch.no_grad()
def sample(model, prompt: bytes, n: int, seq: int, temperature: float = 0.8) -> str:
    model.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.tensor(list(prompt), dtype=torch.long)[None]
    for _ in range(n):
        logits = model.logits(x[:, -seq:])[0, -1] / temperature
        x = torch.cat([x, torch.multinomial(logits.softmax(-1), 1, generator=g)[None]], dim=1)
    model.train()
    return bytes(x[0].tolist()).decode("utf-8", errors="replace")


def plot(steps, losses, evals, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label="train (per step)", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curve written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer updates (default 300)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="how much of the standard library to read")
    ap.add_argument("--amp", choices=["bf16"], default=None, help="Kiln's bf16 mixed precision")
    ap.add_argument("--out", default="char_lm_loss.png", help="loss curve PNG")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    data = stdlib_bytes(args.max_bytes)
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split:]
    print(f"data: {len(data) / 1e6:.1f} MB of Python standard library source ({sysconfig.get_paths()['stdlib']})")

    torch.manual_seed(args.seed)
    model = ByteLM(args.dim, args.layers, args.heads, args.seq)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.startswith(("tok", "pos"))]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1 or n.startswith(("tok", "pos"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)

    def schedule(i):                          # linear warm-up, then cosine decay to 10%
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / max(1, args.steps - warmup))))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.layers} layers, "
          f"dim {args.dim}; batch {args.batch} x {args.seq} bytes; {args.steps} steps, warm-up {warmup}")

    step = kiln.compile(model, optimizer=opt, max_grad_norm=1.0, amp=args.amp)
    g = torch.Generator().manual_seed(args.seed)
    steps, losses, evals = [], [], []
    every = max(1, args.steps // 15)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(args.steps):
        x, y = batch(train, args.batch, args.seq, g)
        loss = step(x, y).item()                 # forward + backward + clipping + AdamW, one program
        sched.step()
        steps.append(i + 1)
        losses.append(loss)
        if i == 0:                               # the first call compiles the program
            print(f"step    1  loss {loss:.3f}  (compiled and ran in {time.perf_counter() - t0:.1f}s)")
            t0, tokens = time.perf_counter(), 0
            continue
        tokens += x.numel()
        if (i + 1) % every == 0 or i == args.steps - 1:
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            line = f"step {i + 1:4d}  loss {loss:.3f}  lr {sched.get_last_lr()[0]:.2e}  {rate:,.0f} bytes/s"
            if (i + 1) % (every * 5) == 0 or i == args.steps - 1:
                evals.append((i + 1, evaluate(model, held_out, args.seq)))
                line += f"  held-out {evals[-1][1]:.3f}"
            print(line, flush=True)
    print(f"{len(step.programs)} program(s) compiled; sample:\n" + "-" * 60)
    print(sample(model, b"def ", 160, args.seq))
    print("-" * 60)
    plot(steps, losses, evals, args.out, f"byte-level LM on the Python stdlib, trained with Kiln "
         f"({args.layers}x{args.dim})")


if __name__ == "__main__":
    main()
