"""The README's main command: ``python -m dlm_ops`` runs, checks and times one call."""

import subprocess
import sys

from dlm_ops.__main__ import main


def test_main_reports_backends_and_a_checked_table(capsys):
    assert main(["--n", "48", "--heads", "4", "--kv-heads", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch: usable" in out
    assert "flex_attention rewrite: on" in out
    assert "cutlass (Hopper sm_90a kernels): " in out
    sparse = out.split("sparse family for ")[1].split("\n")  # its backends, each with a reason
    assert sparse[0].endswith(("torch", "triton", "cutlass"))  # the backend it would take
    assert sparse[1].startswith("  cutlass: ") and len(sparse[1]) > len("  cutlass: ")
    assert "dlm_ops (torch) fwd+bwd" in out and "SDPA dense mask fwd" in out
    assert "check: ok" in out


def test_module_entry_point_exit_code():
    r = subprocess.run([sys.executable, "-m", "dlm_ops", "--n", "16", "--repeats", "1",
                        "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "check: ok" in r.stdout


def test_prebuild_says_why_it_cannot_build(capsys, monkeypatch):
    # CI's torch is a CPU build: --prebuild compiles nothing and names the reason (exit 1); with a
    # CUDA build of torch and the toolchain, the same call compiles both extensions (the device
    # sessions' workstation builds run it).
    from dlm_ops.backends import cutlass

    reason = cutlass.toolchain_reason()
    if reason is None:
        monkeypatch.setattr(cutlass, "toolchain_reason", lambda: "no toolchain (test)")
        reason = "no toolchain (test)"
    assert main(["--prebuild"]) == 1
    assert f"nothing built: cannot build the CUTLASS extension 'dlm_diffusion_sm90': {reason}" in (
        capsys.readouterr().err)


def test_prebuild_leaves_the_libraries_only(tmp_path):
    # What a prebuilt directory keeps for copying: the library and ninja's file, not the objects.
    from dlm_ops.backends import cutlass

    for name in ("a.cuda.o", "a.cuda.o.d", "b.o", "ext_0123.so", "build.ninja"):
        (tmp_path / name).write_text("x")
    assert cutlass.prune_objects(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build.ninja", "ext_0123.so"]
