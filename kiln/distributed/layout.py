"""Gradient buckets and ZeRO shards: which parameters share a collective, and which elements a rank owns.

A bucket is a flat buffer holding the gradients of several parameters (same dtype and device) back to
back, in the order the backward produces them, up to `bucket_mb`. With ZeRO the flat buffer is padded to
a multiple of the world size and rank r owns the r-th equal slice of it: its shard of the gradients, of
the parameters and of the optimizer state. A shard may start or end inside a parameter; `pieces` says
which elements of which parameter it covers. The layout is fixed by a step's first program (the
optimizer state is laid out by it) and every later program reuses it, so every program issues the same
collectives in the same order on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    index: int
    names: tuple[str, ...]              # parameter names (graph sources), in the order their gradients appear
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    device: torch.device
    world: int
    rank: int

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(_numel(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def size(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        """The flat length, a multiple of the world size (each rank's shard is padded / world long)."""
        return -(-self.size // self.world) * self.world

    @property
    def shard_size(self) -> int:
        return self.padded // self.world

    @property
    def shard(self) -> tuple[int, int]:
        """This rank's slice [lo, hi) of the flat bucket."""
        lo = self.rank * self.shard_size
        return lo, lo + self.shard_size

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def pieces(self, rank: int | None = None) -> list[tuple[int, int, int, int]]:
        """(parameter index, start, stop in the flattened parameter, start in the shard) of every parameter
        the shard of `rank` (default: this rank) covers; the shard's padding covers none."""
        rank = self.rank if rank is None else rank
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((i, a - off, b - off, a - lo))
        return out

    def label(self) -> str:
        first = self.names[0] if len(self.names) == 1 else f"{self.names[0]} ... {self.names[-1]}"
        return f"bucket {self.index} ({len(self.names)} parameter{'s' * (len(self.names) != 1)}: {first})"

    def signature(self) -> tuple:
        """What every rank must agree on (the rank itself aside)."""
        return (self.index, self.names, self.shapes, str(self.dtype), self.device.type, self.world)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_buckets(grads: list[tuple[str, tuple[int, ...], torch.dtype, torch.device]], bucket_mb: float,
                 world: int, rank: int) -> tuple[Bucket, ...]:
    """Buckets of at most `bucket_mb` MiB (a larger parameter gets one of its own) over `grads`, given in the
    order the backward produces them as (name, shape, dtype, device); one run of buckets per dtype/device,
    each starting where its first gradient appears."""
    cap = bucket_mb * 2 ** 20
    open_: dict[tuple, list] = {}                 # (dtype, device) -> [names, shapes, bytes] being filled
    done: list[tuple[int, list, list, torch.dtype, torch.device]] = []   # (first position, names, shapes, ...)
    for pos, (name, shape, dtype, device) in enumerate(grads):
        key = (dtype, device)
        nbytes = _numel(shape) * dtype.itemsize
        cur = open_.get(key)
        if cur is not None and cur[2] + nbytes > cap:
            done.append((cur[3], cur[0], cur[1], dtype, device))
            cur = None
        if cur is None:
            cur = open_[key] = [[], [], 0, pos]
        cur[0].append(name)
        cur[1].append(tuple(shape))
        cur[2] += nbytes
    for (dtype, device), cur in open_.items():
        if cur[0]:
            done.append((cur[3], cur[0], cur[1], dtype, device))
    done.sort(key=lambda d: d[0])
    return tuple(Bucket(i, tuple(names), tuple(shapes), dtype, device, world, rank)
                 for i, (_, names, shapes, dtype, device) in enumerate(done))
