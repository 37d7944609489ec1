"""The sm90 forward's per-row key masks for tiles that start anywhere, through a host mirror.

tests/cuda/fwd_mask_mirror.cpp walks what csrc/hopper/diffusion_fwd.cuh's consumers compute
(work items, runs, FULL / PARTIAL visits, the column mask, stored rows) and compares the keys each
stored row lets through with the BD3 mask's definition. No GPU: it checks the kernel's control
flow, which is where issue #7's varlen failure (n = 500, bs = 300) was: in the loop before v5 a
short key tile that is FULL for its query tile took no column mask (v5's loop, which replaced it,
does not have that fault). The mirror is written by hand from the kernel.
"""

import subprocess
from pathlib import Path

import pytest

from dlm_ops.backends.cutlass import csrc_dir

SRC = Path(__file__).resolve().parent / "cuda" / "fwd_mask_mirror.cpp"
SHIPPED, BEFORE_V5 = 0, 1  # the loop since e151295 (v5); the one before (f2a2bfb)


@pytest.fixture(scope="module")
def mirror(tmp_path_factory, cxx):
    exe = tmp_path_factory.mktemp("mirror") / "fwd_mask_mirror"
    cmd = [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{csrc_dir() / 'include'}",
           str(SRC), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"

    def run(*args):
        out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1]), out.stdout

    return run


def test_mirror_sees_the_issue_7_failure(mirror):
    # The loop before v5: both 116-row short query tiles of each half wrong (232 rows), as on the H200
    # (92 bad rows = those tiles' rows among the bwd harness's sampled ones), and n = 1000 right.
    assert mirror(BEFORE_V5, 500, 300, 128)[0] == 232
    assert mirror(BEFORE_V5, 500, 300, 64)[0] == 232
    assert mirror(BEFORE_V5, 1000, 300, 128)[0] == 0


def test_every_row_sees_exactly_its_keys(mirror):
    assert mirror(SHIPPED, 500, 300, 128)[0] == 0
    assert mirror(SHIPPED, 500, 300, 64)[0] == 0
    failing, out = mirror(SHIPPED, 160)  # n in 1..160 x 11 block sizes x BN 128 / 64
    assert failing == 0, out
