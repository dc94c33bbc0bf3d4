"""Micro-benchmark of kiln.kernels: fused vs the unfused eager code each kernel replaces.

    python benchmarks/kernels.py [--dtype fp32,bf16] [--json out.json] [--kernels rms_norm,rope] [--reps 7]

For every kernel: forward+backward wall time (warm-up, then fused and unfused runs interleaved,
median) and peak memory of one forward+backward (each measured in a fresh subprocess: the rise of
the RSS high-water mark, /proc/self/status VmHWM reset through /proc/self/clear_refs, over the RSS
with the inputs already allocated; glibc is told to mmap every buffer over 64 KiB so freed memory
leaves the process at once and the mark tracks live tensors). Then linear_cross_entropy's peak at
vocab 32000 and 128000. bf16 runs smaller shapes: this CPU has no native bf16 matmul.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kiln.kernels as K  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- the cases: inputs, fused call, unfused eager reference -----------------------------------
def _rand(*shape, dtype, scale=1.0, grad=True):
    return (torch.randn(*shape) * scale).to(dtype).requires_grad_(grad)


def _rms_ref(x, w, eps=1e-6):
    # Hugging Face LlamaRMSNorm: statistics in fp32, weight applied in the input dtype
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


def _rope_ref(q, k, cos, sin):
    # Hugging Face apply_rotary_pos_emb with unsqueeze_dim=1
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def make_case(name: str, dtype: torch.dtype, small: bool):
    """(shape label, inputs, fused fn, unfused fn); fns map inputs -> output tensor(s)."""
    t = 512 if small else 4096            # tokens for the memory-bound kernels
    m = 256 if small else 2048            # tokens for the matmul kernels (bf16 matmul is emulated here)
    d = dict(dtype=dtype)
    if name == "rms_norm":
        ins = [_rand(t, 1024, **d), _rand(1024, **d)]
        return f"x ({t}, 1024)", ins, lambda x, w: K.rms_norm(x, w, 1e-6), _rms_ref
    if name == "add_rms_norm":
        ins = [_rand(t, 1024, **d), _rand(t, 1024, **d), _rand(1024, **d)]
        return (f"x, residual ({t}, 1024)", ins, lambda x, r, w: K.rms_norm(x, w, 1e-6, residual=r),
                lambda x, r, w: (_rms_ref(x + r, w), x + r))
    if name == "dropout_add_layer_norm":
        ins = [_rand(t, 1024, **d), _rand(t, 1024, **d), _rand(1024, **d), _rand(1024, **d)]
        return (f"x, residual ({t}, 1024), p=0.1", ins,
                lambda x, r, w, b: K.dropout_add_layer_norm(x, r, w, b, 0.1, 1e-5, True),
                lambda x, r, w, b: _dal_ref(x, r, w, b))
    if name == "swiglu":
        ins = [_rand(t, 2816, **d), _rand(t, 2816, **d)]
        return f"gate, up ({t}, 2816)", ins, K.swiglu, lambda g, u: F.silu(g) * u
    if name == "swiglu_linear":
        ins = [_rand(m, 512, **d), _rand(1376, 512, scale=0.05, **d), _rand(1376, 512, scale=0.05, **d)]
        return (f"x ({m}, 512), W_gate/W_up (1376, 512)", ins, K.swiglu_linear,
                lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu))
    if name == "linear_gelu":
        ins = [_rand(m, 512, **d), _rand(2048, 512, scale=0.05, **d), _rand(2048, **d)]
        return (f"x ({m}, 512), W (2048, 512)", ins, lambda x, w, b: K.linear_gelu(x, w, b),
                lambda x, w, b: F.gelu(F.linear(x, w, b)))
    if name == "rope":
        b, s = (1, 128) if small else (4, 512)
        ins = [_rand(b, 16, s, 64, **d), _rand(b, 4, s, 64, **d), _rand(b, s, 64, grad=False, **d),
               _rand(b, s, 64, grad=False, **d)]
        return (f"q ({b}, 16, {s}, 64), k ({b}, 4, {s}, 64)", ins,
                lambda q, k, c, sn: K.rope(q, k, c, sn, unsqueeze_dim=1), _rope_ref)
    if name == "linear_cross_entropy":
        tokens, vocab = (256, 8000) if small else (2048, 32000)
        return lce_case(tokens, 256, vocab, dtype)
    if name == "cross_entropy":            # on logits a model computed (and returns): no matmul in either
        tokens, vocab = (512, 32000) if small else (2048, 32000)
        labels = torch.randint(0, vocab, (tokens,))
        labels[::10] = -100
        ins = [_rand(tokens, vocab, scale=3.0, dtype=dtype), labels]
        return f"logits ({tokens}, {vocab})", ins, K.cross_entropy, F.cross_entropy
    if name == "linear_act":              # transformers' NewGELUActivation (the tanh formula in eight ops)
        fc = torch.nn.Linear(512, 2048).to(dtype)
        ins = [_rand(m, 512, **d), fc.weight, fc.bias]
        return (f"x ({m}, 512), W (2048, 512), gelu_new", ins,
                lambda x, w, b: K.linear_act(x, _Linear(w, b), _NewGELU()),
                lambda x, w, b: _NewGELU()(F.linear(x, w, b)))
    raise KeyError(name)


class _NewGELU(torch.nn.Module):
    """transformers' NewGELUActivation as written there (recognized by linear_act by class and module)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


