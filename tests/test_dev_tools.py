"""The developer tools beside the tests: ptxas's advisories (tests/ptxas_advisories.py), the small
checked calls for compute-sanitizer (tests/sanitize_small.py), the SASS comparison of two
builds (tests/sass_diff.py) and a kernel's basic-block map (tests/sass_blocks.py)."""

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


# cuobjdump -sass and -res-usage output (abridged) of two builds of one kernel.
SASS = """
Fatbin elf code:
================
arch = sm_90a
	code for sm_90
		Function : _Z6kernelv
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe20000000800 */
        /*0010*/                   IMAD.SHL.U32 R3, R2, 0x40, RZ ;         /* 0x0000000000027919 */
        /*0020*/               @P0 BRA 0x60 ;                              /* 0x0000000000203947 */
        /*0030*/                   IADD3 R4, R3, R1, RZ ;                  /* 0x0000000000203947 */
"""
RES = """
Resource usage:
 Function _Z6kernelv:
  REG:168 STACK:96 SHARED:0 LOCAL:0 CONSTANT[0]:696 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def _kernel(text):
    from tests import sass_diff as sd
    return sd.Kernel(sd.parse_sass(text)["_Z6kernelv"])


def test_sass_diff_parses_instructions_and_resources():
    from tests import sass_diff as sd
    assert sd.parse_sass(SASS) == {"_Z6kernelv": ["LDC R1, c[0x0][0x28]", "IMAD.SHL.U32 R3, R2, 0x40, RZ",
                                                  "@P0 BRA 0x60", "IADD3 R4, R3, R1, RZ"]}
    assert sd.parse_resources(RES) == {"_Z6kernelv": (168, 96)}


def test_sass_diff_classes():
    from tests import sass_diff as sd
    a = _kernel(SASS)
    # R3 -> R7 throughout: the same code.
    assert sd.classify(a, _kernel(SASS.replace("R3", "R7"))) == "renamed"
    # Two registers merged into one is not a renaming (other dataflow), though the blanked text matches.
    assert sd.classify(a, _kernel(SASS.replace("R4, R3", "R4, R4"))) == "same-ops"
    swapped = SASS.replace("LDC R1, c[0x0][0x28]", "TMP").replace(
        "IMAD.SHL.U32 R3, R2, 0x40, RZ", "LDC R1, c[0x0][0x28]").replace("TMP", "IMAD.SHL.U32 R3, R2, 0x40, RZ")
    assert sd.classify(a, _kernel(swapped)) == "same-ops"
    assert sd.classify(a, _kernel(SASS.replace("0x40", "0x80"))) == "differs"
    assert sd.classify(a, _kernel(SASS)) == "identical"


def test_sass_diff_exit_status(monkeypatch, tmp_path, capsys):
    from tests import sass_diff as sd
    for name in ("a.so", "b.so"):
        (tmp_path / name).write_bytes(b"")
    builds = {"a.so": {"k": _kernel(SASS)}, "b.so": {"k": _kernel(SASS.replace("R3", "R7"))}}
    monkeypatch.setattr(sd, "cuobjdump", lambda: "cuobjdump")
    monkeypatch.setattr(sd, "kernels_of", lambda path, tool: builds[path.name])
    monkeypatch.setattr(sd, "demangle", lambda names: names)
    assert sd.main([str(tmp_path / "a.so"), str(tmp_path / "b.so")]) == 0
    builds["b.so"] = {"k": _kernel(SASS.replace("0x40", "0x80"))}
    assert sd.main([str(tmp_path / "a.so"), str(tmp_path / "b.so")]) == 1
    assert "0 identical, 0 renamed, 0 same-ops, 1 differs" in capsys.readouterr().out
    # A template's new defaulted argument renames its kernels: --rename maps B's names back.
    builds["b.so"] = {"kILb0EE": _kernel(SASS), "other": _kernel(SASS)}
    builds["a.so"] = {"kIE": _kernel(SASS), "other": _kernel(SASS)}
    paths = [str(tmp_path / "a.so"), str(tmp_path / "b.so")]
    assert sd.main(paths) == 1 and "1 only in A, 1 only in B" in capsys.readouterr().out
    assert sd.main(paths + ["--rename", "Lb0E="]) == 0
    assert "2 identical" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="only 0 kernels changed"):  # flags before the paths too
        sd.main(["--rename", "Lb0E=", *paths, "--show", "0"])
    monkeypatch.setattr(sd, "cuobjdump", lambda: None)
    assert sd.main([str(tmp_path / "a.so"), str(tmp_path / "b.so")]) == 2
    for bad in ([str(tmp_path / "a.so")], paths + ["--rename"], paths + ["--rename", "=x"],
                paths + ["--show", "x"], paths + ["--other"]):
        with pytest.raises(SystemExit, match="usage"):
            sd.main(bad)


LOOP = """
		Function : _Z4loopv
        /*0000*/                   MOV R1, RZ ;                            /* 0x0 */
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;  /* 0x0 */
        /*0020*/                   MUFU.EX2 R2, R2 ;                       /* 0x0 */
        /*0030*/               @!P0 BRA 0x10 ;                             /* 0x0 */
        /*0040*/                   STS [R3], R2 ;                          /* 0x0 */
        /*0050*/                   EXIT ;                                  /* 0x0 */
"""


def test_sass_blocks_splits_at_targets_and_branches():
    from tests import sass_blocks as sb
    name, lines = sb.kernel_lines(LOOP, "loop")
    assert name == "_Z4loopv" and [a for a, _ in lines] == [0, 0x10, 0x20, 0x30, 0x40, 0x50]
    blocks = sb.basic_blocks(lines)
    # 0x10 is a branch target (a new block), the BRA ends one, EXIT ends the last.
    assert [[a for a, _ in b] for b in blocks] == [[0], [0x10, 0x20, 0x30], [0x40, 0x50]]
    assert sb.summary(blocks[1]) == {"HGMMA": 1, "MUFU.EX2": 1}
    assert sb.opcode("@!P0 BRA 0x10") == "BRA"
    with pytest.raises(SystemExit, match="no kernel matches"):
        sb.kernel_lines(LOOP, "nothing")
