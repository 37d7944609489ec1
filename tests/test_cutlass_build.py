"""The CUTLASS groundwork (dlm_ops/backends/cutlass.py): why nothing is built where it cannot run,
where the sources and headers are found, the build cache key, package data, the sm_90a compile
(where nvcc and the CUTLASS headers exist) and, on the H200, the JIT-built smoke extension."""

import fnmatch
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dlm_ops.backends import REGISTRIES, cutlass
from dlm_ops.errors import UnsupportedConfig
from dlm_ops.geometry import SequenceMask


@pytest.fixture
def sm90_machine(monkeypatch, tmp_path):
    """Everything unavailable_reason() checks, faked present (nvcc 13.0, an sm90 GPU, headers)."""
    include = tmp_path / "include"
    (include / "cute").mkdir(parents=True)
    (include / "cute" / "tensor.hpp").write_text("")
    (include / "cutlass").mkdir()
    (include / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    monkeypatch.setenv("DLM_OPS_CUTLASS_INCLUDE", str(include))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cutlass, "nvcc", lambda: ("/fake/nvcc", (13, 0)))
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: True)
    return include


def test_the_cutlass_backends_and_cpu_never_selects_them():
    from dlm_ops.backends import select
    from dlm_ops.backends.base import Problem

    assert sorted(f for f, registry in REGISTRIES.items() if "cutlass" in registry) == [
        "diffusion", "sparse"]
    for family in ("diffusion", "sparse"):
        for dtype in (torch.float32, torch.bfloat16):
            assert select(Problem("cpu", dtype, 128), family=family).name != "cutlass"


def test_a_cpu_install_builds_nothing_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    reason = cutlass.unavailable_reason()
    assert reason == f"torch {torch.__version__} is a CPU build"
    assert cutlass.availability() == f"nothing built: {reason}"
    with pytest.raises(UnsupportedConfig, match="CPU build"):
        cutlass.build("dlm_never_built", ["bindings/sm90_smoke.cu"])


@pytest.mark.parametrize("change,reason", [
    (lambda m: m.setattr(torch.cuda, "is_available", lambda: False), "no CUDA GPU visible"),
    (lambda m: m.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0)), "this GPU is sm100"),
    (lambda m: m.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0)), "this GPU is sm80"),
    (lambda m: m.setattr(cutlass, "nvcc", lambda: None), "nvcc not found"),
    (lambda m: m.setattr(cutlass, "nvcc", lambda: ("/old/nvcc", (12, 2))), "nvcc 12.2 at /old/nvcc is older"),
    (lambda m: m.setenv("DLM_OPS_CUTLASS_INCLUDE", "/nonexistent"), "pip install nvidia-cutlass"),
    (lambda m: m.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: False), "ninja"),
])
def test_each_missing_piece_is_named(sm90_machine, monkeypatch, change, reason):
    assert cutlass.unavailable_reason() is None
    assert cutlass.availability() == "buildable with nvcc 13.0 and CUTLASS 4.2.0"
    change(monkeypatch)
    assert reason in cutlass.unavailable_reason()
    with pytest.raises(UnsupportedConfig, match=re.escape(reason)):
        cutlass.build("dlm_never_built", ["bindings/sm90_smoke.cu"])


