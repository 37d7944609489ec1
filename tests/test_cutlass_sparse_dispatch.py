"""The sparse family's cutlass backend without a GPU (dlm_ops/backends/cutlass_sparse.py): which
calls run the sm90 block-sparse forward and which go to Triton (block sizes, head dims, TMA
alignment, empty list tables, a failed build; every backward and the column-sparse op), what it
hands the extension (tensors, block sizes, scale, the longest-first work order), its dispatch
(preferred where it builds, DLM_OPS_CUTLASS=0, forcing) and the remembered build failure. A fake
extension stands in for the build: it records its calls and writes the torch backend's result,
so the backend's returned tensors are checked against the reference too."""

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dlm_ops.backends import REGISTRIES, cutlass, select
from dlm_ops.backends import cutlass_sparse as cs
from dlm_ops.backends.base import GQA, Problem
from dlm_ops.backends.sparse import TorchSparseBackend
from dlm_ops.backends.sparse_triton import TritonSparseBackend
from dlm_ops.errors import UnsupportedConfig

from .test_sparse_attn import block_pattern


class FakeExtension:
    """The extension's interface: the kernel's coverage rule, and a forward that records its
    arguments and writes what the kernel must (the torch backend's out and lse)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def supports(block_q, block_k, d):  # block_sparse_fwd_supports in block_sparse_fwd.cuh
        return block_q == 128 and block_k == 128 and d in (64, 128)

    def fwd(self, q, k, v, out, lse, kv_block_indices, kv_block_counts, work_order, block_q,
            block_k, scale):
        self.calls.append(dict(q=q, k=k, v=v, out=out, lse=lse, idx=kv_block_indices,
                               counts=kv_block_counts, order=work_order, block_q=block_q,
                               block_k=block_k, scale=scale))
        o, l = TorchSparseBackend().block_fwd(q, k, v, kv_block_indices, kv_block_counts, block_q,
                                              block_k, scale)
        out.copy_(o), lse.copy_(l)


TRITON_ENTRY_POINTS = ("block_fwd", "block_bwd", "column_fwd", "column_bwd")


@pytest.fixture
def fake(monkeypatch):
    """The backend wired to a FakeExtension; Triton's entry points replaced by markers."""
    ext = FakeExtension()
    monkeypatch.setattr(cs, "_EXT", ext)
    monkeypatch.setattr(cs, "_extension", lambda: ext)
    monkeypatch.setattr(cs, "STATS", dict.fromkeys(cs.STATS, 0))
    for name in TRITON_ENTRY_POINTS:
        monkeypatch.setattr(TritonSparseBackend, name, lambda self, *a, _n=name: ("triton", _n))
    return ext


def _inputs(b, sq, sk, h, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _stable_longest_first(counts):
    flat = counts.reshape(-1).tolist()
    return sorted(range(len(flat)), key=lambda e: (-flat[e], e))


@given(b=st.integers(1, 2), sq=st.integers(0, 400), sk=st.integers(1, 400),
       heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       mode=st.sampled_from(["random", "random", "empty", "all"]), seed=st.integers(0, 1000))
def test_covered_forwards_run_cutlass_with_their_arguments(b, sq, sk, heads, d, dtype, mode, seed):
    """Selection blocks 128, D 64 / 128, any Sq / Sk (partial last blocks), GQA, empty and full
    lists: the kernel runs, gets the caller's tensors, contiguous int32 lists, the block sizes,
    the scale and a stable longest-list-first work order; out / lse are what it wrote."""
    ext = FakeExtension()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cs, "_extension", lambda: ext)
        mp.setattr(cs, "STATS", dict.fromkeys(cs.STATS, 0))
        mp.setattr(TritonSparseBackend, "block_fwd", lambda self, *a: ("triton", "block_fwd"))
        h, hkv = heads
        q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, seed)
        idx, cnt = block_pattern(b, h, sq, sk, 128, 128, mode, seed, extra=2)
        out, lse = cs.CutlassSparseBackend().block_fwd(q, k, v, idx, cnt, 128, 128, 0.3)
        stats = dict(cs.STATS)
    assert stats == dict(cs.STATS, fwd=1, fwd_fallback=0)
    (call,) = ext.calls
    assert call["q"] is q and call["k"] is k and call["v"] is v
    assert call["out"] is out and call["lse"] is lse
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert (call["block_q"], call["block_k"], call["scale"]) == (128, 128, 0.3)
    for t, src in ((call["idx"], idx), (call["counts"], cnt)):
        assert t.dtype == torch.int32 and t.is_contiguous() and torch.equal(t, src)
    order = call["order"]
    assert order.dtype == torch.int32 and order.device == cnt.device and order.is_contiguous()
    assert order.tolist() == _stable_longest_first(cnt)
    # returned as written (the fake writes the torch backend's result, tested against the
    # reference in test_sparse_attn.py), every element: the outputs start NaN-poisoned
    expect = TorchSparseBackend().block_fwd(q, k, v, idx, cnt, 128, 128, 0.3)
    assert torch.equal(out, expect[0]) and torch.equal(lse, expect[1])


