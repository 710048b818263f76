"""Build the ``offload._C`` extension with g++ and pybind11 alone.

No nvcc, no CUDA headers, no torch headers: the extension declares the few CUDA driver types it
needs and loads ``libcuda.so.1`` at run time, so one build works with any torch / CUDA version and
on CPU-only machines. Project metadata lives in ``pyproject.toml``.
"""

from __future__ import annotations

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

# Relative paths on purpose: pip runs this file from the project root, and setuptools wants
# sources relative to it.
SOURCES = sorted(glob("csrc/*.cpp"))
HEADERS = sorted(glob("csrc/*.h"))

ext_modules = [
    Pybind11Extension(
        "offload._C",
        SOURCES,
        depends=HEADERS,  # rebuild when a header changes
        cxx_std=17,
        extra_compile_args=["-O2"],  # after the interpreter's own flags, so it wins
        libraries=["dl"],  # dlopen/dlsym (part of libc on glibc >= 2.34; harmless before)
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
