"""Groundwork for the Hopper CUTLASS backend (issue #7): where the C++/CUDA sources are, how they
are JIT-built, and why they cannot be built here.

The backends that use it, each building its own extension: ``cutlass_diffusion`` (the
block-diffusion forward and backward on sm90, ``dlm_diffusion_sm90``) and ``cutlass_sparse`` (the
block-sparse forward, ``dlm_sparse_sm90``).

Sources. csrc/ ships as package data (``dlm_ops/csrc`` in an install; the repository's ``csrc/``
when dlm_ops is imported from a checkout, like ``templates/``). csrc/include is framework-free;
csrc/bindings is the only place that includes torch.

Build. ``build(name, sources)`` compiles sources from csrc/ with ``torch.utils.cpp_extension.load``
for sm_90a only, with csrc/include and the CUTLASS/CuTe headers of the ``nvidia-cutlass`` wheel
(``cutlass_library/source/include``; DLM_OPS_CUTLASS_INCLUDE overrides). It runs only where
``unavailable_reason()`` is None: a CUDA build of torch, an sm90 GPU, nvcc >= 12.3 and the headers.
A CPU-only install builds nothing. Each build gets its own directory, keyed by torch version, CUDA
version, nvcc release and a hash of every file under csrc/ and the flags, under
DLM_OPS_BUILD_DIR (default ``~/.cache/dlm_ops/cutlass``): an upgrade or an edited header rebuilds,
an unchanged tree only loads (the finished library directly, without a ninja run; such a directory
may be copied to another machine with the same torch, CUDA and nvcc). torch's build lock in that
directory serialises concurrent builds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from ..errors import UnsupportedConfig

log = logging.getLogger("dlm_ops.cutlass")

# sm_90a, not sm_90: wgmma and setmaxnreg exist only in the arch-specific target. The -gencode
# form, because with nvcc 13.0 the -arch=sm_90a shorthand also ran a plain sm_90 pass that rejects
# them (device HOPPER.md). A flag containing "arch" also stops torch from adding its own targets.
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
# No -std: torch picks the standard its own headers are written for (C++20 from torch 2.13, whose
# headers warn under -std=c++17), and CUTLASS 4 builds with either.
CUDA_FLAGS = [
    "-O3", "-DNDEBUG", "-lineinfo",
    "--expt-relaxed-constexpr", "--expt-extended-lambda",  # CuTe's constexpr layouts and lambdas
    # torch defines these to keep its own half operators unambiguous; CUTLASS needs cuda_fp16's.
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]
MIN_NVCC = (12, 3)  # CUTLASS 4's sm90 kernels (wgmma, TMA) need CUDA 12.3 or newer
SOURCE_SUFFIXES = {".h", ".hpp", ".cuh", ".cu", ".cpp"}


def csrc_dir() -> Path:
    """The C++/CUDA sources: the checkout's csrc/ beside dlm_ops/, else the installed package data."""
    package = Path(__file__).resolve().parent.parent
    beside = package.parent / "csrc"
    if (package.parent / "pyproject.toml").exists() and beside.is_dir():
        return beside
    return package / "csrc"


def cutlass_include() -> Path | None:
    """The CUTLASS/CuTe include directory, or None. The wheel's package is located, not imported:
    importing cutlass_library pulls in its generator and its dependencies (cuda-python, scipy,
    networkx, ...), none of which a header-only build needs, so the wheel can travel alone."""
    env = os.environ.get("DLM_OPS_CUTLASS_INCLUDE")
    if env:
        candidates = [Path(env)]
    else:
        spec = importlib.util.find_spec("cutlass_library")
        roots = list(spec.submodule_search_locations or []) if spec else []
        candidates = [Path(r) / "source" / "include" for r in roots]
    return next((p for p in candidates if (p / "cute" / "tensor.hpp").is_file()), None)


def cutlass_version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


@lru_cache(maxsize=1)
def nvcc() -> tuple[str, tuple[int, int]] | None:
    """(path, (major, minor)) of the nvcc torch would build with, or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    path = shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) if CUDA_HOME else shutil.which("nvcc")
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (path, (int(m.group(1)), int(m.group(2)))) if m else None


def unavailable_reason() -> str | None:
    """Why the CUTLASS sources cannot be built and run here, or None when they can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):  # sm_90a code runs on sm90 alone (not on sm100 or later)
        return f"the kernels are sm_90a (H100/H200); this GPU is sm{major}{minor}"
    return toolchain_reason()


