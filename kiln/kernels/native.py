"""Single-pass CPU loops for the elementwise kernels (native.c), built once per machine and loaded with ctypes.

The kernels in norms.py, rope.py and activations.py are written as ATen compositions: correct on every
device and dtype, but each reads and writes its full-size temporaries again (RMSNorm's backward makes
five passes over its rows). On CPU, for float32 and bfloat16 tensors of the usual layouts, they call
the loops in native.c instead, which read each input once and write each output once, in fp32 inside.

Building (native_build.py): the library is for the vector ISA ATen runs with
(`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY` lowers). `pip install` builds one per
ISA into the package (setup.py), named by a digest of the sources and flags, and the first call loads the one
whose digest matches the sources beside it. Where there is none (an edited checkout, a failed install-time
build), the first call compiles native.c with the C compiler (`$CC`, else `cc`; 3-4 s of CPU with -O3, in a
thread beside the model's capture, `prepare`) into `$KILN_CACHE_DIR/native/` (default ~/.cache/kiln/native),
named by a digest of the sources, the compiler's version and the flags, written through a rename. A folder
not private to this user is not loaded from (a shared library is code). No compiler, a failed build or
`KILN_NATIVE=0`: the ATen compositions run, and the log says why once.

The loops use the OpenMP runtime torch already loaded (libgomp.so.1) with torch's thread count.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kiln import cachedir
from kiln.kernels import native_build

log = logging.getLogger("kiln")

ROW_MAX = 8192                     # native.c's row buffers; longer rows run the ATen composition
_CODES = {torch.float32: 0, torch.bfloat16: 1}

# the kernels (torch.ops.kiln.<name>) whose CPU implementation calls these loops
OPS = ("rms_norm", "add_rms_norm", "rms_norm_backward", "layer_norm_backward", "layer_norm_backward_sums", "rope",
       "rope_backward", "swiglu", "swiglu_backward", "swiglu_linear", "swiglu_linear_backward",
       "softmax_cross_entropy", "softmax_cross_entropy_backward")

_i64, _int, _dbl, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_void_p
_i64s = ctypes.POINTER(ctypes.c_int64)      # an array of strides
_ints = ctypes.POINTER(ctypes.c_int)
_SIGNATURES = {
    "kiln_rms_forward": [_ptr, _int, _ptr, _int, _ptr, _int, _ptr, _int, _ptr, _int, _ptr, _int, _i64, _i64, _dbl,
                         _int],
    "kiln_rms_backward": [_ptr, _int, _ptr, _ptr, _ptr, _int, _ptr, _int, _ptr, _int, _ptr, _ptr, _int, _ptr, _int, _ptr,
                          _int, _ptr, _i64, _i64, _int],
    "kiln_ln_backward": [_ptr, _int, _ptr, _int, _ptr, _int, _ptr, _ptr, _ptr, _int, _ptr, _int, _ptr, _int, _ptr,
                         _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _int],
    "kiln_rope": [_ptr, _int, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _int, _ptr, _ptr, _i64, _int, _int],
    "kiln_adamw_param": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _dbl, _dbl, _dbl, _dbl, _dbl, _dbl, _dbl, _int],
    "kiln_adamw_moments": [_ptr, _ptr, _ptr, _i64, _dbl, _dbl, _int],
    "kiln_adamw_step": [_ptr, _ptr, _int, _ptr, _ptr, _i64, _dbl, _dbl, _dbl, _dbl, _dbl, _dbl, _dbl, _int],
    "kiln_swiglu": [_ptr, _int, _i64, _ptr, _int, _i64, _ptr, _int, _i64, _i64, _i64, _int],
    "kiln_swiglu_backward": [_ptr, _int, _i64, _ptr, _int, _i64, _ptr, _int, _i64, _ptr, _int, _i64, _ptr, _int, _i64,
                             _i64, _i64, _int],
    "kiln_gelu_tanh": [_ptr, _int, _ptr, _int, _i64, _int],
    "kiln_gelu_tanh_backward": [_ptr, _int, _ptr, _int, _ptr, _int, _i64, _int],
    "kiln_gelu_backward_sums": [_ptr, _int, _ptr, _int, _ptr, _int, _i64, _i64, _int, _ptr, _ptr, _int],
    "kiln_lut_bf16": [_ptr, _ptr, _ptr, _i64, _int],
    "kiln_lut_scale_bf16": [_ptr, _ptr, _ptr, _ptr, _i64, _int],
    "kiln_ce_forward": [_ptr, _int, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _int],
    "kiln_ce_grads": [_ptr, _int, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _int],
    "kiln_ce_backward": [_ptr, _int, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _int, _i64, _i64, _i64, _int],
    "kiln_attn_probs": [_ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _int, _i64, _i64, _i64, _dbl, _int],
    "kiln_attn_dscores": [_ptr, _int, _ptr, _ptr, _int, _i64, _i64, _i64, _dbl, _int],
    "kiln_attn_softmax": [_ptr, _ptr, _int, _ptr, _ptr, _ptr, _i64, _i64, _int, _i64, _i64, _i64, _dbl, _int],
    "kiln_bf16_abt": [_ptr, _i64, _i64, _int, _ptr, _i64, _i64, _int, _int, _ptr, _int, _i64, _i64, _i64, _i64,
                      _int, _int],
    "kiln_bf16_abt_built": [],
    "kiln_amx_granted": [],
    "kiln_attn_mask_is_causal": [_ptr, _i64s, _i64, _i64, _i64, _i64],
    "kiln_attn_forward_bf16": [_ptr, _i64s, _ptr, _i64s, _ptr, _i64s, _ptr, _i64s, _int, _ptr, _i64s, _ptr, _ptr, _i64,
                               _i64, _i64, _i64, _i64, _i64, _dbl, _int],
    "kiln_first_nonfinite": [_i64s, _ints, _i64s, _int, _int],
    "kiln_scale": [_ptr, _int, _ptr, _int, _i64, _dbl, _int],
    "kiln_widen_acc": [_ptr, _ptr, _i64, _int, _int],
    "kiln_embedding_backward_acc": [_ptr, _int, _ptr, _i64, _i64, _i64, _i64, _ptr, _int, _ptr, _int],
    "kiln_attn_backward_bf16": [_ptr, _i64s, _ptr, _i64s, _ptr, _i64s, _ptr, _i64s, _ptr, _i64s, _ptr, _ptr, _ptr, _i64s,
                                _int, _ptr, _ptr, _ptr, _i64s, _i64, _i64, _i64, _i64, _i64, _i64, _dbl, _int],
}


def enabled() -> bool:
    """False where KILN_NATIVE=0 asks for the ATen compositions."""
    return _switched_on("KILN_NATIVE")


def _switched_on(name: str) -> bool:
    """An on/off environment switch, on unless set to 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _library(isa: str) -> Optional[ctypes.CDLL]:
    """native.c built for `isa` and loaded, or None (logged once) where it cannot be: the library `pip install`
    built from these very sources if there is one, else one built now into the user's cache."""
    try:
        target = _installed(isa) or _built(isa)
        if target is None:
            return None
        lib = ctypes.CDLL(str(target))
        _loaded[isa] = str(target)
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        return lib
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("kiln: could not build Kiln's native CPU kernels (%s); they run as ATen compositions "
                    "(set KILN_NATIVE=0 to silence this)", exc)
        return None