_NewGELU.__name__ = "NewGELUActivation"
_NewGELU.__module__ = "transformers.activations"


class _Linear(torch.nn.Linear):
    """An nn.Linear over given weight and bias (no copy), so the timed call sees the benchmark's inputs."""

    def __init__(self, weight, bias):
        torch.nn.Module.__init__(self)
        self.weight, self.bias = weight, bias


def _dal_ref(x, r, w, b):
    s = F.dropout(x, 0.1, True) + r
    return F.layer_norm(s, (x.shape[-1],), w, b, 1e-5), s


def lce_case(tokens: int, hidden: int, vocab: int, dtype: torch.dtype):
    labels = torch.randint(0, vocab, (tokens,))
    labels[::10] = -100                                   # some ignored tokens, as padding would give
    ins = [_rand(tokens, hidden, dtype=dtype), _rand(vocab, hidden, scale=0.05, dtype=dtype), labels]
    return (f"hidden ({tokens}, {hidden}), vocab {vocab}", ins, K.linear_cross_entropy,
            lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y))


KERNELS = ["rms_norm", "add_rms_norm", "dropout_add_layer_norm", "swiglu", "swiglu_linear", "linear_gelu",
           "linear_act", "rope", "linear_cross_entropy", "cross_entropy"]


# ---- running and measuring --------------------------------------------------------------------
def _outputs(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def fwd_bwd(fn: Callable, ins: list, grads: list | None) -> None:
    """One forward+backward; output gradients are fixed tensors made once (not part of the cost)."""
    outs = _outputs(fn(*ins))
    torch.autograd.backward(outs, grads if grads is not None else [torch.ones_like(o) for o in outs])


def _clear(ins) -> None:
    for t in ins:
        if isinstance(t, torch.Tensor):
            t.grad = None


def output_grads(fn, ins) -> list:
    with torch.no_grad():
        return [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in _outputs_nograd(fn(*ins))]


def _outputs_nograd(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


def time_pair(name: str, dtype: torch.dtype, small: bool, reps: int, warmup: int = 2) -> dict:
    torch.manual_seed(0)
    label, ins, fused, unfused = make_case(name, dtype, small)
    grads = _grads_for(name, unfused, ins)
    times = {"fused": [], "unfused": []}
    fns = {"fused": fused, "unfused": unfused}
    for i in range(warmup + reps):
        order = ("fused", "unfused") if i % 2 == 0 else ("unfused", "fused")   # interleaved, alternating
        for v in order:
            _clear(ins)
            start = time.perf_counter()
            fwd_bwd(fns[v], ins, grads)
            if i >= warmup:
                times[v].append(time.perf_counter() - start)
    return {"kernel": name, "shape": label, **{f"{v}_ms": 1e3 * statistics.median(ts) for v, ts in times.items()},
            **{f"{v}_saved_mib": saved_mib(fns[v], ins) for v in fns}}


def saved_mib(fn: Callable, ins: list) -> float:
    """MiB that autograd keeps from forward to backward beyond the inputs themselves (each storage
    once): what every layer adds to a model's activation memory."""
    inputs = {t.untyped_storage().data_ptr() for t in ins if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*ins)
    del out
    return sum(seen.values()) / 2 ** 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE).group(1))


