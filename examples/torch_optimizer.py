"""A usual PyTorch training loop, compiled by Kiln: torch.optim.AdamW with two parameter groups, a
transformers warm-up schedule, gradient accumulation and clipping, next to the same loop in eager PyTorch.

    python examples/torch_optimizer.py [--steps 12] [--accumulate 4]

The optimizer, its param_groups, its state and the scheduler stay the user's own: Kiln reads the
hyper-parameters at every call (the schedule changes lr without recompiling) and updates the optimizer's
own state tensors, so `opt.state_dict()` can be saved as usual and loaded by either loop.
"""
from __future__ import annotations

import argparse
import copy

import torch
import transformers

import kiln


def param_groups(model):
    """No weight decay on biases and norms, as most recipes do."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="optimizer updates")
    ap.add_argument("--accumulate", type=int, default=4, help="micro-batches per update")
    args = ap.parse_args()

    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    eager = copy.deepcopy(model)

    def make(m):
        opt = torch.optim.AdamW(param_groups(m), lr=1e-3)
        return opt, transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=3,
                                                                num_training_steps=args.steps)
    opt, sched = make(model)
    eager_opt, eager_sched = make(eager)
    step = kiln.compile(model, optimizer=opt, accumulate=args.accumulate, max_grad_norm=1.0)

    g = torch.Generator().manual_seed(0)
    for update in range(args.steps):
        kiln_loss = eager_loss = 0.0
        for _ in range(args.accumulate):
            ids = torch.randint(0, config.vocab_size, (4, 32), generator=g)
            kiln_loss += step(input_ids=ids, labels=ids).item() / args.accumulate     # the update runs on the last
            loss = eager(input_ids=ids, labels=ids).loss
            (loss / args.accumulate).backward()
            eager_loss += loss.item() / args.accumulate
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        eager_opt.step()
        eager_opt.zero_grad()
        sched.step()
        eager_sched.step()
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager.parameters()))
        print(f"update {update:2d}  lr {sched.get_last_lr()[0]:.2e}  loss kiln {kiln_loss:.4f}  eager {eager_loss:.4f}"
              f"  max |param difference| {diff:.1e}")
    print(f"programs compiled: {step.cache_info().compiles} (a micro-step and an update step; lr changes "
          f"did not recompile); optimizer state keys: {sorted(opt.state_dict()['state'][0])}")


if __name__ == "__main__":
    main()
