"""Data-parallel training step time and memory: DDP eager, DDP + ZeroRedundancyOptimizer and Kiln's
DataParallel (zero 0/1/2), side by side on the same ranks, launched with torchrun.

    .venv/bin/python benchmarks/ddp_compare.py --nproc 2 --threads 1 --model llama [--size default]
        [--modes ddp,ddp-zero,kiln-z0,kiln-z1,kiln-z2,kiln-z0-nooverlap] [--steps 10 --warmup 3] [--json out.json]

Every mode trains its own copy of the same model (kiln/bench/zoo.py, random weights) on the same per-rank
batches; steps are interleaved (the order rotates every step) and every timed step starts after a barrier, so
machine noise hits all modes alike; medians after the warm-up steps. `ddp` is DistributedDataParallel with
torch.optim.AdamW (PyTorch's default implementation on CPU), `ddp-zero` DDP with
torch.distributed.optim.ZeroRedundancyOptimizer(AdamW), `kiln-zK` kiln.compile(..., parallel=
kiln.DataParallel(zero=K)), `-nooverlap` issues every collective at the end of the backward (so the
difference to `kiln-z0` is what overlap hides), `-gradoverlap` overlaps only the gradient collectives
(overlap="gradients": ZeRO's updates and all-gathers after the backward, so the difference to `kiln-z1` is
what updating during the backward hides). `local-eager` / `local-kiln` train each rank alone (no
communication, eager AdamW / kiln.compile without parallel=), at the same time: what data parallelism
costs each is the difference. Kiln compiles with tuning="ahead" after rank 0 has filled
the kernel cache alone (so the ranks choose the same kernels, measured on a quiet machine).
Reported per rank 0: the step's CPU time (all threads of the process: less sensitive to other load than
wall time, but it does not count time waiting for the other rank), optimizer-state bytes (Kiln: the step's state; torch: the optimizer's), gradient bytes
(Kiln: the most its collectives held in a step; DDP: the parameters' .grad, which DDP's buckets double),
and for Kiln the time a collective was running and the time the step waited for one (the rest was hidden).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import warnings

MODES = ("ddp", "ddp-zero", "kiln-z0", "kiln-z1", "kiln-z2", "kiln-z0-nooverlap", "local-eager", "local-kiln",
         "kiln-z1-gradoverlap", "kiln-z2-gradoverlap")
DEFAULT = MODES[:6]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes), launched with torchrun")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model", default="llama", help="a kiln.bench.zoo model (llama, gpt2, ...)")
    p.add_argument("--size", default="default", help="zoo size preset (default: 4 layers, hidden 512)")
    p.add_argument("--modes", default=",".join(DEFAULT), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=10, help="measured steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load-start", type=float, default=os.getloadavg()[0], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    return args


def launch(args) -> int:
    """The parent: torchrun with this script as the worker; rank 0 prints the table."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", f"--master_port={port}",
           os.path.abspath(__file__), "--worker", f"--load-start={os.getloadavg()[0]}", *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    return subprocess.call(cmd, env=env)


