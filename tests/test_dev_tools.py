"""The developer tools beside the tests: ptxas's advisories (tests/ptxas_advisories.py) and the
small checked calls for compute-sanitizer (tests/sanitize_small.py)."""

import pytest

from tests import ptxas_advisories as pa

# ptxas -v output of session 26's serialized forward (abridged names), and of a clean kernel.
SERIALIZED = """ptxas info    : Compiling entry function '_ZN3dlm4sm9020diffusion_fwd_kernel' for 'sm_90a'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function '_ZN3dlm4sm9020diffusion_fwd_kernel'
ptxas info    : Function properties for _ZN3dlm4sm9020diffusion_fwd_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for _ZN3dlm4sm9016dkdv_kernel
    24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""


def test_parse_finds_the_serialization_advisory_and_the_spills():
    advisories, spills = pa.parse(SERIALIZED)
    assert len(advisories) == 1 and advisories[0].startswith("ptxas info    : (C7515)")
    assert spills == ["24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads"]


def test_parse_of_a_clean_build_is_empty():
    clean = "\n".join(l for l in SERIALIZED.splitlines() if "C7515" not in l and "dkdv" not in l
                      and "20 bytes" not in l)
    assert pa.parse(clean) == ([], [])


def test_compiler_reason_names_what_is_missing(monkeypatch):
    # What the tool needs, without the CUDA build of torch and ninja that an extension build needs.
    from dlm_ops.backends import cutlass

    monkeypatch.setattr(cutlass, "nvcc", lambda: None)
    assert cutlass.compiler_reason().startswith("no CUDA toolkit")
    monkeypatch.setattr(cutlass, "nvcc", lambda: ("/x/nvcc", (12, 0)))
    assert "older than 12.3" in cutlass.compiler_reason()
    monkeypatch.setattr(cutlass, "nvcc", lambda: ("/x/nvcc", (13, 0)))
    monkeypatch.setattr(cutlass, "cutlass_include", lambda: None)
    assert "CUTLASS headers are missing" in cutlass.compiler_reason()


def test_refuses_without_a_toolchain(capsys, monkeypatch):
    # CI has no nvcc: the tool names the reason and exits 2 instead of reporting a clean build.
    from dlm_ops.backends import cutlass

    monkeypatch.setattr(cutlass, "compiler_reason", lambda: "no nvcc (test)")
    assert pa.main([]) == 2
    assert "cannot compile: no nvcc (test)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["bwd"], ["fwd", "step"], ["step", "--persistant"]])
def test_sanitize_small_refuses_unknown_arguments(argv):
    # Before any CUDA call: a mistyped mode or flag must not run a different set of cases.
    from tests import sanitize_small
    with pytest.raises(SystemExit, match=r"usage: .*\[fwd\|step\] \[--persistent\]"):
        sanitize_small.main(argv)