def toolchain_reason() -> str | None:
    """Why the sources cannot be compiled here (GPU or not), or None: a CUDA build of torch, nvcc
    >= 12.3, the CUTLASS headers, the csrc/ sources and ninja."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    reason = compiler_reason()
    if reason:
        return reason
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is missing (pip install ninja): torch.utils.cpp_extension builds with it"
    return None


def compiler_reason() -> str | None:
    """Why nvcc cannot compile the csrc/ units here, or None: nvcc >= 12.3, the CUTLASS headers and
    the sources (what tests/ptxas_advisories.py needs; an extension build also needs a CUDA build of
    torch and ninja: toolchain_reason)."""
    found = nvcc()
    if found is None:
        return "no CUDA toolkit: nvcc not found (set CUDA_HOME)"
    if found[1] < MIN_NVCC:
        return f"nvcc {found[1][0]}.{found[1][1]} at {found[0]} is older than 12.3 (sm90a wgmma/TMA)"
    if cutlass_include() is None:
        return ("the CUTLASS headers are missing: pip install nvidia-cutlass (or set "
                "DLM_OPS_CUTLASS_INCLUDE to a directory holding cute/tensor.hpp)")
    if not (csrc_dir() / "include" / "dlm" / "geometry.h").is_file():
        return f"the csrc/ sources are missing from this install ({csrc_dir()})"
    return None


def availability() -> str:
    """One line for ``python -m dlm_ops``: whether the CUTLASS sources can be built here, or why not."""
    reason = unavailable_reason()
    if reason:
        return f"nothing built: {reason}"
    major, minor = nvcc()[1]
    return f"buildable with nvcc {major}.{minor} and CUTLASS {cutlass_version(cutlass_include())}"


def _source_hash(flags: Sequence[str]) -> str:
    """Every file under csrc/ (a header edit must rebuild), the CUTLASS version and the flags."""
    h = hashlib.sha256()
    root = csrc_dir()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    include = cutlass_include()
    h.update((cutlass_version(include) if include else "none").encode())
    h.update("\0".join(flags).encode())
    return h.hexdigest()[:16]


def source_hash() -> str:
    """The hash in the build directories of the shipped extensions (built with the default flags):
    what identifies the kernels a benchmark row ran, even where the commit cannot be read."""
    return _source_hash(ARCH_FLAGS + CUDA_FLAGS)


def build_directory(name: str, flags: Sequence[str]) -> Path:
    """Where ``name`` is built: one directory per torch version, CUDA version and source hash."""
    root = Path(os.environ.get("DLM_OPS_BUILD_DIR") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlm_ops" / "cutlass")
    found = nvcc()
    nvcc_tag = f"nvcc{found[1][0]}.{found[1][1]}" if found else "nocuda"
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-{nvcc_tag}-{_source_hash(flags)}"
    return root / re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{name}-{tag}")


def process_libstdcxx() -> str | None:
    """The libstdc++ this process has mapped (torch's), by path, or None (not Linux, not found)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def link_flags() -> list[str]:
    """The extensions link the libstdc++ of the process that loads them, by path. Why: the device
    machine's toolchain (/opt/gcc g++ 13.3) links libstdc++ statically, and its extensions then
    carry a private copy that also exports ~4,500 std:: and __cxa symbols (nm -D, session 31):
    torch's own libstdc++ takes over some of the extension's calls and the private copy serves the
    rest, and a C++ exception raised in a binding ended the process with SIGSEGV (sessions 23 and
    30; with this link every binding raises cleanly there, session 32). Named first on the link
    line, the shared library resolves every libstdc++ reference, so the static archive the driver
    adds behind it contributes nothing; with a toolchain that links it dynamically anyway this
    names the same soname. DLM_OPS_LINK_LIBSTDCXX=0 leaves the driver's default. Not in the build
    hash: the path is the machine's, and a prebuilt library must keep its directory name on the GPU
    machine."""
    if os.environ.get("DLM_OPS_LINK_LIBSTDCXX", "1") == "0":
        return []
    found = process_libstdcxx()
    return [found] if found else []


def build(name: str, sources: Sequence[str], extra_cuda_cflags: Sequence[str] = (),
          verbose: bool = False, without_gpu: bool = False):
    """JIT-build (or load the cached build of) the torch extension ``name`` from ``sources``
    (paths relative to csrc/) for sm_90a, and return the loaded module. Raises UnsupportedConfig
    with the reason where nothing can be built (a CPU-only install, no sm90 GPU, no nvcc, no
    CUTLASS headers). ``without_gpu``: compile on a machine with no sm90 GPU (``prebuild``)."""
    reason = toolchain_reason() if without_gpu else unavailable_reason()
    if reason:
        raise UnsupportedConfig(f"cannot build the CUTLASS extension {name!r}: {reason}")
    from torch.utils import cpp_extension

    flags = ARCH_FLAGS + CUDA_FLAGS + list(extra_cuda_cflags)
    directory = build_directory(name, flags)
    directory.mkdir(parents=True, exist_ok=True)
    module_name, built = built_library(name, directory)
    cached = built.exists()
    if cached and not (directory / "lock").exists():
        # The directory's name already says what was built (versions, flags, every source's
        # bytes), so a finished build loads without a ninja run (ninja re-checks every object's
        # dependencies in every process, needs ninja at run time, and rebuilds a copied directory
        # from scratch: its build.ninja names the sources by absolute path). A build in progress
        # holds torch's "lock" file in the directory.
        try:
            return load_built(module_name, built)
        except ImportError as e:
            log.warning("dlm_ops: the build in %s does not load (%s); rebuilding", directory, e)
    if not cached:
        # WARNING, not INFO: with no logging configured this still reaches stderr, and the first
        # call of a process otherwise stalls for minutes without a word.
        log.warning("dlm_ops: compiling %s for sm_90a (first use with this torch, CUDA and source "
                    "version; takes minutes; cached in %s)", name, directory)
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=module_name,
        sources=[str(csrc_dir() / s) for s in sources],
        extra_include_paths=[str(csrc_dir()), str(csrc_dir() / "include"), str(cutlass_include())],
        extra_cflags=["-O3"],
        extra_cuda_cflags=flags,
        extra_ldflags=link_flags(),
        build_directory=str(directory),
        verbose=verbose,
    )
    if not cached:
        log.info("dlm_ops: built %s in %.0f s", name, time.perf_counter() - t0)
    return module