def state_bytes(opt) -> int:
    inner = getattr(opt, "optim", opt)            # ZeroRedundancyOptimizer keeps its shard's optimizer here
    return sum(t.nbytes for s in inner.state.values() for t in s.values() if hasattr(t, "nbytes"))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import kiln
    from kiln.bench import zoo

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    entry = zoo.get(args.model, args.size)
    base = entry.build_model()
    batches = [entry.build_batch(rank * 1000 + i) for i in range(4)]      # each rank its own batches
    names = args.modes.split(",")
    opt_kw = dict(lr=1e-4, weight_decay=0.01)
    if rank == 0 and any(n.startswith("kiln") for n in names):           # fill the kernel cache alone
        warm = kiln.compile(copy.deepcopy(base), optimizer=kiln.optim.AdamW(**opt_kw), tuning="ahead")
        warm(**batches[0])
        del warm
    dist.barrier()
    steps, extra = {}, {}
    for name in names:
        model = copy.deepcopy(base)
        if name == "local-kiln":
            step = kiln.compile(model, optimizer=kiln.optim.AdamW(**opt_kw), tuning="ahead")
            steps[name] = (lambda s: lambda b: s(**b))(step)
            continue
        if name.startswith("kiln"):
            zero = int(name.split("-z")[1][0])
            step = kiln.compile(model, optimizer=kiln.optim.AdamW(**opt_kw), tuning="ahead",
                                parallel=kiln.DataParallel(zero=zero, bucket_mb=args.bucket_mb, overlap=(
                                    False if "nooverlap" in name else "gradients" if "gradoverlap" in name else True)))
            steps[name] = (lambda s: lambda b: s(**b))(step)
            extra[name] = step
            continue
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb) if name != "local-eager" else model
        opt = (ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **opt_kw)
               if name == "ddp-zero" else torch.optim.AdamW(ddp.parameters(), **opt_kw))

        def eager(b, ddp=ddp, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = ddp(**b).loss
            loss.backward()
            opt.step()
            return loss.detach()
        steps[name], extra[name] = eager, (ddp, opt)
    del base
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}         # this process's CPU time per step (all its threads): noise-robust work
    stats = {n: [] for n in names}
    first, last = {}, {}
    for i in range(args.warmup + args.steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            steps[n](batches[i % len(batches)])
            dt = last[n] = time.perf_counter() - t0
            dc = time.process_time() - c0
            if i == 0:
                first[n] = dt
            if i >= args.warmup:
                times[n].append(dt)
                cpu[n].append(dc)
                if n.startswith("kiln"):
                    stats[n].append(dict(extra[n].parallel.comm.last))
        if rank == 0:
            print(f"step {i}: " + "  ".join(f"{n} {last[n]:.2f}s" for n in names), flush=True)
    rows = {}
    for n in names:
        med = statistics.median(times[n])
        q = statistics.quantiles(times[n], n=4) if len(times[n]) > 1 else [med, med, med]
        row = {"median_s": med, "q1_s": q[0], "q3_s": q[2], "first_step_s": first[n],
               "cpu_s": statistics.median(cpu[n])}
        if n in ("local-eager", "local-kiln"):
            row["state_bytes"] = row["grad_bytes"] = 0
        elif n.startswith("kiln"):
            step = extra[n]
            row["state_bytes"] = step.parallel.stats(step)["state_bytes"]
            row["grad_bytes"] = statistics.median(s["peak_grad_bytes"] for s in stats[n])
            row["comm_s"] = statistics.median(s["comm_s"] for s in stats[n])
            row["waited_s"] = statistics.median(s["blocked_s"] for s in stats[n])
        else:
            ddp, opt = extra[n]
            row["state_bytes"] = state_bytes(opt)
            row["grad_bytes"] = sum(p.grad.nbytes for p in ddp.parameters() if p.grad is not None)
        rows[n] = row
    if rank == 0:
        report(args, entry, rows, world)


def report(args, entry, rows, world) -> None:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    result = {"machine": {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
                          "load_avg_start": args.load_start, "load_avg_end": os.getloadavg(),
                          "torch": torch.__version__},
              "config": {k: v for k, v in vars(args).items() if k not in ("worker", "load_start")}, "world": world,
              "modes": rows, "command": "python benchmarks/ddp_compare.py " + " ".join(
                  a for a in sys.argv[1:] if a != "--worker" and not a.startswith("--load-start"))}
    p = entry.params
    print(f"\n{args.model} ({p['layers']} layers, hidden {p['hidden']}, batch {p['batch']} x seq {p['seq']} per rank), "
          f"{world} ranks x {args.threads} thread(s), gloo; {args.steps} measured steps after {args.warmup}; "
          f"{cpu} ({result['machine']['isa']}); 1-minute load average {args.load_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end (on {os.cpu_count()} CPUs)")
    print(f"{'mode':<20}{'median ms':>10}{'IQR ms':>16}{'vs ddp':>8}{'vs ddp-zero':>12}{'CPU ms':>8}"
          f"{'opt state MB':>13}{'grads MB':>10}{'comm ms':>9}{'waited ms':>10}{'hidden ms':>10}")
    mb = 2 ** 20
    for n, r in rows.items():
        vs = lambda ref: f"{rows[ref]['median_s'] / r['median_s']:.3f}x" if ref in rows else "-"  # noqa: E731
        comm = (f"{r['comm_s'] * 1e3:>9.1f}{r['waited_s'] * 1e3:>10.1f}{(r['comm_s'] - r['waited_s']) * 1e3:>10.1f}"
                if "comm_s" in r else f"{'-':>9}{'-':>10}{'-':>10}")
        print(f"{n:<20}{r['median_s'] * 1e3:>10.1f}{r['q1_s'] * 1e3:>8.1f}-{r['q3_s'] * 1e3:<7.1f}{vs('ddp'):>8}"
              f"{vs('ddp-zero'):>12}{r['cpu_s'] * 1e3:>8.0f}{r['state_bytes'] / mb:>13.1f}{r['grad_bytes'] / mb:>10.1f}"
              f"{comm}")
    if "kiln-z0" in rows and "kiln-z0-nooverlap" in rows:
        saved = rows["kiln-z0-nooverlap"]["median_s"] - rows["kiln-z0"]["median_s"]
        print(f"overlap: kiln-z0 is {saved * 1e3:.1f} ms per step faster than kiln-z0-nooverlap")
        result["overlap_saved_s"] = saved
    for z in ("kiln-z1", "kiln-z2"):
        if z in rows and f"{z}-gradoverlap" in rows:
            saved = rows[f"{z}-gradoverlap"]["median_s"] - rows[z]["median_s"]
            print(f"updates during the backward: {z} is {saved * 1e3:.1f} ms per step faster than {z}-gradoverlap")
            result[f"{z}_early_update_saved_s"] = saved
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    a = parse()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(a))
