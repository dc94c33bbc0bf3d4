"""Builds Kiln's native CPU loops (kiln/kernels/native.c) at install time, once per vector ISA, so that a first
training step does not wait for the C compiler (kiln/kernels/native_build.py says how, and how the library
is found). Everything else about the package is in pyproject.toml.

A build that fails (no C compiler, no OpenMP) does not fail the install: it is reported, and Kiln builds the
library on first use instead (or runs its ATen compositions where it cannot).
"""
import importlib.util
import os
import platform
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_spec = importlib.util.spec_from_file_location("kiln_native_build",
                                               Path(__file__).resolve().parent / "kiln" / "kernels" / "native_build.py")
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)


class NativeLibrary(Extension):
    """A plain shared library (loaded with ctypes, not imported) for one ISA."""

    def __init__(self, isa: str):
        self.isa = isa
        self.build_flags = native_build.flags(isa)
        super().__init__(f"kiln.kernels.{native_build.installed_stem(isa, self.build_flags)}",
                         sources=[os.path.relpath(native_build.SOURCE, Path(__file__).resolve().parent)],
                         optional=True)


class BuildNative(build_ext):
    def build_extension(self, ext):
        if not isinstance(ext, NativeLibrary):
            return super().build_extension(ext)
        compiler = shutil.which(os.environ.get("CC") or "cc")
        if compiler is None:
            print(f"kiln: no C compiler: the {ext.isa} native kernels are built on first use instead")
            return
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        print(f"kiln: building the native CPU kernels for {ext.isa} ({out.name})")
        try:
            native_build.compile_library(compiler, ext.build_flags, str(tmp))
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError) as exc:      # a failure, or a compiler that hung
            print(f"kiln: the {ext.isa} native kernels were not built ({exc}); they are built on first use")
        finally:
            if tmp.exists():
                tmp.unlink()


setup(ext_modules=[NativeLibrary(isa) for isa in native_build.isas_for(platform.machine())],
      cmdclass={"build_ext": BuildNative})