def load_built(module_name: str, path: Path):
    """Import the extension module ``module_name`` from the shared library at ``path``."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prebuild(verbose: bool = False) -> list[Path]:
    """Compile every cutlass extension here, GPU or not (a login node, a CI image), into
    DLM_OPS_BUILD_DIR: a GPU machine with the same torch, CUDA and nvcc versions and sources then
    loads them without compiling. The object files are removed (``prune_objects``): what is left to
    copy is the two libraries, ~20 MB at 2.11 / CUDA 13. Returns the shared libraries; raises
    UnsupportedConfig with the reason where the toolchain is missing."""
    from . import cutlass_diffusion, cutlass_sparse

    built = []
    for name, sources in (("dlm_diffusion_sm90", cutlass_diffusion.SOURCES),
                          ("dlm_sparse_sm90", cutlass_sparse.SOURCES)):
        build(name, sources, verbose=verbose, without_gpu=True)
        directory = build_directory(name, ARCH_FLAGS + CUDA_FLAGS)
        prune_objects(directory)
        built.append(built_library(name, directory)[1])
    return built


def built_library(name: str, directory: Path) -> tuple[str, Path]:
    """(module name, shared library) of extension ``name`` in its build directory. The module name
    carries the directory's hash too: two source versions never share a Python module name."""
    module_name = f"{name}_{directory.name.rsplit('-', 1)[-1]}"
    return module_name, directory / f"{module_name}.so"


def prune_objects(directory: Path) -> int:
    """Delete a finished build's object files (*.o, *.o.d) and return how many: a finished build
    loads its library without ninja (``build``), and a source edit builds a new directory anyway."""
    objects = [p for pattern in ("*.o", "*.o.d") for p in directory.glob(pattern)]
    for p in objects:
        p.unlink()
    return len(objects)


def build_or_reason(name: str, sources: Sequence[str]):
    """``(build(name, sources), None)``, or ``(None, why)`` when the build fails, warned once: a
    compiler error must not take the op down (the family's Triton backend still runs), and the
    caller remembers the reason so that dispatch moves on for good."""
    try:
        return build(name, sources), None
    except Exception as e:
        reason = f"the sm90 build failed ({type(e).__name__}: {str(e)[-300:]})"
        warnings.warn(f"dlm_ops: {reason}; the triton backend runs instead")
        return None, reason


def tma_ready(t: torch.Tensor) -> bool:
    """Viewable as a kernel's (S, D, H, B) TMA tensor: unit stride in D, 16-byte aligned. (One
    stride() call and no generator: a training step asks 9 times, and the per-dimension form took
    1.5 us a call on the workstation, 0.4 us this way.)"""
    st, size = t.stride(), t.element_size()
    return (st[3] == 1 and t.data_ptr() % 16 == 0
            and not ((st[0] * size) % 16 or (st[1] * size) % 16 or (st[2] * size) % 16))


@lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors: the grid of a persistent kernel (one CTA per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_TOOLCHAIN: list = []  # [unavailable_reason()] once computed (Sm90Backend)


class Sm90Backend:
    """What the cutlass backends of every op family share (a mixin before the family's Triton
    backend): chosen automatically on CUDA unless DLM_OPS_CUTLASS=0 (then nothing is ever built),
    unavailable while the toolchain is missing or after a failed build. Each family module keeps
    its own extension and memory of its build (``_build_error``); the toolchain's answer is one
    per process (``_TOOLCHAIN``: it runs `ninja --version` in a subprocess and dispatch asks on every
    call; on the H200 a 0.4 ms forward took 2.6 ms per call before this was cached)."""

    opt_in = "DLM_OPS_CUTLASS is not 0"

    @property
    def auto_device_types(self):
        return frozenset() if os.environ.get("DLM_OPS_CUTLASS") == "0" else frozenset({"cuda"})

    def unavailable_reason(self) -> str | None:
        return super().unavailable_reason() or self._toolchain_reason() or self._build_error()

    def _toolchain_reason(self) -> str | None:
        if not _TOOLCHAIN:
            _TOOLCHAIN.append(unavailable_reason())
        return _TOOLCHAIN[0]

    def _build_error(self) -> str | None:
        raise NotImplementedError