def test_the_wheel_is_found_without_importing_it(monkeypatch, tmp_path):
    """cutlass_library's __init__ imports its generator and dependencies; the headers need none."""
    package = tmp_path / "site" / "cutlass_library"
    (package / "source" / "include" / "cute").mkdir(parents=True)
    (package / "source" / "include" / "cute" / "tensor.hpp").write_text("")
    (package / "__init__.py").write_text("raise ImportError('the headers need no import')\n")
    monkeypatch.delenv("DLM_OPS_CUTLASS_INCLUDE", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert cutlass.cutlass_include() == package / "source" / "include"
    assert "cutlass_library" not in sys.modules


def test_build_directory_keys_on_torch_cuda_sources_and_flags(sm90_machine, monkeypatch, tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(cutlass.csrc_dir(), src)
    monkeypatch.setattr(cutlass, "csrc_dir", lambda: src)
    monkeypatch.setenv("DLM_OPS_BUILD_DIR", str(tmp_path / "cache"))
    flags = cutlass.ARCH_FLAGS + cutlass.CUDA_FLAGS
    first = cutlass.build_directory("ext", flags)
    assert first.parent == tmp_path / "cache"
    assert first.name.startswith(f"ext-torch{torch.__version__}-cu13.0-nvcc13.0-")
    assert cutlass.build_directory("ext", flags) == first  # unchanged tree: the cached build
    assert cutlass.build_directory("ext", flags + ["-DX"]) != first
    header = src / "include" / "dlm" / "geometry.h"
    header.write_text(header.read_text() + "\n// edited\n")
    edited = cutlass.build_directory("ext", flags)
    assert edited != first
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert cutlass.build_directory("ext", flags) not in (first, edited)


def test_a_finished_build_loads_without_ninja(sm90_machine, monkeypatch, tmp_path):
    """A build directory holding its library loads it directly (no cpp_extension.load, no ninja
    run); one whose build is in progress (torch's lock file) or whose library does not import goes
    through cpp_extension.load, which waits for or redoes the build."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("DLM_OPS_BUILD_DIR", str(tmp_path / "cache"))
    directory = cutlass.build_directory("ext", cutlass.ARCH_FLAGS + cutlass.CUDA_FLAGS)
    module_name = f"ext_{directory.name.rsplit('-', 1)[-1]}"
    directory.mkdir(parents=True)
    (directory / f"{module_name}.so").write_bytes(b"\x7fELF")
    loaded, built = [], []
    monkeypatch.setattr(cutlass, "load_built", lambda name, path: loaded.append(path) or "module")
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]) or "rebuilt")
    assert cutlass.build("ext", ["x.cu"]) == "module" and not built
    (directory / "lock").write_text("")
    assert cutlass.build("ext", ["x.cu"]) == "rebuilt" and built == [module_name]
    (directory / "lock").unlink()

    def unloadable(name, path):
        raise ImportError("invalid ELF header")

    monkeypatch.setattr(cutlass, "load_built", unloadable)
    assert cutlass.build("ext", ["x.cu"]) == "rebuilt" and built == [module_name] * 2


def test_builds_link_the_libstdcxx_of_the_process(sm90_machine, monkeypatch, tmp_path):
    """Every build names the libstdc++ this process mapped on its link line (a toolchain that
    links it statically otherwise gives the extension a private copy: csrc/NOTES.md "Session
    31"); DLM_OPS_LINK_LIBSTDCXX=0 leaves the driver's default; the flag does not move the build
    directory (a prebuilt library keeps its name on another machine)."""
    from torch.utils import cpp_extension

    found = cutlass.process_libstdcxx()
    if found is None:
        pytest.skip("no libstdc++ mapped in this process (/proc/self/maps)")
    assert os.path.basename(found).startswith("libstdc++.so") and os.path.isfile(found)
    monkeypatch.setenv("DLM_OPS_BUILD_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "built")
    directory = cutlass.build_directory("ext", cutlass.ARCH_FLAGS + cutlass.CUDA_FLAGS)
    monkeypatch.delenv("DLM_OPS_LINK_LIBSTDCXX", raising=False)
    assert cutlass.build("ext", ["x.cu"]) == "built" and calls[-1]["extra_ldflags"] == [found]
    assert calls[-1]["build_directory"] == str(directory)
    monkeypatch.setenv("DLM_OPS_LINK_LIBSTDCXX", "0")
    assert cutlass.build("ext", ["x.cu"]) == "built" and calls[-1]["extra_ldflags"] == []
    assert calls[-1]["build_directory"] == str(directory)


def test_load_built_imports_an_extension_module(tmp_path):
    import math

    if not getattr(math, "__file__", None):
        pytest.skip("math is built into this interpreter")
    assert cutlass.load_built("math", Path(math.__file__)).sqrt(4.0) == 2.0
    (tmp_path / "broken.so").write_bytes(b"not a library")
    with pytest.raises(ImportError):
        cutlass.load_built("broken", tmp_path / "broken.so")


def test_csrc_ships_as_package_data():
    """Every source file under csrc/ matches a package-data glob of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")
    root = cutlass.csrc_dir()
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert pyproject["package-dir"]["dlm_ops.csrc"] == "csrc" and "dlm_ops.csrc" in pyproject["packages"]
    globs = pyproject["package-data"]["dlm_ops.csrc"]
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), files


def test_smoke_kernels_compile_for_sm90a(tmp_path):
    """The header and CuTe's wgmma path compile for sm_90a with the CUTLASS wheel's headers, with
    no spill and no stack, and the machine code holds wgmma (HGMMA). Needs nvcc and the headers."""
    found, include = cutlass.nvcc(), cutlass.cutlass_include()
    if found is None or include is None:
        pytest.skip("needs nvcc and the nvidia-cutlass headers (pip install nvidia-cutlass)")
    tu = tmp_path / "smoke.cu"
    tu.write_text('#include "hopper/sm90_smoke.cuh"\n')
    cmd = [found[0], "-std=c++17", *cutlass.ARCH_FLAGS, *cutlass.CUDA_FLAGS, "-Xptxas", "-v", "-c",
           f"-I{cutlass.csrc_dir()}", f"-I{cutlass.csrc_dir() / 'include'}", f"-I{include}",
           str(tu), "-o", str(tmp_path / "smoke.o")]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    print(f"nvcc sm_90a compile: {time.perf_counter() - t0:.1f} s\n{r.stderr}")
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                       r.stderr)
    assert len(usage) == 2 and all(u == ("0", "0", "0") for u in usage), r.stderr
    cuobjdump = shutil.which("cuobjdump", path=str(Path(found[0]).parent))
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "--dump-sass", str(tmp_path / "smoke.o")],
                              capture_output=True, text=True, timeout=120).stdout
        assert "HGMMA.64x64x16.F32.BF16" in sass


