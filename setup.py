"""Build offload's two extensions.

``offload._C`` (``csrc/*.cpp``) is built with g++ and pybind11 alone: no nvcc, no CUDA headers, no
torch headers. It declares the few CUDA driver types it needs and loads ``libcuda.so.1`` at run
time, so one build works with any torch / CUDA version and on CPU-only machines.

``offload._entries`` (``csrc/torch/*.cpp``, a group's per-tensor bookkeeping) is built against
torch's C++ API, so only where torch is importable at build time: ``pip install
--no-build-isolation`` (what the README and CI use), or torch in the build environment. It is
tied to that exact torch; ``offload.host.native`` checks the version and falls back to the Python
reference otherwise. ``OFFLOAD_BUILD_ENTRIES=0`` skips it. Project metadata lives in
``pyproject.toml``.
"""

from __future__ import annotations

import os
import sys
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
cmdclass = {"build_ext": build_ext}


def _torch_extension() -> None:
    """Add ``offload._entries`` when torch's headers can be had; say why not otherwise."""
    if os.environ.get("OFFLOAD_BUILD_ENTRIES", "1").strip().lower() in ("0", "false", "no", "off"):
        print("offload: OFFLOAD_BUILD_ENTRIES=0: offload._entries not built (Python fallback)", file=sys.stderr)
        return
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        print(
            f"offload: torch is not importable in the build environment ({type(exc).__name__}: {exc}), "
            "so offload._entries (the native per-tensor path) is not built and the Python fallback "
            "is used; install with `pip install --no-build-isolation -e .` to build it",
            file=sys.stderr,
        )
        return
    ext_modules.append(
        CppExtension(
            "offload._entries",
            sorted(glob("csrc/torch/*.cpp")),
            extra_compile_args=["-O2"],
            define_macros=[("OFFLOAD_TORCH_VERSION", f'"{torch.__version__}"')],
        )
    )
    # torch's build_ext adds its include paths and ABI flags to its own extensions only where
    # they ask for them (CppExtension did); offload._C keeps its plain flags.
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=False)


_torch_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