def test_work_order_is_longest_first_stable_and_sync_free():
    counts = torch.tensor([[[3, 0, 5], [5, 1, 3]], [[0, 0, 7], [2, 5, 2]]], dtype=torch.int32)
    order = cs.work_order(counts)
    assert order.dtype == torch.int32 and order.shape == (12,)
    assert order.tolist() == [8, 2, 3, 10, 0, 5, 9, 11, 4, 1, 6, 7]
    assert cs.work_order(torch.zeros((1, 2, 0), dtype=torch.int32)).numel() == 0


def test_uncovered_forwards_fall_back_to_triton(fake, monkeypatch):
    backend = cs.CutlassSparseBackend()
    q, k, v = _inputs(1, 300, 260, 4, 2, 128)

    def fwd(q, k, v, bsq=128, bsk=128, max_blocks=4):
        idx, cnt = block_pattern(1, 4, q.shape[1], k.shape[1], bsq, bsk, "random", 1)
        return backend.block_fwd(q, k, v, idx[..., :max_blocks], cnt.clamp(max=max_blocks), bsq,
                                 bsk, 0.1)

    assert fwd(q, k, v)[0] != "triton"  # the covered call, for contrast
    for bsq, bsk in ((64, 128), (128, 64), (64, 64), (256, 256), (16, 128)):
        assert fwd(q, k, v, bsq, bsk) == ("triton", "block_fwd")
    q256, k256, v256 = _inputs(1, 300, 260, 4, 2, 256)  # a head dim the kernel lacks
    assert fwd(q256, k256, v256) == ("triton", "block_fwd")
    shifted = torch.randn(q.numel() + 4).to(q.dtype)[4:].view(q.shape)  # 8 bytes off: not TMA-ready
    assert fwd(shifted, k, v) == ("triton", "block_fwd")
    padded = torch.randn(1, 260, 2, 136).to(k.dtype)[..., :128]  # row stride 272 B: TMA-ready
    assert fwd(q, padded, v)[0] != "triton"
    odd = torch.randn(1, 260, 2, 129).to(k.dtype)[..., :128]  # 258-byte rows
    assert fwd(q, odd, v) == ("triton", "block_fwd")
    assert fwd(q, k, v, max_blocks=0) == ("triton", "block_fwd")  # no list slot at all
    monkeypatch.setattr(cs, "_extension", lambda: None)  # a failed build
    assert fwd(q, k, v) == ("triton", "block_fwd")
    assert cs.STATS["fwd"] == 2 and cs.STATS["fwd_fallback"] == 10
    assert len(fake.calls) == 2


def test_backwards_and_column_sparse_run_triton_counted(fake):
    backend = cs.CutlassSparseBackend()
    q, k, v = _inputs(1, 256, 256, 2, 2, 128)
    idx, cnt = block_pattern(1, 2, 256, 256, 128, 128, "all", 0)
    out, lse = backend.block_fwd(q, k, v, idx, cnt, 128, 128, 0.1)
    assert backend.block_bwd(q, q, k, v, out, lse, None, idx, cnt, 128, 128, 0.1) == \
        ("triton", "block_bwd")
    cidx = torch.arange(10, dtype=torch.int32).expand(1, 2, 10).contiguous()
    ccnt = torch.full((1, 2), 10, dtype=torch.int32)
    assert backend.column_fwd(q, k, v, cidx, ccnt, 0.1) == ("triton", "column_fwd")
    assert backend.column_bwd(q, q, k, v, out, lse, None, cidx, ccnt, 0.1) == ("triton", "column_bwd")
    assert cs.STATS == dict(fwd=1, fwd_fallback=0, bwd_fallback=1, column_fwd_fallback=1,
                            column_bwd_fallback=1)