def _installed(isa: str) -> Optional[Path]:
    """The library setup.py built for `isa` at install time from the sources beside this file (their digest is
    in its name), or None: not installed that way, built for other sources (an edited checkout), or for
    another ISA."""
    path = native_build.HERE / (native_build.installed_stem(isa, native_build.flags(isa))
                                + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    return path if path.is_file() else None


def _built(isa: str) -> Optional[Path]:
    """The library for `isa` from the user's cache, compiled there first if it is not there yet; None where
    there is no C compiler."""
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        log.info("kiln: no C compiler (%s) found: Kiln's elementwise kernels run as ATen compositions", cc)
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    folder = cachedir.private(cachedir.root(), ("native",))   # a shared library is code: ours alone
    try:
        return _build(path, version, native_build.flags(isa), folder, isa)
    except OSError as exc:                 # a compiler without OpenMP (Apple's clang): one thread
        target = _build(path, version, native_build.flags(isa, openmp=False), folder, isa)
        log.info("kiln: native CPU kernels built without OpenMP (%s): they run on one thread", exc)
        return target


_loaded: dict[str, str] = {}          # ISA -> the library file loaded for it


def describe() -> str:
    """One line for `kiln.explain`: whether the kernels run their native loops, for which ISA, from where."""
    if not enabled():
        return "off (KILN_NATIVE=0): Kiln's elementwise kernels run as ATen compositions"
    isa = torch.backends.cpu.get_cpu_capability()
    if library() is None:
        return "unavailable (no C compiler or the build failed; see the log): ATen compositions"
    path = _loaded.get(isa, "?")
    how = "installed with the package" if Path(path).parent == native_build.HERE else "built on first use"
    tiles = "; bf16 products on AMX tiles (KILN_AMX=0 turns them off)" if amx_tiles() else ""
    return f"{isa.lower()} build, {how}: {path} (KILN_NATIVE=0 turns them off){tiles}"


def _build(compiler: str, version: str, flags: list[str], folder: Path, isa: str) -> Path:
    """native.c compiled with `flags` into `folder` (named by a digest of the source, compiler and flags; built
    once, through a temporary file and a rename, so no reader sees half a library)."""
    sources = tuple(p.read_bytes() for p in native_build.SOURCES)
    digest = hashlib.sha256(repr((sources, version, flags, os.path.realpath(compiler))).encode())
    target = folder / f"kiln-native-{isa.lower()}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        native_build.compile_library(compiler, flags, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_building = threading.Lock()        # one build at a time (prepare's thread and a kernel's call may race)


def library() -> Optional[ctypes.CDLL]:
    """The loaded loops for the ISA ATen runs with now, or None (disabled, no compiler, failed build)."""
    if not enabled():
        return None
    isa = torch.backends.cpu.get_cpu_capability()
    if isa in _loaded:                  # built and loaded: the cached result, without the lock
        return _library(isa)
    with _building:
        return _library(isa)


def prepare() -> None:
    """Build or load the loops in a thread while the caller goes on: `kiln.compile` calls it, so that on a fresh
    machine the compiler (a second or so, in its own process) runs beside the model's capture instead of
    inside the first step. A kernel that needs the library meanwhile waits for it."""
    if enabled() and torch.backends.cpu.get_cpu_capability() not in _loaded and not _building.locked():
        threading.Thread(target=library, name="kiln-native-build").start()


def bf16_products() -> Optional[ctypes.CDLL]:
    """The library where `kiln_bf16_abt` (bf16 products with fp32 results on AVX-512 BF16) may run: built with
    it, ATen running its AVX-512 kernels (ATEN_CPU_CAPABILITY=avx2 asks for the AVX2 paths: then not), and
    the CPU saying it has the instructions; else None."""
    lib = library()
    if lib is None or torch.backends.cpu.get_cpu_capability() != "AVX512" or not lib.kiln_bf16_abt_built():
        return None
    return lib if cpu_flag("avx512_bf16") else None


def amx_tiles() -> bool:
    """Whether `kiln_bf16_abt` runs on AMX tiles (native_amx.c): where the products run at all, the CPU has
    AMX-BF16, oneDNN may use it (ONEDNN_MAX_CPU_ISA below AVX512_CORE_AMX asks for less: then not) and the OS
    granted the process the tile state (asked once). KILN_AMX=0 turns them off: the pair dot products and the
    one-pass attention kernels run, as on a CPU without AMX. About 4x the pair dot products' rate at
    attention's sizes (docs/kernels.md)."""
    lib = bf16_products()
    if lib is None:
        return False
    return cpu_flag("amx_bf16") and cpu_flag("amx_tile") and _onednn_amx_allowed() and _switched_on("KILN_AMX") \
        and bool(lib.kiln_amx_granted())


def _onednn_amx_allowed() -> bool:
    """ONEDNN_MAX_CPU_ISA, which caps oneDNN (ATen's bf16 products) below AMX, caps Kiln's products too, so
    that an AMX machine can run the paths of a CPU without it (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return not cap or cap == "ALL" or "AMX" in cap


@functools.cache
def cpu_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split(":", 1)[1].split() for line in f)
    except OSError:
        return False


def usable(*tensors: Optional[Tensor]) -> Optional[ctypes.CDLL]:
    """The library when every given tensor is a CPU float32/bfloat16 tensor (None entries are skipped);
    None otherwise: the caller runs its ATen composition."""
    if any(t is not None and (t.device.type != "cpu" or t.dtype not in _CODES) for t in tensors):
        return None
    return library()


def supports(dtype: torch.dtype) -> bool:
    return dtype in _CODES


def code(t: Tensor) -> int:
    return _CODES[t.dtype]


def ptr(t: Optional[Tensor]):
    return None if t is None else t.data_ptr()


def strides(t: Optional[Tensor]):
    """t's strides as a C array of int64 (None for None)."""
    return None if t is None else (ctypes.c_int64 * t.dim())(*t.stride())


def threads() -> int:
    return torch.get_num_threads()


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"kiln: the native {what} kernel refused its arguments (status {status})")