def test_the_forward_kernel_compiles_for_sm90(tmp_path):
    """csrc/hopper/diffusion_fwd.cuh (one of its four instantiations) compiles for sm_90a without
    spills, with wgmma and the SFU exp2 in the machine code: a compile break shows here, before
    any device time. The 16-byte stack frame is the two-run TileRuns arrays, indexed by the loop
    over runs (no spill). Needs nvcc and the headers (skipped in CI)."""
    found, include = cutlass.nvcc(), cutlass.cutlass_include()
    if found is None or include is None:
        pytest.skip("needs nvcc and the nvidia-cutlass headers (pip install nvidia-cutlass)")
    tu = cutlass.csrc_dir() / "hopper" / "diffusion_fwd_bf16_d128.cu"
    cmd = [found[0], "-std=c++17", *cutlass.ARCH_FLAGS, *cutlass.CUDA_FLAGS, "-Xptxas", "-v", "-c",
           f"-I{cutlass.csrc_dir()}", f"-I{cutlass.csrc_dir() / 'include'}", f"-I{include}",
           str(tu), "-o", str(tmp_path / "fwd.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                       r.stderr)
    assert usage and all(int(frame) <= 16 and st == ld == "0" for frame, st, ld in usage), r.stderr
    cuobjdump = shutil.which("cuobjdump", path=str(Path(found[0]).parent))
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "--dump-sass", str(tmp_path / "fwd.o")],
                              capture_output=True, text=True, timeout=120).stdout
        assert "HGMMA.64x128x16.F32.BF16" in sass and "MUFU.EX2" in sass


def test_the_column_gather_compiles_for_sm90(tmp_path):
    """csrc/hopper/column_gather.cuh (plain CUDA, no torch) compiles for sm_90a: four kernels
    (16 / 8 / 4 / 2-byte vectors), no stack, no spill, and the 16-byte one moves rows with
    128-bit loads and stores. Needs nvcc (skipped in CI)."""
    found = cutlass.nvcc()
    if found is None:
        pytest.skip("needs nvcc")
    tu = tmp_path / "gather.cu"
    tu.write_text('#include "hopper/column_gather.cuh"\n'
                  "cudaError_t run(const dlm::sm90::ColumnGatherArgs& a) {\n"
                  "  return dlm::sm90::launch_column_gather(a);\n}\n")
    cmd = [found[0], "-std=c++17", *cutlass.ARCH_FLAGS, *cutlass.CUDA_FLAGS, "-Xptxas", "-v", "-c",
           f"-I{cutlass.csrc_dir()}", str(tu), "-o", str(tmp_path / "gather.o")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    usage = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert len(usage) == 4 and all(u == ("0", "0", "0") for u in usage), r.stderr
    cuobjdump = shutil.which("cuobjdump", path=str(Path(found[0]).parent))
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "--dump-sass", str(tmp_path / "gather.o")],
                              capture_output=True, text=True, timeout=120).stdout
        assert "LDG.E.128.CONSTANT" in sass and "STG.E.128" in sass


# -- on the H200 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke():
    reason = cutlass.unavailable_reason()
    if reason:
        pytest.skip(f"the CUTLASS extension cannot be built here: {reason}")
    return cutlass.build("dlm_sm90_smoke", ["bindings/sm90_smoke.cu"])


@st.composite
def masks(draw):
    n = draw(st.integers(0, 300))
    nn = draw(st.sampled_from([n, 0]))  # BD3 or block-causal
    bs = draw(st.one_of(st.integers(1, n + 5), st.sampled_from([1, 16, 64])))
    return SequenceMask(nn, n, bs)


