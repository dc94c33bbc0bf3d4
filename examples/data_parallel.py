"""Data-parallel training of a small Llama with Kiln, ZeRO-1, checkpointing on rank 0.

    torchrun --nproc_per_node=2 examples/data_parallel.py [--zero 1] [--steps 20] [--resume ckpt.pt]

Each rank trains on its own batches; the gradients are averaged across the ranks inside the compiled step
(bucketed all-reduce / reduce-scatter overlapping the backward), each rank keeps and updates 1/N of the
AdamW state (zero=1), and the parameters are all-gathered before the step commits. Resume the checkpoint on
any number of ranks (or on one, without parallel=).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers

import kiln


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save", default="ckpt.pt")
    p.add_argument("--resume", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")                  # "nccl" (and one GPU per rank) on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                             # rank 0's weights are broadcast anyway, as DDP does
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    step = kiln.compile(model, optimizer=kiln.optim.AdamW(lr=1e-3, weight_decay=0.01),
                        parallel=kiln.DataParallel(zero=args.zero, bucket_mb=25))
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        step.load_state_dict(ckpt["optimizer"])      # a whole state: each rank cuts its shard

    g = torch.Generator().manual_seed(1000 + rank)   # each rank its own data
    for i in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (4, 64), generator=g)
        loss = step(input_ids=ids, labels=ids)       # this rank's loss; the update used every rank's gradients
        if rank == 0 and i % 5 == 0:
            print(f"step {i}: loss {loss.item():.4f}", flush=True)

    if rank == 0:
        kiln.explain(step)                           # every op, and each collective with what it overlaps
    optimizer_state = step.state_dict()              # collective with ZeRO: every rank calls it
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer_state}, args.save)
        print(f"saved {args.save} ({world} ranks, zero={args.zero})")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