def worker(name: str, variant: str, dtype: str, small: bool, vocab: int) -> dict:
    """Runs in a fresh process: the RSS peak of one forward+backward over the inputs' RSS."""
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    case = lce_case(2048, 256, vocab, dt) if vocab else make_case(name, dt, small)
    _, ins, fused, unfused = case
    fn = fused if variant == "fused" else unfused
    grads = _grads_for(name, unfused, ins)
    # warm-up: first calls allocate library workspaces; a big vocabulary warms up on a small case
    _, wins, wfused, wunfused = lce_case(16, 256, 1000, dt) if vocab else case
    fwd_bwd(wfused if variant == "fused" else wunfused, wins, None if vocab else grads)
    _clear(wins)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    fwd_bwd(fn, ins, grads)
    return {"peak_mib": (_status_kib("VmHWM") - base) / 1024}


def _grads_for(name, fn, ins):
    # a scalar loss is seeded with 1; no need to run the (big) unfused forward to learn its shape
    return None if name == "linear_cross_entropy" else output_grads(fn, ins)


def measure_peak(name: str, variant: str, dtype: str, small: bool, vocab: int = 0) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, variant, dtype, str(int(small)), str(vocab)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def machine() -> str:
    model = "unknown CPU"
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = re.search(r"model name\s*:\s*(.+)", info).group(1).strip()
        flags = set(re.search(r"flags\s*:\s*(.+)", info).group(1).split())
    except (OSError, AttributeError):
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = "native bf16" if flags & {"avx512_bf16", "amx_bf16"} else "no native bf16"
    return (f"{model}, {isa}, {bf16}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {platform.python_implementation()} {platform.python_version()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", help="comma-separated: fp32,bf16")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--lce-vocab", default="32000,128000", help="vocabularies for the memory table ('' skips)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.worker:
        name, variant, dtype, small, vocab = args.worker
        print(json.dumps(worker(name, variant, dtype, bool(int(small)), int(vocab))))
        return 0
    result = {"command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
              "machine": machine(), "rows": [], "lce_vocab": []}
    print(f"# {result['command']}\n# {result['machine']}")
    print(f"{'kernel':23} {'dtype':5} {'shape':40} {'fused ms':>9} {'eager ms':>9} {'speedup':>7} "
          f"{'peak MiB fused/eager':>20} {'saved MiB fused/eager':>21}")
    for dtype in args.dtype.split(","):
        small = dtype != "fp32"
        for name in args.kernels.split(","):
            row = time_pair(name, DTYPES[dtype], small, args.reps)
            row.update(dtype=dtype, fused_mib=measure_peak(name, "fused", dtype, small),
                       unfused_mib=measure_peak(name, "unfused", dtype, small))
            result["rows"].append(row)
            print(f"{name:23} {dtype:5} {row['shape']:40} {row['fused_ms']:9.1f} {row['unfused_ms']:9.1f} "
                  f"{row['unfused_ms'] / row['fused_ms']:6.2f}x {row['fused_mib']:9.1f} /{row['unfused_mib']:9.1f} "
                  f"{row['fused_saved_mib']:10.1f} /{row['unfused_saved_mib']:9.1f}", flush=True)
    for vocab in [int(v) for v in args.lce_vocab.split(",") if v]:
        row = {"vocab": vocab, "tokens": 2048, "hidden": 256,
               **{f"{v}_mib": measure_peak("linear_cross_entropy", v, "fp32", False, vocab)
                  for v in ("fused", "unfused")}}
        result["lce_vocab"].append(row)
        print(f"linear_cross_entropy peak, fp32, 2048 tokens, hidden 256, vocab {vocab}: "
              f"fused {row['fused_mib']:.1f} MiB, unfused {row['unfused_mib']:.1f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