@pytest.mark.gpu
@given(masks(), st.integers(1, 130), st.integers(1, 130))
def test_device_geometry_matches_geometry_py(smoke, mask, block_m, block_n):
    for transpose in (False, True):
        plans = mask.bwd_tiles(block_m, block_n) if transpose else mask.fwd_tiles(block_m, block_n)
        other = mask._tiles(block_m if transpose else block_n)
        runs, area, kinds = (t.cpu() for t in smoke.tile_runs(mask.n_noisy, mask.n_clean,
                                                                mask.block_size, block_m, block_n,
                                                                transpose))
        assert area.tolist() == [p.area for p in plans]
        want = torch.zeros(len(plans), len(other), dtype=torch.int8)
        for t, p in enumerate(plans):
            for v in p.visits:
                want[t, other.index((v.start, v.end))] = 2 if v.full else 1
        assert torch.equal(kinds, want), (mask, block_m, block_n, transpose)
        for t, (b0, e0, b1, e1) in enumerate(runs.tolist()):  # the runs list exactly the visits
            assert [o for o in [*range(b0, e0), *range(b1, e1)]] == torch.nonzero(want[t]).flatten().tolist()


@pytest.mark.gpu
@given(masks().filter(lambda m: m.seqlen > 0), st.integers(0, 10**6), st.integers(0, 2**31))
def test_wgmma_tile_with_the_element_mask(smoke, mask, where, seed):
    s = mask.seqlen
    row0, col0 = where % s, (where // s) % s
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(s, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    got = smoke.masked_scores(q, k, mask.n_noisy, mask.n_clean, mask.block_size, row0, col0)
    rows, cols = torch.arange(row0, row0 + 64), torch.arange(col0, col0 + 64)
    inside = (rows < s)[:, None] & (cols < s)[None, :]
    seen = inside & mask.visible(rows.clamp(max=s - 1), cols.clamp(max=s - 1))
    assert torch.equal(torch.isneginf(got).cpu(), ~seen)
    qt, kt = (torch.zeros(64, 64, device="cuda", dtype=torch.float64) for _ in range(2))
    qt[: min(64, s - row0)], kt[: min(64, s - col0)] = q[row0:row0 + 64].double(), k[col0:col0 + 64].double()
    gold = qt @ kt.T
    plain = (qt.float() @ kt.float().T).double()  # plain PyTorch in the kernel's fp32 accumulation
    seen = seen.cuda()
    err, plain_err = (float((x - gold)[seen].abs().amax()) if seen.any() else 0.0
                      for x in (got.double(), plain))
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)  # DESIGN.md section 4


def test_the_cutlass_backend_is_the_default_unless_opted_out(monkeypatch):
    """Chosen automatically wherever it can run, unless DLM_OPS_CUTLASS=0 (no JIT build then);
    backend="cutlass" forces it regardless."""
    from dlm_ops.backends import _auto_reasons
    from dlm_ops.backends.base import Problem
    from dlm_ops.backends.cutlass_diffusion import CutlassDiffusionBackend

    b = CutlassDiffusionBackend()
    monkeypatch.setattr(b, "not_supported_reasons", lambda problem: [])  # as on a ready H200
    problem = Problem("cuda", torch.bfloat16, 128)
    monkeypatch.setenv("DLM_OPS_CUTLASS", "0")
    assert _auto_reasons(b, problem) == [
        "chosen automatically only when DLM_OPS_CUTLASS is not 0 (force it with backend='cutlass')"]
    monkeypatch.delenv("DLM_OPS_CUTLASS")
    assert _auto_reasons(b, problem) == []


def test_the_persistent_rules(monkeypatch):
    """The forward: one CTA per SM walking the work items, whatever the length and head dim; the
    dK/dV kernel: the persistent one at D = 64 at every length, at D = 128 up to
    PERSISTENT_DKDV_MAX_HALF, or _GQA where query heads share a K / V head (the measured crossovers:
    cutlass_diffusion's comments; D = 256 has its own role-split kernel, one CTA per key tile); the
    main limit at 0 turns it off everywhere."""
    from dlm_ops.backends import cutlass_diffusion as cd

    monkeypatch.setattr(cd, "_sm_count", lambda device: 132)
    assert cd._max_ctas("cuda") == 132
    assert cd.PERSISTENT_DKDV_MAX_HALF == 2048 and cd.PERSISTENT_DKDV_MAX_HALF_GQA == 1024
    for group, limit in ((1, cd.PERSISTENT_DKDV_MAX_HALF), (4, cd.PERSISTENT_DKDV_MAX_HALF_GQA)):
        assert cd._persistent_dkdv(1, 128, group) and cd._persistent_dkdv(limit, 128, group)
        assert not cd._persistent_dkdv(limit + 1, 128, group)
        assert cd._persistent_dkdv(1, 64, group) and cd._persistent_dkdv(1 << 20, 64, group)
        assert not cd._persistent_dkdv(1, 256, group)
    monkeypatch.setattr(cd, "PERSISTENT_DKDV_MAX_HALF", 0)
    for d, group in itertools.product((64, 128), (1, 4)):
        assert not cd._persistent_dkdv(1, d, group)