def dense(t: Tensor) -> bool:
    """Whether t covers a block of its storage exactly once (a permutation of a contiguous layout)."""
    expected = 1
    for size, st in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= size
    return True


def read_scalars(ts) -> list[float] | None:
    """The values of one-element fp32 CPU tensors (an optimizer's step counts), read from memory: one Python
    read each where `float(t)` is an ATen call (`item`) per tensor, about 400 profiler events a step for the
    52 step counts of the GPT-2 bench model's AdamW with the increment and the write-back. None unless every
    tensor is such a scalar."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or t.numel() != 1 or t.requires_grad for t in ts):
        return None
    return [ctypes.c_float.from_address(t.data_ptr()).value for t in ts]


def write_scalars(ts, values) -> None:
    """Write `values` into the one-element fp32 CPU tensors `ts` (`read_scalars`' counterpart; a step's commit).
    The tensors' version counters are bumped as an in-place write of them would."""
    for t, v in zip(ts, values):
        ctypes.c_float.from_address(t.data_ptr()).value = v
        torch.autograd.graph.increment_version(t)


def first_nonfinite(tensors: list[Tensor]) -> Optional[int]:
    """The index of the first tensor holding a NaN or an infinity, or None when all are finite: one read of
    each (native.c's exponent scan for dense CPU float32/bfloat16 tensors, `torch.isfinite` for the rest)."""
    lib = library()
    fast, ptrs, codes, sizes = [], [], [], []
    if lib is not None:
        for i, t in enumerate(tensors):
            c = _CODES.get(t.dtype)
            if c is not None and t.is_cpu and (t.is_contiguous() or dense(t)):
                fast.append(i)                 # a dense block starts at its data pointer (strides are positive)
                ptrs.append(t.data_ptr())
                codes.append(c)
                sizes.append(t.numel())
    bad = None
    if fast:
        n = len(fast)
        status = lib.kiln_first_nonfinite((ctypes.c_int64 * n)(*ptrs), (ctypes.c_int * n)(*codes),
                                          (ctypes.c_int64 * n)(*sizes), n, threads())
        if status < 0:
            raise MemoryError("kiln: the native non-finite scan could not allocate its chunk table")
        bad = fast[status - 1] if status else None
    if len(fast) == len(tensors):
        return bad
    done = set(fast)
    slow = (i for i, t in enumerate(tensors) if i not in done and (bad is None or i < bad))
    return next((i for i in slow if not bool(torch.isfinite(tensors[i]).all())), bad)