@pytest.fixture
def buildable(monkeypatch):
    """Dispatch as on an sm90 machine whose toolchain can build the extension."""
    monkeypatch.setattr(cutlass, "_TOOLCHAIN", [None])
    monkeypatch.setattr(cs, "_BUILD_ERROR", None)
    monkeypatch.delenv("DLM_OPS_CUTLASS", raising=False)


def test_dispatch_prefers_cutlass_where_it_builds(buildable, monkeypatch):
    assert isinstance(REGISTRIES["sparse"]["cutlass"], cs.CutlassSparseBackend)
    pick = lambda dtype=torch.bfloat16, d=128, forced=None: select(
        Problem("cuda", dtype, d, frozenset({GQA})), forced, family="sparse").name
    assert pick() == "cutlass" and pick(torch.float16, 64) == "cutlass"
    # what the kernel cannot take at all selects Triton directly
    assert pick(torch.float32) == "triton" and pick(d=256) == "triton" and pick(d=96) == "triton"
    assert select(Problem("cpu", torch.bfloat16, 128), family="sparse").name == "torch"
    monkeypatch.setenv("DLM_OPS_CUTLASS", "0")  # opted out: Triton everywhere, forcing still works
    assert pick() == "triton" and pick(forced="cutlass") == "cutlass"
    monkeypatch.setattr(cutlass, "_TOOLCHAIN", ["no CUDA GPU visible"])
    monkeypatch.delenv("DLM_OPS_CUTLASS")
    assert pick() == "triton"
    with pytest.raises(UnsupportedConfig, match="no CUDA GPU visible"):
        pick(forced="cutlass")


def test_a_failed_build_is_remembered_warned_once_and_reported(buildable, monkeypatch):
    builds = []

    def failing_build(name, sources):
        builds.append((name, list(sources)))
        raise RuntimeError("nvcc: error in block_sparse_fwd.cuh")

    monkeypatch.setattr(cs.cutlass, "build", failing_build)
    monkeypatch.setattr(cs, "_EXT", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cs._extension() is None and cs._extension() is None
    assert len(builds) == 1 and len(caught) == 1 and "triton backend runs instead" in str(caught[0].message)
    name, sources = builds[0]
    assert name == "dlm_sparse_sm90"  # its own extension: none of the block-diffusion units
    assert "bindings/sparse_sm90.cpp" in sources and not any("diffusion" in s for s in sources)
    assert {f"hopper/block_sparse_fwd_{t}_d{d}.cu" for t in ("bf16", "fp16") for d in (64, 128)} \
        <= set(sources)
    reason = cs.CutlassSparseBackend().unavailable_reason()
    assert "sm90 build failed" in reason and "block_sparse_fwd.cuh" in reason
    assert select(Problem("cuda", torch.bfloat16, 128), family="sparse").name == "triton"


def test_sources_exist_in_csrc():
    """Every unit the build names is in csrc/: the bindings here, the kernel units beside the
    kernel header (hopper/block_sparse_fwd.cuh, written on the sm90 kernel's branch)."""
    from dlm_ops.backends.cutlass import csrc_dir

    root = csrc_dir()
    bindings = [s for s in cs.SOURCES if s.startswith("bindings/")]
    assert bindings and all((root / s).is_file() for s in bindings)
    if not (root / "hopper" / "block_sparse_fwd.cuh").is_file():
        pytest.skip("the sm90 block-sparse kernel is not in this checkout yet")
    missing = [s for s in cs.SOURCES if not (root / s).is_file()]
    assert not missing, f"missing from csrc/: {missing}"
