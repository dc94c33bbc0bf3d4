"""How native.c becomes a shared library: the sources, the flags per vector ISA, the compiler's command, and
the name of a library built at install time. Imports nothing of torch or kiln, so that setup.py can load it
by path in pip's build environment (where torch may not be installed) and build the same libraries that
kiln/kernels/native.py would build on first use.

Two places a library can come from (native.py looks in this order):
- **installed**: `pip install` (setup.py's build_ext) compiles native.c once per ISA into the package, named
  `_native_<isa>_<digest>` plus the interpreter's extension suffix. The digest covers the sources and the
  flags only, so a library found there was built from exactly the sources beside it; an edited source (an
  editable checkout) has another digest and is not loaded. The ISA flags are fixed lists, never
  `-march=native`, so a library built on one x86-64 machine is right on every machine whose ATen runs that ISA.
- **built on first use**: into the user's cache (native.py), when nothing installed matches.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "native.c"
# native.c #includes these: all of them decide the library
SOURCES = (SOURCE, *(HERE / f for f in ("native_loss.c", "native_attention.c", "native_sweeps.c", "native_embedding.c",
                                         "native_lut.c", "native_norms.c", "native_vec512.c",
                                         "native_amx.c")))
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fPIC", "-shared", "-std=c11"]
OPENMP = "-fopenmp"
PREFIX = "_native_"                 # installed libraries: _native_<isa>_<digest><extension suffix>


def flags(isa: str, openmp: bool = True) -> list[str]:
    """The compiler flags for `isa` (as torch.backends.cpu.get_cpu_capability() names it; an ISA without
    flags of its own, DEFAULT included, gets the compiler's baseline)."""
    return [*([OPENMP] if openmp else []), *BASE_FLAGS, *ISA_FLAGS.get(isa, [])]


def source_digest(build_flags: list[str]) -> str:
    """A digest of the sources and the flags: what an installed library must match to be loaded."""
    h = hashlib.sha256()
    for path in SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join(build_flags).encode())
    return h.hexdigest()[:16]


def installed_stem(isa: str, build_flags: list[str]) -> str:
    """The module name (without the extension suffix) of the installed library for `isa` built with `flags`."""
    return f"{PREFIX}{isa.lower()}_{source_digest(build_flags)}"


def isas_for(machine: str) -> list[str]:
    """The ISAs whose libraries an install builds on a platform (`platform.machine()`): every x86-64 level
    ATen dispatches to, so the one installed tree serves AVX2-only and AVX-512 CPUs (and
    ATEN_CPU_CAPABILITY=avx2 on the latter); elsewhere the baseline only."""
    if machine.lower() in ("x86_64", "amd64"):
        return ["AVX512", "AVX2", "DEFAULT"]
    return ["DEFAULT"]


def compile_library(compiler: str, build_flags: list[str], out: str, timeout: float = 120) -> None:
    """Compile native.c with `build_flags` into `out`; OSError with the compiler's message when it fails."""
    done = subprocess.run([compiler, *build_flags, str(SOURCE), "-o", out], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise OSError(f"{os.path.basename(compiler)} failed: {done.stderr.strip()[:400]}")
