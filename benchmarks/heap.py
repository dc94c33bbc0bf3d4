"""What the heap policy between steps is worth: Kiln's step and eager PyTorch's, under glibc's default heap
and under `keep` (kiln/runtime/heap.py), alternated in one process.

    .venv/bin/python benchmarks/heap.py [--model llama|gpt2] [--length 256] [--batch 8] [--rounds 6]

Both steps run in the same process, so both see the same heap setting at any moment; the setting is
switched between measurements with `kiln.runtime.heap.apply` (`system` puts glibc's defaults back and trims the
heap first, so each `system` measurement starts from memory returned to the OS). Kiln's static program is
tuned before anything is timed. Each round measures every (mode, setting) pair once after one untimed
step, the order alternating; reported are medians of the step's wall time, its minor page faults and its
system CPU time (the kernel's share, page faults included).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["KILN_HEAP"] = "system"          # this script switches the heap itself


def set_heap(keep: bool) -> None:
    """The setting Kiln's `keep` policy makes, or glibc's defaults back with the heap trimmed."""
    from kiln.runtime import heap
    heap.apply("keep" if keep else "system")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--settle", type=float, default=300.0, help="seconds to wait for Kiln's tuning")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    import kiln
    from kiln.bench import zoo
    torch.manual_seed(0)
    base = zoo.get(args.model, "default", seq=args.length).build_model()
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.length),
                        generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids, labels=ids)
    step = kiln.compile(copy.deepcopy(base), optimizer=kiln.optim.AdamW(lr=3e-4, weight_decay=0.01), dynamic=False)
    eager_model = copy.deepcopy(base)
    opt = torch.optim.AdamW(eager_model.parameters(), lr=3e-4, weight_decay=0.01)

    def eager():
        opt.zero_grad(set_to_none=True)
        loss = eager_model(**batch).loss
        loss.backward()
        opt.step()
        return loss.item()
    modes = {"kiln": lambda: step(**batch).item(), "eager": eager}
    deadline = time.perf_counter() + args.settle
    step.tune_now()                        # the tuned steady state is measured: compile its kernels now
    modes["kiln"]()
    while step.pending_tuning() and time.perf_counter() < deadline:
        modes["kiln"]()
    modes["eager"]()
    got: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for r in range(args.rounds):
        order = [(m, h) for m in (("kiln", "eager") if r % 2 else ("eager", "kiln"))
                 for h in (("keep", "system") if r % 3 else ("system", "keep"))]
        for mode, setting in order:
            set_heap(setting == "keep")
            modes[mode]()
            before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            modes[mode]()
            wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            got.setdefault((mode, setting), []).append((wall, after.ru_stime - before.ru_stime,
                                                        after.ru_minflt - before.ru_minflt))
    set_heap(False)
    rows = []
    print(f"{args.model}, batch {args.batch} x {args.length}, {args.rounds} rounds (medians)")
    print(f"{'mode':6} {'heap':7} {'step':>8} {'sys CPU':>8} {'faults':>8}")
    for (mode, setting), xs in sorted(got.items()):
        row = dict(mode=mode, heap=setting, step_s=statistics.median(x[0] for x in xs),
                   sys_s=statistics.median(x[1] for x in xs), minor_faults=statistics.median(x[2] for x in xs))
        rows.append(row)
        print(f"{mode:6} {setting:7} {row['step_s']:7.3f}s {row['sys_s']:7.3f}s {row['minor_faults']:8.0f}")
    med = {(r["mode"], r["heap"]): r["step_s"] for r in rows}
    for mode in modes:
        print(f"{mode}: keep is {med[(mode, 'system')] / med[(mode, 'keep')]:.3f}x faster than glibc's default")
    print(f"kiln (keep) vs eager (glibc default): {med[('eager', 'system')] / med[('kiln', 'keep')]:.3f}x; "
          f"both on keep: {med[('eager', 'keep')] / med[('kiln', 'keep')]:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), torch=torch.__version__, threads=torch.get_num_threads(),
                           cpu_capability=torch.backends.cpu.get_cpu_capability(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
